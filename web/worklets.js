// The page's two AudioWorklet processors. The AudioContext runs at 24 kHz (the model's rate), so
// the browser resamples the microphone and the output device; these only cut and buffer.
//
// `capture`: the microphone (echo cancellation on, in getUserMedia) in 20 ms blocks of 480 samples,
// posted to the page for the Opus encoder.
// `player`: an adaptive jitter buffer: playback starts once `target` is queued; an underrun plays
// silence (counted, concealed) and raises the target by 20 ms (up to `max`); after 10 s without
// one the target creeps back toward the listener's setting. Stats are posted 4 times a second.

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(480);
    this.n = 0;
  }
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (ch) {
      for (let i = 0; i < ch.length; i++) {
        this.block[this.n++] = ch[i];
        if (this.n === this.block.length) {
          this.port.postMessage(this.block, [this.block.buffer]);
          this.block = new Float32Array(480);
          this.n = 0;
        }
      }
    }
    return true;
  }
}

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Float32Array(24000 * 4);
    this.read = 0;
    this.write = 0;
    this.setting = 0.12 * sampleRate;
    this.target = this.setting;
    this.max = 1.0 * sampleRate;
    this.playing = false;
    this.started = false;
    this.underruns = 0;
    this.concealed = 0;
    this.played = 0;
    this.dropped = 0;
    this.received = 0;
    this.sinceUnderrun = 0;
    this.stall = 0; // silent samples in a row while audio should be playing
    this.longestStall = 0;
    this.lastStats = 0;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.pcm) this.push(m.pcm);
      if (m.target_ms) {
        this.setting = (m.target_ms / 1000) * sampleRate;
        this.target = this.setting;
      }
      if (m.reset) {
        this.read = this.write = 0;
        this.playing = false;
      }
    };
  }
  depth() {
    return this.write - this.read;
  }
  push(pcm) {
    this.received += pcm.length;
    for (let i = 0; i < pcm.length; i++) {
      if (this.depth() >= this.ring.length) {
        this.read++; // full: the oldest goes
        this.dropped++;
      }
      this.ring[this.write++ % this.ring.length] = pcm[i];
    }
  }
  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.depth() >= this.target) this.playing = true;
    for (let i = 0; i < out.length; i++) {
      if (this.playing && this.depth() > 0) {
        out[i] = this.ring[this.read++ % this.ring.length];
        this.played++;
        this.started = true;
        this.stall = 0;
      } else {
        if (this.playing) {
          this.playing = false;
          this.underruns++;
          this.sinceUnderrun = 0;
          this.target = Math.min(this.max, this.target + 0.02 * sampleRate);
        }
        out[i] = 0;
        // Silence in place of audio that should be playing (not the first fill of the buffer).
        if (this.started) {
          this.concealed++;
          this.stall++;
          if (this.stall > this.longestStall) this.longestStall = this.stall;
        }
      }
    }
    this.sinceUnderrun += out.length;
    if (this.sinceUnderrun > 10 * sampleRate && this.target > this.setting) {
      this.target = Math.max(this.setting, this.target - 0.01 * sampleRate);
      this.sinceUnderrun = 0;
    }
    // A buffer far above target (a burst after a stall) is trimmed to keep latency bounded.
    if (this.depth() > this.target * 3 + 0.2 * sampleRate) {
      const cut = this.depth() - this.target;
      this.read += cut;
      this.dropped += cut;
    }
    if (currentTime - this.lastStats >= 0.25) {
      this.lastStats = currentTime;
      this.port.postMessage({
        depth_ms: (this.depth() / sampleRate) * 1000,
        target_ms: (this.target / sampleRate) * 1000,
        underruns: this.underruns,
        concealed: this.concealed,
        longest_stall_ms: (this.longestStall / sampleRate) * 1000,
        played: this.played,
        dropped: this.dropped,
        received: this.received,
      });
    }
    return true;
  }
}

registerProcessor("capture", Capture);
registerProcessor("player", Player);
