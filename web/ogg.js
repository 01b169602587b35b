// Ogg framing for Opus streams (RFC 3533, RFC 7845), as the Moshi protocol carries them: a writer
// that packs Opus packets into pages, and a push-based reader that takes the stream in chunks cut
// anywhere and returns whole packets. No codec here: WebCodecs does the Opus.

const CRC = (() => {
  const t = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let k = 0; k < 8; k++) r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    t[i] = r >>> 0;
  }
  return t;
})();

function crc32(bytes) {
  let c = 0;
  for (let i = 0; i < bytes.length; i++) c = ((c << 8) ^ CRC[((c >>> 24) ^ bytes[i]) & 0xff]) >>> 0;
  return c >>> 0;
}

/** Packs Opus packets into Ogg pages: OpusHead and OpusTags first, then `perPage` packets. */
export class OggWriter {
  constructor({ sampleRate = 24000, preSkip = 312, perPage = 2, serial } = {}) {
    this.serial = serial ?? (Math.random() * 0xffffffff) >>> 0;
    this.seq = 0;
    this.granule = preSkip; // counted at 48 kHz
    this.perPage = perPage;
    this.pending = [];
    const head = new Uint8Array(19);
    head.set(new TextEncoder().encode("OpusHead"));
    const v = new DataView(head.buffer);
    head[8] = 1; // version
    head[9] = 1; // channels
    v.setUint16(10, preSkip, true);
    v.setUint32(12, sampleRate, true);
    const vendor = new TextEncoder().encode("duplex web");
    const tags = new Uint8Array(8 + 4 + vendor.length + 4);
    tags.set(new TextEncoder().encode("OpusTags"));
    new DataView(tags.buffer).setUint32(8, vendor.length, true);
    tags.set(vendor, 12);
    this.headers = concat([this.page([head], 0, 2), this.page([tags], 0, 0)]);
  }

  page(packets, granule, flags) {
    const lacing = [];
    for (const p of packets) {
      for (let n = p.length; ; n -= 255) {
        if (n >= 255) lacing.push(255);
        else {
          lacing.push(n);
          break;
        }
      }
    }
    const size = packets.reduce((a, p) => a + p.length, 0);
    const out = new Uint8Array(27 + lacing.length + size);
    const v = new DataView(out.buffer);
    out.set([0x4f, 0x67, 0x67, 0x53, 0, flags]);
    v.setUint32(6, granule % 2 ** 32, true);
    v.setUint32(10, Math.floor(granule / 2 ** 32), true);
    v.setUint32(14, this.serial, true);
    v.setUint32(18, this.seq++, true);
    out[26] = lacing.length;
    out.set(lacing, 27);
    let at = 27 + lacing.length;
    for (const p of packets) {
      out.set(p, at);
      at += p.length;
    }
    v.setUint32(22, crc32(out), true);
    return out;
  }

  /** Takes one Opus packet of `samples48k` samples (at 48 kHz); returns the bytes it completes. */
  push(packet, samples48k) {
    this.pending.push(packet);
    this.granule += samples48k;
    let out = new Uint8Array(0);
    if (this.headers) {
      out = this.headers;
      this.headers = null;
    }
    if (this.pending.length >= this.perPage) {
      out = concat([out, this.page(this.pending, this.granule, 0)]);
      this.pending = [];
    }
    return out;
  }
}

/** Reads an Ogg/Opus stream pushed in chunks cut anywhere. */
export class OggReader {
  constructor() {
    this.buf = new Uint8Array(0);
    this.partial = [];
    this.head = null; // the OpusHead packet
    this.tagsSeen = false;
    this.pages = 0;
  }

  /** Returns the audio packets the bytes complete; throws on a stream that is not Ogg/Opus. */
  push(bytes) {
    this.buf = concat([this.buf, bytes]);
    const packets = [];
    for (;;) {
      if (this.buf.length < 27) break;
      if (this.buf[0] !== 0x4f || this.buf[1] !== 0x67 || this.buf[2] !== 0x67 || this.buf[3] !== 0x53) {
        throw new Error(`not an Ogg stream (page ${this.pages})`);
      }
      const nseg = this.buf[26];
      if (this.buf.length < 27 + nseg) break;
      const lacing = this.buf.subarray(27, 27 + nseg);
      const size = lacing.reduce((a, b) => a + b, 0);
      const end = 27 + nseg + size;
      if (this.buf.length < end) break;
      const copy = this.buf.slice(0, end);
      const want = new DataView(copy.buffer).getUint32(22, true);
      copy.fill(0, 22, 26);
      if (crc32(copy) !== want) throw new Error(`damaged Ogg page ${this.pages}`);
      let at = 27 + nseg;
      for (const l of lacing) {
        this.partial.push(this.buf.subarray(at, at + l));
        at += l;
        if (l < 255) {
          packets.push(concat(this.partial));
          this.partial = [];
        }
      }
      this.buf = this.buf.slice(end);
      this.pages++;
    }
    const audio = [];
    for (const p of packets) {
      if (!this.head) {
        if (p.length < 19 || new TextDecoder().decode(p.subarray(0, 8)) !== "OpusHead") {
          throw new Error("not an Opus stream");
        }
        this.head = p;
      } else if (!this.tagsSeen) {
        this.tagsSeen = true;
      } else {
        audio.push(p);
      }
    }
    return audio;
  }
}

export function concat(parts) {
  const n = parts.reduce((a, p) => a + p.length, 0);
  const out = new Uint8Array(n);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
