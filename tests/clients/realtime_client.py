"""Clients of `duplex serve`'s `/v1/realtime` for the tests, on independent parts.

`sdk` mode is the official `openai` SDK's realtime client (`AsyncOpenAI(base_url=…)`): it sends
`session.update` (instructions, voice, formats in the GA spelling, the `duplex` sampling
extension, `turn_detection` when given), streams a WAV in real time (20 ms appends), listens on,
and reports what came back (the user's turns the server detected among it).
G.711 is made and read with Python's own `audioop` (`lin2ulaw`, `ulaw2lin`, `ratecv`), never
with duplex's code. `raw` mode speaks the WebSocket itself (`websockets`), to send what the SDK
would refuse to: bad events, one by one, each answered by an `error` event.

Prints one JSON object on stdout.
"""

import argparse
import asyncio
import base64
import json
import sys
import time
import warnings
import wave

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # noqa: E402  (Python's own G.711 and rate conversion)


def read_wav(path):
    with wave.open(path, "rb") as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1, path
        return w.getframerate(), w.readframes(w.getnframes())


def wire_audio(pcm24k: bytes, fmt: str) -> tuple[bytes, int]:
    """The WAV's 24 kHz PCM16 in `fmt`; returns the bytes and their bytes per 20 ms."""
    if fmt == "pcm16":
        return pcm24k, 960
    pcm8k, _ = audioop.ratecv(pcm24k, 2, 1, 24000, 8000, None)
    law = audioop.lin2ulaw(pcm8k, 2) if fmt == "g711_ulaw" else audioop.lin2alaw(pcm8k, 2)
    return law, 160


def ga_format(fmt: str) -> dict:
    return {
        "pcm16": {"type": "audio/pcm", "rate": 24000},
        "g711_ulaw": {"type": "audio/pcmu"},
        "g711_alaw": {"type": "audio/pcma"},
    }[fmt]


def to_pcm16(data: bytes, fmt: str) -> bytes:
    """Received audio as PCM16 at its own rate (24 kHz for pcm16, 8 kHz for G.711)."""
    if fmt == "pcm16":
        return data
    return audioop.ulaw2lin(data, 2) if fmt == "g711_ulaw" else audioop.alaw2lin(data, 2)


async def sdk(args):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.url + "/v1", api_key=args.key or "none")
    rate, pcm = read_wav(args.wav)
    assert rate == 24000, rate
    data, step = wire_audio(pcm, args.input)
    out = {"events": {}, "errors": [], "audio_b64": "", "text": "", "session_id": None, "turns": []}
    audio = bytearray()
    async with client.realtime.connect(model="duplex") as conn:
        session = {
            "type": "realtime",
            "instructions": args.instructions,
            "audio": {
                "input": {"format": ga_format(args.input)},
                "output": {"format": ga_format(args.output)},
            },
        }
        if args.voice:
            session["audio"]["output"]["voice"] = args.voice
        if args.greedy:
            session["duplex"] = {"text_temperature": 0, "audio_temperature": 0}
        if args.turn_detection is not None:
            session["audio"]["input"]["turn_detection"] = json.loads(args.turn_detection)
        await conn.session.update(session=session)

        async def send():
            t0 = time.monotonic()
            for i, at in enumerate(range(0, len(data), step)):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(data[at : at + step]).decode()
                )
                # Real time: the i-th 20 ms chunk leaves at i * 20 ms.
                delay = t0 + (i + 1) * 0.02 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

        sender = asyncio.create_task(send())
        deadline = None
        while True:
            if sender.done() and deadline is None:
                deadline = time.monotonic() + args.listen
            timeout = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
            if deadline is not None and timeout == 0.0:
                break
            try:
                ev = await asyncio.wait_for(conn.recv(), timeout)
            except asyncio.TimeoutError:
                if deadline is None:
                    out["errors"].append("no event for 30 s")
                break
            t = ev.type
            out["events"][t] = out["events"].get(t, 0) + 1
            if t in ("response.output_audio.delta", "response.audio.delta"):
                audio += base64.b64decode(ev.delta)
            elif t in ("response.output_audio_transcript.delta", "response.audio_transcript.delta"):
                out["text"] += ev.delta
            elif t == "response.created":
                out["session_id"] = (ev.response.metadata or {}).get("duplex_session")
            elif t == "input_audio_buffer.speech_started":
                out["turns"].append([t, ev.audio_start_ms, ev.item_id])
            elif t == "input_audio_buffer.speech_stopped":
                out["turns"].append([t, ev.audio_end_ms, ev.item_id])
            elif t == "input_audio_buffer.committed":
                out["turns"].append([t, None, ev.item_id])
            elif t == "response.done":
                out.setdefault("done", []).append(
                    [ev.response.status, (ev.response.status_details.reason if ev.response.status_details else None)]
                )
            elif t == "session.updated":
                out["updated"] = ev.session.model_dump(exclude_none=True)
            elif t == "error":
                out["errors"].append(ev.error.model_dump(exclude_none=True))
        await sender
    pcm_back = to_pcm16(bytes(audio), args.output)
    back_rate = 24000 if args.output == "pcm16" else 8000
    out["audio_seconds"] = len(pcm_back) / 2 / back_rate
    if args.save:
        with wave.open(args.save, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(back_rate)
            w.writeframes(pcm_back)
    print(json.dumps(out))


async def raw(args):
    """Sends each of `--events` (a JSON list of raw text messages, or `@file` holding one), then reads what comes back
    for `--listen` seconds; reports every server event and how the connection closed."""
    import websockets

    headers = {}
    subprotocols = None
    if args.key:
        subprotocols = ["realtime", "openai-insecure-api-key." + args.key]
    out = {"events": [], "close": None, "status": None}
    try:
        async with websockets.connect(
            args.url.replace("http", "ws", 1) + "/v1/realtime" + args.query,
            additional_headers=headers,
            subprotocols=subprotocols,
            max_size=None,
        ) as ws:
            out["subprotocol"] = ws.subprotocol
            events = args.events
            if events.startswith("@"):
                with open(events[1:]) as f:
                    events = f.read()
            for m in json.loads(events):
                try:
                    await ws.send(m)
                except websockets.ConnectionClosed:
                    break
            deadline = time.monotonic() + args.listen
            while time.monotonic() < deadline:
                try:
                    m = await asyncio.wait_for(ws.recv(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
                except websockets.ConnectionClosed as e:
                    out["close"] = [e.rcvd.code if e.rcvd else None, e.rcvd.reason if e.rcvd else None]
                    break
                ev = json.loads(m)
                if ev.get("type", "").endswith(".delta"):
                    ev = {"type": ev["type"]}
                out["events"].append(ev)
    except websockets.InvalidStatus as e:
        out["status"] = e.response.status_code
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--mode", choices=["sdk", "raw"], default="sdk")
    p.add_argument("--wav")
    p.add_argument("--input", default="pcm16", choices=["pcm16", "g711_ulaw", "g711_alaw"])
    p.add_argument("--output", default="pcm16", choices=["pcm16", "g711_ulaw", "g711_alaw"])
    p.add_argument("--instructions", default="")
    p.add_argument("--voice")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--turn-detection", help="the session's audio.input.turn_detection, as JSON")
    p.add_argument("--key")
    p.add_argument("--listen", type=float, default=2.0)
    p.add_argument("--save")
    p.add_argument("--events", default="[]")
    p.add_argument("--query", default="")
    args = p.parse_args()
    asyncio.run(sdk(args) if args.mode == "sdk" else raw(args))


if __name__ == "__main__":
    sys.exit(main())
