"""A test client of the Moshi WebSocket protocol, independent of duplex: Ogg/Opus by Kyutai's
`sphn`, WebSocket by `aiohttp`.

Two behaviours (docs/PROTOCOL.md):
  --mode kyutai  as Kyutai's Python client: no query string, does not wait for the handshake,
                 sends what `sphn.OpusStreamWriter.append_pcm` returns for each 1920-sample block.
  --mode web     as the web client: a query string, waits for the handshake, records 20 ms Opus
                 frames (libopus through opuslib), two per Ogg page, and sends the stream re-cut
                 so that messages hold several pages or parts of one.
Other flags make a misbehaving client (--no-read, --silent, --garbage, ...) for the server's
fault tests. Prints one JSON object with what it saw.
"""

import argparse
import asyncio
import json
import time

import aiohttp
import numpy as np
import sphn


from oggpages import ogg_page


class WebEncoder:
    """As the web client records: 20 ms Opus frames (libopus through opuslib, not sphn), two per
    Ogg page, muxed here (RFC 7845: OpusHead, OpusTags, granules at 48 kHz)."""

    def __init__(self):
        import opuslib
        self.enc = opuslib.Encoder(24000, 1, "voip")
        self.serial, self.seq, self.granule = 0x5EB, 0, 312
        self.pcm = np.zeros(0, dtype=np.float32)
        self.packets = []
        head = b"OpusHead" + bytes([1, 1]) + (312).to_bytes(2, "little") + (24000).to_bytes(4, "little") + bytes(3)
        vendor = b"test client"
        tags = b"OpusTags" + len(vendor).to_bytes(4, "little") + vendor + (0).to_bytes(4, "little")
        self.out = self.page([head], flags=2) + self.page([tags])

    def page(self, packets, flags=0):
        p = ogg_page(packets, self.serial, self.seq, self.granule if self.seq > 1 else 0, flags)
        self.seq += 1
        return p

    def append_pcm(self, pcm):
        self.pcm = np.concatenate([self.pcm, pcm])
        while len(self.pcm) >= 480:
            frame = (np.clip(self.pcm[:480], -1, 1) * 32767).astype(np.int16).tobytes()
            self.pcm = self.pcm[480:]
            self.packets.append(self.enc.encode(frame, 480))
            self.granule += 960
            if len(self.packets) == 2:
                self.out += self.page(self.packets)
                self.packets = []
        out, self.out = self.out, b""
        return out


def never_read(url, hold):
    """Completes the upgrade on a socket with a tiny receive buffer, then never reads."""
    import socket, base64, os, urllib.parse
    u = urllib.parse.urlparse(url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((u.hostname, u.port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    status = int(head.split()[1])
    t0 = time.monotonic()
    closed_after = None
    # Never read, but keep sending audio in real time (so that it is not idle): a send fails
    # once the server has closed the connection.
    writer = sphn.OpusStreamWriter(24000)
    tone = (0.2 * np.sin(np.arange(1920) * 0.05)).astype(np.float32)
    while time.monotonic() - t0 < hold:
        time.sleep(0.08)
        payload = b"\x01" + bytes(writer.append_pcm(tone))
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x82]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        try:
            s.sendall(head + mask + body)
        except OSError:
            closed_after = time.monotonic() - t0
            break
    print(json.dumps({"status": status, "closed_after_s": closed_after}))


def underruns(arrivals, buffer_s):
    """Underruns of a player that starts `buffer_s` after the first audio and plays at 24 kHz,
    re-buffering the same after each underrun (what a browser's jitter buffer would do)."""
    if not arrivals:
        return 0
    count, have = 0, 0
    start = arrivals[0][0] + buffer_s
    for at, n in arrivals:
        played = (at - start) * 24000
        if played > have:
            count += 1
            start = at + buffer_s - have / 24000
        have += n
    return count


def load(path, seconds):
    pcm, sr = sphn.read(path, sample_rate=24000)
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim == 2:
        pcm = pcm.mean(axis=0)
    if seconds:
        pcm = pcm[: int(seconds * 24000)]
    return pcm


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--mode", choices=["kyutai", "web"], default="kyutai")
    ap.add_argument("--query", default="")
    ap.add_argument("--wav")
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--tail", type=float, default=1.5, help="seconds to keep listening after the input")
    ap.add_argument("--out-wav")
    ap.add_argument("--playout-ms", type=float, default=200, help="the simulated player's buffer")
    ap.add_argument("--no-read", action="store_true", help="never read what the server sends")
    ap.add_argument("--silent", type=float, default=0, help="send nothing, stay this long")
    ap.add_argument("--send-raw", help="hex bytes to send as one message before the audio")
    ap.add_argument("--send-size", type=int, default=0, help="send one message of this many bytes")
    ap.add_argument("--fast", action="store_true", help="send as fast as possible")
    ap.add_argument("--speed", type=float, default=1.0, help="send this many times faster than real time")
    ap.add_argument("--corrupt", action="store_true", help="damage a byte of the audio stream after 1 s")
    ap.add_argument("--vorbis", action="store_true", help="send an Ogg stream that carries Vorbis")
    ap.add_argument("--truncate", action="store_true", help="send the headers and half a page, then close")
    ap.add_argument("--never-read", type=float, default=0, help="raw upgrade, never read, hold this long")
    ap.add_argument("--header", action="append", default=[], help="NAME:VALUE sent with the upgrade")
    ap.add_argument("--origin", help="the Origin header a browser page would send")
    args = ap.parse_args()
    if args.never_read:
        never_read(args.url, args.never_read)
        return

    url = args.url + (("?" + args.query) if args.mode == "web" and args.query else "")
    result = {"handshake_s": None, "first_audio_s": None, "samples": 0, "text": [], "errors": [],
              "kinds": {}, "close_code": None, "sent_s": 0.0, "first_kind": None, "metadata": None}
    reader = sphn.OpusStreamReader(24000)
    pcm_out = []
    arrivals = []
    t0 = time.monotonic()
    handshake = asyncio.Event()

    async with aiohttp.ClientSession() as session:
        try:
            headers = dict(h.split(":", 1) for h in args.header)
            ws = await session.ws_connect(url, max_msg_size=64 << 20, headers=headers, origin=args.origin)
        except aiohttp.WSServerHandshakeError as e:
            result["refused"] = {"status": e.status, "retry_after": (e.headers or {}).get("Retry-After")}
            print(json.dumps(result))
            return
        sock = ws.get_extra_info("sockname")
        result["local_port"] = sock[1] if sock else None

        async def receive():
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                data = msg.data
                kind = data[0]
                if result["first_kind"] is None:
                    result["first_kind"] = kind
                result["kinds"][str(kind)] = result["kinds"].get(str(kind), 0) + 1
                if kind == 4 and result["metadata"] is None:
                    result["metadata"] = json.loads(data[1:].decode("utf-8"))
                if kind == 0:
                    result["handshake_s"] = time.monotonic() - t0
                    handshake.set()
                elif kind == 1:
                    pcm = reader.append_bytes(data[1:])
                    if pcm is not None and len(pcm):
                        if result["first_audio_s"] is None:
                            result["first_audio_s"] = time.monotonic() - t0
                        pcm_out.append(np.asarray(pcm, dtype=np.float32))
                        arrivals.append((time.monotonic(), len(pcm)))
                elif kind == 2:
                    result["text"].append(data[1:].decode("utf-8"))
                elif kind == 5:
                    result["errors"].append(data[1:].decode("utf-8", "replace"))
            result["close_code"] = ws.close_code

        rx = None if args.no_read else asyncio.create_task(receive())

        if args.vorbis:
            await ws.send_bytes(b"\x01" + ogg_page([b"\x01vorbis" + bytes(23)], flags=2))
        if args.truncate:
            w = sphn.OpusStreamWriter(24000)
            data = bytes(w.append_pcm(np.zeros(1920 * 3, dtype=np.float32)))
            await ws.send_bytes(b"\x01" + data[: len(data) - 40])
        if args.send_raw is not None:
            await ws.send_bytes(bytes.fromhex(args.send_raw))
        if args.send_size:
            try:
                await ws.send_bytes(b"\x01" + bytes(args.send_size))
            except (OSError, aiohttp.ClientError) as e:
                result["send_error"] = str(e)
        if args.silent:
            await asyncio.sleep(args.silent)
        if args.wav:
            pcm = load(args.wav, args.seconds)
            writer = sphn.OpusStreamWriter(24000) if args.mode == "kyutai" else WebEncoder()
            if args.mode == "web":
                # Until the handshake, or until the server has closed (an error instead).
                waiter = asyncio.create_task(handshake.wait())
                await asyncio.wait([waiter] + ([rx] if rx else []), timeout=30,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not handshake.is_set():
                    pcm = pcm[:0]
            start = time.monotonic()
            step = 1920 if args.mode == "kyutai" else 480
            pending = b""
            for i in range(0, len(pcm) - step + 1, step):
                out = writer.append_pcm(pcm[i : i + step])
                if args.corrupt and i >= 24000 and len(out) > 40:
                    out = bytearray(out)
                    out[len(out) - 2] ^= 0x5A  # inside the last page's body
                    args.corrupt = False
                if args.mode == "kyutai":
                    if len(out):
                        try:
                            await ws.send_bytes(b"\x01" + bytes(out))
                        except (OSError, aiohttp.ClientError):
                            break
                    if ws.closed:
                        break
                else:
                    pending += bytes(out)
                    # Messages cut anywhere: half of what is there now, the rest later.
                    if len(pending) > 60:
                        cut = len(pending) // 2 + 7
                        try:
                            await ws.send_bytes(b"\x01" + pending[:cut])
                        except (OSError, aiohttp.ClientError):
                            break
                        pending = pending[cut:]
                    if ws.closed:
                        break
                if not args.fast:
                    due = start + (i + step) / 24000 / args.speed
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
            if pending and not ws.closed:
                try:
                    await ws.send_bytes(b"\x01" + pending)
                except (OSError, aiohttp.ClientError):
                    pass
            result["sent_s"] = time.monotonic() - start
        if rx is not None and not rx.done():
            try:
                await asyncio.wait_for(asyncio.shield(rx), args.tail)
            except asyncio.TimeoutError:
                pass
        try:
            await ws.close()
        except (OSError, aiohttp.ClientError):
            pass
        if rx is not None:
            try:
                await asyncio.wait_for(rx, 5)
            except asyncio.TimeoutError:
                pass
        if result["close_code"] is None:
            result["close_code"] = ws.close_code
    result["underruns"] = underruns(arrivals, args.playout_ms / 1000)
    if pcm_out:
        pcm = np.concatenate(pcm_out)
        result["samples"] = int(len(pcm))
        if args.out_wav:
            sphn.write_wav(args.out_wav, pcm, 24000)
    print(json.dumps(result))


asyncio.run(main())
