#!/usr/bin/env bash
# The exports the one-layer 7B test checks (tests/it/compute/export.rs,
# `the_7b_at_one_layer_…`), made into DIR: PersonaPlex-7B's checkpoint at one layer and its real
# widths, the 7B's graphs with their weights declared only (the inputs every export must have),
# and the checkpoint exported for a GPU, then quantized with every quantization option (int4 LM
# and depformer, int8 codec) and with int8, each step with its log. Minutes of Python and no
# duplex binary: `tools/test.sh` runs it at the lowest priority beside the real-time suites
# (whose tests wait on the clock more than they compute), in memory (/dev/shm) so that its
# gigabytes are not written to the disk they share, and the test runs it itself when it is not
# given a DIR made before (DUPLEX_TEST_7B).
#
#   tools/prepare-7b-test.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: tools/prepare-7b-test.sh DIR}
py=.venv/bin/python
rm -rf "$dir"
mkdir -p "$dir"
step() {
  local log=$1
  shift
  if ! "$@" >"$dir/$log.log" 2>&1; then
    echo "prepare-7b-test: $* failed:" >&2
    tail -n 20 "$dir/$log.log" >&2
    exit 1
  fi
}
step checkpoint "$py" tools/make_checkpoint.py "$dir/checkpoint" \
  --tokenizer models/tokenizer-tiny.model --size 7b --layers 1
step 7b-shapes "$py" tools/make_pack.py --size 7b --variant gqa-fp16 --mimi full \
  --shapes-only --out "$dir/7b-shapes" -q
# Exported once (fp16, for a GPU), then quantized as `export_pack --quantize…` quantizes
# (tools/quantize_pack.py, the same code): with every option, and with int8.
step export "$py" tools/export_pack.py "$dir/checkpoint" --out "$dir/fp16" --provider cuda --no-check
rm -rf "$dir/checkpoint"
step int4 "$py" tools/quantize_pack.py "$dir/fp16" "$dir/int4" \
  --quantize int4 --quantize-depformer int4 --quantize-codec int8
step int8 "$py" tools/quantize_pack.py "$dir/fp16" "$dir/int8" --quantize int8
rm -rf "$dir/fp16"
touch "$dir/done"
