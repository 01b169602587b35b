"""A phone call as Twilio's Media Streams make it, for the tests, written from Twilio's published
message format (`connected`, `start`, `media`, `mark`, `stop`; `media`, `mark`, `clear` back).

Streams a 24 kHz WAV as μ-law at 8 kHz in 20 ms `media` messages at real time (Python's own
`audioop` makes the μ-law), plays what comes back on a clock of its own and echoes each mark
once the audio sent before it has played, as Twilio does; then hangs up (`stop`). Signs the
upgrade request as Twilio does (`X-Twilio-Signature`: base64 HMAC-SHA1 of the URL with the auth
token, Python's `hmac`) when given a token. Prints one JSON report on stdout.
"""

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import time
import warnings
import wave

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # noqa: E402

import websockets  # noqa: E402

SID = "MZ0123456789abcdef0123456789abcdef"


async def call(args):
    with wave.open(args.wav, "rb") as w:
        assert w.getframerate() == 24000 and w.getsampwidth() == 2
        pcm = w.readframes(w.getnframes())
    pcm8k, _ = audioop.ratecv(pcm, 2, 1, 24000, 8000, None)
    ulaw = audioop.lin2ulaw(pcm8k, 2)
    headers = {}
    if args.token:
        mac = hmac.new(args.token.encode(), args.signed_url.encode(), hashlib.sha1).digest()
        headers["X-Twilio-Signature"] = base64.b64encode(mac).decode()
    out = {"media": 0, "audio_seconds": 0.0, "marks": 0, "echoed": 0, "clears": 0,
           "sids": [], "status": None, "errors": []}
    received = bytearray()
    try:
        async with websockets.connect(args.url, additional_headers=headers) as ws:
            await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await ws.send(json.dumps({
                "event": "start", "sequenceNumber": "1", "streamSid": SID,
                "start": {
                    "accountSid": "AC0123", "callSid": "CA0123", "streamSid": SID,
                    "tracks": ["inbound"],
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    "customParameters": json.loads(args.parameters),
                },
            }))
            seq = 2
            t0 = time.monotonic()
            # Playback: the audio received plays from its arrival on, at real time.
            play_end = None
            pending = []  # (time the mark's audio has played, name)

            async def reader():
                try:
                    await read()
                except websockets.ConnectionClosed:
                    pass

            async def read():
                nonlocal play_end
                async for m in ws:
                    ev = json.loads(m)
                    out["sids"].append(ev.get("streamSid"))
                    kind = ev.get("event")
                    now = time.monotonic()
                    if kind == "media":
                        chunk = base64.b64decode(ev["media"]["payload"])
                        received.extend(chunk)
                        out["media"] += 1
                        start = max(now, play_end or now)
                        play_end = start + len(chunk) / 8000
                    elif kind == "mark":
                        out["marks"] += 1
                        pending.append((play_end or now, ev["mark"]["name"]))
                    elif kind == "clear":
                        out["clears"] += 1
                        play_end = now
                        pending[:] = [(now, n) for _, n in pending]
                    else:
                        out["errors"].append(ev)

            task = asyncio.create_task(reader())
            total = len(ulaw) // 160
            for i in range(total + int(args.listen / 0.02)):
                chunk = ulaw[i * 160:(i + 1) * 160] if i < total else b"\xff" * 160
                await ws.send(json.dumps({
                    "event": "media", "sequenceNumber": str(seq), "streamSid": SID,
                    "media": {"track": "inbound", "chunk": str(i + 1),
                              "timestamp": str(i * 20), "payload": base64.b64encode(chunk).decode()},
                }))
                seq += 1
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, name = pending.pop(0)
                    await ws.send(json.dumps({"event": "mark", "sequenceNumber": str(seq),
                                              "streamSid": SID, "mark": {"name": name}}))
                    seq += 1
                    out["echoed"] += 1
                delay = t0 + (i + 1) * 0.02 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await ws.send(json.dumps({"event": "stop", "sequenceNumber": str(seq), "streamSid": SID,
                                      "stop": {"accountSid": "AC0123", "callSid": "CA0123"}}))
            try:
                await asyncio.wait_for(task, 5)
            except asyncio.TimeoutError:
                task.cancel()
    except websockets.InvalidStatus as e:
        out["status"] = e.response.status_code
    pcm_back = audioop.ulaw2lin(bytes(received), 2)
    out["audio_seconds"] = len(pcm_back) / 2 / 8000
    out["rms"] = audioop.rms(pcm_back, 2) / 32768 if pcm_back else 0.0
    out["sids"] = sorted(set(s for s in out["sids"] if s is not None)) + (
        ["(missing)"] if None in out["sids"] else [])
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--wav", required=True)
    p.add_argument("--token")
    p.add_argument("--signed-url", help="the URL Twilio signs (the TwiML's)")
    p.add_argument("--parameters", default="{}", help="the <Parameter>s, as a JSON object")
    p.add_argument("--listen", type=float, default=2.0)
    asyncio.run(call(p.parse_args()))


if __name__ == "__main__":
    main()
