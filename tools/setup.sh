#!/usr/bin/env bash
# Installs what a fresh machine lacks to build, run and test duplex. Idempotent: a second run
# checks and does nothing. Called by every Makefile target.
#
#   - Debian packages (installed when running as root, otherwise the exact command is printed)
#   - .venv with onnxruntime (the ONNX Runtime library duplex loads at run time)
set -euo pipefail
cd "$(dirname "$0")/.."

ORT_VERSION=1.31.1
APT_PACKAGES=(pkg-config libasound2-dev python3-venv)
PYTHON=${PYTHON:-python3}

say() { printf 'setup: %s\n' "$*" >&2; }

# --- Debian packages ---------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  # python3-venv is not needed when the interpreter already has a working venv module
  if [[ $p == python3-venv ]] && "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
    continue
  fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing[*]}"
  if [[ $(id -u) -eq 0 ]]; then
    say "installing ${missing[*]}"
    bash -c "$cmd" >/dev/null
  else
    say "missing Debian packages: ${missing[*]}"
    say "run as root: $cmd"
    exit 1
  fi
fi

# --- Rust ----------------------------------------------------------------------------------------
if ! command -v cargo >/dev/null; then
  say "cargo not found: install a Rust toolchain (https://rustup.rs), then run this again"
  exit 1
fi

# --- Python venv with ONNX Runtime ---------------------------------------------------------------
if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv
fi
have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("onnxruntime"))' 2>/dev/null || true)
if [[ $have != "$ORT_VERSION" ]]; then
  say "installing onnxruntime==$ORT_VERSION into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "onnxruntime==$ORT_VERSION"
fi
lib=$(ls .venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so* 2>/dev/null | head -n1 || true)
if [[ -z $lib ]]; then
  say "onnxruntime is installed but libonnxruntime.so was not found in .venv"
  exit 1
fi
