#!/usr/bin/env bash
# The image test (`make test-image`): builds the Containerfile's `host` target (the host's
# target/release/duplex) on a Debian base made here with mmdebstrap (no registry is needed),
# checks the server's settings in it, serves from it with the host's tiny packs mounted, holds a
# conversation with the independent test client (sphn, aiohttp) and a `duplex loadtest` level,
# checks the image's HEALTHCHECK and its drain on SIGTERM, and prints the image's size and the
# times. Needs podman, runc and mmdebstrap (Debian packages) and `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/image
mkdir -p "$out"
say() { printf 'test-image: %s\n' "$*"; }
t_all=$(date +%s)

# podman on these machines: no default ulimits, runc, cgroupfs; builds chroot-isolated with the
# host's network (the build's apt and pip reach the mirrors).
printf '[containers]\ndefault_ulimits = []\n' > "$out/containers.conf"
export CONTAINERS_CONF=$PWD/$out/containers.conf
P=(podman --runtime runc --cgroup-manager cgroupfs)

[[ -x target/release/duplex ]] || cargo build --release
if ! "${P[@]}" image exists localhost/debian:bookworm; then
  t0=$(date +%s)
  [[ -f $out/base.tar ]] || mmdebstrap --quiet --variant=minbase bookworm "$out/base.tar"
  "${P[@]}" import --quiet "$out/base.tar" localhost/debian:bookworm >/dev/null
  say "base image made in $(( $(date +%s) - t0 )) s"
fi

t0=$(date +%s)
# A TLS-intercepting proxy's CA, when the host has one, for the build's pip.
secret=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && secret=(--secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt)
"${P[@]}" build --quiet --isolation chroot --network host --format docker --target host \
  "${secret[@]}" --build-arg BASE=localhost/debian:bookworm -t localhost/duplex:test \
  -f Containerfile . >/dev/null
build_s=$(( $(date +%s) - t0 ))
size=$("${P[@]}" image inspect localhost/duplex:test --format '{{.Size}}')
say "image built in ${build_s} s: $(( size / 1000000 )) MB"

port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'address: "127.0.0.1:%s"\npipeline: /opt/duplex/pipelines/serve.yaml\ndrain_timeout_s: 5\n' "$port" > "$out/serve.yaml"
run=("${P[@]}" run --network host -v "$PWD/models:/opt/duplex/models:ro"
     -v "$PWD/$out/serve.yaml:/etc/duplex/test.yaml:ro")

# 1. The settings and the models check in the image (exit 0, "ok: …").
"${run[@]}" --rm localhost/duplex:test serve --check --config /etc/duplex/test.yaml 2>/dev/null | grep -q '^ok: '
say "serve --check passed in the image"

# 2. Serving: a conversation with the independent client, a load-test level.
"${P[@]}" rm -f duplex-image-test >/dev/null 2>&1 || true
# (podman's healthcheck timers need systemd, which is not here: `healthcheck run` below runs it.)
"${run[@]}" -d --name duplex-image-test -e DUPLEX_HEALTH_PORT="$port" localhost/duplex:test \
  serve --config /etc/duplex/test.yaml >/dev/null 2>&1
cleanup() { "${P[@]}" rm -f duplex-image-test >/dev/null 2>&1 || true; }
trap cleanup EXIT
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.5
done
curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null
"${P[@]}" healthcheck run duplex-image-test
say "the server answers /healthz, and the image's HEALTHCHECK passes"
.venv/bin/python - "$out/in.wav" <<'PY'
import math, struct, sys, wave
with wave.open(sys.argv[1], "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(24000)
    w.writeframes(b"".join(struct.pack("<h", int(9000 * (0.5 + 0.5 * math.sin(2 * math.pi * 3 * i / 24000))
                                               * math.sin(2 * math.pi * 180 * i / 24000))) for i in range(24000 * 4)))
PY
r=$(.venv/bin/python tests/clients/moshi_client.py --url "ws://127.0.0.1:$port/api/chat" --mode kyutai --wav "$out/in.wav")
.venv/bin/python - "$r" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
seconds = r["samples"] / 24000
assert not r["errors"] and r["handshake_s"] is not None, r
assert seconds >= 3.0, r
print("test-image: a conversation: %.1f s of agent audio back" % seconds)
PY
# Both sessions admitted and served; whether they kept up is the machine's to decide (the test
# runs beside others), printed, not judged (exit 1 says they did not).
target/release/duplex loadtest "http://127.0.0.1:$port" --sessions 2 --seconds 3 --json > "$out/loadtest.json" || true
.venv/bin/python - "$out/loadtest.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
level = r["levels"][0]
# Served: the agent's frames came back (a latency was measured). Frames still missing when the
# clients stopped are the machine's load, as whether they kept up is (2026-12-06: two of about
# 75 missing beside the real-time suites failed a run that asserted none).
assert level["admitted"] == 2 and level["latency_ms"]["max"] > 0, r
print("test-image: duplex loadtest: 2 sessions admitted and served, kept up with %d (%d frames "
      "missing at the end)" % (r["keeps_up_with"], level["missing"]))
PY

# 3. SIGTERM drains and exits 0.
"${P[@]}" stop --time 20 duplex-image-test >/dev/null
code=$("${P[@]}" inspect duplex-image-test --format '{{.State.ExitCode}}')
[[ $code == 0 ]] || { "${P[@]}" logs duplex-image-test | tail -20; say "exit code $code after SIGTERM"; exit 1; }
say "stopped by SIGTERM: exit 0"
say "passed in $(( $(date +%s) - t_all )) s (image $(( size / 1000000 )) MB, built in ${build_s} s)"
