#!/usr/bin/env bash
# Installs what a fresh machine lacks to build, run and test duplex. Idempotent: a second run
# checks and does nothing. Called by every Makefile target.
#
#   tools/setup.sh          what the main job needs (`make demo`): the Rust build's Debian
#                           packages, ONNX Runtime, the exporter, the tiny packs
#   tools/setup.sh --test   that, and everything the tests need besides (`make test`, CI)
#   tools/setup.sh --debian the main job's Debian packages alone (what the Rust build needs)
#
# Always (the main job):
#   - Debian packages (installed when running as root, otherwise the exact command is printed)
#   - .venv with onnxruntime (the ONNX Runtime library duplex loads at run time)
#   - models/vad/silero_vad.onnx: the voice-activity detector of `/v1/realtime` (Silero VAD)
#   - cmake and g++ (libopus and aws-lc are built from source by their crates)
#   - the model-pack exporter in .venv (mobius-onnx and its pinned graph-building dependencies)
#     and the tiny test packs it builds: models/tiny, models/tiny-gqa, models/tiny-gqa-fp16,
#     models/tiny-gqa-mimi-full; safetensors, with which tools/export_pack.py reads real
#     checkpoints; the small SentencePiece model the server's template names
# With --test, besides:
#   - PulseAudio and the ALSA pulse plugin: the tests start a private server with a null sink, a
#     real, paced sound device without a sound card; espeak-ng speaks into the echo tests' room
#   - Prometheus and promtool: the tests scrape a running pipeline and check deploy/
#   - sphn, opuslib and aiohttp in .venv: independent clients of `duplex serve` in the tests, and
#     Chromium (headless) for the browser client's tests; the official openai SDK for the
#     realtime endpoint's tests
#   - podman, runc and mmdebstrap: the image test builds the Containerfile on a Debian base it
#     makes (no registry needed) and serves from it
#   - iproute2 and nftables: a lossy network namespace for WebRTC's loss test
#   - haproxy: replicas behind a real load balancer (deploy/haproxy/haproxy.cfg)
#   - baresip and sip-tester (sipp): real SIP user agents calling the server's SIP ingress
set -euo pipefail
cd "$(dirname "$0")/.."

FOR_TESTS=0
DEBIAN_ONLY=0
case "${1:-}" in
  "") ;;
  --test) FOR_TESTS=1 ;;
  --debian) DEBIAN_ONLY=1 ;;
  *) printf 'setup: unknown argument %s (expected nothing, --test or --debian)\n' "$1" >&2; exit 2 ;;
esac

ORT_VERSION=1.31.1
# What building duplex and running the main job need.
APT_PACKAGES=(pkg-config libasound2-dev python3-venv cmake g++)
# What the tests need besides: the private sound server and its voices, Prometheus, systemd's
# unit checker, the independent clients' libopus, Chromium, the image tools, network namespaces,
# a load balancer, SIP user agents.
TEST_APT_PACKAGES=(pulseaudio pulseaudio-utils libasound2-plugins prometheus systemd libopus0
  chromium espeak-ng podman runc mmdebstrap catatonit fuse-overlayfs uidmap slirp4netns curl
  iproute2 nftables haproxy baresip sip-tester)
((FOR_TESTS)) && APT_PACKAGES+=("${TEST_APT_PACKAGES[@]}")
PYTHON=${PYTHON:-python3}

say() { printf 'setup: %s\n' "$*" >&2; }

# Prints the NAME==VERSION pins that .venv does not have.
missing_pins() {
  .venv/bin/python - "$@" <<'PY'
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    name = name.split("[")[0]
    try:
        ok = m.version(name) == version
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(pin)
PY
}

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
  cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
  if [[ $(id -u) -eq 0 ]]; then
    say "installing ${missing[*]}"
    bash -c "$cmd" >/dev/null
  else
    say "missing Debian packages: ${missing[*]}"
    say "run as root: $cmd"
    exit 1
  fi
fi

# --debian: the Debian packages alone (what the Rust build needs), for `make demo`, which builds
# while the rest installs.
((DEBIAN_ONLY)) && exit 0

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

# --- The voice-activity detector of `/v1/realtime` ------------------------------------------------
# Silero VAD's ONNX model (MIT), from its PyPI wheel (whose Python side needs torch: only the
# file is taken), checked against its digest.
VAD_VERSION=6.2.3
VAD_SHA256=1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3
vad=models/vad/silero_vad.onnx
if [[ ! -f $vad ]] || ! echo "$VAD_SHA256  $vad" | sha256sum --check --status; then
  say "fetching Silero VAD's model (silero-vad==$VAD_VERSION) into $vad"
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
    "silero-vad==$VAD_VERSION" -d "$tmp"
  mkdir -p "$(dirname "$vad")"
  .venv/bin/python - "$tmp"/silero_vad-*.whl "$vad.part" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("silero_vad/data/silero_vad.onnx"))
PY
  rm -rf "$tmp"
  if ! echo "$VAD_SHA256  $vad.part" | sha256sum --check --status; then
    say "silero-vad==$VAD_VERSION's model does not have the digest this script expects"
    rm -f "$vad.part"
    exit 1
  fi
  mv "$vad.part" "$vad"
fi

# --- Model-pack exporter and the tiny test packs -------------------------------------------------
# tools/make_pack.py builds packs with the real exporter (mobius-onnx) and random weights. The
# exporter is installed without its dependencies (it would pull in torch, which it only needs to
# read real checkpoints); what it needs to build graphs is pinned here, so a rebuild is
# byte-identical.
EXPORTER_PACKAGES=(
  mobius-onnx==0.1.0
  numpy==2.4.6
  ml_dtypes==0.6.0
  protobuf==7.36.2
  onnx==1.23.2
  onnx-ir==1.1.0
  onnxscript==0.7.2
  onnx-shape-inference==0.4.0
  sympy==1.14.0
  sentencepiece==0.2.1
  mpmath==1.3.0
  packaging==26.4
  typing_extensions==4.16.0
)
TINY_PACKS=(tiny tiny-gqa tiny-gqa-fp16)

wrong=$(missing_pins "${EXPORTER_PACKAGES[@]}")
if [[ -n $wrong ]]; then
  say "installing into .venv: $(echo $wrong)"
  deps=()
  for p in "${EXPORTER_PACKAGES[@]}"; do [[ $p == mobius-onnx==* ]] || deps+=("$p"); done
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "${deps[@]}"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "${EXPORTER_PACKAGES[0]}"
fi

# tools/export_pack.py reads Kyutai-format checkpoints with safetensors' numpy API (no torch).
CHECKPOINT_PACKAGES=(safetensors==0.8.0)
wrong=$(missing_pins "${CHECKPOINT_PACKAGES[@]}")
if [[ -n $wrong ]]; then
  say "installing into .venv: $(echo $wrong)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "${CHECKPOINT_PACKAGES[@]}"
fi

# --- Independent implementations for the protocol tests (--test) --------------------------------
# The server's tests talk to it with clients of other parts: Kyutai's sphn (Ogg/Opus), opuslib (the
# system's libopus, for the web client's 20 ms frames), aiohttp (WebSocket) and the official openai
# SDK's realtime client (with its websockets), aiortc (a WebRTC peer: ICE, DTLS-SRTP, Opus), never
# only duplex on both ends; kubernetes-validate checks deploy/kubernetes.
TEST_PACKAGES=(sphn==0.2.1 aiohttp==3.14.3 opuslib==3.0.1 kubernetes-validate==1.37.0
  "openai[realtime]==3.57.0" websockets==15.0.1 aiortc==1.16.0)
wrong=$( ((FOR_TESTS)) && missing_pins "${TEST_PACKAGES[@]}" || true)
if [[ -n $wrong ]]; then
  say "installing into .venv: $(echo $wrong)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "${TEST_PACKAGES[@]}"
fi

# Agent frameworks, as their users install them, in a venv of their own (their pins of openai,
# websockets and onnxruntime are theirs, not the tests'): Pipecat's OpenAI realtime service and
# LiveKit Agents' OpenAI realtime plugin (the two share one venv: their requirements agree).
AGENT_PACKAGES=("pipecat-ai[openai]==1.14.0" livekit-agents==1.8.9 livekit-plugins-openai==1.8.9)
if ((FOR_TESTS)); then
  [[ -x .venv-agents/bin/python ]] || "$PYTHON" -m venv .venv-agents
  wrong=$(.venv-agents/bin/python - "${AGENT_PACKAGES[@]}" <<'PY'
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        ok = m.version(name.split("[")[0]) == version
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(pin)
PY
)
  if [[ -n $wrong ]]; then
    say "installing into .venv-agents: $(echo $wrong)"
    .venv-agents/bin/python -m pip install --quiet --disable-pip-version-check "${AGENT_PACKAGES[@]}"
  fi
fi

# The stamp records what built the packs: a changed script or pin rebuilds them.
stamp=models/.tiny-packs.stamp
want="make_pack.py $(sha256sum tools/make_pack.py | cut -d' ' -f1) make_mimi_step.py $(sha256sum tools/make_mimi_step.py | cut -d' ' -f1) ${EXPORTER_PACKAGES[*]}"
built=1
for p in "${TINY_PACKS[@]}" tiny-gqa-mimi-full; do
  for f in pack.yaml {mimi_encoder,mimi_decoder,temporal,depformer}/model.onnx{,.data} \
    mimi_{encoder,decoder}_step{,_f16}/{model.onnx,model.onnx.data,state.json}; do
    [[ -f models/$p/$f ]] || built=0
  done
done
if [[ $built == 0 || ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  say "building tiny model packs into models/ (${TINY_PACKS[*]} tiny-gqa-mimi-full)"
  rm -f "$stamp"
  .venv/bin/python tools/make_pack.py --all-tiny --out models --quiet
  # The tiny LM with the full-size Mimi: the step graphs' tests at the real codec's shapes.
  .venv/bin/python tools/make_pack.py --size tiny --variant gqa --mimi full \
    --out models/tiny-gqa-mimi-full --quiet
  printf '%s\n' "$want" >"$stamp"
fi

# A small SentencePiece model for persona text and transcripts in tests (a stand-in for the
# PersonaPlex tokenizer, which cannot be downloaded here).
if [[ ! -f models/tokenizer-tiny.model ]]; then
  say "training models/tokenizer-tiny.model"
  .venv/bin/python tools/make_tokenizer.py models/tokenizer-tiny.model
fi
