#!/usr/bin/env bash
# Installs the GPU build of ONNX Runtime and the CUDA 13 / cuDNN user-space libraries it needs,
# all from PyPI, into .venv-gpu (about 2 GB; `make setup` never does this). Then writes
# .venv-gpu/duplex.env, which points duplex at that library:
#
#   make setup-gpu && source .venv-gpu/duplex.env && target/release/duplex doctor
#
# The NVIDIA driver itself comes from the system (`nvidia-smi` must work); nothing else is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

ORT_VERSION=1.31.1
PYTHON=${PYTHON:-python3}
say() { printf 'setup-gpu: %s\n' "$*" >&2; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  say "warning: nvidia-smi finds no GPU here; installing anyway (duplex doctor will say what is missing)"
fi
if [[ ! -x .venv-gpu/bin/python ]]; then
  say "creating .venv-gpu"
  "$PYTHON" -m venv .venv-gpu
fi
have=$(.venv-gpu/bin/python -c 'import importlib.metadata as m; print(m.version("onnxruntime-gpu"))' 2>/dev/null || true)
if [[ $have != "$ORT_VERSION" ]]; then
  say "installing onnxruntime-gpu[cuda,cudnn]==$ORT_VERSION into .venv-gpu"
  .venv-gpu/bin/python -m pip install --quiet --disable-pip-version-check "onnxruntime-gpu[cuda,cudnn]==$ORT_VERSION"
fi
site=$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lib=$(ls "$site"/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n1 || true)
if [[ -z $lib || ! -f $site/onnxruntime/capi/libonnxruntime_providers_cuda.so ]]; then
  say "onnxruntime-gpu is installed but its CUDA provider library is missing under $site/onnxruntime/capi"
  exit 1
fi
# The CUDA and cuDNN libraries the nvidia-* wheels put under site-packages/nvidia/*/lib.
libdirs=$(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | sort | paste -sd: -)
cat >.venv-gpu/duplex.env <<ENV
# source this file: duplex then loads the GPU build of ONNX Runtime and its CUDA libraries
export ORT_DYLIB_PATH=$lib
export LD_LIBRARY_PATH=$libdirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
ENV
say "wrote .venv-gpu/duplex.env; next: source .venv-gpu/duplex.env && target/release/duplex doctor"
