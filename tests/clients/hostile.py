"""Hostile clients of `duplex serve`, for the tests of what a client cannot make the server spend.
Independent of duplex: the WebSocket by `aiohttp` or by hand on a raw socket (RFC 6455 framing
written here), the Ogg pages by hand (RFC 3533), Opus packets as bytes.

  --attack bomb        one message of Ogg pages, each of 255 Opus packets of 2 bytes that claim
                       120 ms each (two 60 ms frames of nothing), after the header pages
  --attack zeros       the same with packets of no bytes (each a lost frame)
  --attack ping-flood  pings as fast as possible on a raw socket; --read reads what comes back
  --attack prime-leave an upgrade with a long text_prompt (--query), then gone after --hold s
  --attack upgrade     a raw upgrade with the given --key and --host; prints the status line

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
        await ws.close()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.TimeoutError:
            pass
        if result["close_code"] is None:
            result["close_code"] = ws.close_code
    return result


def raw_upgrade(url, host=None, key=None, rcvbuf=None):
    u = urllib.parse.urlparse(url)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((u.hostname, u.port))
    key = key if key is not None else base64.b64encode(os.urandom(16)).decode()
    path = u.path + (("?" + u.query) if u.query else "")
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: {host or u.netloc}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--attack", required=True,
                    choices=["bomb", "zeros", "ping-flood", "prime-leave", "upgrade"])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--hold", type=float, default=5)
    ap.add_argument("--read", action="store_true")
    ap.add_argument("--query", default="")
    ap.add_argument("--host")
    ap.add_argument("--key")
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
    else:
        s, status, head = raw_upgrade(url, host=args.host, key=args.key)
        s.close()
        r = {"status": status, "head": head}
    print(json.dumps(r))


main()
