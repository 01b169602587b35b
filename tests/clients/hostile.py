"""Hostile clients of `duplex serve`, for the tests of what a client cannot make the server spend.
Independent of duplex: the WebSocket by `aiohttp` or by hand on a raw socket (RFC 6455 framing
written here), the Ogg pages by hand (RFC 3533), Opus packets as bytes.

  --attack bomb        one message of Ogg pages, each of 255 Opus packets of 2 bytes that claim
                       120 ms each (two 60 ms frames of nothing), after the header pages
  --attack zeros       the same with packets of no bytes (each a lost frame)
  --attack ping-flood  pings as fast as possible on a raw socket; --read reads what comes back
  --attack prime-leave an upgrade with a long text_prompt (--query), then gone after --hold s
  --attack upgrade     a raw upgrade with the given --key, --host and --header lines; prints
                       the status line
  --attack twilio      Twilio Media Streams (--url ws://…/twilio/media): `connected`, then
                       `start` unless --no-start, then `media` of --size bytes of μ-law at --rate
                       messages a second for --hold s (--marks: only a `mark` every --every s)
  --attack realtime    the realtime API (--url ws://…/v1/realtime): `session.update` with
                       --format, then appends of --size bytes at --rate a second for --hold s
                       (--marks: only a `session.update` every --every s)
  --attack event-id    the realtime API: an unknown event whose `event_id` is --size characters
  --attack bad-utf8    a text frame that is not UTF-8, on a raw socket; prints the close code
  --attack webrtc      a WebRTC peer (aiortc: ICE, DTLS-SRTP, Opus) offering to --url's
                       /api/webrtc, its audio sent at --speed times real time for --hold s
  --attack slow        slowloris: the request to --url's host and port for --path, its head a
                       byte a second (or, with --body N, the head at once and N bytes of body
                       promised, a byte a second), for up to --hold s; prints when it was closed

Prints one JSON object with what it saw.
"""

import argparse
import asyncio
import base64
import json
import os
import socket
import time
import urllib.parse

import aiohttp


from oggpages import ogg_page

SERIAL = 77


def bomb_stream(packet, size):
    """Header pages, then pages of 255 copies of `packet` up to about `size` bytes."""
    head = b"OpusHead" + bytes([1, 1]) + (0).to_bytes(2, "little") + (24000).to_bytes(4, "little") + bytes(3)
    tags = b"OpusTags" + (4).to_bytes(4, "little") + b"evil" + (0).to_bytes(4, "little")
    out = [ogg_page([head], SERIAL, 0, flags=2), ogg_page([tags], SERIAL, 1)]
    seq, total = 2, sum(len(p) for p in out)
    while True:
        page = ogg_page([packet] * 255, SERIAL, seq, granule=seq * 255 * 2880)
        if total + len(page) > size:
            break
        out.append(page)
        total += len(page)
        seq += 1
    return b"".join(out)


async def closed(ws, task, result, wait):
    """Closes our side (unless the server has), waits for the reader, keeps the close code."""
    if not task.done():
        await ws.close()
    try:
        await asyncio.wait_for(task, wait)
    except asyncio.TimeoutError:
        pass
    if result["close_code"] is None:
        result["close_code"] = ws.close_code


async def send_stream(url, data, hold):
    result = {"errors": [], "close_code": None, "kinds": {}}
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url, max_msg_size=64 << 20)

        async def rx():
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY and msg.data:
                    k = str(msg.data[0])
                    result["kinds"][k] = result["kinds"].get(k, 0) + 1
                    if msg.data[0] == 5:
                        result["errors"].append(msg.data[1:].decode("utf-8", "replace"))
            result["close_code"] = ws.close_code

        task = asyncio.create_task(rx())
        await ws.send_bytes(b"\x01" + data)
        try:
            await asyncio.wait_for(asyncio.shield(task), hold)
        except asyncio.TimeoutError:
            pass
        await closed(ws, task, result, 5)
    return result


def raw_upgrade(url, host=None, key=None, rcvbuf=None, headers=()):
    u = urllib.parse.urlparse(url)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((u.hostname, u.port))
    key = key if key is not None else base64.b64encode(os.urandom(16)).decode()
    path = u.path + (("?" + u.query) if u.query else "")
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: {host or u.netloc}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
               + "".join(h + "\r\n" for h in headers) + "\r\n").encode())
    head = b""
    s.settimeout(30)
    while b"\r\n\r\n" not in head:
        b = s.recv(1)
        if not b:
            break
        head += b
    status = int(head.split()[1]) if head else 0
    return s, status, head.decode("latin-1")


def frame(opcode, payload=b""):
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def ping_flood(url, hold, read):
    s, status, _ = raw_upgrade(url, rcvbuf=None if read else 4096)
    s.setblocking(True)
    ping = frame(0x9, b"x" * 125)
    burst = ping * 64
    t0 = time.monotonic()
    closed_after, sent, received = None, 0, 0
    s.settimeout(0.5)
    while time.monotonic() - t0 < hold:
        try:
            s.sendall(burst)
            sent += 64
        except (OSError, socket.timeout):
            closed_after = time.monotonic() - t0
            break
        if read:
            try:
                s.settimeout(0.0)
                while True:
                    b = s.recv(65536)
                    if not b:
                        closed_after = time.monotonic() - t0
                        break
                    received += len(b)
            except (BlockingIOError, OSError):
                pass
            finally:
                s.settimeout(0.5)
            if closed_after is not None:
                break
    return {"status": status, "closed_after_s": closed_after, "pings_sent": sent, "bytes_received": received}


async def prime_leave(url, hold):
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url, max_msg_size=64 << 20)
        kinds = []
        try:
            msg = await asyncio.wait_for(ws.receive(), hold)
            if msg.type == aiohttp.WSMsgType.BINARY and msg.data:
                kinds.append(msg.data[0])
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(max(0.0, hold - (time.monotonic() - t0)))
        await ws.close()
    return {"left_after_s": time.monotonic() - t0, "kinds": kinds}


async def reader(ws, result):
    """Reads until the server closes: counts messages, keeps the first few text ones short."""
    async for msg in ws:
        result["received"] += 1
        if msg.type == aiohttp.WSMsgType.TEXT:
            result["text_bytes"] = max(result["text_bytes"], len(msg.data))
            if len(result["texts"]) < 8:
                result["texts"].append(msg.data[:300])
    result["close_code"] = ws.close_code
    result["closed_after_s"] = time.monotonic() - result["t0"]


async def flood(url, kind, args):
    """Twilio's or the realtime API's audio, faster than real time (or marks only)."""
    result = {"t0": time.monotonic(), "received": 0, "texts": [], "text_bytes": 0, "sent": 0,
              "audio_bytes": 0, "close_code": None, "closed_after_s": None}
    payload = base64.b64encode(os.urandom(args.size)).decode()
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url, max_msg_size=64 << 20)
        task = asyncio.create_task(reader(ws, result))
        if kind == "twilio":
            await ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            if not args.no_start:
                await ws.send_str(json.dumps({"event": "start", "streamSid": "MZevil", "start": {
                    "streamSid": "MZevil", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    "customParameters": {}}}))
            message = json.dumps({"event": "media", "streamSid": "MZevil",
                                  "media": {"track": "inbound", "payload": payload}})
        else:
            await ws.send_str(json.dumps({"type": "session.update", "session": {"input_audio_format": args.format}}))
            message = json.dumps({"type": "input_audio_buffer.append", "audio": payload})
        every = args.every if args.marks else 1.0 / args.rate
        next_at = time.monotonic()
        try:
            while time.monotonic() - result["t0"] < args.hold and not task.done():
                if args.marks and kind == "twilio":
                    await ws.send_str(json.dumps({"event": "mark", "streamSid": "MZevil", "mark": {"name": "x"}}))
                elif args.marks:
                    await ws.send_str(json.dumps({"type": "session.update", "session": {"instructions": "hi"}}))
                else:
                    await ws.send_str(message)
                    result["audio_bytes"] += args.size
                result["sent"] += 1
                next_at += every
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        except (ConnectionResetError, aiohttp.ClientError, RuntimeError):
            pass
        result["sent_for_s"] = time.monotonic() - result["t0"]
        await closed(ws, task, result, 10)
    del result["t0"]
    return result


async def event_id(url, size):
    result = {"t0": time.monotonic(), "received": 0, "texts": [], "text_bytes": 0,
              "close_code": None, "closed_after_s": None}
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(url, max_msg_size=64 << 20)
        created = await ws.receive(timeout=10)
        await ws.send_str(json.dumps({"type": "no.such.event", "event_id": "e" * size}))
        msg = await ws.receive(timeout=10)
        result["reply"] = msg.data[:2000] if msg.type == aiohttp.WSMsgType.TEXT else None
        result["reply_bytes"] = len(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else 0
        result["created"] = created.type == aiohttp.WSMsgType.TEXT
        await ws.close()
    del result["t0"]
    return result


def bad_utf8(url):
    s, status, _ = raw_upgrade(url)
    s.sendall(frame(0x1, b"\xff\xfe not UTF-8 \xc3"))
    s.settimeout(10)
    data, code, opcodes = b"", None, []
    try:
        while code is None:
            b = s.recv(65536)
            if not b:
                break
            data += b
            # The server's frames, unmasked: opcode, length (7 bits, or 16 or 64 more), payload.
            while len(data) >= 2:
                op, n, at = data[0] & 0x0F, data[1] & 0x7F, 2
                if n == 126:
                    n, at = int.from_bytes(data[2:4], "big"), 4
                elif n == 127:
                    n, at = int.from_bytes(data[2:10], "big"), 10
                if len(data) < at + n:
                    break
                payload, data = data[at:at + n], data[at + n:]
                opcodes.append(op)
                if op == 0x8:
                    code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
                    break
    except OSError:
        pass
    s.close()
    return {"status": status, "close_code": code, "opcodes": opcodes}


def slow(url, path, body, hold):
    u = urllib.parse.urlparse(url)
    s = socket.create_connection((u.hostname, u.port))
    if body:
        head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/sdp\r\n"
                f"Content-Length: {body}\r\n\r\n").encode()
        s.sendall(head)
        trickle = b"v=0\r\n" + b"x" * body
    else:
        trickle = (f"GET {path} HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n").encode() + b"X-Slow: " + b"a" * 200
    t0 = time.monotonic()
    s.settimeout(1.0)
    got, closed_after, sent = b"", None, 0
    while time.monotonic() - t0 < hold and sent < len(trickle):
        try:
            s.sendall(trickle[sent:sent + 1])
            sent += 1
        except OSError:
            closed_after = time.monotonic() - t0
            break
        try:
            b = s.recv(65536)
            if not b:
                closed_after = time.monotonic() - t0
                break
            got += b
        except socket.timeout:
            pass
        except OSError:
            closed_after = time.monotonic() - t0
            break
    s.close()
    status = int(got.split()[1]) if got.startswith(b"HTTP/") else None
    return {"closed_after_s": closed_after, "status": status, "bytes_sent": sent}


async def webrtc_flood(url, speed, hold):
    """An aiortc peer whose microphone runs `speed` times faster than real time: its packets'
    timestamps are those of real audio, their arrival `speed` times too early."""
    import fractions

    import numpy as np
    from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
    from av import AudioFrame

    class Fast(MediaStreamTrack):
        kind = "audio"

        def __init__(self):
            super().__init__()
            self.n = 0
            t = np.arange(960) / 48000
            self.pcm = (8000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16).tobytes()

        async def recv(self):
            await asyncio.sleep(0.02 / speed)
            f = AudioFrame(format="s16", layout="mono", samples=960)
            f.planes[0].update(self.pcm)
            f.sample_rate = 48000
            f.pts = self.n * 960
            f.time_base = fractions.Fraction(1, 48000)
            self.n += 1
            return f

    u = urllib.parse.urlparse(url)
    base = f"http://{u.netloc}"
    track = Fast()
    pc = RTCPeerConnection()
    pc.addTransceiver(track, direction="sendrecv")
    pc.createDataChannel("duplex")
    await pc.setLocalDescription(await pc.createOffer())
    result = {"status": None, "frames": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/api/webrtc", data=pc.localDescription.sdp,
                          headers={"Content-Type": "application/sdp"}) as r:
            result["status"] = r.status
            answer = await r.text()
            location = r.headers.get("Location")
        if result["status"] != 201:
            result["body"] = answer[:300]
            await pc.close()
            return result
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        t0 = time.monotonic()
        await asyncio.sleep(hold)
        result["sent_for_s"] = time.monotonic() - t0
        result["frames"] = track.n
        result["state"] = pc.connectionState
        async with s.delete(base + location) as r:
            result["hangup"] = r.status
    await pc.close()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--attack", required=True,
                    choices=["bomb", "zeros", "ping-flood", "prime-leave", "upgrade", "twilio",
                             "realtime", "event-id", "bad-utf8", "slow", "webrtc"])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--hold", type=float, default=5)
    ap.add_argument("--read", action="store_true")
    ap.add_argument("--query", default="")
    ap.add_argument("--host")
    ap.add_argument("--key")
    ap.add_argument("--header", action="append", default=[])
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--no-start", action="store_true")
    ap.add_argument("--marks", action="store_true")
    ap.add_argument("--every", type=float, default=5)
    ap.add_argument("--format", default="g711_ulaw")
    ap.add_argument("--path", default="/v1/realtime")
    ap.add_argument("--body", type=int, default=0)
    ap.add_argument("--speed", type=float, default=8)
    args = ap.parse_args()
    url = args.url + (("?" + args.query) if args.query else "")
    if args.attack in ("bomb", "zeros"):
        packet = bytes([0x1B, 0x02]) if args.attack == "bomb" else b""
        data = bomb_stream(packet, args.size - 1)
        r = asyncio.run(send_stream(url, data, args.hold))
        r["bytes"] = len(data) + 1
    elif args.attack == "ping-flood":
        r = ping_flood(url, args.hold, args.read)
    elif args.attack == "prime-leave":
        r = asyncio.run(prime_leave(url, args.hold))
    elif args.attack in ("twilio", "realtime"):
        r = asyncio.run(flood(url, args.attack, args))
    elif args.attack == "event-id":
        r = asyncio.run(event_id(url, args.size))
    elif args.attack == "bad-utf8":
        r = bad_utf8(url)
    elif args.attack == "webrtc":
        r = asyncio.run(webrtc_flood(url, args.speed, args.hold))
    elif args.attack == "slow":
        r = slow(url, args.path, args.body, args.hold)
    else:
        s, status, head = raw_upgrade(url, host=args.host, key=args.key, headers=args.header)
        s.close()
        r = {"status": status, "head": head}
    print(json.dumps(r))


main()
