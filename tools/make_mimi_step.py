#!/usr/bin/env python3
"""Builds Mimi step graphs: one 80 ms frame per call, every piece of codec state explicit.

    python tools/make_mimi_step.py PACK [--dtype f32|f16|both] [--rvq gemm|broadcast]

The offline graphs of a pack (`mimi_encoder`, `mimi_decoder`, built by the exporter,
`mobius-onnx`) take a whole utterance. This script builds, from the same weights:

* `mimi_encoder_step`: `pcm` (B, 1, 1920) float32 + state -> `codes` (B, 8, 1) int64 + state;
* `mimi_decoder_step`: `codes` (B, 8, 1) int64 + state -> `pcm` (B, 1, 1920) float32 + state;

and an `active` (B,) bool input to both: a row whose `active` is false keeps every state tensor
and counter bit for bit (its output is meaningless), so one batched call can step the rows that
have a frame and leave the others as they were (a shared codec's tick);

each beside a `state.json` that names every state tensor (input, output, shape without the
batch dimension, dtype, initial value), so that a runtime needs no list of its own. fp16 graphs
(`--dtype f16`, folders `*_step_f16`) keep float32 PCM at their edges.

What holds state (read ../shared/design/MIMI_STREAMING.md):

* every causal convolution keeps the last `kernel - stride` samples of its input (zeros at the
  start equal the offline left padding; the downsample, replicate-padded offline, takes its
  first input sample on the first call);
* every transposed convolution keeps its overlap-add tail, less the bias;
* each codec transformer layer keeps its keys (after RoPE, at absolute positions) and values in
  a ring of `WINDOW` slots written in place (`TensorScatter`, circular); a query attends to the
  keys within the transformer's context of 250 frames, which is Kyutai's offline codec;
* two counters per batch row: `position` (absolute 25 Hz frame, for RoPE and the ring) and
  `filled` (how many past frames are valid; a reset sets both to 0). RoPE angles are computed
  in float64 from the integer position, so hours of stream do not drift.

The graphs are built with the exporter's own components and optimisation passes (the module
tree mirrors its parameter names), and the weights are copied by name from the pack's offline
graphs: the step graphs compute what the offline graphs compute, one frame at a time.

The encoder's RVQ distance is `|c|^2 - 2 x.c` (one GEMM per codebook, `--rvq gemm`, the
default) or the exporter's broadcast difference (`--rvq broadcast`); the tests show both give
the same codes. This script knows nothing of the runtime that runs the graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FRAME = 1920
RATIOS = [8, 6, 5, 4]
RESAMPLE = 2
CONTEXT = 250
# Ring slots per layer: a call writes 2 frames, and its first query still needs the 249 before it.
WINDOW = 256
THETA = 10000.0
FRAMES_PER_CALL = FRAME // int(np.prod(RATIOS))  # 2 transformer frames per 80 ms
# Convolutions with at most this many output frames per call run as one GEMM over the batch
# (their weights read once per call, not once per row); longer ones stay Conv (compute-bound).
GEMM_FRAMES = 16


@dataclasses.dataclass(frozen=True)
class Sizes:
    filters: int
    dim: int
    tr_layers: int
    tr_heads: int
    tr_head_dim: int
    tr_ffn: int
    vq_dim: int
    bins: int
    codebooks: int


def _shape(g, name):
    v = g.initializers.get(name)
    if v is None:
        raise SystemExit(f"make_mimi_step: the offline graph has no initializer {name!r}")
    return tuple(int(d) for d in v.shape)


def infer_sizes(enc, dec) -> Sizes:
    """Reads the codec's sizes from the offline graphs' initializers."""
    g = enc.graph
    filters = _shape(g, "encoder.encoder.model.0.conv.conv.weight")[0]
    dim = _shape(g, "encoder.encoder.model.14.conv.conv.weight")[0]
    prefix = "encoder.encoder_transformer.transformer"
    layers = 0
    while f"{prefix}.layers.{layers}.input_layernorm.weight" in g.initializers:
        layers += 1
    half = _shape(g, f"{prefix}.rotary_emb.cos_cache")[1]
    head_dim = 2 * half
    ffn = _shape(g, f"{prefix}.layers.0.mlp.up_proj.weight_t")[1]
    bins, vq_dim = _shape(g, "encoder.quantizer.rvq_first.vq.layers.0._codebook.embedding.weight")
    rest = 0
    while f"encoder.quantizer.rvq_rest.vq.layers.{rest}._codebook.embedding.weight" in g.initializers:
        rest += 1
    return Sizes(filters, dim, layers, dim // head_dim, head_dim, ffn, vq_dim, bins, 1 + rest)


# --- Modules ---------------------------------------------------------------------------------
# Built only inside build(): they need the exporter, imported with its placeholders.


def _modules():
    import onnx_ir as ir
    from onnxscript import nn

    from mobius.components import _codec_vq
    from mobius.components._codec_conv import LayerScale
    from mobius.components._common import LayerNorm, Linear
    from mobius.components._mlp import FCMLP
    from mobius.models import mimi

    class Step:
        """Collects the state tensors of one graph while its modules are traced."""

        def __init__(self, builder, dtype):
            self.builder = builder
            self.dtype = dtype
            self.states = []
            self.outputs = []
            # (B, 1, 1) bool: the stream's first call, set by the transformer (its `filled`
            # counter), read by the replicate-padded downsample after it.
            self.first = None
            # (B,) bool, the graph input `active`: rows without a frame this call keep every
            # state and counter bit for bit (their frame output is meaningless).
            self.active = None
            self._inputs = {}
            self._inplace = set()
            # Samples (or frames) along time of the value being traced, when known: a
            # convolution's GEMM form needs its output length.
            self.frames = None

        def active_like(self, rank):
            """`active` reshaped to (B, 1, ...) of `rank` dimensions, for a Where."""
            op = self.builder.op
            if rank == 1:
                return self.active
            shape = op.Constant(value=ir.tensor(np.array([-1] + [1] * (rank - 1), dtype=np.int64)))
            return op.Reshape(self.active, shape)

        def state(self, key, shape, dtype=None, inplace=False):
            dtype = dtype or self.dtype
            batch = ir.SymbolicDim("batch")
            value = self.builder.input(f"state.{key}", dtype=dtype, shape=[batch, *shape])
            self._inputs[key] = (value, 1 + len(shape))
            if inplace:
                self._inplace.add(key)
            self.states.append(
                {
                    "name": key,
                    "input": f"state.{key}",
                    "output": f"state_next.{key}",
                    "shape": list(shape),
                    "dtype": {ir.DataType.FLOAT: "f32", ir.DataType.FLOAT16: "f16",
                              ir.DataType.INT64: "i64"}[dtype],
                    "init": "zeros",
                    "inplace": inplace,
                }
            )
            return value

        def next(self, key, value):
            if key not in self._inplace:
                # A row without a frame keeps its state (in-place rings keep theirs by what
                # they are written with: see StepAttention).
                old, rank = self._inputs[key]
                value = self.builder.op.Where(self.active_like(rank), value, old)
            self.outputs.append((value, f"state_next.{key}"))

    class ConvWeights(nn.Module):
        """A Conv1d's weight and bias, as the exporter names them (`….conv.conv.weight`)."""

        def __init__(self, in_ch, out_ch, kernel, groups, bias):
            super().__init__()
            self.weight = nn.Parameter([out_ch, in_ch // groups, kernel])
            self.bias = nn.Parameter([out_ch]) if bias else None

        def forward(self, op):
            b = op.Identity(self.bias) if self.bias is not None else None
            return op.Identity(self.weight), b

    class ConvHolder(nn.Module):
        def __init__(self, in_ch, out_ch, kernel, groups, bias):
            super().__init__()
            self.conv = ConvWeights(in_ch, out_ch, kernel, groups, bias)

        def forward(self, op):
            return self.conv(op)

    class StepConv(nn.Module):
        """A causal Conv1d that keeps the last `kernel - stride` samples of its input."""

        def __init__(self, in_ch, out_ch, kernel, *, stride=1, groups=1, bias=True, edge=False):
            super().__init__()
            self._pad = kernel - stride
            self._in = in_ch
            self._out = out_ch
            self._stride = stride
            self._groups = groups
            self._edge = edge
            self._kernel = kernel
            self.conv = ConvHolder(in_ch, out_ch, kernel, groups, bias)

        def _gemm(self, op, joined, frames):
            """The convolution as one GEMM over every row's `frames` output frames.

            ONNX Runtime's Conv runs a batch row at a time, so a layer with a few output frames
            and large weights reads its weights once per row; unfolded into (B, frames,
            in * kernel) windows, one MatMul reads them once per call.
            """
            k, s = self._kernel, self._stride
            weight, bias = self.conv(op)
            i64 = lambda v: op.Constant(value=ir.tensor(np.array(v, dtype=np.int64)))  # noqa: E731
            cols = [
                op.Unsqueeze(op.Slice(joined, i64([i]), i64([i + (frames - 1) * s + 1]),
                                      i64([2]), i64([s])), i64([3]))
                for i in range(k)
            ]
            u = cols[0] if k == 1 else op.Concat(*cols, axis=3)  # (B, in, frames, k)
            u = op.Reshape(op.Transpose(u, perm=[0, 2, 1, 3]), i64([0, frames, self._in * k]))
            w = op.Transpose(op.Reshape(weight, i64([self._out, self._in * k])), perm=[1, 0])
            y = op.MatMul(u, w)  # (B, frames, out)
            if bias is not None:
                y = op.Add(y, bias)
            return op.Transpose(y, perm=[0, 2, 1])

        def _apply(self, op, joined, step):
            """Conv, or the GEMM form for layers of at most GEMM_FRAMES output frames."""
            frames = None if step.frames is None else step.frames // self._stride
            step.frames = frames
            if frames is not None and frames <= GEMM_FRAMES and self._groups == 1:
                return self._gemm(op, joined, frames)
            weight, bias = self.conv(op)
            args = (joined, weight) if bias is None else (joined, weight, bias)
            return op.Conv(*args, kernel_shape=[self._kernel], strides=[self._stride],
                           dilations=[1], pads=[0, 0], group=self._groups)

        def forward(self, op, x, step, key, first=None):
            if self._pad == 0:
                return self._apply(op, x, step)
            state = step.state(key, [self._in, self._pad])
            if self._edge:
                # Offline replicates the first sample on the left: so does the first call.
                head = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]),
                                op.Constant(value_ints=[2]))
                replicated = op.Expand(head, op.Shape(state))
                state = op.Where(first, replicated, state)
            joined = op.Concat(state, x, axis=2)
            step.next(key, op.Slice(joined, op.Constant(value_ints=[-self._pad]),
                                    op.Constant(value_ints=[2**62]), op.Constant(value_ints=[2])))
            return self._apply(op, joined, step)

    class TrWeights(nn.Module):
        """A ConvTranspose1d's weight and bias, as the exporter names them."""

        def __init__(self, in_ch, out_ch, kernel, bias):
            super().__init__()
            self.weight = nn.Parameter([in_ch, out_ch, kernel])
            self.bias = nn.Parameter([out_ch]) if bias else None

        def forward(self, op):
            b = op.Identity(self.bias) if self.bias is not None else None
            return op.Identity(self.weight), b

    class TrHolder(nn.Module):
        def __init__(self, in_ch, out_ch, kernel, bias):
            super().__init__()
            self.convtr = TrWeights(in_ch, out_ch, kernel, bias)

        def forward(self, op):
            return self.convtr(op)

    class StepConvTr(nn.Module):
        """A causal ConvTranspose1d as overlap-add: keeps the `kernel - stride` tail, less bias."""

        def __init__(self, in_ch, out_ch, kernel, stride, *, groups=1, bias=True):
            super().__init__()
            self._tail = kernel - stride
            self._stride = stride
            self._out = out_ch
            self._bias = bias
            self._groups = groups
            self._in = in_ch
            if groups == 1 and kernel == 2 * stride:
                self.convtr = TrHolder(in_ch, out_ch, kernel, bias)
            else:
                self.convtr = mimi._NormConvTr(
                    in_ch, out_ch, kernel, stride, groups=groups, bias=bias
                )

        def _gemm(self, op, x, step, key, frames):
            """kernel = 2 * stride as one GEMM and an overlap-add of two halves.

            ONNX Runtime's ConvTranspose on a few input frames is bound by its col2im; the
            GEMM reads the weights (in, out * kernel) once. Frame t's kernel output has a head
            (its first `stride` samples, at block t) and a tail (at block t + 1): block t is
            head[t] + tail[t - 1], with tail[-1] the state; the new state is the last tail.
            """
            s, c = self._stride, self._out
            i64 = lambda v: op.Constant(value=ir.tensor(np.array(v, dtype=np.int64)))  # noqa: E731
            weight, bias = self.convtr(op)
            w = op.Reshape(weight, i64([self._in, c * 2 * s]))
            z = op.MatMul(op.Transpose(x, perm=[0, 2, 1]), w)  # (B, T, C * 2s)
            z = op.Reshape(z, i64([0, frames, c, 2, s]))
            head = op.Squeeze(op.Slice(z, i64([0]), i64([1]), i64([3])), i64([3]))  # (B,T,C,s)
            tail = op.Squeeze(op.Slice(z, i64([1]), i64([2]), i64([3])), i64([3]))
            partial = step.state(key, [c, s])  # (B, C, s)
            # Tails shifted one block later: the state, then every tail but the last.
            shifted = op.Concat(
                op.Unsqueeze(partial, i64([1])),
                op.Slice(tail, i64([0]), i64([frames - 1]), i64([1])),
                axis=1,
            )
            step.next(key, op.Squeeze(op.Slice(tail, i64([frames - 1]), i64([frames]),
                                               i64([1])), i64([1])))
            y = op.Add(head, shifted)  # (B, T, C, s)
            y = op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), i64([0, c, frames * s]))
            if bias is not None:
                y = op.Add(y, op.Unsqueeze(bias, i64([0, 2])))
            return y

        def forward(self, op, x, step, key, frames):
            step.frames = frames * self._stride
            if self._groups == 1 and self._tail == self._stride:
                return self._gemm(op, x, step, key, frames)
            y = self.convtr(op, x)  # (B, C, frames * stride + tail)
            emit = frames * self._stride
            partial = step.state(key, [self._out, self._tail])
            y = op.Add(y, op.Pad(partial, op.Constant(value_ints=[0, 0, 0, 0, 0, emit])))
            tail = op.Slice(y, op.Constant(value_ints=[emit]), op.Constant(value_ints=[2**62]),
                            op.Constant(value_ints=[2]))
            if self._bias:
                bias = self.convtr.convtr.bias
                tail = op.Sub(tail, op.Unsqueeze(bias, op.Constant(value_ints=[0, 2])))
            step.next(key, tail)
            return op.Slice(y, op.Constant(value_ints=[0]), op.Constant(value_ints=[emit]),
                            op.Constant(value_ints=[2]))

    class Elu(nn.Module):
        def forward(self, op, x, *_):
            return op.Elu(x, alpha=1.0)

    class StepResnet(nn.Module):
        """SEANet residual block: ELU, k3 conv (state), ELU, k1 conv, plus the input."""

        def __init__(self, dim):
            super().__init__()
            self.block = nn.ModuleList(
                [Elu(), StepConv(dim, dim // 2, 3), Elu(), StepConv(dim // 2, dim, 1)]
            )

        def forward(self, op, x, step, key):
            h = x
            for i, layer in enumerate(self.block):
                h = layer(op, h, step, f"{key}.block.{i}")
            return op.Add(x, h)

    class StepAttention(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            width = s.tr_heads * s.tr_head_dim
            self._heads = s.tr_heads
            self._width = width
            self._head_dim = s.tr_head_dim
            self.q_proj = Linear(s.dim, width, bias=False)
            self.k_proj = Linear(s.dim, width, bias=False)
            self.v_proj = Linear(s.dim, width, bias=False)
            self.o_proj = Linear(width, s.dim, bias=False)

        def forward(self, op, h, ctx, step, key):
            q = op.RotaryEmbedding(self.q_proj(op, h), ctx.cos, ctx.sin, num_heads=self._heads)
            k = op.RotaryEmbedding(self.k_proj(op, h), ctx.cos, ctx.sin, num_heads=self._heads)
            v = self.v_proj(op, h)
            caches = []
            for name, new in (("k", k), ("v", v)):
                ring = step.state(f"{key}.{name}", [WINDOW, self._width], inplace=True)
                # A row without a frame writes back what its slots held.
                held = op.GatherElements(ring, op.Expand(ctx.slots, op.Shape(new)), axis=1)
                new = op.Where(step.active_like(3), new, held)
                ring = op.TensorScatter(ring, new, ctx.write, axis=1, mode="circular")
                step.next(f"{key}.{name}", ring)
                caches.append(ring)
            out, _, _ = op.Attention(
                q, caches[0], caches[1], ctx.mask,
                q_num_heads=self._heads, kv_num_heads=self._heads,
                scale=float(self._head_dim**-0.5), _outputs=3,
            )
            return self.o_proj(op, out)

    class StepLayer(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            self.input_layernorm = LayerNorm(s.dim, eps=1e-5)
            self.self_attn = StepAttention(s)
            self.self_attn_layer_scale = LayerScale(s.dim)
            self.post_attention_layernorm = LayerNorm(s.dim, eps=1e-5)
            self.mlp = FCMLP(s.dim, s.tr_ffn, activation="gelu", bias=False)
            self.mlp_layer_scale = LayerScale(s.dim)

        def forward(self, op, h, ctx, step, key):
            a = self.input_layernorm(op, h)
            a = self.self_attn_layer_scale(op, self.self_attn(op, a, ctx, step, key))
            h = op.Add(h, a)
            m = self.mlp_layer_scale(op, self.mlp(op, self.post_attention_layernorm(op, h)))
            return op.Add(h, m)

    class Context:
        pass

    class StepTransformerLayers(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            self.layers = nn.ModuleList([StepLayer(s) for _ in range(s.tr_layers)])
            self._sizes = s

        def forward(self, op, x, step, key):
            s = self._sizes
            t = FRAMES_PER_CALL
            position = step.state(f"{key}.position", [], ir.DataType.INT64)
            filled = step.state(f"{key}.filled", [], ir.DataType.INT64)
            i64 = lambda v: op.Constant(value=ir.tensor(np.array(v, dtype=np.int64)))  # noqa: E731
            # Absolute positions of this call's frames: (B, T).
            pos = op.Add(op.Unsqueeze(position, i64([1])), i64(np.arange(t)))
            # RoPE in float64 from the integer position (exact for hours), then cast.
            inv_freq = (1.0 / (THETA ** (np.arange(0, s.tr_head_dim, 2, dtype=np.float32)
                                         / s.tr_head_dim))).astype(np.float32)
            angles = op.Mul(op.Unsqueeze(op.Cast(pos, to=ir.DataType.DOUBLE), i64([2])),
                            op.Constant(value=ir.tensor(inv_freq.astype(np.float64))))
            ctx = Context()
            ctx.cos = op.Cast(op.Cos(angles), to=step.dtype)
            ctx.sin = op.Cast(op.Sin(angles), to=step.dtype)
            ctx.write = op.Mod(position, i64(WINDOW))
            # The ring slots this call writes: (B, T, 1).
            ctx.slots = op.Unsqueeze(op.Mod(pos, i64(WINDOW)), i64([2]))
            # The ring slot s holds the latest position a(s) <= last with a(s) = s (mod WINDOW).
            last = op.Add(position, i64(t - 1))
            slots = i64(np.arange(WINDOW).reshape(1, WINDOW))
            held = op.Sub(op.Unsqueeze(last, i64([1])),
                          op.Mod(op.Sub(op.Unsqueeze(last, i64([1])), slots), i64(WINDOW)))
            held = op.Unsqueeze(held, i64([1, 2]))  # (B, 1, 1, W)
            query = op.Unsqueeze(pos, i64([1, 3]))  # (B, 1, T, 1)
            age = op.Sub(query, held)
            earliest = op.Unsqueeze(op.Sub(position, filled), i64([1, 2, 3]))
            ctx.mask = op.And(
                op.And(op.GreaterOrEqual(age, i64(0)), op.Less(age, i64(CONTEXT))),
                op.GreaterOrEqual(held, earliest),
            )
            step.next(f"{key}.position", op.Add(position, i64(t)))
            step.next(f"{key}.filled", op.Min(op.Add(filled, i64(t)), i64(CONTEXT)))
            step.first = op.Unsqueeze(op.Equal(filled, i64(0)), i64([1, 2]))  # (B, 1, 1)
            h = op.Transpose(x, perm=[0, 2, 1])
            for i, layer in enumerate(self.layers):
                h = layer(op, h, ctx, step, f"{key}.{i}")
            return op.Transpose(h, perm=[0, 2, 1])

    class StepTransformer(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            self.transformer = StepTransformerLayers(s)

        def forward(self, op, x, step, key):
            return self.transformer(op, x, step, key)

    class SeanetEncoder(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            layers = [StepConv(1, s.filters, 7)]
            mult = 1
            for ratio in reversed(RATIOS):
                ch = mult * s.filters
                layers += [StepResnet(ch), Elu(), StepConv(ch, ch * 2, ratio * 2, stride=ratio)]
                mult *= 2
            layers += [Elu(), StepConv(mult * s.filters, s.dim, 3)]
            self.model = nn.ModuleList(layers)

        def forward(self, op, x, step):
            for i, layer in enumerate(self.model):
                x = layer(op, x, step, f"encoder.model.{i}")
            return x

    class SeanetDecoder(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            mult = 2 ** len(RATIOS)
            layers = [StepConv(s.dim, mult * s.filters, 7)]
            for ratio in RATIOS:
                ch = mult * s.filters
                layers += [Elu(), StepConvTr(ch, ch // 2, ratio * 2, ratio), StepResnet(ch // 2)]
                mult //= 2
            layers += [Elu(), StepConv(s.filters, 1, 3)]
            self.model = nn.ModuleList(layers)

        def forward(self, op, x, step):
            frames = FRAMES_PER_CALL
            for i, layer in enumerate(self.model):
                if isinstance(layer, StepConvTr):
                    x = layer(op, x, step, f"decoder.model.{i}", frames)
                    frames *= layer._stride
                else:
                    x = layer(op, x, step, f"decoder.model.{i}")
            return x

    class Downsample(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            self.conv = StepConv(s.dim, s.dim, RESAMPLE * 2, stride=RESAMPLE, bias=False, edge=True)

        def forward(self, op, x, step):
            return self.conv(op, x, step, "downsample", step.first)

    class Upsample(nn.Module):
        def __init__(self, s: Sizes):
            super().__init__()
            self.convtr = StepConvTr(s.dim, s.dim, RESAMPLE * 2, RESAMPLE, groups=s.dim, bias=False)

        def forward(self, op, x, step):
            return self.convtr(op, x, step, "upsample", 1)

    class EncVQ(nn.Module):
        """One codebook: the nearest entry, by GEMM (`|c|^2 - 2 x.c`) or broadcast difference."""

        def __init__(self, s: Sizes, gemm: bool):
            super().__init__()
            self._codebook = mimi._CodebookTable(s.bins, s.vq_dim)
            self._gemm = gemm

        def forward(self, op, x):  # x: (B, T, vq) float32
            table = op.Cast(self._codebook(op), to=ir.DataType.FLOAT)  # (bins, vq)
            if self._gemm:
                norms = op.ReduceSumSquare(table, op.Constant(value_ints=[1]), keepdims=0)
                dots = op.MatMul(x, op.Transpose(table, perm=[1, 0]))  # (B, T, bins)
                dist = op.Sub(norms, op.Mul(dots, op.Constant(value_float=2.0)))
            else:
                diff = op.Sub(op.Unsqueeze(x, op.Constant(value_ints=[2])),
                              op.Unsqueeze(table, op.Constant(value_ints=[0, 1])))
                dist = op.ReduceSumSquare(diff, op.Constant(value_ints=[-1]), keepdims=0)
            codes = op.ArgMin(dist, axis=-1, keepdims=0)  # (B, T)
            return codes, op.Gather(table, codes, axis=0)

    class EncVQList(nn.Module):
        def __init__(self, s: Sizes, n: int, gemm: bool):
            super().__init__()
            self.layers = nn.ModuleList([EncVQ(s, gemm) for _ in range(n)])

        def forward(self, op, x):
            codes = []
            for layer in self.layers:
                c, q = layer(op, x)
                codes.append(op.Unsqueeze(c, op.Constant(value_ints=[1])))
                x = op.Sub(x, q)
            return codes

    class EncRVQ(nn.Module):
        def __init__(self, s: Sizes, n: int, gemm: bool):
            super().__init__()
            self.input_proj = mimi._ProjParams(s.dim, s.vq_dim)
            self.vq = EncVQList(s, n, gemm)

        def forward(self, op, hidden):
            projected = op.Cast(self.input_proj(op, hidden), to=ir.DataType.FLOAT)
            return self.vq(op, op.Transpose(projected, perm=[0, 2, 1]))

    class EncQuantizer(nn.Module):
        def __init__(self, s: Sizes, gemm: bool):
            super().__init__()
            self.rvq_first = EncRVQ(s, 1, gemm)
            self.rvq_rest = EncRVQ(s, s.codebooks - 1, gemm)

        def forward(self, op, hidden):
            return op.Concat(*self.rvq_first(op, hidden), *self.rvq_rest(op, hidden), axis=1)

    class EncoderStep(nn.Module):
        def __init__(self, s: Sizes, dtype, gemm: bool):
            super().__init__()
            self._dtype = dtype
            self.encoder = SeanetEncoder(s)
            self.encoder_transformer = StepTransformer(s)
            self.downsample = Downsample(s)
            self.quantizer = EncQuantizer(s, gemm)

        def forward(self, op, pcm, step):
            x = pcm if self._dtype == ir.DataType.FLOAT else op.Cast(pcm, to=self._dtype)
            step.frames = FRAME
            x = self.encoder(op, x, step)
            x = self.encoder_transformer(op, x, step, "encoder_transformer")
            x = self.downsample(op, x, step)
            return self.quantizer(op, x)

    class DecoderStep(nn.Module):
        def __init__(self, s: Sizes, dtype):
            super().__init__()
            self._dtype = dtype
            self.quantizer = _codec_vq.SplitResidualVectorQuantizer(
                num_quantizers=s.codebooks, codebook_size=s.bins, codebook_dim=2 * s.vq_dim
            )
            self.upsample = Upsample(s)
            self.decoder_transformer = StepTransformer(s)
            self.decoder = SeanetDecoder(s)

        def forward(self, op, codes, step):
            x = self.quantizer(op, codes)
            x = self.upsample(op, x, step)
            x = self.decoder_transformer(op, x, step, "decoder_transformer")
            x = self.decoder(op, x, step)
            if self._dtype != ir.DataType.FLOAT:
                x = op.Cast(x, to=ir.DataType.FLOAT)
            return x

    class StepModel(nn.Module):
        def __init__(self, s: Sizes, dtype, gemm: bool):
            super().__init__()
            self.encoder = EncoderStep(s, dtype, gemm)
            self.decoder = DecoderStep(s, dtype)

    return Step, StepModel


def build(sizes: Sizes, dtype_name: str, gemm: bool):
    """Returns {"encoder": (ir.Model, states), "decoder": (ir.Model, states)} without weights."""
    if "mobius" not in sys.modules:
        import make_pack

        make_pack._import_exporter()
    import onnx_ir as ir

    from mobius._builder import build_from_module
    from mobius.models import mimi
    from mobius.tasks._base import ModelTask, _make_graph, _make_model
    from mobius._model_package import ModelPackage

    dtype = {"f32": ir.DataType.FLOAT, "f16": ir.DataType.FLOAT16}[dtype_name]
    Step, StepModel = _modules()
    steps = {}

    class StepTask(ModelTask):
        model_roles = {"encoder": "encoder", "decoder": "decoder"}

        def build(self, module, config):
            models = {}
            batch = ir.SymbolicDim("batch")
            for role, (in_name, in_dtype, in_shape, out_name) in {
                "encoder": ("pcm", ir.DataType.FLOAT, [batch, 1, FRAME], "codes"),
                "decoder": ("codes", ir.DataType.INT64, [batch, sizes.codebooks, 1], "pcm"),
            }.items():
                graph, builder = _make_graph(name=f"mimi_{role}_step")
                step = Step(builder, dtype)
                x = builder.input(in_name, dtype=in_dtype, shape=in_shape)
                step.active = builder.input("active", dtype=ir.DataType.BOOL, shape=[batch])
                y = getattr(module, role)(builder.op, x, step)
                builder.add_output(y, out_name)
                for value, name in step.outputs:
                    builder.add_output(value, name)
                steps[role] = step.states
                models[role] = _make_model(graph)
            return ModelPackage(models, config=config)

    config = mimi.mimi_default_config()
    config = dataclasses.replace(config, dtype=dtype)
    pkg = build_from_module(StepModel(sizes, dtype, gemm), config, StepTask())
    return {role: (pkg[role], steps[role]) for role in ("encoder", "decoder")}


def copy_weights(step_model, offline_model, role: str) -> None:
    """Fills the step graph's parameters from the offline graph's, by name (cast as needed)."""
    import onnx_ir as ir

    source = offline_model.graph.initializers
    missing = []
    for name, value in step_model.graph.initializers.items():
        if value.const_value is not None:
            continue
        src = source.get(name)
        if src is not None and src.const_value is not None:
            data = src.const_value.numpy()
        elif source.get(name + "_t") is not None and source[name + "_t"].const_value is not None:
            # The exporter's passes store linear weights transposed: undo it.
            data = source[name + "_t"].const_value.numpy().T
        else:
            missing.append(name)
            continue
        if tuple(data.shape) != tuple(int(d) for d in value.shape):
            raise SystemExit(
                f"make_mimi_step: {role}: {name} is {tuple(value.shape)} in the step graph but "
                f"{tuple(data.shape)} in the offline graph"
            )
        value.const_value = ir.Tensor(np.ascontiguousarray(data.astype(value.dtype.numpy())), name=name)
    if missing:
        raise SystemExit(
            f"make_mimi_step: {role}: {len(missing)} parameters have no weight in the offline "
            f"graph, e.g. {missing[:4]}"
        )


def add_step_graphs(pack: str, dtypes=("f32", "f16"), gemm: bool = True, say=print) -> list[str]:
    """Builds the step graphs of `pack` beside its offline graphs; returns the folders written.

    Of a pack built with `make_pack.py --shapes-only` (its offline graphs' weights declared in
    `weights.json`, not written), the step graphs are built the same way: their weights
    declared and listed, for `tools/fill_weights.py`."""
    import onnx_ir as ir

    enc = ir.load(os.path.join(pack, "mimi_encoder", "model.onnx"))
    dec = ir.load(os.path.join(pack, "mimi_decoder", "model.onnx"))
    shapes_only = os.path.isfile(os.path.join(pack, "mimi_encoder", "weights.json"))
    sizes = infer_sizes(enc, dec)
    written = []
    for dtype in dtypes:
        built = build(sizes, dtype, gemm)
        for role, offline in (("encoder", enc), ("decoder", dec)):
            model, states = built[role]
            folder = f"mimi_{role}_step" + ("" if dtype == "f32" else "_f16")
            tmp = os.path.join(pack, folder + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            if shapes_only:
                import make_pack

                for value in model.graph.initializers.values():
                    if value.const_value is None:
                        value.const_value = make_pack._unwritten(value)
                make_pack.save_shapes_only(model, tmp)
            else:
                copy_weights(model, offline, role)
                ir.save(model, os.path.join(tmp, "model.onnx"), external_data="model.onnx.data")
            manifest = {
                "format": 1,
                "role": role,
                "dtype": dtype,
                "frame_samples": FRAME,
                "codebooks": sizes.codebooks,
                "context": CONTEXT,
                "window": WINDOW,
                "rvq": ("gemm" if gemm else "broadcast") if role == "encoder" else None,
                "input": "pcm" if role == "encoder" else "codes",
                "output": "codes" if role == "encoder" else "pcm",
                "active": "active",
                "states": states,
            }
            with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
                f.write("\n")
            final = os.path.join(pack, folder)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            written.append(folder)
            say(f"wrote {final} ({len(states)} state tensors)")
    _set_strategies(pack, dtypes)
    return written


def _set_strategies(pack: str, dtypes) -> None:
    """Records in pack.yaml which codec strategies the pack has."""
    path = os.path.join(pack, "pack.yaml")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if not line.startswith("mimi_streaming:")]
    strategies = ["window", "stateful"] + (["stateful_f16"] if "f16" in dtypes else [])
    lines.append(f"mimi_streaming: [{', '.join(strategies)}]")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pack", help="a pack folder with mimi_encoder/ and mimi_decoder/")
    parser.add_argument("--dtype", choices=["f32", "f16", "both"], default="both")
    parser.add_argument("--rvq", choices=["gemm", "broadcast"], default="gemm")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    for role in ("mimi_encoder", "mimi_decoder"):
        if not os.path.isfile(os.path.join(args.pack, role, "model.onnx")):
            print(f"make_mimi_step: {args.pack}: no {role}/model.onnx", file=sys.stderr)
            return 2
    dtypes = ("f32", "f16") if args.dtype == "both" else (args.dtype,)
    add_step_graphs(args.pack, dtypes, args.rvq == "gemm", say=(lambda _m: None) if args.quiet else print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
