# The two commands of the README, and a few more. Every target runs the (idempotent) set-up first.
SHELL := /bin/bash
CARGO ?= cargo
DUPLEX := target/release/duplex

.PHONY: setup demo test test-fast test-image bench lint build clean fuzz export-deps setup-gpu

setup:
	@tools/setup.sh

build: setup
	$(CARGO) build --release

# The main job: the full duplex pipeline on the tiny pack, on headless audio (no sound card).
demo: build
	$(DUPLEX) run pipelines/make-tone.yaml
	$(DUPLEX) run pipelines/duplex-file.yaml
	@echo "demo: wrote out/agent-48k.wav and out/agent-tokens.jsonl"

# Lints, then every test (unit, integration, doc), then the server's image built and served from.
test: setup lint
	$(CARGO) test --release
	tools/test-image.sh

# For iterating: the unit and doc tests and the suites that wait on no real-time audio, sound
# server, browser or served conversation (78 s here after a build). `make test`
# still runs everything, and is what CI runs.
FAST_SUITES := audio_no_alloc cli_doctor config_validation docs engine error_kinds export \
  fuzz_inputs gpu_check metrics_recorded mimi_step model_conformance model_contract \
  model_pipeline model_placement model_temporal model_tokenizer quantize runtime_edges \
  runtime_shutdown
test-fast: setup
	$(CARGO) test --release --lib --bins $(addprefix --test ,$(FAST_SUITES))
	$(CARGO) test --release --doc

lint: setup
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --release -- -D warnings
	# The CUDA path must compile (it runs only where a GPU build of ONNX Runtime is loaded).
	$(CARGO) check --release --features cuda

# The server image alone (the last step of `make test`): Containerfile's `host` target built on a
# Debian base made here, served from and talked to. podman, runc and mmdebstrap come with setup.
test-image: build
	tools/test-image.sh

# The bad-input suite with many more generated cases per parser than `make test` runs.
fuzz: setup
	PROPTEST_CASES=30000 $(CARGO) test --release --test fuzz_inputs

bench: setup
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
