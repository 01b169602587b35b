//! Who gets a session, and what a refusal costs: a slot of `max_sessions` (or the shared
//! engine's), one of its key's `sessions=`, its address's connections (`max_connections_per_ip`)
//! and its allowance of new sessions (`limits.session_burst_per_ip`, then
//! `limits.sessions_per_minute_per_ip`); each held as a guard given back when dropped. A refusal
//! is a response before any upgrade, counted by reason and logged at most once per reason per
//! [`LOG_EVERY`]. Knows nothing of protocols or of what a session computes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{access, Client, Server};
use crate::observe::names;

/// A refusal of one reason is logged at most once per this long (with the count held back).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// Client addresses whose rate of new sessions is tracked at once; past it, the addresses
/// whose allowance is whole again are forgotten.
pub(super) const RATE_TABLE_MAX: usize = 10_000;

/// A reserved session slot (and one of its key's sessions), given back when dropped.
pub(crate) struct Admission {
    pub(super) server: Arc<Server>,
    pub(super) key: Option<KeyHold>,
}

/// One of a key's sessions, given back when dropped.
pub(crate) struct KeyHold {
    pub(super) keys: Arc<access::Keys>,
    pub(super) index: usize,
}

impl KeyHold {
    /// The key's name.
    pub(crate) fn name(&self) -> &str {
        &self.keys.key(self.index).name
    }
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        self.keys.release(self.index);
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let left = self.server.taken.fetch_sub(1, Ordering::AcqRel) - 1;
        self.server.active.set(left as f64);
    }
}

/// One open TCP connection of a client address, counted until dropped.
pub(crate) struct Connection {
    pub(super) server: Arc<Server>,
    pub(super) ip: IpAddr,
}

impl Drop for Connection {
    fn drop(&mut self) {
        metrics::gauge!(names::CONNECTIONS_OPEN).decrement(1.0);
        if let Ok(mut m) = self.server.per_ip.lock() {
            if let Some(n) = m.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&self.ip);
                }
            }
        }
    }
}

/// Lines of one reason logged at most once per [`LOG_EVERY`]: a burst of refusals, or a client
/// repeating a mistake, costs one line, not one per request.
#[derive(Default)]
pub(crate) struct LogThrottle(Mutex<HashMap<&'static str, (Instant, u64)>>);

impl LogThrottle {
    /// Whether a line of `reason` may be logged now; `Some(n)` with the lines held back since
    /// the last one.
    pub(crate) fn allow(&self, reason: &'static str) -> Option<u64> {
        let mut m = self.0.lock().ok()?;
        let now = Instant::now();
        match m.get_mut(reason) {
            Some((last, held)) if now.duration_since(*last) < LOG_EVERY => {
                *held += 1;
                None
            }
            Some((last, held)) => {
                *last = now;
                Some(std::mem::take(held))
            }
            None => {
                m.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

impl Server {
    /// A refusal before the upgrade, counted by `reason` and logged (at most once per reason
    /// per [`LOG_EVERY`]).
    pub(super) fn refusal(
        &self,
        ip: IpAddr,
        reason: &'static str,
        status: StatusCode,
        retry_after: u64,
        msg: String,
    ) -> Box<Response> {
        metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = self.log_throttle.allow(reason) {
            let more = if held > 0 {
                format!(" ({held} more of this reason since the last line)")
            } else {
                String::new()
            };
            tracing::info!(client = %ip, reason, "refused: {msg}{more}");
        }
        Box::new(
            (
                status,
                [(header::RETRY_AFTER, retry_after.to_string())],
                format!("{msg}\n"),
            )
                .into_response(),
        )
    }

    /// Takes one new session from `ip`'s allowance (`limits.sessions_per_minute_per_ip`,
    /// `limits.session_burst_per_ip`); `false` when it is spent.
    pub(super) fn take_session_allowance(&self, ip: IpAddr) -> bool {
        let ip = access::group(ip);
        let Ok(mut m) = self.new_sessions.lock() else {
            return true;
        };
        let now = Instant::now();
        if m.len() >= RATE_TABLE_MAX && !m.contains_key(&ip) {
            m.retain(|_, b| !b.is_full_at(now));
        }
        let l = &self.cfg.limits;
        m.entry(ip)
            .or_insert_with(|| {
                crate::audio::pace::TokenBucket::new(
                    l.sessions_per_minute_per_ip / 60.0,
                    l.session_burst_per_ip,
                )
            })
            .take_at(1.0, now)
    }

    /// Counts a new connection from `peer` (an IPv6 address by its /64), or `None` when that
    /// address has `max_connections_per_ip` open already (a trusted proxy has no such limit).
    pub(super) fn connect(self: &Arc<Self>, peer: IpAddr) -> Option<Connection> {
        self.connect_as(peer, false)
    }

    /// As [`connect`](Self::connect); `carrier`: `peer` carries many clients (a PBX or a trunk
    /// in `sip.allow`), so that, as for a trusted proxy, its count has no limit.
    pub(super) fn connect_as(self: &Arc<Self>, peer: IpAddr, carrier: bool) -> Option<Connection> {
        let ip = access::group(peer);
        let proxy = carrier || self.cfg.trusted_proxies.iter().any(|c| c.contains(peer));
        let mut m = self.per_ip.lock().ok()?;
        let n = m.entry(ip).or_insert(0);
        // A trusted proxy carries many clients: their own limits apply at admission.
        if *n >= self.cfg.max_connections_per_ip && !proxy {
            return None;
        }
        *n += 1;
        metrics::gauge!(names::CONNECTIONS_OPEN).increment(1.0);
        Some(Connection {
            server: self.clone(),
            ip,
        })
    }

    /// Reserves a session slot for a client at `ip`, or says why not (and counts it).
    pub(super) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Admission, Box<Response>> {
        self.admit_as(ip, false)
    }

    /// As [`admit`](Self::admit); `carrier`: `ip` carries many clients (a PBX or a trunk in
    /// `sip.allow`), whose new sessions are not held to one address's allowance.
    pub(super) fn admit_as(
        self: &Arc<Self>,
        ip: IpAddr,
        carrier: bool,
    ) -> Result<Admission, Box<Response>> {
        if self.draining.load(Ordering::Acquire) {
            return Err(self.refusal(
                ip,
                "draining",
                StatusCode::SERVICE_UNAVAILABLE,
                30,
                "this server is shutting down: try another".into(),
            ));
        }
        if !self.ready.load(Ordering::Acquire) {
            return Err(self.refusal(
                ip,
                "not_ready",
                StatusCode::SERVICE_UNAVAILABLE,
                5,
                "the models are still loading".into(),
            ));
        }
        if !carrier && !self.take_session_allowance(ip) {
            let l = &self.cfg.limits;
            return Err(self.refusal(
                ip,
                "rate",
                StatusCode::TOO_MANY_REQUESTS,
                (60.0 / l.sessions_per_minute_per_ip).ceil() as u64,
                format!(
                    "too many new sessions from {ip} (limits.sessions_per_minute_per_ip = {}, \
                     limits.session_burst_per_ip = {})",
                    l.sessions_per_minute_per_ip, l.session_burst_per_ip
                ),
            ));
        }
        let max = self.capacity;
        match self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < max).then_some(t + 1)
            }) {
            Ok(t) => {
                self.active.set((t + 1) as f64);
                Ok(Admission {
                    server: self.clone(),
                    key: None,
                })
            }
            Err(_) => Err(self.refusal(
                ip,
                "full",
                StatusCode::SERVICE_UNAVAILABLE,
                5,
                format!("all {max} session slots are in use: try again shortly"),
            )),
        }
    }

    /// Admits a client: one of its key's sessions (when it presented a key) and a slot.
    pub(super) fn admit_client(
        self: &Arc<Self>,
        client: &Client,
    ) -> Result<Admission, Box<Response>> {
        let key = match client.key {
            Some(i) if !self.cfg.keys.hold(i) => {
                let k = self.cfg.keys.key(i);
                return Err(self.refusal(
                    client.ip,
                    "key_limit",
                    StatusCode::TOO_MANY_REQUESTS,
                    5,
                    format!(
                        "key {} holds its {} session(s) already",
                        k.name,
                        k.max_sessions.unwrap_or(0)
                    ),
                ));
            }
            Some(i) => Some(KeyHold {
                keys: self.cfg.keys.clone(),
                index: i,
            }),
            None => None,
        };
        let mut admission = self.admit(client.ip)?;
        admission.key = key;
        Ok(admission)
    }

    pub(super) fn free_slots(&self) -> usize {
        self.capacity
            .saturating_sub(self.taken.load(Ordering::Acquire))
    }
}
