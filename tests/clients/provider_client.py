"""A phone call as Telnyx, Plivo, Vonage or Exotel make one over their WebSocket media streams,
for the tests, written from each provider's published message format (see the notes per provider
below), not from the server's code.

Streams a WAV (any rate, 16-bit; resampled here by a windowed-sinc low-pass and linear
interpolation) in the provider's encoding and framing at real time, then `--listen` seconds of
silence, as the provider streams the caller's line continuously. Plays what comes back on a clock
of its own and acknowledges each mark (Telnyx, Exotel `mark`; Plivo `checkpoint` → `playedStream`;
Vonage `notify` → `websocket:notify`) once the audio sent before it has played; answers a clear as
the provider does. Optionally presses DTMF keys. Ends the call as the provider does (Telnyx and
Exotel: a `stop` event, then the server closes; Plivo and Vonage: the socket closes). Signs or
authenticates the upgrade as the provider does when given a secret. G.711 comes from Python's own
`audioop`. Prints one JSON report on stdout.

Per provider (rate and encoding both ways, unless overridden):
  telnyx  JSON text; `connected`, `start` (stream_id, start.call_control_id, start.media_format),
          `media` (base64 RTP payload: PCMU 8 kHz by default; PCMA; L16 big-endian), `dtmf`,
          `stop`; back: `media` {payload}, `mark` {name}, `clear`. Auth: the stream_auth_token
          as the `x-telnyx-streaming-auth-token` header (and in the `connected` frame).
  plivo   JSON text; `start` (start.streamId, start.callId, start.mediaFormat), `media`, `dtmf`;
          no `stop`: the socket closes. Back: `playAudio` {media: {contentType, sampleRate,
          payload}}, `checkpoint` {streamId, name} → `playedStream`, `clearAudio` →
          `clearedAudio`. Auth: X-Plivo-Signature-V3 = base64 HMAC-SHA256(auth token,
          URL (query sorted) + "." + nonce), with X-Plivo-Signature-V3-Nonce.
  vonage  first a text `websocket:connected` {content-type: audio/l16;rate=16000, +headers},
          then binary 16-bit little-endian PCM, 20 ms a frame (640 bytes at 16 kHz) both ways;
          `websocket:dtmf` text events; back: binary audio, {"action": "clear"} →
          `websocket:cleared`, {"action": "notify", "payload"} → `websocket:notify`. The
          socket's close ends the call. Auth: `Authorization: Bearer <JWT HS256 signed with the
          signature secret>` (the NCCO's authorization type "vonage").
  exotel  JSON text; `connected`, `start` (stream_sid, start.call_sid, start.media_format),
          `media` (base64 16-bit LE PCM "raw/slin", 8 kHz by default, ~100 ms chunks), `dtmf`,
          `mark`, `stop`; back: `media`, `mark`, `clear`, each with stream_sid; chunks back must
          be multiples of 320 bytes (3,200 and more advised). Auth: HTTP Basic (the
          `wss://KEY:TOKEN@host/` of the applet).
"""

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
import urllib.parse
import uuid
import warnings
import wave

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # noqa: E402

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402


# ---------------------------------------------------------------------------------- audio

def read_wav(path, seconds=None):
    """The WAV's samples as float64 in [-1, 1), mono, and its rate."""
    with wave.open(path, "rb") as w:
        assert w.getsampwidth() == 2, "16-bit WAV expected"
        rate, channels = w.getframerate(), w.getnchannels()
        frames = w.getnframes()
        if seconds is not None:
            frames = min(frames, int(seconds * rate))
        raw = w.readframes(frames)
    x = np.frombuffer(raw, dtype="<i2").astype(np.float64) / 32768.0
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return x, rate


def resample(x, src, dst):
    """Resamples `x` from `src` Hz to `dst` Hz: a Hann-windowed sinc low-pass at 0.45 of the
    lower rate (when going down), then linear interpolation onto the new clock."""
    if src == dst or len(x) == 0:
        return x
    if dst < src:
        fc = 0.45 * dst / src  # cycles per input sample
        half = 32
        n = np.arange(-half, half + 1)
        h = 2 * fc * np.sinc(2 * fc * n) * np.hanning(2 * half + 1)
        x = np.convolve(x, h / h.sum(), mode="same")
    n_out = int(len(x) * dst / src)
    t = np.arange(n_out) * (src / dst)
    return np.interp(t, np.arange(len(x)), x)


def to_pcm16(x):
    """float64 → 16-bit little-endian bytes."""
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


class Codec:
    """One of the providers' wire encodings, to and from 16-bit little-endian PCM."""

    def __init__(self, name):
        self.name = name  # "ulaw" | "alaw" | "l16le" | "l16be"
        self.width = 1 if name in ("ulaw", "alaw") else 2

    def encode(self, pcm):
        if self.name == "ulaw":
            return audioop.lin2ulaw(pcm, 2)
        if self.name == "alaw":
            return audioop.lin2alaw(pcm, 2)
        if self.name == "l16be":
            return audioop.byteswap(pcm, 2)
        return pcm

    def decode(self, data):
        if self.name == "ulaw":
            return audioop.ulaw2lin(data, 2)
        if self.name == "alaw":
            return audioop.alaw2lin(data, 2)
        data = data[: len(data) - len(data) % 2]
        if self.name == "l16be":
            return audioop.byteswap(data, 2)
        return data


# --------------------------------------------------------------------------------- a call

class Call:
    """What every provider shares: the playback clock, the acknowledgements due, the report."""

    provider = None
    default_rate = 8000
    default_frame_ms = 20

    def __init__(self, args):
        self.args = args
        self.rate = args.rate or self.default_rate
        self.frame_ms = args.frame_ms or self.default_frame_ms
        self.params = json.loads(args.parameters)
        self.seq = 0
        self.t0 = None
        self.play_end = None
        # Acknowledgements due: [time the audio before it has played, message to send].
        self.pending = []
        self.received = bytearray()  # decoded 16-bit PCM
        self.out = {
            "provider": self.provider, "status": None, "errors": [], "audio_seconds": 0.0,
            "rms": 0.0, "media": 0, "frame_bytes": {}, "frame_rule_violations": 0,
            "marks": 0, "echoed": 0, "clears": 0, "ids": [], "expected_id": None,
            "events": {}, "sent_seconds": 0.0, "dtmf_sent": 0, "first_audio_after": None,
            "closed_by": None, "close_code": None,
        }
        self._ids = []

    # -- hooks per provider
    def headers(self):
        return {}

    def greeting(self):
        """Messages sent once the socket opens (str: text frame, bytes: binary frame)."""
        return []

    def media(self, payload, i):
        raise NotImplementedError

    def dtmf(self, digit):
        raise NotImplementedError

    def hangup(self):
        """Messages that end the call before the close (none: the close alone)."""
        return []

    def on_text(self, ev, now):
        raise NotImplementedError

    def on_binary(self, data, now):
        self.error({"binary": len(data)})

    def frame_rule(self, n_bytes):
        """Whether a chunk of `n_bytes` of audio from the server keeps the provider's rules."""
        return True

    def stamp(self, message):
        """An acknowledgement as it goes out (with the sequence number of its sending)."""
        return message

    # -- shared
    def next_seq(self):
        self.seq += 1
        return self.seq

    def error(self, what):
        if len(self.out["errors"]) < 50:
            self.out["errors"].append(what)

    def count(self, kind):
        self.out["events"][kind] = self.out["events"].get(kind, 0) + 1

    def saw_id(self, value):
        self._ids.append(value)

    def audio(self, wire, now, codec=None, rate=None):
        """Audio from the server: decoded, counted, and played from now on at real time."""
        codec = codec or self.codec
        rate = rate or self.rate
        n = len(wire)
        key = str(n)
        self.out["frame_bytes"][key] = self.out["frame_bytes"].get(key, 0) + 1
        if not self.frame_rule(n) or (codec.width == 2 and n % 2):
            self.out["frame_rule_violations"] += 1
        pcm = codec.decode(wire)
        self.received.extend(pcm)
        self.out["media"] += 1
        seconds = len(pcm) / 2 / rate
        self.out["audio_seconds"] += seconds
        if self.out["first_audio_after"] is None:
            self.out["first_audio_after"] = round(now - self.t0, 3)
        start = max(now, self.play_end or now)
        self.play_end = start + seconds

    def mark(self, message, now):
        """A mark of the server's: acknowledged by `message` once what came before it played."""
        self.out["marks"] += 1
        self.pending.append([self.play_end or now, message])

    def clear(self, now, flush_marks, reply=None):
        """The server drops what is queued: pending marks are sent now (`flush_marks`) or
        dropped; `reply` is the provider's acknowledgement of the clear, if any."""
        self.out["clears"] += 1
        self.play_end = now
        if flush_marks:
            for p in self.pending:
                p[0] = now
        else:
            self.pending.clear()
        if reply is not None:
            self.pending.insert(0, [now, reply])

    def due(self, now):
        msgs = []
        while self.pending and self.pending[0][0] <= now:
            msgs.append(self.pending.pop(0)[1])
        return msgs

    def report(self):
        pcm = bytes(self.received)
        self.out["rms"] = audioop.rms(pcm, 2) / 32768 if pcm else 0.0
        self.out["audio_seconds"] = round(self.out["audio_seconds"], 3)
        self.out["sent_seconds"] = round(self.out["sent_seconds"], 3)
        self.out["ids"] = sorted(set(s for s in self._ids if s is not None)) + (
            ["(missing)"] if None in self._ids else [])
        return self.out


def payload_of(ev, call):
    """The base64 `media.payload` of a message, decoded; None (an error noted) if it is not."""
    try:
        return base64.b64decode(ev["media"]["payload"], validate=True)
    except (KeyError, TypeError, ValueError):
        call.error({"bad_payload": ev.get("event")})
        return None


# ------------------------------------------------------------------------------- telnyx

class Telnyx(Call):
    """Telnyx Media Streaming (Call Control `stream_url`, bidirectional `rtp` mode):
    developers.telnyx.com/api-reference/websockets/stream-call-media-over-websocket."""

    provider = "telnyx"

    def __init__(self, args):
        super().__init__(args)
        enc = (args.encoding or "PCMU").upper()
        self.encoding = enc
        self.codec = Codec({"PCMU": "ulaw", "PCMA": "alaw", "L16": "l16be"}[enc])
        self.stream_id = str(uuid.uuid4()).upper()
        self.call_control_id = "v3:" + secrets.token_urlsafe(40)
        self.out["expected_id"] = self.stream_id

    def headers(self):
        token = self.args.auth_token
        return {"x-telnyx-streaming-auth-token": token} if token else {}

    def greeting(self):
        connected = {"event": "connected", "version": "1.0.0"}
        if self.args.auth_token:
            connected["x-telnyx-streaming-auth-token"] = self.args.auth_token
        start = {
            "event": "start", "sequence_number": str(self.next_seq()),
            "stream_id": self.stream_id,
            "start": {
                "user_id": str(uuid.uuid4()), "call_control_id": self.call_control_id,
                "call_session_id": str(uuid.uuid4()), "from": "+13122010094",
                "to": "+13122123456", "tags": [], "custom_parameters": self.params,
                "media_format": {"encoding": self.encoding, "sample_rate": self.rate,
                                 "channels": 1},
            },
        }
        return [json.dumps(connected), json.dumps(start)]

    def media(self, payload, i):
        return json.dumps({
            "event": "media", "sequence_number": str(self.next_seq()),
            "media": {"track": "inbound", "chunk": str(i + 1),
                      "timestamp": str(i * self.frame_ms),
                      "payload": base64.b64encode(payload).decode()},
            "stream_id": self.stream_id,
        })

    def dtmf(self, digit):
        return json.dumps({
            "event": "dtmf", "stream_id": self.stream_id,
            "sequence_number": str(self.next_seq()),
            "occurred_at": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
            "dtmf": {"digit": digit},
        })

    def hangup(self):
        return [json.dumps({
            "event": "stop", "sequence_number": str(self.next_seq()),
            "stop": {"user_id": str(uuid.uuid4()), "call_control_id": self.call_control_id},
            "stream_id": self.stream_id,
        })]

    def frame_rule(self, n):
        # RTP media back may hold 20 ms to 30 s of audio.
        seconds = n / self.codec.width / self.rate
        return 0.02 - 1e-9 <= seconds <= 30.0

    def on_text(self, ev, now):
        kind = ev.get("event")
        if "stream_id" in ev:
            self.saw_id(ev["stream_id"])
        if kind == "media":
            data = payload_of(ev, self)
            if data is not None:
                self.audio(data, now)
        elif kind == "mark":
            name = (ev.get("mark") or {}).get("name")
            if not isinstance(name, str):
                self.error({"bad_mark": ev})
                return
            # Sent back when the media before it has played (at once if none is queued).
            self.mark(json.dumps({"event": "mark", "sequence_number": None,
                                  "stream_id": self.stream_id, "mark": {"name": name}}), now)
        elif kind == "clear":
            # Stops playback, drops what is queued; the queued marks are sent back.
            self.clear(now, flush_marks=True)
        else:
            self.error(ev)

    def stamp(self, message):
        """Marks go out with the sequence number of their sending."""
        ev = json.loads(message)
        if "sequence_number" in ev and ev["sequence_number"] is None:
            ev["sequence_number"] = str(self.next_seq())
        return json.dumps(ev)


# -------------------------------------------------------------------------------- plivo

class Plivo(Call):
    """Plivo Audio Streaming (`<Stream bidirectional="true">`):
    plivo.com/docs/voice/audio-streaming/audio-streaming (Stream Event Protocol)."""

    provider = "plivo"
    CONTENT = {"audio/x-mulaw": "ulaw", "audio/x-l16": "l16le"}

    def __init__(self, args):
        super().__init__(args)
        enc = args.encoding or "audio/x-mulaw"
        if enc not in self.CONTENT:
            raise SystemExit(f"plivo encodings: {sorted(self.CONTENT)}")
        self.encoding = enc
        self.codec = Codec(self.CONTENT[enc])
        self.stream_id = str(uuid.uuid4())
        self.call_id = str(uuid.uuid4())
        self.out["expected_id"] = self.stream_id
        self.out["content_types"] = []

    def headers(self):
        token = self.args.auth_token
        if not token:
            return {}
        nonce = self.args.nonce or "".join(secrets.choice("0123456789") for _ in range(20))
        signed = plivo_v3_string(self.args.signed_url or self.args.url, nonce)
        mac = base64.b64encode(hmac.new(token.encode(), signed.encode(), hashlib.sha256)
                               .digest()).decode()
        return {"X-Plivo-Signature-V3": mac, "X-Plivo-Signature-Ma-V3": mac,
                "X-Plivo-Signature-V3-Nonce": nonce}

    def extra_headers(self):
        return ";".join(f"{k}={v}" for k, v in self.params.items())

    def greeting(self):
        return [json.dumps({
            "event": "start", "sequenceNumber": self.next_seq(),
            "start": {"callId": self.call_id, "streamId": self.stream_id,
                      "accountId": "MA" + "X" * 18, "tracks": ["inbound"],
                      "mediaFormat": {"encoding": self.encoding, "sampleRate": self.rate}},
            "extra_headers": self.extra_headers(),
        })]

    def media(self, payload, i):
        return json.dumps({
            "event": "media", "sequenceNumber": self.next_seq(), "streamId": self.stream_id,
            "media": {"track": "inbound", "timestamp": str(int(time.time() * 1000)),
                      "chunk": i + 1, "payload": base64.b64encode(payload).decode()},
            "extra_headers": self.extra_headers(),
        })

    def dtmf(self, digit):
        return json.dumps({
            "event": "dtmf", "sequenceNumber": self.next_seq(), "streamId": self.stream_id,
            "dtmf": {"track": "inbound", "digit": digit,
                     "timestamp": str(int(time.time() * 1000))},
        })

    def on_text(self, ev, now):
        kind = ev.get("event")
        if kind == "playAudio":
            if "streamId" in ev:
                self.saw_id(ev["streamId"])
            media = ev.get("media") or {}
            ctype, rate = media.get("contentType"), media.get("sampleRate")
            seen = f"{ctype};rate={rate}"
            if seen not in self.out["content_types"]:
                self.out["content_types"].append(seen)
            allowed = {"audio/x-mulaw": (8000,), "audio/x-l16": (8000, 16000)}
            if ctype not in allowed or rate not in allowed[ctype]:
                self.error({"bad_content": seen})
                return
            data = payload_of(ev, self)
            if data is not None:
                self.audio(data, now, Codec(self.CONTENT[ctype]), rate)
        elif kind == "checkpoint":
            self.saw_id(ev.get("streamId"))
            name = ev.get("name")
            if not isinstance(name, str):
                self.error({"bad_checkpoint": ev})
                return
            self.mark(json.dumps({"event": "playedStream", "sequenceNumber": None,
                                  "streamId": self.stream_id, "name": name}), now)
        elif kind == "clearAudio":
            self.saw_id(ev.get("streamId"))
            # Buffered audio dropped; its checkpoints are not acknowledged.
            self.clear(now, flush_marks=False, reply=json.dumps({
                "sequenceNumber": None, "event": "clearedAudio", "streamId": self.stream_id}))
        elif kind == "sendDTMF":
            self.count("sendDTMF")
        else:
            self.error(ev)

    def stamp(self, message):
        ev = json.loads(message)
        if "sequenceNumber" in ev and ev["sequenceNumber"] is None:
            ev["sequenceNumber"] = self.next_seq()
        return json.dumps(ev)


def plivo_v3_string(url, nonce):
    """What X-Plivo-Signature-V3 signs for a GET without a body, as Plivo's SDKs compute it
    (plivo-python `utils/signature_v3.py`): scheme://host/path, then `?` and the query's pairs
    sorted by name (`k=v` joined by `&`, values decoded) when there is a query, then `.` and
    the nonce."""
    p = urllib.parse.urlsplit(url)
    base = urllib.parse.urlunsplit((p.scheme, p.netloc, p.path, "", ""))
    q = urllib.parse.parse_qs(p.query, keep_blank_values=True)
    pairs = []
    for k in sorted(q):
        pairs.append("&".join(f"{k}={v}" for v in sorted(q[k])))
    query = "&".join(pairs)
    if query:
        base += "?" + query
    return f"{base}.{nonce}"


# ------------------------------------------------------------------------------- vonage

class Vonage(Call):
    """Vonage Voice API WebSockets (NCCO `connect` to a `websocket` endpoint):
    developer.vonage.com/en/voice/voice-api/concepts/websockets."""

    provider = "vonage"
    default_rate = 16000

    def __init__(self, args):
        super().__init__(args)
        if self.rate not in (8000, 16000, 24000):
            raise SystemExit("vonage rates: 8000, 16000, 24000")
        self.codec = Codec("l16le")
        self.frame_bytes = int(self.rate * self.frame_ms / 1000) * 2

    def headers(self):
        if not self.args.auth_token:
            return {}
        now = int(time.time())
        claims = {"iat": now, "jti": str(uuid.uuid4()), "iss": "Vonage",
                  "application_id": self.args.application_id, "api_key": self.args.api_key}
        return {"Authorization": "Bearer " + jwt_hs256(claims, self.args.auth_token)}

    def greeting(self):
        ev = {"event": "websocket:connected", "content-type": f"audio/l16;rate={self.rate}"}
        ev.update(self.params)
        return [json.dumps(ev)]

    def media(self, payload, i):
        return payload  # a binary frame

    def dtmf(self, digit):
        return json.dumps({"event": "websocket:dtmf", "digit": digit, "duration": 260})

    def frame_rule(self, n):
        return n == self.frame_bytes  # 20 ms a frame

    def on_binary(self, data, now):
        self.audio(data, now)

    def on_text(self, ev, now):
        action = ev.get("action")
        if action == "clear":
            # Vonage empties its playback buffer and says so.
            self.clear(now, flush_marks=False,
                       reply=json.dumps({"event": "websocket:cleared"}))
        elif action == "notify":
            self.mark(json.dumps({"event": "websocket:notify",
                                  "payload": ev.get("payload")}), now)
        else:
            self.error(ev)


def jwt_hs256(claims, secret):
    def b64(b):
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = b64(json.dumps(claims, separators=(",", ":")).encode())
    mac = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(mac)}"


# ------------------------------------------------------------------------------- exotel

class Exotel(Call):
    """Exotel AgentStream, the Voicebot applet (bidirectional):
    developer.exotel.com/docs/agentstream/stream-voicebot-applet, .../websocket-protocol."""

    provider = "exotel"
    default_frame_ms = 100

    def __init__(self, args):
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(args.url).query)
        if not args.rate and "sample-rate" in q:
            args.rate = int(q["sample-rate"][0])
        super().__init__(args)
        if self.rate not in (8000, 16000, 24000):
            raise SystemExit("exotel rates: 8000, 16000, 24000")
        self.codec = Codec("l16le")
        self.stream_sid = secrets.token_hex(16)
        self.call_sid = secrets.token_hex(16)
        self.out["expected_id"] = self.stream_sid

    def headers(self):
        if not self.args.auth_token:
            return {}
        return {"Authorization": "Basic "
                + base64.b64encode(self.args.auth_token.encode()).decode()}

    def greeting(self):
        start = {
            "event": "start", "sequence_number": str(self.next_seq()),
            "stream_sid": self.stream_sid,
            "start": {"stream_sid": self.stream_sid, "call_sid": self.call_sid,
                      "account_sid": "exotel" + secrets.token_hex(4),
                      "from": "+919876543210", "to": "+918047491899",
                      "custom_parameters": self.params,
                      "media_format": {"encoding": "raw/slin", "sample_rate": str(self.rate),
                                       "bit_rate": "128kbps"}},
        }
        return [json.dumps({"event": "connected"}), json.dumps(start)]

    def media(self, payload, i):
        return json.dumps({
            "event": "media", "sequence_number": str(self.next_seq()),
            "stream_sid": self.stream_sid,
            "media": {"chunk": str(i + 1), "timestamp": str(i * self.frame_ms),
                      "payload": base64.b64encode(payload).decode()},
        })

    def dtmf(self, digit):
        return json.dumps({"event": "dtmf", "sequence_number": str(self.next_seq()),
                           "stream_sid": self.stream_sid,
                           "dtmf": {"digit": digit, "duration": "100"}})

    def hangup(self):
        return [json.dumps({
            "event": "stop", "sequence_number": str(self.next_seq()),
            "stream_sid": self.stream_sid,
            "stop": {"call_sid": self.call_sid, "account_sid": "exotel",
                     "reason": "callended"},
        })]

    def frame_rule(self, n):
        # Multiples of 320 bytes, at most 100 kB (under 3,200 only advised against).
        if n < 3200:
            self.out["small_chunks"] = self.out.get("small_chunks", 0) + 1
        return n % 320 == 0 and 0 < n <= 100_000

    def on_text(self, ev, now):
        kind = ev.get("event")
        if kind in ("media", "mark", "clear"):
            self.saw_id(ev.get("stream_sid"))
        if kind == "media":
            data = payload_of(ev, self)
            if data is not None:
                self.audio(data, now)
        elif kind == "mark":
            name = (ev.get("mark") or {}).get("name")
            if not isinstance(name, str):
                self.error({"bad_mark": ev})
                return
            self.mark(json.dumps({"event": "mark", "sequence_number": None,
                                  "stream_sid": self.stream_sid, "mark": {"name": name}}), now)
        elif kind == "clear":
            self.clear(now, flush_marks=True)
        else:
            self.error(ev)

    def stamp(self, message):
        ev = json.loads(message)
        if "sequence_number" in ev and ev["sequence_number"] is None:
            ev["sequence_number"] = str(self.next_seq())
        return json.dumps(ev)


PROVIDERS = {"telnyx": Telnyx, "plivo": Plivo, "vonage": Vonage, "exotel": Exotel}


# ------------------------------------------------------------------------------ the run

def strip_userinfo(url):
    """`wss://KEY:TOKEN@host/p` → (`wss://host/p`, "KEY:TOKEN" or None)."""
    p = urllib.parse.urlsplit(url)
    if p.username is None:
        return url, None
    netloc = p.hostname + (f":{p.port}" if p.port else "")
    cred = urllib.parse.unquote(p.username) + ":" + urllib.parse.unquote(p.password or "")
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment)), cred


async def call(args):
    args.url, cred = strip_userinfo(args.url)
    if cred and not args.auth_token:
        args.auth_token = cred  # Exotel's basic auth in the URL
    c = PROVIDERS[args.provider](args)
    x, src = read_wav(args.wav, args.seconds)
    pcm = to_pcm16(resample(x, src, c.rate))
    n = int(c.rate * c.frame_ms / 1000) * 2  # PCM bytes a frame
    frames = [pcm[k:k + n] for k in range(0, len(pcm), n)]
    if frames and len(frames[-1]) < n:
        frames[-1] += b"\x00" * (n - len(frames[-1]))
    total = len(frames) + int(args.listen * 1000 / c.frame_ms)
    silence = b"\x00" * n
    headers = c.headers()
    if args.authorization:
        headers["Authorization"] = args.authorization
    dtmf_at = {}
    if args.dtmf:
        for k, digit in enumerate(args.dtmf):
            dtmf_at.setdefault(int((args.dtmf_at + 0.2 * k) * 1000 / c.frame_ms), []).append(
                digit)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            ws = await session.ws_connect(args.url, headers=headers, max_msg_size=0,
                                          autoclose=False, heartbeat=None)
        except aiohttp.WSServerHandshakeError as e:
            c.out["status"] = e.status
            print(json.dumps(c.report()))
            return
        except aiohttp.ClientError as e:
            c.error({"connect": str(e)})
            print(json.dumps(c.report()))
            return
        c.t0 = time.monotonic()
        client_closing = False

        async def reader():
            while True:
                msg = await ws.receive()
                now = time.monotonic()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    try:
                        ev = json.loads(msg.data)
                        assert isinstance(ev, dict)
                    except (ValueError, AssertionError):
                        c.error({"not_json": msg.data[:200]})
                        continue
                    c.count(ev.get("event") or ev.get("action") or "?")
                    c.on_text(ev, now)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    c.count("binary")
                    c.on_binary(msg.data, now)
                elif msg.type == aiohttp.WSMsgType.CLOSE:
                    if not client_closing and c.out["closed_by"] is None:
                        c.out["closed_by"] = "server"
                    c.out["close_code"] = msg.data
                    if not client_closing:
                        await ws.close()
                    return
                else:  # CLOSING, CLOSED, ERROR
                    if c.out["closed_by"] is None:
                        c.out["closed_by"] = "server"
                    c.out["close_code"] = ws.close_code
                    return

        task = asyncio.create_task(reader())

        async def send(m):
            if ws.closed or task.done():
                return False
            try:
                if isinstance(m, bytes):
                    await ws.send_bytes(m)
                else:
                    await ws.send_str(m)
            except (ConnectionError, RuntimeError):
                # The server closed while we sent: not an error of the server's, the report's
                # closed_by and close_code tell it.
                c.out["send_failures"] = c.out.get("send_failures", 0) + 1
                return False
            return True

        period = c.frame_ms / 1000
        ok = True
        for m in c.greeting():
            ok = ok and await send(m)
        for i in range(total):
            if not ok or task.done():
                break
            chunk = frames[i] if i < len(frames) else silence
            ok = await send(c.media(c.codec.encode(chunk), i))
            c.out["sent_seconds"] += period
            for digit in dtmf_at.get(i, []):
                if ok and await send(c.dtmf(digit)):
                    c.out["dtmf_sent"] += 1
            for m in c.due(time.monotonic()):
                if ok and await send(c.stamp(m)):
                    c.out["echoed"] += 1
            delay = c.t0 + (i + 1) * period - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        # The hang-up: the provider's stop event (then the server closes), or the close alone.
        if not task.done():
            bye = [] if args.no_stop else c.hangup()
            for m in bye:
                await send(m)
            if bye:
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except asyncio.TimeoutError:
                    pass
            if not task.done():
                client_closing = True
                c.out["closed_by"] = "client"
                await ws.close()
                try:
                    await asyncio.wait_for(task, 5)
                except asyncio.TimeoutError:
                    task.cancel()
                if c.out["close_code"] is None:
                    c.out["close_code"] = ws.close_code
    print(json.dumps(c.report()))


def main():
    p = argparse.ArgumentParser(
        description="Play a phone call to a WebSocket server as Telnyx, Plivo, Vonage or "
        "Exotel would; print one JSON report.")
    p.add_argument("--provider", required=True, choices=sorted(PROVIDERS))
    p.add_argument("--url", required=True,
                   help="the server's ws:// or wss:// URL (Exotel: KEY:TOKEN@ and "
                   "?sample-rate= as in the applet)")
    p.add_argument("--wav", required=True, help="a 16-bit WAV, any rate (resampled)")
    p.add_argument("--seconds", type=float, help="send at most this much of the WAV")
    p.add_argument("--listen", type=float, default=2.0,
                   help="seconds of silence streamed after the WAV")
    p.add_argument("--auth-token", "--token", dest="auth_token",
                   help="telnyx: the stream_auth_token; plivo: the auth token that signs; "
                   "vonage: the signature secret of the JWT; exotel: KEY:TOKEN (basic auth)")
    p.add_argument("--signed-url", help="plivo: the URL Plivo signs (default: --url)")
    p.add_argument("--nonce", help="plivo: the X-Plivo-Signature-V3-Nonce (default: random)")
    p.add_argument("--authorization", help="a raw Authorization header (e.g. Vonage's "
                   "authorization type \"custom\"); overrides the provider's own")
    p.add_argument("--api-key", default="abcd1234", help="vonage: the JWT's api_key claim")
    p.add_argument("--application-id", default="aaaaaaaa-bbbb-cccc-dddd-0123456789ab",
                   help="vonage: the JWT's application_id claim")
    p.add_argument("--parameters", default="{}",
                   help="custom parameters, a JSON object: telnyx start.custom_parameters, "
                   "plivo extra_headers, vonage websocket:connected headers, exotel "
                   "start.custom_parameters")
    p.add_argument("--encoding", help="telnyx: PCMU (default), PCMA, L16; plivo: "
                   "audio/x-mulaw (default), audio/x-l16")
    p.add_argument("--rate", type=int, help="sample rate on the wire (default: telnyx, "
                   "plivo 8000; vonage 16000; exotel 8000 or the URL's sample-rate)")
    p.add_argument("--frame-ms", type=int, help="audio a media message (default 20; exotel "
                   "100)")
    p.add_argument("--dtmf", help="keys to press, e.g. 1 or 12#")
    p.add_argument("--dtmf-at", type=float, default=1.0,
                   help="seconds into the call of the first key")
    p.add_argument("--no-stop", action="store_true",
                   help="hang up by closing the socket without the provider's stop event")
    asyncio.run(call(p.parse_args()))


if __name__ == "__main__":
    main()
