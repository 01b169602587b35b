//! Session timers (RFC 4028) for a call we answer: what a caller's `Session-Expires`,
//! `Min-SE` and `Supported: timer` ask for ([`negotiate`]), what our 2xx says back
//! ([`Timer::headers`]), and, on a clock passed in, when the call must be refreshed by us (we
//! are the refresher) or is dead (the caller is, and its refresh never came: the call is ended
//! before it expires, as §10 says: at the interval less a third of it, or 32 s if less).
//!
//! A call whose INVITE asks for no session timer gets none (RFC 4028 lets the UAS add one; a
//! caller that did not ask may not refresh). Pure logic: no sockets, no dialogs.

use std::time::{Duration, Instant};

use rsipstack::sip::Request;

/// The smallest interval RFC 4028 lets a server take (§4): the default of `sip.min_se_s`.
#[cfg(test)]
const MIN_SE: Duration = Duration::from_secs(90);

/// Who refreshes the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refresher {
    /// The caller (the UAC): we wait for its refreshes.
    Uac,
    /// We (the UAS) refresh, with an UPDATE at half the interval.
    Uas,
}

/// A negotiated session timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timer {
    pub interval: Duration,
    pub refresher: Refresher,
    /// Whether the caller supports timers (we then `Require: timer` in our answer).
    pub caller_supports: bool,
    /// When the session was last refreshed.
    pub refreshed: Instant,
}

/// What to do about a call's timer now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// Send a refresh (we are the refresher).
    Refresh,
    /// End the call: its refresh never came.
    Expired,
}

/// Why a request's timer cannot be taken: `422 Session Interval Too Small`, with our Min-SE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooSmall {
    pub min_se: Duration,
}

fn header<'a>(req: &'a Request, names: &[&str]) -> Option<&'a str> {
    req.headers
        .iter()
        .find(|h| names.iter().any(|n| h.name().eq_ignore_ascii_case(n)))
        .map(|h| h.value())
}

/// Whether `req` says `Supported: timer` (or its compact form, `k`).
fn supports_timer(req: &Request) -> bool {
    req.headers
        .iter()
        .filter(|h| h.name().eq_ignore_ascii_case("Supported") || h.name() == "k")
        .any(|h| {
            h.value()
                .split(',')
                .any(|o| o.trim().eq_ignore_ascii_case("timer"))
        })
}

/// Our limits on a call's interval: the longest we give, the smallest we take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub max: Duration,
    pub min_se: Duration,
}

/// The timer `req` (an INVITE, re-INVITE or UPDATE) asks for at `now`, within `limits`: `None`
/// when it asks for none.
///
/// # Errors
///
/// [`TooSmall`] when its interval is under our Min-SE (the caller retries with ours).
pub(crate) fn negotiate(
    req: &Request,
    limits: Limits,
    now: Instant,
) -> Result<Option<Timer>, TooSmall> {
    let Limits { max, min_se } = limits;
    let Some(se) = header(req, &["Session-Expires", "x"]) else {
        return Ok(None);
    };
    let mut parts = se.split(';');
    let Some(delta) = parts.next().and_then(|d| d.trim().parse::<u64>().ok()) else {
        // An unreadable timer is none (the request is still a call's).
        return Ok(None);
    };
    let asked = Duration::from_secs(delta);
    if asked < min_se {
        return Err(TooSmall { min_se });
    }
    let their_min = header(req, &["Min-SE"])
        .and_then(|m| m.split(';').next()?.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(min_se);
    let interval = asked.min(max.max(their_min).max(min_se));
    let caller_supports = supports_timer(req);
    let named = parts.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("refresher")
            .then(|| v.trim().to_ascii_lowercase())
    });
    let refresher = match named.as_deref() {
        Some("uas") => Refresher::Uas,
        Some("uac") if caller_supports => Refresher::Uac,
        // A caller that does not support timers cannot refresh: we do.
        _ if caller_supports => Refresher::Uac,
        _ => Refresher::Uas,
    };
    Ok(Some(Timer {
        interval,
        refresher,
        caller_supports,
        refreshed: now,
    }))
}

impl Timer {
    /// The headers of our 2xx: `Session-Expires` with the refresher, and `Require: timer` when
    /// the caller supports timers (§9).
    pub(crate) fn headers(&self) -> Vec<(String, String)> {
        let who = match self.refresher {
            Refresher::Uac => "uac",
            Refresher::Uas => "uas",
        };
        let mut h = vec![(
            "Session-Expires".to_string(),
            format!("{};refresher={who}", self.interval.as_secs()),
        )];
        if self.caller_supports {
            h.push(("Require".to_string(), "timer".to_string()));
        }
        h
    }

    /// When something is next due.
    pub(crate) fn deadline(&self) -> Instant {
        match self.refresher {
            Refresher::Uas => self.refreshed + self.interval / 2,
            Refresher::Uac => {
                let slack = (self.interval / 3).min(Duration::from_secs(32));
                self.refreshed + self.interval - slack
            }
        }
    }

    /// What is due at `now`, if anything.
    pub(crate) fn due(&self, now: Instant) -> Option<Due> {
        (now >= self.deadline()).then_some(match self.refresher {
            Refresher::Uas => Due::Refresh,
            Refresher::Uac => Due::Expired,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invite(extra: &str) -> Request {
        let text = format!(
            "INVITE sip:duplex@192.0.2.1 SIP/2.0\r\nVia: SIP/2.0/UDP 198.51.100.7;branch=z9hG4bK1\r\n\
             From: <sip:c@198.51.100.7>;tag=a\r\nTo: <sip:duplex@192.0.2.1>\r\nCall-ID: t\r\n\
             CSeq: 1 INVITE\r\n{extra}Content-Length: 0\r\n\r\n"
        );
        match rsipstack::sip::SipMessage::try_from(text.as_str()).unwrap() {
            rsipstack::sip::SipMessage::Request(r) => r,
            _ => unreachable!(),
        }
    }

    const MAX: Limits = Limits {
        max: Duration::from_secs(1800),
        min_se: MIN_SE,
    };

    #[test]
    fn sip_session_timers_are_negotiated_as_rfc_4028_says() {
        let now = Instant::now();
        // None asked, none given.
        assert_eq!(negotiate(&invite(""), MAX, now), Ok(None));
        // Too small: 422 with our Min-SE.
        assert_eq!(
            negotiate(&invite("Session-Expires: 30\r\n"), MAX, now),
            Err(TooSmall { min_se: MIN_SE })
        );
        // A caller that supports timers refreshes, at the interval it asked (within ours).
        let t = negotiate(
            &invite("Supported: timer\r\nSession-Expires: 120\r\n"),
            MAX,
            now,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.interval, t.refresher),
            (Duration::from_secs(120), Refresher::Uac)
        );
        assert_eq!(
            t.headers(),
            vec![
                ("Session-Expires".into(), "120;refresher=uac".into()),
                ("Require".into(), "timer".into())
            ]
        );
        // Longer than ours: ours.
        let t = negotiate(&invite("k: timer\r\nx: 7200\r\n"), MAX, now)
            .unwrap()
            .unwrap();
        assert_eq!(t.interval, MAX.max);
        // It may name us; one that does not support timers (a proxy asked) leaves it to us.
        let t = negotiate(
            &invite("Supported: timer\r\nSession-Expires: 600;refresher=uas\r\n"),
            MAX,
            now,
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.refresher, Refresher::Uas);
        let t = negotiate(&invite("Session-Expires: 600\r\n"), MAX, now)
            .unwrap()
            .unwrap();
        assert_eq!(t.refresher, Refresher::Uas);
        assert_eq!(t.headers().len(), 1);
    }

    #[test]
    fn sip_session_timer_refreshes_at_half_or_ends_the_call_before_expiry() {
        let t0 = Instant::now();
        let mut t = negotiate(
            &invite("Supported: timer\r\nSession-Expires: 120\r\n"),
            MAX,
            t0,
        )
        .unwrap()
        .unwrap();
        // The caller refreshes: nothing due until 120 s less 32 s (a third is 40 s).
        assert_eq!(t.due(t0 + Duration::from_secs(87)), None);
        assert_eq!(t.due(t0 + Duration::from_secs(88)), Some(Due::Expired));
        // A refresh at 60 s moves it.
        t.refreshed = t0 + Duration::from_secs(60);
        assert_eq!(t.due(t0 + Duration::from_secs(100)), None);
        assert_eq!(t.due(t0 + Duration::from_secs(148)), Some(Due::Expired));
        // A 90 s interval: a third (30 s) is less than 32.
        let t = negotiate(
            &invite("Supported: timer\r\nSession-Expires: 90\r\n"),
            MAX,
            t0,
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.deadline(), t0 + Duration::from_secs(60));
        // We refresh at half.
        let t = negotiate(&invite("Session-Expires: 600\r\n"), MAX, t0)
            .unwrap()
            .unwrap();
        assert_eq!(t.due(t0 + Duration::from_secs(299)), None);
        assert_eq!(t.due(t0 + Duration::from_secs(300)), Some(Due::Refresh));
    }
}
