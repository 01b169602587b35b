#!/usr/bin/env bash
# The GPU check: what duplex does on a GPU, measured there and nowhere else.
#
#   tools/gpu-check.sh --prepare [DIR]   here: build what the GPU machine needs into DIR
#                                        (default gpu-check/, git-ignored), in parts of at most
#                                        56 MiB, and print the commands that carry them over
#   tools/gpu-check.sh OUT               there: assemble the parts, run the checks, write
#                                        OUT/gpu-check.txt (the figures, dated) and print them
#   tools/gpu-check.sh OUT --cpu         here: the same checks on the CPU, with this checkout's
#                                        build, library and packs (a dry run of the script)
#
# The GPU machine has CUDA 13 libraries and PyTorch, but no onnxruntime-gpu and no network, and
# receives at most 64 MiB of files per command. So everything is built here: a stripped
# `--features cuda` build of duplex, the shared libraries of the onnxruntime-gpu 1.31.1 wheel
# (from PyPI), a `small` GQA fp16 pack and the tiny packs, and the CPU run's token streams.
# They travel as one gzip'd tar cut into parts, one part per command. The machine keeps its
# files between commands while it stays up; each part command also copies its part to
# /tmp/duplex-gpu. The last command runs the check, in under 8 minutes:
#   - which provider each graph runs on (`duplex doctor --pack`),
#   - the temporal step at contexts 50 / 1000 / 2500 / 3000 on the small GQA fp16 pack: cache
#     resident, fed from the host, and replayed as a CUDA graph (`duplex doctor --time`),
#   - one conversation's depformer frame, every substep against the user's skipped, plainly
#     bound, with each substep captured as a CUDA graph and replayed, and so with the audio
#     drawn on the GPU (`device_sampling: true`: no logits to the host each substep),
#   - the codec's step graphs as the shared codec runs them, fp32 and fp16: one call of
#     B = 1/16/32/48 rows against B calls of one row, encoder and decoder (`duplex doctor
#     --time`, the same pack's codec),
#   - the shared LM engine's frame for B = 1/8/16/32/48/64 conversations stepped together (the
#     audio drawn on the host, then on the GPU), and the
#     device memory a conversation adds to it at the pack's whole context (an engine of 1 slot
#     and one of 4, each opened in a process of its own),
#   - the temporal step of the same pack quantized (int8, int4: tools/quantize_pack.py), at
#     the same contexts, and its engine's frame at B = 1/8/16/32/48/64 (`duplex doctor --time`),
#   - PersonaPlex's 7B shapes with the full-size codec: the graphs built here with their
#     weights declared, not written (`make_pack.py --size 7b --mimi full --shapes-only`), the
#     weights generated there (`fill_weights.py`, numpy only), then the temporal step at the
#     same contexts, the depformer's frame, the codec's batched steps at B = 1/16/32/48 and the
#     engine's frame at B = 1/8/16/32/48/64 and the memory per conversation (`duplex doctor
#     --time`), and the full-duplex loop over 600 frames (its completion interval's p50 / p90
#     / p99),
#   - the full-duplex pipeline's completion interval (tiny GQA fp16 pack, file to file),
#   - greedy token streams on the CUDA provider against the CPU run's, frame by frame.
# Nobody may call a figure a GPU figure unless this script printed it on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACKS=$ROOT/models
ORT_VERSION=1.31.1
PART_BYTES=$((56 * 1024 * 1024)) # with the working tree, under the 64 MiB a command receives
say() { printf 'gpu-check: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

prepare() {
  local dir=${1:-gpu-check}
  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  mkdir -p "$dir" && rm -f "$dir"/part.* "$dir"/SHA256SUMS
  say "building duplex with --features cuda (target/cuda)"
  cargo build --release --features cuda --target-dir target/cuda --bin duplex >&2 || die "the cuda build failed"
  mkdir -p "$stage/bundle/bin" "$stage/bundle/ort" "$stage/bundle/packs" "$stage/bundle/ref"
  strip -o "$stage/bundle/bin/duplex" target/cuda/release/duplex
  # The wheel is kept in DIR/cache/ and fetched once.
  local wheel=$dir/cache/wheel
  if ! ls "$wheel"/onnxruntime_gpu-"$ORT_VERSION"-*.whl >/dev/null 2>&1; then
    say "fetching onnxruntime-gpu==$ORT_VERSION from PyPI (kept in $wheel)"
    mkdir -p "$wheel"
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
      --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
      -d "$wheel" "onnxruntime-gpu==$ORT_VERSION" || die "pip download onnxruntime-gpu failed"
  else
    say "onnxruntime-gpu==$ORT_VERSION: the wheel fetched before ($wheel)"
  fi
  .venv/bin/python - "$wheel" "$stage/bundle/ort" <<'PY' || die "no libraries in the wheel"
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    # The runtime and the CUDA provider (TensorRT's is not used).
    names = [n for n in z.namelist() if "/capi/" in n and ".so" in os.path.basename(n)
             and os.path.basename(n).startswith("libonnxruntime") and "tensorrt" not in n]
    for n in names:
        with open(os.path.join(sys.argv[2], os.path.basename(n)), "wb") as f:
            f.write(z.read(n))
    print(" ".join(os.path.basename(n) for n in names), file=sys.stderr)
PY
  say "building the small GQA fp16 pack"
  .venv/bin/python tools/make_pack.py --size small --variant gqa-fp16 --out "$stage/bundle/packs/small-gqa-fp16" -q \
    || die "make_pack failed"
  for q in int8 int4; do
    .venv/bin/python tools/quantize_pack.py "$stage/bundle/packs/small-gqa-fp16" \
      "$stage/bundle/packs/small-gqa-fp16-$q" --quantize "$q" -q || die "quantize_pack $q failed"
  done
  say "building the 7B-shaped pack's graphs (weights declared, written there by tools/fill_weights.py)"
  .venv/bin/python tools/make_pack.py --size 7b --variant gqa-fp16 --mimi full --shapes-only \
    --out "$stage/bundle/packs/7b-gqa-fp16" -q || die "make_pack --size 7b failed"
  cp tools/fill_weights.py "$stage/bundle/"
  cp -r models/tiny-gqa models/tiny-gqa-fp16 "$stage/bundle/packs/"
  reference_tokens "$stage/bundle/ref" target/release/duplex cpu
  cp tools/gpu-check.sh "$stage/bundle/"
  say "packing"
  tar -C "$stage" -czf "$stage/bundle.tgz" bundle
  split -b "$PART_BYTES" -d -a 2 "$stage/bundle.tgz" "$dir/part."
  (cd "$dir" && sha256sum part.* >SHA256SUMS)
  local n
  n=$(ls "$dir"/part.* | wc -l)
  say "wrote $n parts ($(du -sh "$stage/bundle.tgz" | cut -f1) in all) into $dir/; on the GPU machine, one command per part:"
  for p in "$dir"/part.*; do
    printf '  run carry=[%s, %s/SHA256SUMS]: mkdir -p /tmp/duplex-gpu && cp %s %s/SHA256SUMS /tmp/duplex-gpu/\n' "$p" "$dir" "$p" "$dir"
  done
  printf '  then: tools/gpu-check.sh $OUT   (timeout_s 540)\n'
}

# Codes, then greedy token streams of the tiny packs on `provider`, into `out`.
reference_tokens() {
  local out=$1 duplex=$2 provider=$3
  mkdir -p "$out"
  [[ -f $out/codes.json ]] || python3 - "$out/codes.json" <<'PY'
import json, sys
x, frames = 12345, []
for _ in range(60):
    row = []
    for _ in range(8):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        row.append((x >> 33) % 2048)
    frames.append(row)
json.dump(frames, open(sys.argv[1], "w"))
PY
  for pack in tiny-gqa tiny-gqa-fp16; do
    "$duplex" replay --pack "$PACKS/$pack" --codes "$out/codes.json" --out "$out/$pack.$provider.jsonl" \
      --greedy --provider "$provider" 2>>"$out/replay.log" || return 1
  done
}

# The full-duplex pipeline on pack $2, a $3 s tone file to file, as fast as possible, within
# $4 s, in folder $1: its stages' times and completion interval (uses $duplex and $provider).
whole_loop() {
  local dir=$1 pack=$2 secs=$3 limit=$4
  mkdir -p "$dir"
  timeout 60 "$duplex" run "$ROOT/pipelines/make-tone.yaml" --set "stages.out.path=$dir/tone-48k.wav" \
    --set "stages.tone.duration=$secs" >/dev/null 2>&1
  timeout "$limit" "$duplex" run "$ROOT/pipelines/duplex-file.yaml" \
    --set "stages.source.path=$dir/tone-48k.wav" --set "stages.sink.path=$dir/agent.wav" \
    --set "stages.tokens.path=$dir/tokens.jsonl" --set metrics.address= \
    $(for s in encode temporal depformer decode; do printf -- '--set stages.%s.pack=%s --set stages.%s.execution_provider=%s ' "$s" "$pack" "$s" "$provider"; done) \
    >"$dir/run.txt" 2>"$dir/run.err" || echo "  the pipeline failed: $(grep -v ' INFO ' "$dir/run.err" | tail -n 3)"
  grep -E "completion interval|^(encode|temporal|depformer|decode) " "$dir/run.txt" | sed 's/^/  /'
}

run_checks() {
  local out=$1 mode=$2 duplex provider small tiny ref QPACKS
  mkdir -p "$out"
  if [[ $mode == cpu ]]; then
    duplex=$ROOT/target/release/duplex provider=cpu
    [[ -x $duplex ]] || die "build duplex first (cargo build --release)"
    PACKS=$ROOT/models
    small=$PACKS/tiny-gqa-fp16 # the dry run times the tiny pack: the small one is built by --prepare
    ref=$out/ref && reference_tokens "$ref" "$duplex" cpu || die "the CPU replay failed"
    # (and its quantized copies, which --prepare makes of the small pack)
    for q in int8 int4; do
      "$ROOT/.venv/bin/python" "$ROOT/tools/quantize_pack.py" "$small" "$out/packs/$(basename "$small")-$q" \
        --quantize "$q" -q || die "quantize_pack $q failed"
    done
    QPACKS=$out/packs
  else
    local work=/tmp/duplex-gpu
    [[ -f $work/SHA256SUMS ]] || die "$work/SHA256SUMS missing: carry the parts first (tools/gpu-check.sh --prepare)"
    (cd "$work" && sha256sum -c --quiet SHA256SUMS) || die "a part is missing or damaged in $work"
    rm -rf "$work/bundle" && cat "$work"/part.* | tar -C "$work" -xz || die "cannot unpack the parts"
    duplex=$work/bundle/bin/duplex provider=cuda PACKS=$work/bundle/packs
    small=$PACKS/small-gqa-fp16 ref=$work/bundle/ref QPACKS=$PACKS
    export ORT_DYLIB_PATH
    ORT_DYLIB_PATH=$(ls "$work"/bundle/ort/libonnxruntime.so.* | head -n1)
    # The CUDA 13 / cuDNN libraries PyTorch brought (its nvidia-* wheels), and the system's.
    local libs
    libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
dirs = []
for s in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib")))
    dirs += glob.glob(os.path.join(s, "torch", "lib"))
print(":".join(d for d in dirs if os.path.isdir(d)))
PY
)
    export LD_LIBRARY_PATH=$work/bundle/ort:${libs}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  local report=$out/gpu-check.txt
  {
    echo "# duplex gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC'), mode $mode"
    echo "## machine"
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi") | sed 's/^/  /'
    echo "## duplex doctor"
    timeout 60 "$duplex" doctor 2>&1 | sed 's/^/  /'
    echo "## which provider each graph runs on; temporal step times ($(basename "$small") pack)"
    timeout 240 "$duplex" doctor --pack "$small" --provider "$provider" --time 2>&1 | grep -v ' INFO ' | sed 's/^/  /'
    for q in int8 int4; do
      echo "## the same pack quantized, $q: temporal step times"
      timeout 120 "$duplex" doctor --pack "$QPACKS/$(basename "$small")-$q" --provider "$provider" --time 2>&1 \
        | grep -E "^ok|^error|weights int|context 50|^  resident /|^shared LM engine|^  B=1:|^  1 slot:|^  not measured" | sed 's/^/  /'
    done
    # PersonaPlex's shapes, the weights generated here (the dry run: one layer, no timing).
    local big fill=$ROOT/tools/fill_weights.py py=$ROOT/.venv/bin/python
    if [[ $mode == cpu ]]; then
      big=$out/packs/7b-gqa-fp16-1l
      "$ROOT/.venv/bin/python" "$ROOT/tools/make_pack.py" --size 7b --variant gqa-fp16 --layers 1 \
        --mimi full --shapes-only --out "$big" -q || die "make_pack --size 7b failed"
    else
      big=$PACKS/7b-gqa-fp16 fill=$work/bundle/fill_weights.py py=python3
    fi
    echo "## PersonaPlex 7B shapes ($(basename "$big"), generated weights)"
    if "$py" "$fill" "$big" 2>&1 | sed 's/^/  /'; then
      local timing=()
      [[ $mode == cpu ]] || timing=(--time)
      timeout 300 "$duplex" doctor --pack "$big" --provider "$provider" "${timing[@]}" 2>&1 \
        | grep -E "^ok|^error|^(temporal|depformer|mimi step graphs \(f32\)):|context 50|^  resident /|^depformer frame|^  (plain|graphs|separate|device) |^codec step graphs|^  (encoder|decoder) |^shared LM engine|^  B=1:|^  1 slot:|^  not measured" \
        | sed 's/^/  /'
      # The whole full-duplex loop at these shapes, file to file, as fast as possible: 600
      # frames there, 25 in the dry run.
      local secs=48
      [[ $mode == cpu ]] && secs=2
      echo "## full-duplex pipeline at the 7B's shapes, $((secs * 25 / 2)) frames, file to file"
      whole_loop "$out/pipeline-7b" "$big" "$secs" 240
    fi
    rm -f "$big"/*/model.onnx.data
    echo "## full-duplex pipeline, tiny GQA fp16 pack, file to file"
    whole_loop "$out/pipeline" "$PACKS/tiny-gqa-fp16" 3 120
    echo "## greedy token streams on $provider against the CPU run (60 user frames)"
    local here=$out/tokens
    mkdir -p "$here" && cp "$ref/codes.json" "$here/"
    if reference_tokens "$here" "$duplex" "$provider"; then
      for pack in tiny-gqa tiny-gqa-fp16; do
        python3 - "$ref/$pack.cpu.jsonl" "$here/$pack.$provider.jsonl" "$pack" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
same = sum(1 for x, y in zip(a, b) if x["text"] == y["text"] and x["audio"] == y["audio"])
first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print(f"  {sys.argv[3]}: {same}/{max(len(a), len(b))} frames identical"
      + ("" if first is None else f", first difference at frame {first}"))
PY
      done
    else
      echo "  the replay on $provider failed: $(tail -n 3 "$here/replay.log")"
    fi
  } 2>&1 | tee "$report"
  say "wrote $report"
}

case ${1:-} in
  --prepare) prepare "${2:-gpu-check}" ;;
  "" | -h | --help) sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  *)
    out=$1
    mode=gpu
    [[ ${2:-} == --cpu ]] && mode=cpu
    PACKS=$ROOT/models
    run_checks "$out" "$mode"
    ;;
esac
