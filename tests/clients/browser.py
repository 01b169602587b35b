"""Drives the browser voice chat of `duplex serve` in a real headless Chromium through the
DevTools protocol (our own small client on aiohttp), with a fake microphone fed from a WAV.

  browser.py --url http://127.0.0.1:PORT/ --wav in.wav --talk 5 --screenshot shot.png
      connects, talks for `--talk` seconds, prints the page's counters (window.duplexStats),
      the console errors and exceptions, and saves a screenshot mid-conversation.
  browser.py --url ... --codec-roundtrip in.wav
      encodes the WAV with the page's own Ogg/Opus path (returned base64), and decodes the
      Ogg/Opus file --decode FILE with it; prints both for the caller to check with sphn.
Prints one JSON object.
"""

import argparse
import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time

import aiohttp


class Cdp:
    def __init__(self, ws):
        self.ws = ws
        self.next = 0
        self.pending = {}
        self.events = []
        self.reader = asyncio.create_task(self.read())

    async def read(self):
        async for m in self.ws:
            if m.type != aiohttp.WSMsgType.TEXT:
                continue
            msg = json.loads(m.data)
            if "id" in msg and msg["id"] in self.pending:
                self.pending.pop(msg["id"]).set_result(msg)
            else:
                self.events.append(msg)

    async def call(self, method, session=None, **params):
        self.next += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next] = fut
        msg = {"id": self.next, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        r = await asyncio.wait_for(fut, 60)
        if "error" in r:
            raise RuntimeError(f"{method}: {r['error']}")
        return r.get("result", {})


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    raise SystemExit("chromium not found: run `make setup`")


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--wav", help="the fake microphone")
    ap.add_argument("--talk", type=float, default=5)
    ap.add_argument("--screenshot")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--stop-server-pid", type=int, help="kill this pid mid-session (a server that goes away)")
    ap.add_argument("--encode-wav", help="encode this WAV (24 kHz mono) with the page's codec path")
    ap.add_argument("--encode-out", help="where to write what --encode-wav produced")
    ap.add_argument("--decode", help="decode this Ogg/Opus file with the page's codec path")
    ap.add_argument("--expect-state", help="wait for this state instead of talking")
    ap.add_argument("--deny-mic", action="store_true", help="the user refuses the microphone")
    ap.add_argument("--then-kill", type=int, help="once --expect-state is reached, kill this pid")
    ap.add_argument("--then-state", help="... and wait for this state (within --talk seconds)")
    ap.add_argument("--history", action="store_true", help="sample the live panel every 250 ms")
    ap.add_argument("--offers", help="write the browser's own SDP offers into this folder: "
                    "audio.sdp (an audio transceiver and a data channel), data.sdp (a data channel only)")
    ap.add_argument("--transport", choices=["auto", "webrtc", "websocket"],
                    help="the page's transport (?transport= in its URL)")
    args = ap.parse_args()

    profile = tempfile.mkdtemp(prefix="duplex-chromium-")
    flags = [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        "--autoplay-policy=no-user-gesture-required",
        "--allow-loopback-in-peer-connection",
        "--remote-debugging-port=0", f"--user-data-dir={profile}",
        f"--window-size={args.width},{args.height}", "about:blank",
    ]
    if args.wav:
        flags.insert(0, f"--use-file-for-fake-audio-capture={os.path.abspath(args.wav)}")
    from urllib.parse import urlparse
    origin = urlparse(args.url)
    if origin.hostname not in ("127.0.0.1", "localhost", "::1"):
        # The microphone needs a secure context: a page served over plain HTTP from another
        # address (a server in a test's network namespace) is treated as one.
        flags.insert(0, f"--unsafely-treat-insecure-origin-as-secure={origin.scheme}://{origin.netloc}")
    if args.deny_mic:
        # No automatic "allow": the permission set below (denied) decides.
        flags.remove("--use-fake-ui-for-media-stream")
    proc = subprocess.Popen([chromium()] + flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = {}
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        t0 = time.monotonic()
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if time.monotonic() - t0 > 60:
                raise SystemExit("chromium did not start")
            await asyncio.sleep(0.1)
        port, path = open(port_file).read().split("\n")[:2]
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=64 << 20)
            cdp = Cdp(ws)
            target = (await cdp.call("Target.createTarget", url="about:blank"))["targetId"]
            sess = (await cdp.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
            for m in ("Runtime.enable", "Log.enable", "Page.enable"):
                await cdp.call(m, sess)
            await cdp.call("Emulation.setDeviceMetricsOverride", sess, width=args.width,
                           height=args.height, deviceScaleFactor=1, mobile=args.width < 600)
            if args.deny_mic:
                from urllib.parse import urlparse
                u = urlparse(args.url)
                await cdp.call("Browser.setPermission", permission={"name": "microphone"},
                               setting="denied", origin=f"{u.scheme}://{u.netloc}")
            url = args.url
            if args.transport:
                url += ("&" if "?" in url else "?") + f"transport={args.transport}"
            await cdp.call("Page.navigate", sess, url=url)

            async def js(expr):
                r = await cdp.call("Runtime.evaluate", sess, expression=expr, awaitPromise=True,
                                   returnByValue=True)
                if "exceptionDetails" in r:
                    raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
                return r["result"].get("value")

            async def wait_for(expr, limit):
                t = time.monotonic()
                while time.monotonic() - t < limit:
                    try:
                        if await js(expr):
                            return True
                    except RuntimeError:
                        pass
                    await asyncio.sleep(0.1)
                return False

            await wait_for("document.readyState === 'complete' && !!window.duplexStats", 30)
            await wait_for("window.duplexStats.defaults_loaded === true", 10)
            if args.offers:
                for name, audio in (("audio", True), ("data", False)):
                    sdp = await js("(async () => { const pc = new RTCPeerConnection(); pc.createDataChannel('d'); "
                                   + ("pc.addTransceiver('audio', {direction: 'sendrecv'}); " if audio else "")
                                   + "await pc.setLocalDescription(await pc.createOffer()); "
                                   "await new Promise((r) => { if (pc.iceGatheringState === 'complete') r(); "
                                   "pc.onicegatheringstatechange = () => pc.iceGatheringState === 'complete' && r(); "
                                   "setTimeout(r, 2000); }); const s = pc.localDescription.sdp; pc.close(); return s; })()")
                    open(os.path.join(args.offers, f"{name}.sdp"), "w").write(sdp)
                result["offers"] = True
            if args.encode_wav:
                import sphn, numpy as np
                pcm, _ = sphn.read(args.encode_wav, sample_rate=24000)
                samples = np.asarray(pcm, dtype=np.float32).reshape(-1).tolist()
                encoded = base64.b64decode(await js(f"window.duplexCodec.encode({json.dumps(samples)})"))
                open(args.encode_out, "wb").write(encoded)
                result["encoded_bytes"] = len(encoded)
            if args.decode:
                b64 = base64.b64encode(open(args.decode, "rb").read()).decode()
                result["decoded"] = await js(f"window.duplexCodec.decode({json.dumps(b64)})")
            if args.wav:
                await js("document.getElementById('connect').click(), true")
                if args.expect_state:
                    result["reached"] = await wait_for(f"window.duplexStats.state === {json.dumps(args.expect_state)}", args.talk)
                    result["message"] = await js("document.getElementById('message').textContent")
                    if args.then_kill and result["reached"]:
                        os.kill(args.then_kill, 9)
                        result["then_reached"] = await wait_for(f"window.duplexStats.state === {json.dumps(args.then_state)}", args.talk)
                else:
                    result["live"] = await wait_for("window.duplexStats.state === 'live'", 30)
                    half = 0 if args.history else args.talk / 2
                    await asyncio.sleep(half)
                    if args.screenshot:
                        shot = await cdp.call("Page.captureScreenshot", sess, format="png")
                        open(args.screenshot, "wb").write(base64.b64decode(shot["data"]))
                    if args.stop_server_pid:
                        os.kill(args.stop_server_pid, 9)
                        result["lost"] = await wait_for("window.duplexStats.state === 'lost'", 30)
                    elif args.history:
                        history = []
                        t_end = time.monotonic() + args.talk - half
                        while time.monotonic() < t_end:
                            history.append(await js("JSON.parse(JSON.stringify({p: window.duplexStats.player, b: window.duplexStats.breakdown, "
                                                  "q: window.duplexStats.quality, r: window.duplexStats.rtc, s: window.duplexStats.server_transport}))"))
                            await asyncio.sleep(0.25)
                        result["history"] = history
                    else:
                        await asyncio.sleep(args.talk - half)
                result["stats"] = await js("JSON.parse(JSON.stringify(window.duplexStats))")
                result["page"] = await js("({state: document.getElementById('state').textContent, "
                                          "message: document.getElementById('message').textContent, "
                                          "transcript: document.getElementById('transcript').textContent, "
                                          "rtf: document.getElementById('s_rtf').textContent, "
                                          "buffer: document.getElementById('s_buffer').textContent, "
                                          "transport: document.getElementById('s_transport').textContent, "
                                          "loss: document.getElementById('s_loss').textContent, "
                                          "connect: document.getElementById('connect').textContent})")
                await js("document.getElementById('hangup').disabled || document.getElementById('hangup').click(), true")
            await asyncio.sleep(0.3)
            errors = []
            for e in cdp.events:
                m, p = e.get("method"), e.get("params", {})
                if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                    errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
                elif m == "Runtime.exceptionThrown":
                    errors.append(p["exceptionDetails"].get("exception", {}).get("description", p["exceptionDetails"].get("text")))
                elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                    errors.append(p["entry"].get("text"))
            result["console_errors"] = errors
            await ws.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    print(json.dumps(result))


asyncio.run(main())
