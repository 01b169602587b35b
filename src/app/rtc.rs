//! What both ends of a WebRTC call in this crate share (the server's driver and the load test's
//! client, both on str0m): running a peer's state machine until it wants waking, its datagrams
//! sent on a UDP socket, and writing one Opus packet on its audio track. Knows nothing of
//! sessions, HTTP or what the audio says.

use std::time::Instant;

use str0m::media::{Frequency, MediaTime, Mid};
use str0m::{Event, Output, Rtc, RtcError};

/// Runs `rtc` until it wants waking: its datagrams sent on `socket` (a datagram the socket
/// cannot take now is dropped, as the network would), its events handed to `event`. Returns
/// when to wake it, at `wake` at the latest.
///
/// # Errors
///
/// The peer's failure: it is over.
pub(crate) fn poll(
    rtc: &mut Rtc,
    socket: &tokio::net::UdpSocket,
    wake: Instant,
    mut event: impl FnMut(Event),
) -> Result<Instant, RtcError> {
    loop {
        match rtc.poll_output()? {
            Output::Timeout(t) => return Ok(wake.min(t)),
            Output::Transmit(t) => {
                let _ = socket.try_send_to(&t.contents, t.destination);
            }
            Output::Event(e) => event(e),
        }
    }
}

/// Writes one Opus packet on `mid`, stamped `ticks` of the 48 kHz RTP clock; `false` when the
/// track is not there yet or its remote took no Opus.
///
/// # Errors
///
/// str0m's refusal of the packet.
pub(crate) fn write_opus(
    rtc: &mut Rtc,
    mid: Mid,
    now: Instant,
    ticks: u64,
    packet: &[u8],
) -> Result<bool, RtcError> {
    let Some(w) = rtc.writer(mid) else {
        return Ok(false);
    };
    let Some(pt) = w
        .payload_params()
        .find(|p| p.spec().codec == str0m::format::Codec::Opus)
        .map(|p| p.pt())
    else {
        return Ok(false);
    };
    let t = MediaTime::new(ticks, Frequency::FORTY_EIGHT_KHZ);
    w.write(pt, now, t, packet.to_vec())?;
    Ok(true)
}
