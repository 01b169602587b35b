#!/usr/bin/env python3
"""Independent reference of the LM step loop, for conformance tests.

Written from the step algorithm in the design notes (the PersonaPlex convention), with plain
numpy and onnxruntime sessions, no IO binding and no tricks: the cache is fed from host arrays
every step, the depformer runs its 16 substeps from an empty cache, and tokens are chosen by
argmax. `tests/it/compute/model_conformance.rs` runs it next to `duplex replay --greedy` on the tiny packs
and compares the token streams step by step.

usage: reference_lm.py PACK CODES.json OUT.jsonl [--persona 1,2,3] [--silence-frames N]
"""
import argparse
import json
import os

import numpy as np
import onnxruntime as ort

TEXT_CARD, AUDIO_CARD, TEXT_PAD = 32000, 2048, 3
DELAYS = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
SILENCE = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]
SINE = [430, 1268, 381, 1611, 1095, 1495, 56, 472]


class Reference:
    def __init__(self, pack):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        load = lambda g: ort.InferenceSession(os.path.join(pack, g, "model.onnx"), so)
        self.temporal, self.depformer = load("temporal"), load("depformer")
        self.t_names = [i.name for i in self.temporal.get_inputs()]
        self.t_kv = [i for i in self.temporal.get_inputs() if i.name.startswith("past_key_values")]
        self.d_kv = [i for i in self.depformer.get_inputs() if i.name.startswith("past_key_values")]
        self.np_type = lambda i: np.float16 if "float16" in i.type else np.float32
        self.reset()

    def reset(self):
        self.ct = max(DELAYS) + 3
        self.ring = np.full((17, self.ct), -2, np.int64)
        self.given = np.zeros((17, self.ct), bool)
        self.offset = 0
        self.past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), self.np_type(i)) for i in self.t_kv}
        self.pos = 0

    def temporal_step(self, column):
        n = self.past[self.t_kv[0].name].shape[2]
        feeds = {"input_frame": column.reshape(1, 17, 1), "attention_mask": np.ones((1, n + 1), np.int64)}
        if "position_ids" in self.t_names:
            feeds["position_ids"] = np.array([[self.pos]], np.int64)
        feeds.update(self.past)
        names = [o.name for o in self.temporal.get_outputs()]
        outs = dict(zip(names, self.temporal.run(names, feeds)))
        for name in self.past:
            self.past[name] = outs[name.replace("past_key_values", "present")]
        self.pos += 1
        return outs["hidden"], outs["text_logits"][0, -1].astype(np.float32)

    def depformer_step(self, hidden, text, target, given):
        past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), self.np_type(i)) for i in self.d_kv}
        names = [o.name for o in self.depformer.get_outputs()]
        prev, out = text, []
        for cb in range(16):
            feeds = {"hidden": hidden, "prev_token": np.array([[prev]], np.int64), "substep_index": np.array(cb, np.int64)}
            feeds.update(past)
            outs = dict(zip(names, self.depformer.run(names, feeds)))
            for name in past:
                past[name] = outs[name.replace("past_key_values", "present")]
            tok = int(np.argmax(outs["logits"][0, 0].astype(np.float32)))
            out.append(tok)
            prev = int(target[cb]) if given[cb] else tok
        return out

    def step(self, user, text=None, agent=None):
        ct, o = self.ct, self.offset
        for q in range(8):
            k = 9 + q
            self.ring[k, (o + DELAYS[k]) % ct] = user[q]
            self.given[k, (o + DELAYS[k]) % ct] = True
        if text is not None:
            self.ring[0, (o + DELAYS[0]) % ct] = text
            self.given[0, (o + DELAYS[0]) % ct] = True
        if agent is not None:
            for q in range(8):
                k = 1 + q
                self.ring[k, (o + DELAYS[k]) % ct] = agent[q]
                self.given[k, (o + DELAYS[k]) % ct] = True
        for k, d in enumerate(DELAYS):
            if o <= d:
                self.ring[k, o % ct] = TEXT_CARD if k == 0 else AUDIO_CARD
                self.given[k, o % ct] = True
        if o == 0:
            self.ring[:, 0] = [TEXT_CARD] + [AUDIO_CARD] * 16
            self.offset += 1
            return None
        inp, tgt = (o - 1) % ct, o % ct
        hidden, logits = self.temporal_step(self.ring[:, inp].copy())
        drawn = int(np.argmax(logits))
        t = int(self.ring[0, tgt]) if self.given[0, tgt] else drawn
        audio = self.depformer_step(hidden, t, self.ring[1:, tgt], self.given[1:, tgt])
        self.given[:, inp] = False
        if not self.given[0, tgt]:
            self.ring[0, tgt] = drawn
        for k in range(1, 17):
            if not self.given[k, tgt]:
                self.ring[k, tgt] = audio[k - 1]
        if o <= max(DELAYS):
            self.offset += 1
            return None
        col = lambda k: int(self.ring[k, (o - max(DELAYS) + DELAYS[k]) % ct])
        self.offset += 1
        return {"text": col(0), "audio": [col(k) for k in range(1, 9)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("codes")
    ap.add_argument("out")
    ap.add_argument("--persona", default="")
    ap.add_argument("--silence-frames", type=int, default=6)
    a = ap.parse_args()
    ref = Reference(a.pack)
    persona = [int(t) for t in a.persona.split(",") if t]
    for _ in range(a.silence_frames):
        ref.step(SINE, TEXT_PAD, SILENCE)
    for t in persona:
        ref.step(SINE, t, SILENCE)
    for _ in range(a.silence_frames):
        ref.step(SINE, TEXT_PAD, SILENCE)
    frames = json.load(open(a.codes))
    n = 0
    with open(a.out, "w") as f:
        for user in frames:
            r = ref.step(user)
            if r is not None:
                f.write(json.dumps({"frame": n, "text": r["text"], "audio": r["audio"]}, separators=(",", ":")) + "\n")
                n += 1


if __name__ == "__main__":
    main()
