//! Every SIP request, judged before the stack makes a transaction of it: what a public SIP port
//! receives is mostly scanners, floods and forgeries, and each transaction rsipstack keeps
//! costs memory for half a minute (its Timer J or H). [`Guard`] decides, with the time passed
//! in, whether a request goes on to the stack ([`Verdict::Pass`]), is answered here without
//! any state ([`Verdict::Answer`]: a stray request, a forbidden caller, an option we do not
//! support), or is dropped unanswered ([`Verdict::Drop`]: over its sender's allowance, an ACK
//! for nothing).
//!
//! What it holds, each bounded: the calls it has let through (keyed by Call-ID and the
//! caller's tag, with the address they came from: an in-dialog request, a CANCEL or an ACK is
//! taken only from the call's own party — or, for a call from `sip.allow`, from any address
//! of the allow-list), and a window of the requests each source sent in the last
//! [`WINDOW`] (a source past [`Limits::per_source`], or everyone past [`Limits::total`], is
//! dropped until the window moves on).
//!
//! Knows nothing of sockets, sessions or the server: the inspector ([`Screen`](super::Screen))
//! sends what it answers, the door tells it when a call is answered and ended.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use rsipstack::sip::prelude::HeadersExt;
use rsipstack::sip::{Method, Request};

use crate::app::serve::access::Cidr;
use crate::audio::pace::TokenBucket;

/// How long a request counts against its sender: RFC 3261's 64×T1, the longest a transaction
/// of the stack's outlives its last message.
pub(crate) const WINDOW: Duration = Duration::from_secs(32);
/// How long a call's ids are remembered after it ends (its BYE's retransmissions) or, for an
/// INVITE never answered, after it came.
const LINGER: Duration = Duration::from_secs(32);
/// The options of `Require:` this server supports (RFC 4028 session timers).
pub(crate) const SUPPORTED: &[&str] = &["timer"];

/// The headers every request carries (RFC 3261 §8.1.1).
const MANDATORY: [&str; 5] = ["Via", "From", "To", "Call-ID", "CSeq"];

/// How many requests a source may send within [`WINDOW`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// An address outside `sip.allow` (or any address when there is no allow-list).
    pub per_source: usize,
    /// An address in `sip.allow`: a trunk or a PBX, many callers behind it.
    pub per_trusted_source: usize,
    /// All sources together.
    pub total: usize,
    /// Digest challenges (401) a source may be sent per minute (a password guesser's pace).
    pub challenges_per_minute: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_source: 1000,
            per_trusted_source: 10_000,
            total: 20_000,
            challenges_per_minute: 30.0,
        }
    }
}

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// On to the stack.
    Pass,
    /// Answered here, statelessly.
    Answer(Stateless),
    /// Dropped unanswered, counted under the reason.
    Drop(&'static str),
}

/// A stateless answer: its status, its extra headers, and the reason it is counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stateless {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub reason: &'static str,
}

fn answer(status: u16, reason: &'static str, headers: &[(&str, &str)]) -> Verdict {
    Verdict::Answer(Stateless {
        status,
        headers: headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        reason,
    })
}

/// A `Warning` header's value carrying `text` (RFC 3261 §20.43: code 399, miscellaneous).
pub(crate) fn warning_value(text: &str) -> String {
    format!("399 duplex \"{}\"", text.replace('"', "'"))
}

/// A call the guard let through.
#[derive(Debug)]
struct Call {
    /// Where its INVITE came from.
    source: IpAddr,
    /// Whether that address is in `sip.allow` (any address of it may then speak for the call).
    trusted: bool,
    /// Our tag, once the call has a dialog.
    local_tag: Option<String>,
    /// `None` while the call lives; else when its ids are forgotten.
    forget_at: Option<Instant>,
}

/// The request policy of a SIP port. See the module's doc.
#[derive(Debug)]
pub(crate) struct Guard {
    allow: Vec<Cidr>,
    limits: Limits,
    /// Calls by (Call-ID, the caller's From tag).
    calls: HashMap<(String, String), Call>,
    /// Requests counted, oldest first, and each source's share of them.
    counted: VecDeque<(Instant, IpAddr)>,
    per_source: HashMap<IpAddr, usize>,
    challenges: HashMap<IpAddr, TokenBucket>,
    next_sweep: Option<Instant>,
}

/// The parts of a request the guard reads.
struct Parts {
    call_id: String,
    from_tag: String,
    to_tag: Option<String>,
    cseq_method: Option<Method>,
}

impl Parts {
    fn of(req: &Request) -> Option<Parts> {
        let call_id = req.call_id_header().ok()?.value().trim().to_string();
        let from_tag = req
            .from_header()
            .ok()
            .and_then(|f| f.tag().ok().flatten())
            .map(|t| t.value().to_string())
            .unwrap_or_default();
        let to_tag = req
            .to_header()
            .ok()
            .and_then(|t| t.tag().ok().flatten())
            .map(|t| t.value().to_string());
        let cseq_method = req.cseq_header().ok().and_then(|c| c.method().ok());
        Some(Parts {
            call_id,
            from_tag,
            to_tag,
            cseq_method,
        })
    }
}

impl Guard {
    pub(crate) fn new(allow: Vec<Cidr>, limits: Limits) -> Guard {
        Guard {
            allow,
            limits,
            calls: HashMap::new(),
            counted: VecDeque::new(),
            per_source: HashMap::new(),
            challenges: HashMap::new(),
            next_sweep: None,
        }
    }

    /// Whether `ip` is in `sip.allow`.
    pub(crate) fn trusted(&self, ip: IpAddr) -> bool {
        self.allow.iter().any(|c| c.contains(ip))
    }

    /// Whether `ip` may call at all (no allow-list, or in it).
    pub(crate) fn allowed(&self, ip: IpAddr) -> bool {
        self.allow.is_empty() || self.trusted(ip)
    }

    /// Judges `req` from `source` at `now`; `taking`: whether the server takes calls now (an
    /// `OPTIONS` is answered 200, else 503), asked only of an `OPTIONS`.
    pub(crate) fn check(
        &mut self,
        now: Instant,
        req: &Request,
        source: IpAddr,
        taking: &dyn Fn() -> bool,
    ) -> Verdict {
        self.sweep(now);
        let parts = match parts(req) {
            Ok(p) => p,
            Err(v) => return v,
        };
        // Past its allowance, a source is not answered at all (an answer costs too).
        if !self.count(now, source) {
            return Verdict::Drop("sip_throttled");
        }
        if req.method == Method::Ack {
            // An ACK belongs to a call we let through, from that call's party; the rest is
            // nothing to anyone.
            return match self.calls.get(&(parts.call_id, parts.from_tag)) {
                Some(c) if self.speaks_for(c, source) => Verdict::Pass,
                _ => Verdict::Drop("sip_stray"),
            };
        }
        if let Some(v) = self.refused(req, &parts, source) {
            return v;
        }
        self.route(now, req.method, parts, source, taking)
    }

    /// What refuses a request whoever it is for: a CSeq of another method (400), a source
    /// outside `sip.allow` (403), an option of `Require:` we lack (420).
    fn refused(&self, req: &Request, parts: &Parts, source: IpAddr) -> Option<Verdict> {
        let method = req.method;
        if parts.cseq_method.as_ref() != Some(&method) {
            let text = format!("the CSeq's method is not the request's ({method})");
            return Some(answer(
                400,
                "sip_malformed",
                &[("Warning", &warning_value(&text))],
            ));
        }
        if !self.allowed(source) {
            let text = format!("{source} is not in sip.allow");
            return Some(answer(
                403,
                "sip_forbidden",
                &[("Warning", &warning_value(&text))],
            ));
        }
        if method != Method::Cancel {
            let unsupported = unsupported(req);
            if !unsupported.is_empty() {
                return Some(answer(
                    420,
                    "sip_unsupported",
                    &[("Unsupported", &unsupported)],
                ));
            }
        }
        None
    }

    /// Where a request goes: to the stack when it is a call's own party's, or a new INVITE;
    /// answered here otherwise.
    fn route(
        &mut self,
        now: Instant,
        method: Method,
        parts: Parts,
        source: IpAddr,
        taking: &dyn Fn() -> bool,
    ) -> Verdict {
        let key = (parts.call_id, parts.from_tag);
        let in_dialog = parts.to_tag.is_some();
        match (method, self.calls.get(&key)) {
            // A call's own party: on to its dialog (or, for a new INVITE of the same ids —
            // a retransmission, or one answering our challenge — to the door).
            (_, Some(c)) if self.speaks_for(c, source) => {
                if in_dialog && c.local_tag.is_some() && c.local_tag != parts.to_tag {
                    return answer(481, "sip_stray", &[]);
                }
                Verdict::Pass
            }
            // Someone else speaking for a call: a forged BYE, CANCEL, re-INVITE, or a new
            // INVITE reusing a live call's ids.
            (_, Some(_)) => {
                let text = "this request does not come from the call's party";
                answer(403, "sip_forged", &[("Warning", &warning_value(text))])
            }
            (Method::Invite, None) if !in_dialog => {
                let call = Call {
                    source,
                    trusted: self.trusted(source),
                    local_tag: None,
                    forget_at: Some(now + LINGER),
                };
                self.calls.insert(key, call);
                Verdict::Pass
            }
            // Out of any dialog, answered here: no transaction is kept for them.
            (Method::Options, None) if !in_dialog => options(taking()),
            (Method::Register, None) => answer(405, "sip_stray", &[("Allow", super::ALLOW)]),
            (Method::Invite | Method::Bye | Method::Cancel | Method::Info, None)
            | (Method::Update | Method::PRack | Method::Options, None) => {
                answer(481, "sip_stray", &[])
            }
            _ => answer(405, "sip_stray", &[("Allow", super::ALLOW)]),
        }
    }

    /// Whether `source` speaks for `call`: its own address, or for a call from the
    /// allow-list, any address of the allow-list (a trunk's other proxy).
    fn speaks_for(&self, call: &Call, source: IpAddr) -> bool {
        call.source == source || (call.trusted && self.trusted(source))
    }

    /// Counts a request of `source` at `now`; false when it is past its allowance.
    fn count(&mut self, now: Instant, source: IpAddr) -> bool {
        while let Some(&(t, ip)) = self.counted.front() {
            if now.saturating_duration_since(t) < WINDOW {
                break;
            }
            self.counted.pop_front();
            if let Some(n) = self.per_source.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.per_source.remove(&ip);
                }
            }
        }
        let cap = if self.trusted(source) {
            self.limits.per_trusted_source
        } else {
            self.limits.per_source
        };
        let mine = self.per_source.get(&source).copied().unwrap_or(0);
        if mine >= cap || self.counted.len() >= self.limits.total {
            return false;
        }
        self.counted.push_back((now, source));
        *self.per_source.entry(source).or_insert(0) += 1;
        true
    }

    /// Whether a Digest challenge may be sent to `source` at `now` (a guesser is held to
    /// [`Limits::challenges_per_minute`]).
    pub(crate) fn challenge(&mut self, now: Instant, source: IpAddr) -> bool {
        let per_minute = self.limits.challenges_per_minute;
        // Bounded by the window: a source without requests in it has no bucket worth keeping.
        if self.challenges.len() > self.limits.total {
            self.challenges.clear();
        }
        self.challenges
            .entry(source)
            .or_insert_with(|| TokenBucket::new(per_minute / 60.0, (per_minute / 2.0).max(1.0)))
            .take_at(1.0, now)
    }

    /// The call of `call_id` and the caller's `from_tag` has a dialog with our `local_tag`:
    /// it is remembered until it ends.
    pub(crate) fn answered(&mut self, call_id: &str, from_tag: &str, local_tag: &str) {
        if let Some(c) = self
            .calls
            .get_mut(&(call_id.to_string(), from_tag.to_string()))
        {
            c.local_tag = Some(local_tag.to_string());
            c.forget_at = None;
        }
    }

    /// The call has ended: its ids are forgotten after [`LINGER`].
    pub(crate) fn ended(&mut self, now: Instant, call_id: &str, from_tag: &str) {
        if let Some(c) = self
            .calls
            .get_mut(&(call_id.to_string(), from_tag.to_string()))
        {
            c.forget_at = Some(now + LINGER);
        }
    }

    /// Forgets what has lingered long enough (at most once a second).
    fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|t| now < t) {
            return;
        }
        self.next_sweep = Some(now + Duration::from_secs(1));
        self.calls
            .retain(|_, c| c.forget_at.is_none_or(|t| now < t));
        let live = &self.per_source;
        self.challenges.retain(|ip, _| live.contains_key(ip));
    }

    /// Calls remembered (live, ringing or lingering).
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.calls.len()
    }
}

/// The parts of `req` the guard reads, or the answer to a request that lacks a header every
/// request carries (an INVITE also says where the call's requests go: §8.1.1.8).
fn parts(req: &Request) -> Result<Parts, Verdict> {
    let has = |name: &str| {
        req.headers
            .iter()
            .any(|h| h.name().eq_ignore_ascii_case(name))
    };
    let mut missing: Vec<&str> = MANDATORY.into_iter().filter(|h| !has(h)).collect();
    if req.method == Method::Invite && !has("Contact") && !has("m") {
        missing.push("Contact");
    }
    let parts = if missing.is_empty() {
        Parts::of(req)
    } else {
        None
    };
    parts.ok_or_else(|| {
        if req.method == Method::Ack || !has("Via") {
            // An answer needs a Via to go back by.
            return Verdict::Drop("sip_malformed");
        }
        let text = if missing.is_empty() {
            "a header the request has cannot be read".to_string()
        } else {
            format!("the request has no {}", missing.join(", "))
        };
        answer(400, "sip_malformed", &[("Warning", &warning_value(&text))])
    })
}

/// An `OPTIONS` outside a call: whether this server takes calls now (a trunk's keep-alive).
fn options(taking: bool) -> Verdict {
    if taking {
        answer(
            200,
            "sip_options",
            &[
                ("Allow", super::ALLOW),
                ("Accept", "application/sdp"),
                ("Supported", "timer"),
            ],
        )
    } else {
        answer(503, "sip_options", &[("Retry-After", "30")])
    }
}

/// The options of `req`'s `Require:` this server does not support, comma-separated (empty:
/// none).
fn unsupported(req: &Request) -> String {
    req.headers
        .iter()
        .filter(|h| h.name().eq_ignore_ascii_case("Require"))
        .flat_map(|h| {
            h.value()
                .split(',')
                .map(|o| o.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|o| !o.is_empty() && !SUPPORTED.contains(&o.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &str) -> Request {
        let text = text.replace('\n', "\r\n");
        match rsipstack::sip::SipMessage::try_from(text.as_str()) {
            Ok(rsipstack::sip::SipMessage::Request(r)) => r,
            other => panic!("not a request: {other:?}"),
        }
    }

    /// A request of `method` for the call `call` (the caller's tag `a`), in its dialog when
    /// `to_tag` is given.
    fn sip(method: &str, call: &str, to_tag: Option<&str>, extra: &str) -> Request {
        let to = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
        req(&format!(
            "{method} sip:duplex@192.0.2.1 SIP/2.0\nVia: SIP/2.0/UDP 198.51.100.7:5060;branch=z9hG4bK{call}{method}\n\
             From: <sip:c@198.51.100.7>;tag=a\nTo: <sip:duplex@192.0.2.1>{to}\nCall-ID: {call}\n\
             CSeq: 1 {method}\nContact: <sip:c@198.51.100.7>\nMax-Forwards: 70\n{extra}Content-Length: 0\n\n"
        ))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn status(v: &Verdict) -> u16 {
        match v {
            Verdict::Answer(s) => s.status,
            Verdict::Pass => 0,
            Verdict::Drop(_) => 1,
        }
    }

    #[test]
    fn sip_forged_bye_and_cancel_from_another_address_are_refused() {
        let mut g = Guard::new(Vec::new(), Limits::default());
        let t = Instant::now();
        let caller = ip("198.51.100.7");
        let other = ip("203.0.113.66");
        assert_eq!(
            g.check(t, &sip("INVITE", "c1", None, ""), caller, &|| true),
            Verdict::Pass
        );
        // While it rings, a CANCEL from elsewhere is refused; the caller's own goes on.
        assert_eq!(
            status(&g.check(t, &sip("CANCEL", "c1", None, ""), other, &|| true)),
            403
        );
        assert_eq!(
            g.check(t, &sip("CANCEL", "c1", None, ""), caller, &|| true),
            Verdict::Pass
        );
        g.answered("c1", "a", "srv");
        // Answered: a BYE from elsewhere, knowing the ids, is refused (the forged hang-up).
        let bye = sip("BYE", "c1", Some("srv"), "");
        assert_eq!(status(&g.check(t, &bye, other, &|| true)), 403);
        assert_eq!(g.check(t, &bye, caller, &|| true), Verdict::Pass);
        // A BYE with the wrong tag of ours is no request of this dialog.
        assert_eq!(
            status(&g.check(t, &sip("BYE", "c1", Some("x"), ""), caller, &|| true)),
            481
        );
        // A new INVITE reusing the live call's ids from elsewhere: refused.
        assert_eq!(
            status(&g.check(t, &sip("INVITE", "c1", None, ""), other, &|| true)),
            403
        );
        // An ACK from elsewhere is dropped; the caller's goes on.
        let ack = sip("ACK", "c1", Some("srv"), "");
        assert_eq!(
            g.check(t, &ack, other, &|| true),
            Verdict::Drop("sip_stray")
        );
        assert_eq!(g.check(t, &ack, caller, &|| true), Verdict::Pass);
    }

    #[test]
    fn a_trunks_other_proxies_speak_for_its_calls() {
        let allow = vec![Cidr::parse("198.51.100.0/24").unwrap()];
        let mut g = Guard::new(allow, Limits::default());
        let t = Instant::now();
        assert_eq!(
            g.check(
                t,
                &sip("INVITE", "c1", None, ""),
                ip("198.51.100.7"),
                &|| true
            ),
            Verdict::Pass
        );
        g.answered("c1", "a", "srv");
        let bye = sip("BYE", "c1", Some("srv"), "");
        assert_eq!(
            g.check(t, &bye, ip("198.51.100.8"), &|| true),
            Verdict::Pass
        );
        // Outside the allow-list: not even heard.
        assert_eq!(status(&g.check(t, &bye, ip("203.0.113.1"), &|| true)), 403);
    }

    #[test]
    fn sip_stray_requests_are_answered_statelessly_and_remember_nothing() {
        let mut g = Guard::new(Vec::new(), Limits::default());
        let t = Instant::now();
        let c = ip("198.51.100.7");
        let opt = g.check(t, &sip("OPTIONS", "o1", None, ""), c, &|| true);
        assert_eq!(status(&opt), 200);
        let Verdict::Answer(a) = &opt else {
            unreachable!()
        };
        assert!(a
            .headers
            .iter()
            .any(|(n, v)| n == "Allow" && v.contains("INVITE")));
        assert_eq!(
            status(&g.check(t, &sip("OPTIONS", "o2", None, ""), c, &|| false)),
            503
        );
        assert_eq!(
            status(&g.check(t, &sip("REGISTER", "r1", None, ""), c, &|| true)),
            405
        );
        assert_eq!(
            status(&g.check(t, &sip("BYE", "b1", Some("x"), ""), c, &|| true)),
            481
        );
        assert_eq!(
            status(&g.check(t, &sip("CANCEL", "b2", None, ""), c, &|| true)),
            481
        );
        assert_eq!(
            status(&g.check(t, &sip("MESSAGE", "b3", None, ""), c, &|| true)),
            405
        );
        assert_eq!(
            g.check(t, &sip("ACK", "b4", Some("x"), ""), c, &|| true),
            Verdict::Drop("sip_stray")
        );
        assert_eq!(g.remembered(), 0);
    }

    #[test]
    fn sip_require_unknown_is_420_and_a_cseq_of_another_method_is_400() {
        let mut g = Guard::new(Vec::new(), Limits::default());
        let t = Instant::now();
        let c = ip("198.51.100.7");
        let v = g.check(
            t,
            &sip("INVITE", "r1", None, "Require: timer, 100rel, foo\n"),
            c,
            &|| true,
        );
        assert_eq!(
            v,
            answer(420, "sip_unsupported", &[("Unsupported", "100rel, foo")])
        );
        assert_eq!(
            g.check(
                t,
                &sip("INVITE", "r2", None, "Require: timer\n"),
                c,
                &|| true
            ),
            Verdict::Pass
        );
        let mut bad = sip("INVITE", "r3", None, "");
        let text = bad.to_string().replace("CSeq: 1 INVITE", "CSeq: 1 BYE");
        bad = req(&text.replace("\r\n", "\n"));
        assert_eq!(status(&g.check(t, &bad, c, &|| true)), 400);
    }

    #[test]
    fn sip_allow_holds_for_every_request() {
        let allow = vec![Cidr::parse("10.0.0.0/8").unwrap()];
        let mut g = Guard::new(allow, Limits::default());
        let t = Instant::now();
        for m in ["INVITE", "OPTIONS", "REGISTER", "MESSAGE"] {
            let v = g.check(t, &sip(m, "x", None, ""), ip("198.51.100.7"), &|| true);
            assert_eq!(status(&v), 403, "{m}");
        }
        assert_eq!(
            g.check(t, &sip("OPTIONS", "y", None, ""), ip("10.1.2.3"), &|| true),
            answer(
                200,
                "sip_options",
                &[
                    ("Allow", super::super::ALLOW),
                    ("Accept", "application/sdp"),
                    ("Supported", "timer")
                ]
            )
        );
    }

    #[test]
    fn sip_transactions_are_bounded_per_source_and_in_total() {
        let limits = Limits {
            per_source: 5,
            per_trusted_source: 8,
            total: 12,
            challenges_per_minute: 6.0,
        };
        let allow = vec![Cidr::parse("10.0.0.1").unwrap()];
        let mut g = Guard::new(allow, limits);
        let t = Instant::now();
        let a = ip("198.51.100.7");
        let trunk = ip("10.0.0.1");
        let sent = |g: &mut Guard, at: Instant, from: IpAddr, n: usize| {
            (0..n)
                .filter(|i| {
                    g.check(
                        at,
                        &sip("OPTIONS", &format!("o{i}"), None, ""),
                        from,
                        &|| true,
                    ) != Verdict::Drop("sip_throttled")
                })
                .count()
        };
        // Rows of 100 (refused 403 outside the allow-list, answered all the same): 5
        // answered, the rest dropped unanswered.
        assert_eq!(sent(&mut g, t, a, 100), 5);
        // A trunk in the allow-list has its own, larger allowance.
        assert_eq!(sent(&mut g, t, trunk, 100), 7);
        // Everyone together: 12.
        assert_eq!(sent(&mut g, t, ip("198.51.100.9"), 100), 0);
        // The window moves on.
        let later = t + WINDOW;
        assert_eq!(sent(&mut g, later, a, 100), 5);
        // Challenges: a burst of 3, then one each 10 s.
        let c = (0..10).filter(|_| g.challenge(later, a)).count();
        assert_eq!(c, 3);
        assert!(g.challenge(later + Duration::from_secs(10), a));
        assert!(!g.challenge(later + Duration::from_secs(11), a));
    }

    #[test]
    fn ended_calls_are_forgotten_after_their_linger() {
        let mut g = Guard::new(Vec::new(), Limits::default());
        let t = Instant::now();
        let c = ip("198.51.100.7");
        g.check(t, &sip("INVITE", "c1", None, ""), c, &|| true);
        g.check(t, &sip("INVITE", "c2", None, ""), c, &|| true);
        g.answered("c1", "a", "srv");
        // The unanswered INVITE is forgotten after its linger; the live call is kept.
        g.check(
            t + LINGER + Duration::from_secs(1),
            &sip("OPTIONS", "o", None, ""),
            c,
            &|| true,
        );
        assert_eq!(g.remembered(), 1);
        g.ended(t + LINGER * 2, "c1", "a");
        g.check(t + LINGER * 4, &sip("OPTIONS", "o", None, ""), c, &|| true);
        assert_eq!(g.remembered(), 0);
    }
}
