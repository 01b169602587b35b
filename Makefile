# The two commands of the README, and a few more. Every target runs the (idempotent) set-up first.
SHELL := /bin/bash
CARGO ?= cargo
DUPLEX := target/release/duplex

.PHONY: setup demo test bench lint build clean

setup:
	@tools/setup.sh

build: setup
	$(CARGO) build --release

# The main job: a real pipeline on headless audio (no sound card needed).
demo: build
	$(DUPLEX) run pipelines/make-tone.yaml
	$(DUPLEX) run pipelines/resample-roundtrip.yaml
	@echo "demo: wrote out/roundtrip-48k.wav"

# Lints, then every test (unit, integration, doc).
test: setup lint
	$(CARGO) test --release

lint: setup
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --release -- -D warnings

bench: setup
	$(CARGO) bench --bench runtime

clean:
	$(CARGO) clean
	rm -rf out
