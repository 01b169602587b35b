// The browser voice chat of `duplex serve`. Over WebRTC when the server offers it (POST
// /api/webrtc with the offer, WHIP-style): the microphone as an Opus track through the
// browser's own echo cancellation and jitter buffer, the transcript and the session's status on
// a data channel, loss and jitter from getStats(). Otherwise on the Moshi protocol over a
// WebSocket (kinds 0 handshake, 1 Ogg/Opus audio, 2 text, 4 metadata, 5 error): microphone ->
// capture worklet (24 kHz) -> WebCodecs Opus encoder (20 ms) -> Ogg pages (two packets each) ->
// WebSocket; WebSocket -> Ogg reader -> WebCodecs Opus decoder -> player worklet (jitter
// buffer) -> speakers. Plain modules, no build.

import { OggReader, OggWriter } from "./ogg.js";

const $ = (id) => document.getElementById(id);
const KIND = { HANDSHAKE: 0, AUDIO: 1, TEXT: 2, METADATA: 4, ERROR: 5 };

// What the page shows and the tests read.
const stats = {
  state: "idle",
  handshake: false,
  session: null,
  sent_packets: 0,
  received_packets: 0,
  decoded_samples: 0,
  text_pieces: 0,
  player: null,
  rtt_ms: null,
  mouth_to_ear_ms: null,
  breakdown: null,
  realtime_factor: null,
  verdicts: null,
  stats_updates: 0,
  transport: null,
  rtc: null,
  // The same measures for either transport: underruns (or concealment events), concealed ms,
  // the longest stretch of silence where audio should have played, ms.
  quality: null,
  errors: [],
};
window.duplexStats = stats;

let call = null; // the live call's resources
let retryTimer = null;
let serverDefaults = {}; // what /api/defaults said (WebRTC offered: its ICE servers)

function setState(s, message = "") {
  stats.state = s;
  $("state").textContent = s;
  $("message").textContent = message;
  $("connect").disabled = !["idle", "ended", "lost", "full", "error"].includes(s);
  $("hangup").disabled = !["connecting", "priming", "live"].includes(s);
  $("connect").textContent = s === "lost" ? "Reconnect" : "Connect";
}

function missingFeature() {
  if (!navigator.mediaDevices?.getUserMedia) return "microphone access (getUserMedia)";
  if (!window.AudioWorkletNode) return "AudioWorklet";
  if (!window.AudioEncoder || !window.AudioDecoder) return "WebCodecs (AudioEncoder/AudioDecoder)";
  if (!window.WebSocket) return "WebSocket";
  return null;
}

// The sampling controls the page sends as query parameters (Kyutai's names).
const SAMPLING = ["text_temperature", "text_topk", "audio_temperature", "audio_topk",
  "pad_mult", "repetition_penalty", "repetition_penalty_context"];
// A server with keys wants one: entered once, kept in this browser's storage, sent as the
// `kyutai-api-key` header to the API and as `auth_id` on the WebSocket (which takes no header).
const KEY_STORE = "duplex.api_key";
function apiKey() {
  try { return localStorage.getItem(KEY_STORE) || ""; } catch (_) { return ""; }
}
function api(path, init = {}) {
  const key = apiKey();
  const headers = { ...(init.headers || {}), ...(key ? { "kyutai-api-key": key } : {}) };
  return fetch(path, { ...init, headers });
}

async function loadDefaults() {
  $("api_key").value = apiKey();
  $("api_key").addEventListener("change", () => {
    try { localStorage.setItem(KEY_STORE, $("api_key").value.trim()); } catch (_) {}
    loadDefaults();
  });
  try {
    const r = await api("/api/defaults");
    if (r.status === 401) {
      $("message").textContent = "This server needs an API key: enter it under Settings.";
      return;
    }
    const d = await r.json();
    serverDefaults = d;
    for (const k of SAMPLING) {
      if (d[k] !== undefined) $(k).value = d[k];
    }
    if (d.default_persona) $("persona").placeholder = "(the server's default persona)";
    const v = await (await api("/api/voices")).json();
    $("voice").replaceChildren($("voice").firstElementChild);
    for (const name of v.voices || []) {
      const o = document.createElement("option");
      o.value = o.textContent = name;
      if (name === d.voice_prompt) o.selected = true;
      $("voice").append(o);
    }
  } catch (e) {
    // The page still works with the server's defaults.
  }
  stats.defaults_loaded = true;
}

function query() {
  const q = new URLSearchParams();
  for (const k of SAMPLING) {
    if ($(k).value !== "") q.set(k, $(k).value);
  }
  if (apiKey()) q.set("auth_id", apiKey());
  if ($("persona").value.trim()) q.set("text_prompt", $("persona").value.trim());
  if ($("voice").value) q.set("voice_prompt", $("voice").value);
  return q.toString();
}

async function opusEncoder(onPacket) {
  const config = { codec: "opus", sampleRate: 24000, numberOfChannels: 1, bitrate: 32000, opus: { frameDuration: 20000 } };
  const ok = await AudioEncoder.isConfigSupported(config);
  if (!ok.supported) throw new Error("this browser's WebCodecs cannot encode Opus at 24 kHz");
  const enc = new AudioEncoder({ output: (chunk) => {
    const b = new Uint8Array(chunk.byteLength);
    chunk.copyTo(b);
    onPacket(b, Math.round((chunk.duration ?? 20000) * 48 / 1000));
  }, error: (e) => fail(`Opus encoder: ${e.message}`) });
  enc.configure(config);
  return enc;
}

function opusDecoder(head, onPcm) {
  const dec = new AudioDecoder({ output: (data) => {
    const pcm = new Float32Array(data.numberOfFrames);
    data.copyTo(pcm, { planeIndex: 0, format: "f32-planar" });
    const rate = data.sampleRate;
    data.close();
    onPcm(rate === 24000 ? pcm : resample(pcm, rate, 24000));
  }, error: (e) => fail(`Opus decoder: ${e.message}`) });
  dec.configure({ codec: "opus", sampleRate: 48000, numberOfChannels: 1, description: head });
  return dec;
}

// Linear resampling for a decoder that outputs another rate (WebCodecs decodes Opus at 48 kHz).
function resample(x, from, to) {
  const n = Math.floor((x.length * to) / from);
  const y = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const t = (i * from) / to;
    const k = Math.floor(t);
    const f = t - k;
    y[i] = (x[k] ?? 0) * (1 - f) + (x[k + 1] ?? x[k] ?? 0) * f;
  }
  return y;
}

function fail(msg) {
  stats.errors.push(msg);
  hangup("error", msg);
}

// Which transport a call uses: the page's choice (or ?transport= in its URL), WebRTC when the
// server offers it and the browser has it.
function transport() {
  const choice = $("transport").value;
  const rtc = !!window.RTCPeerConnection && !!serverDefaults.webrtc;
  if (choice === "websocket") return "websocket";
  if (choice === "webrtc" && !rtc) return null;
  return rtc ? "webrtc" : "websocket";
}

// Why a session was not opened (no WebSocket upgrade, or the offer refused): a key, the server
// full (retried), or what the server said.
async function refused(status, text, retryAfter) {
  if (status === 401) {
    hangup("error", "This server needs an API key: enter it under Settings.");
    return;
  }
  if (status === 503) {
    try {
      const r = await fetch("/readyz");
      const j = await r.json();
      if (j.models_loaded && !j.draining) {
        const wait = Number(retryAfter || r.headers.get("Retry-After") || 5);
        hangup("full", `The server is full (${j.sessions} of ${j.capacity} sessions): retrying in ${wait} s.`);
        retryTimer = setTimeout(connect, wait * 1000);
        return;
      }
    } catch (_) {}
  }
  hangup("error", text || "The server refused the session.");
}

// Resolves once the browser has gathered its ICE candidates (they go in the one offer), or
// after two seconds with what it has.
function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { if (pc.iceGatheringState === "complete") resolve(); };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, 2000);
  });
}

async function connectWebRtc(mic) {
  const pc = new RTCPeerConnection({ iceServers: serverDefaults.webrtc.ice_servers || [] });
  const dc = pc.createDataChannel("duplex");
  for (const t of mic.getAudioTracks()) pc.addTrack(t, mic);
  const audio = new Audio();
  audio.autoplay = true;
  pc.ontrack = (e) => {
    audio.srcObject = e.streams[0] ?? new MediaStream([e.track]);
    audio.play().catch(() => {});
  };
  call = { mic, pc, dc, audio, timer: null, closing: false, resource: null };
  call.timer = setInterval(() => updateStats(), 1000);
  // The longest stall: 100 ms windows in a row in which the browser concealed (nearly) all it
  // played.
  const stall = { last: null, run: 0, longest: 0 };
  call.stallTimer = setInterval(async () => {
    try {
      (await pc.getStats()).forEach((s) => {
        if (s.type !== "inbound-rtp" || s.kind !== "audio") return;
        const now = { t: s.timestamp, concealed: s.concealedSamples || 0, rate: 48000 };
        if (stall.last && now.t > stall.last.t) {
          const window = ((now.t - stall.last.t) / 1000) * now.rate;
          const dt = now.t - stall.last.t;
          if (now.concealed - stall.last.concealed >= 0.8 * window) {
            stall.run += dt;
            stall.longest = Math.max(stall.longest, stall.run);
          } else stall.run = 0;
        }
        stall.last = now;
        call && (call.longestStall = stall.longest);
      });
    } catch (_) {}
  }, 100);
  await pc.setLocalDescription(await pc.createOffer());
  await gathered(pc);
  if (!call || call.pc !== pc) return;
  let r;
  try {
    r = await api(`/api/webrtc?${query()}`, { method: "POST", headers: { "content-type": "application/sdp" }, body: pc.localDescription.sdp });
  } catch (e) {
    hangup("error", `The server cannot be reached: ${e.message}`);
    return;
  }
  if (r.status !== 201) {
    await refused(r.status, (await r.text()).trim(), r.headers.get("Retry-After"));
    return;
  }
  call.resource = r.headers.get("Location");
  await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  setState("priming");
  dc.onmessage = (e) => {
    let m;
    try { m = JSON.parse(e.data); } catch (_) { return; }
    switch (m.type) {
      case "ready":
        stats.handshake = true;
        stats.session = m.session?.session ?? null;
        setState("live");
        break;
      case "text":
        stats.text_pieces++;
        $("transcript").textContent += m.text;
        break;
      case "error":
        stats.errors.push(m.message);
        $("message").textContent = m.message;
        break;
      case "end":
        if (!stats.handshake) hangup("error", $("message").textContent || m.reason || "The server refused the session.");
        else hangup("ended", m.code === 1001 ? "The server closed the session." : "The session ended.");
        break;
      default:
        break;
    }
  };
  // A server that went away answers no more consent checks: "disconnected" within seconds,
  // "failed" much later. Lost when it stays disconnected for 3 s.
  const lost = () => hangup("lost", "The connection was lost: reconnect when the server is back.");
  pc.onconnectionstatechange = () => {
    if (!call || call.pc !== pc || call.closing) return;
    clearTimeout(call.lostTimer);
    if (pc.connectionState === "failed" || pc.connectionState === "closed") lost();
    else if (pc.connectionState === "disconnected") {
      call.lostTimer = setTimeout(() => { if (call?.pc === pc && pc.connectionState !== "connected") lost(); }, 3000);
    }
  };
}

// The browser's own view of the WebRTC call: what it received, lost, concealed and buffered.
async function rtcStats(pc) {
  const report = await pc.getStats();
  const out = { packets_sent: 0 };
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      out.packets_received = s.packetsReceived;
      out.packets_lost = s.packetsLost;
      out.jitter_ms = (s.jitter || 0) * 1000;
      out.samples_received = s.totalSamplesReceived;
      out.concealed_ms = (s.concealedSamples || 0) / 48;
      out.concealment_events = s.concealmentEvents || 0;
      out.audio_energy = s.totalAudioEnergy || 0;
      out.buffer_ms = s.jitterBufferEmittedCount ? (s.jitterBufferDelay / s.jitterBufferEmittedCount) * 1000 : 0;
      out.target_ms = s.jitterBufferEmittedCount && s.jitterBufferTargetDelay ? (s.jitterBufferTargetDelay / s.jitterBufferEmittedCount) * 1000 : null;
    } else if (s.type === "outbound-rtp" && s.kind === "audio") {
      out.packets_sent = s.packetsSent;
    } else if (s.type === "candidate-pair" && s.nominated && s.state === "succeeded") {
      out.rtt_ms = (s.currentRoundTripTime || 0) * 1000;
    } else if (s.type === "media-playout" && s.totalSamplesCount) {
      out.playout_ms = (s.totalPlayoutDelay / s.totalSamplesCount) * 1000;
    }
  });
  return out;
}

async function connect() {
  clearTimeout(retryTimer);
  const missing = missingFeature();
  if (missing) {
    setState("error", `This browser lacks ${missing}: use a recent Chrome, Edge or Firefox.`);
    return;
  }
  const via = transport();
  if (!via) {
    setState("error", "WebRTC was chosen, but this server does not offer it (or this browser lacks it).");
    return;
  }
  setState("connecting");
  stats.transport = via;
  $("s_transport").textContent = via === "webrtc" ? "WebRTC (UDP)" : "WebSocket (TCP)";
  $("transcript").textContent = "";
  let mic;
  try {
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: false, autoGainControl: false, channelCount: 1 },
    });
  } catch (e) {
    setState("error", e.name === "NotAllowedError"
      ? "The microphone was refused: allow it in the browser's site settings, then connect again."
      : `No microphone: ${e.message}`);
    return;
  }
  if (via === "webrtc") {
    await connectWebRtc(mic);
    return;
  }
  const ctx = new AudioContext({ sampleRate: 24000, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/worklets.js");
  const capture = new AudioWorkletNode(ctx, "capture");
  const player = new AudioWorkletNode(ctx, "player", { outputChannelCount: [1] });
  player.connect(ctx.destination);
  player.port.postMessage({ target_ms: Number($("latency").value) });
  player.port.onmessage = (e) => { stats.player = e.data; };
  const source = ctx.createMediaStreamSource(mic);
  source.connect(capture);

  const proto = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${proto}://${location.host}/api/chat?${query()}`);
  ws.binaryType = "arraybuffer";
  const writer = new OggWriter({ sampleRate: 24000 });
  const reader = new OggReader();
  let decoder = null;
  let ts = 0;
  const encoder = await opusEncoder((packet, samples48k) => {
    stats.sent_packets++;
    const bytes = writer.push(packet, samples48k);
    if (bytes.length && ws.readyState === WebSocket.OPEN) {
      const m = new Uint8Array(bytes.length + 1);
      m[0] = KIND.AUDIO;
      m.set(bytes, 1);
      ws.send(m);
    }
  });
  capture.port.onmessage = (e) => {
    if (!stats.handshake || encoder.state !== "configured") return;
    encoder.encode(new AudioData({ format: "f32", sampleRate: 24000, numberOfFrames: e.data.length, numberOfChannels: 1, timestamp: ts, data: e.data }));
    ts += (e.data.length / 24000) * 1e6;
  };
  call = { ctx, mic, ws, encoder, capture, player, timer: null, closing: false };
  call.timer = setInterval(() => updateStats(), 1000);

  ws.onmessage = (e) => {
    const b = new Uint8Array(e.data);
    const payload = b.subarray(1);
    switch (b[0]) {
      case KIND.HANDSHAKE:
        stats.handshake = true;
        setState("live");
        break;
      case KIND.AUDIO:
        try {
          for (const p of reader.push(payload)) {
            if (!decoder) decoder = opusDecoder(reader.head, (pcm) => {
              stats.decoded_samples += pcm.length;
              player.port.postMessage({ pcm }, [pcm.buffer]);
            });
            stats.received_packets++;
            decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: stats.received_packets * 40000, data: p }));
          }
        } catch (err) {
          fail(`the server's audio: ${err.message}`);
        }
        break;
      case KIND.TEXT: {
        stats.text_pieces++;
        $("transcript").textContent += new TextDecoder().decode(payload);
        break;
      }
      case KIND.METADATA:
        try { stats.session = JSON.parse(new TextDecoder().decode(payload)).session ?? null; } catch (_) {}
        break;
      case KIND.ERROR:
        stats.errors.push(new TextDecoder().decode(payload));
        $("message").textContent = new TextDecoder().decode(payload);
        break;
      default:
        break; // the protocol says: ignore unknown kinds
    }
  };
  ws.onopen = () => { if (!stats.handshake) setState("priming"); };
  ws.onclose = async (e) => {
    if (!call || call.closing) return;
    if (!stats.handshake) {
      // The upgrade was refused, or the server closed before the session started: ask why.
      let status = 0;
      try {
        if ((await api("/api/defaults")).status === 401) status = 401;
        else if ((await fetch("/readyz")).status === 503) status = 503;
      } catch (_) {}
      await refused(status, $("message").textContent);
    } else if (e.code === 1000 || e.code === 1001) {
      hangup("ended", e.code === 1001 ? "The server closed the session." : "The session ended.");
    } else {
      hangup("lost", "The connection was lost: reconnect when the server is back.");
    }
  };
}

async function updateStats() {
  const p = stats.player;
  if (p) {
    $("s_buffer").textContent = `${p.depth_ms.toFixed(0)} / ${p.target_ms.toFixed(0)} ms`;
    $("s_underruns").textContent = `${p.underruns} (${(p.concealed / 24).toFixed(0)} ms)`;
  }
  if (p) stats.quality = { underruns: p.underruns, concealed_ms: p.concealed / 24, longest_stall_ms: p.longest_stall_ms ?? 0 };
  const pc = call?.pc;
  if (pc) {
    try {
      const rtc = await rtcStats(pc);
      stats.rtc = rtc;
      stats.quality = { underruns: rtc.concealment_events ?? 0, concealed_ms: rtc.concealed_ms ?? 0, longest_stall_ms: call?.longestStall ?? 0 };
      stats.sent_packets = rtc.packets_sent ?? 0;
      stats.received_packets = rtc.packets_received ?? 0;
      $("s_buffer").textContent = `${(rtc.buffer_ms ?? 0).toFixed(0)}${rtc.target_ms != null ? ` / ${rtc.target_ms.toFixed(0)}` : ""} ms`;
      $("s_underruns").textContent = `${rtc.concealment_events ?? 0} (${(rtc.concealed_ms ?? 0).toFixed(0)} ms)`;
      const got = (rtc.packets_received ?? 0) + (rtc.packets_lost ?? 0);
      $("s_loss").textContent = `${got ? ((100 * (rtc.packets_lost ?? 0)) / got).toFixed(1) : "0.0"} % / ${(rtc.jitter_ms ?? 0).toFixed(0)} ms`;
    } catch (_) {}
  }
  try {
    const t0 = performance.now();
    const r = await api("/api/sessions", { cache: "no-store" });
    stats.rtt_ms = pc && stats.rtc?.rtt_ms != null ? stats.rtc.rtt_ms : performance.now() - t0;
    const j = await r.json();
    const me = (j.sessions || []).find((s) => s.id === stats.session) ?? null;
    if (me) {
      stats.realtime_factor = me.realtime_factor;
      stats.verdicts = me.verdicts;
      stats.server_transport = me.transport ?? null;
      stats.late_frames = me.late_frames ?? 0;
      const server = me.server_latency_ms ?? 0;
      const ctx = call?.ctx;
      const device = ctx ? ((ctx.baseLatency || 0) + (ctx.outputLatency || 0)) * 1000 : (stats.rtc?.playout_ms ?? 0);
      // capture block + network both ways + server (and its jitter buffer, over WebRTC) +
      // the page's jitter buffer + the devices.
      const buffer = pc ? (stats.rtc?.buffer_ms ?? 0) : (p ? p.depth_ms : 0);
      stats.breakdown = { capture_ms: 20, network_ms: stats.rtt_ms, server_ms: server, server_jitter_ms: me.transport?.jitter_buffer_ms ?? 0, buffer_ms: buffer, device_ms: device };
      stats.mouth_to_ear_ms = Object.values(stats.breakdown).reduce((a, b) => a + b, 0);
      $("s_rtf").textContent = me.realtime_factor?.toFixed(2) ?? "–";
      $("s_verdicts").textContent = Object.entries(me.verdicts || {}).map(([k, v]) => `${k}: ${v}`).join(", ");
      $("s_m2e").textContent = `${stats.mouth_to_ear_ms.toFixed(0)} ms (server ${server.toFixed(0)} ms)`;
    }
    $("s_rtt").textContent = `${stats.rtt_ms.toFixed(0)} ms`;
    stats.stats_updates++;
  } catch (_) {}
}

function hangup(state = "ended", message = "") {
  if (call) {
    call.closing = true;
    clearInterval(call.timer);
    if (call.ws) {
      try { call.ws.close(1000); } catch (_) {}
      try { call.encoder.close(); } catch (_) {}
      call.ctx.close();
    }
    if (call.pc) {
      clearTimeout(call.lostTimer);
      clearInterval(call.stallTimer);
      // WHIP: the session's resource is deleted, then the peer connection closed (closing it
      // first would end the session before the server hears the hang-up).
      const pc = call.pc;
      const close = () => { try { pc.close(); } catch (_) {} };
      if (call.resource) api(call.resource, { method: "DELETE" }).catch(() => {}).finally(close);
      else close();
      call.audio.srcObject = null;
    }
    call.mic.getTracks().forEach((t) => t.stop());
    call = null;
  }
  stats.handshake = false;
  setState(state, message);
}

$("connect").addEventListener("click", connect);
$("hangup").addEventListener("click", () => { clearTimeout(retryTimer); hangup("ended"); });
$("latency").addEventListener("input", () => {
  $("latency_ms").textContent = `${$("latency").value} ms`;
  call?.player?.port.postMessage({ target_ms: Number($("latency").value) });
});
{
  const t = new URLSearchParams(location.search).get("transport");
  if (["auto", "webrtc", "websocket"].includes(t)) $("transport").value = t;
}
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && call) hangup("ended");
});

// For tests: the page's own Ogg/Opus path, without a call.
window.duplexCodec = {
  async encode(samples) {
    const writer = new OggWriter({ sampleRate: 24000 });
    const parts = [];
    const enc = await opusEncoder((p, n) => parts.push(writer.push(p, n)));
    const x = Float32Array.from(samples);
    for (let i = 0; i + 480 <= x.length; i += 480) {
      enc.encode(new AudioData({ format: "f32", sampleRate: 24000, numberOfFrames: 480, numberOfChannels: 1, timestamp: (i / 24000) * 1e6, data: x.slice(i, i + 480) }));
    }
    await enc.flush();
    enc.close();
    const all = parts.reduce((a, p) => a + p.length, 0);
    const out = new Uint8Array(all);
    let at = 0;
    for (const p of parts) { out.set(p, at); at += p.length; }
    return btoa(String.fromCharCode(...out));
  },
  async decode(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const reader = new OggReader();
    const out = [];
    let dec = null;
    let k = 0;
    for (let i = 0; i < bytes.length; i += 777) {
      for (const p of reader.push(bytes.subarray(i, i + 777))) {
        if (!dec) dec = opusDecoder(reader.head, (pcm) => out.push(pcm));
        dec.decode(new EncodedAudioChunk({ type: "key", timestamp: k++ * 20000, data: p }));
      }
    }
    if (dec) { await dec.flush(); dec.close(); }
    const n = out.reduce((a, p) => a + p.length, 0);
    let energy = 0;
    for (const p of out) for (const v of p) energy += v * v;
    return { samples: n, rms: Math.sqrt(energy / Math.max(1, n)) };
  },
};

setState("idle");
loadDefaults();
