# The two commands of the README, and a few more. Every target runs the (idempotent) set-up first.
SHELL := /bin/bash
CARGO ?= cargo
DUPLEX := target/release/duplex

.PHONY: setup setup-test demo test soak test-fast test-image bench lint build clean fuzz export-deps setup-gpu

# What the main job needs (the Rust build's packages, ONNX Runtime, the exporter, the tiny packs).
setup:
	@tools/setup.sh

# That, and everything the tests need besides (sound server, Chromium, Prometheus, image tools).
setup-test:
	@tools/setup.sh --test

build: setup
	$(CARGO) build --release

# The main job: the full duplex pipeline on the tiny pack, on headless audio (no sound card). The
# build needs only the Debian packages: ONNX Runtime, the exporter and the packs install beside it.
demo:
	@tools/setup.sh --debian
	@mkdir -p target; tools/setup.sh > target/setup.log 2>&1 & setup=$$!; \
	  $(CARGO) build --release; built=$$?; \
	  wait $$setup; ok=$$?; cat target/setup.log >&2; \
	  [[ $$built == 0 && $$ok == 0 ]]
	$(DUPLEX) run pipelines/make-tone.yaml
	$(DUPLEX) run pipelines/duplex-file.yaml
	@echo "demo: wrote out/agent-48k.wav and out/agent-tokens.jsonl"

# Lints, then every test (unit, integration, doc), then the server's image built and served from:
# tools/test.sh runs the phases (every one, even after a failure) and prints each one's time; it
# installs what only the tests need (`tools/setup.sh --test`) while the lints and the build run.
test: setup
	tools/test.sh

# The soak-length runs at full length (the WebRTC loss test's 60 s per transport and loss, the
# daemon's two minutes at real time, fifty reloads); `make test` runs each at the shortest length
# that decides its criterion. Results: docs/testing.md.
SOAKS := realtime::webrtc_loss:: realtime::daemon::daemon_runs realtime::daemon_faults::reloads
soak: setup-test
	$(CARGO) test --release --test it --no-run
	DUPLEX_SOAK=1 $(CARGO) test --release --test it -- --test-threads=1 --nocapture $(SOAKS)

# For iterating: the unit and doc tests and the suites that wait on no real-time audio, sound
# server, browser or served conversation. `make test` still runs everything, and is what CI runs.
test-fast: setup-test
	$(CARGO) test --release --lib --bins --test fuzz_inputs
	$(CARGO) test --release --test it -- compute::
	$(CARGO) test --release --doc

lint: setup
	DUPLEX_TEST_PHASES=lint tools/test.sh

# The server image alone (the last step of `make test`): Containerfile's `host` target built on a
# Debian base made here, served from and talked to. podman, runc and mmdebstrap come with setup.
test-image: setup-test build
	tools/test-image.sh

# The bad-input suite with many more generated cases per parser than `make test` runs.
fuzz: setup
	PROPTEST_CASES=30000 $(CARGO) test --release --test fuzz_inputs

bench: setup-test
	$(CARGO) bench --bench runtime
	$(CARGO) bench --bench model
	$(CARGO) bench --bench jitter
	$(CARGO) bench --bench serve
	$(CARGO) bench --bench browser
	$(CARGO) bench --bench aec
	$(CARGO) bench --bench session_start
	$(CARGO) bench --bench priming

# Extras that `make setup` never installs. export-deps: huggingface_hub, for
# `tools/export_pack.py --from-hub` (reading a checkpoint needs nothing more than `make setup`).
export-deps: setup
	.venv/bin/python -m pip install --quiet --disable-pip-version-check huggingface_hub==2.4.0

# The GPU build of ONNX Runtime with CUDA 13 and cuDNN from PyPI, into .venv-gpu (about 2 GB).
setup-gpu:
	@tools/setup-gpu.sh

clean:
	$(CARGO) clean
	rm -rf out
