# smp-partition — set-up, build, test, demo. Non-interactive and idempotent: each target
# installs only what is missing (apt packages, the project .venv), then runs.
#
#   make demo     system packages + build, then graph, plan and inspect of models/gpt2.onnx
#   make test     system packages + .venv + ONNX conformance cases, then cargo test and the
#                 Python package's pytest (python/, installed into .venv)
#   make venv     .venv brought to exactly requirements.lock (uv pip sync)
#   make lock     re-resolve requirements.in into requirements.lock (then make venv)
#   make engines-venv  .venv-engines brought to exactly requirements-engines.lock: Megatron-Core,
#                 torchtitan, DeepSpeed, whose own code checks what `emit` writes (part of test)
#   make engines-lock  re-resolve requirements-engines.in into requirements-engines.lock
#   make models   regenerate models/ (not part of test)
#   make keras-models  regenerate models/keras/ with TensorFlow + tf2onnx in .venv-keras (not part of test)
#   make check-cuda  build smp-runner with NCCL (feature cuda) against the NVIDIA wheels' headers
#   make wheel    dist/smp_partition-<version>-<platform>.whl: the package and both release binaries
#                 (not part of test; scripts/wheel-check.sh installs it into a fresh venv and runs a job)
#   make fuzz     the fuzzing harness over every input format, FUZZ_SECONDS in all (docs/fuzzing.md)
#   make fuzz-ci  the brief run CI does: every target 20 s on its corpus

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

# apt packages the build needs (HiGHS via cmake + bindgen/libclang; Gloo headers for c10d).
APT_PACKAGES := cmake libclang-dev libgloo-dev
# Python packages (tests, fixtures, libtorch for the runner): requirements.in names the direct
# ones, requirements.lock pins every package with hashes.
# Cargo features for build and test: the libtorch runner is on by default (`make test FEATURES=` skips it).
FEATURES ?= runner

VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo
ONNX_CASES := tests/data/onnx-cases

# torch-sys finds libtorch through the venv's torch (python on PATH).
export LIBTORCH_USE_PYTORCH := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: deps venv lock engines-venv engines-lock onnx-cases build test demo models keras-models help check-cuda wheel fuzz fuzz-ci

help:
	@sed -n '1,15p' Makefile

## System packages: only those missing are installed (apt-get update first).
deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s "$$p" >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v c++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v python3 >/dev/null 2>&1 || missing="$$missing python3"; \
	python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  echo "deps: installing$$missing"; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi; \
	command -v $(CARGO) >/dev/null 2>&1 || { echo "deps: cargo not found; install Rust >= 1.95 (https://rustup.rs)" >&2; exit 1; }

## Project .venv holding exactly requirements.lock: created when missing, synced when it differs.
venv: | deps
	@scripts/venv.sh

## Re-resolve requirements.in into requirements.lock (exact versions and hashes), then sync .venv.
lock: | deps
	@scripts/venv.sh --lock

## The engines' own venv (their pins conflict with .venv's): exactly requirements-engines.lock.
ENGINES_VENV := .venv-engines
engines-venv: venv
	@scripts/venv-engines.sh

engines-lock: venv
	@scripts/venv-engines.sh --lock

## ONNX operator conformance cases from the installed onnx wheel (stamped, gitignored).
onnx-cases: venv
	@"$(PY)" scripts/gen_onnx_cases.py --out $(ONNX_CASES)

build: deps venv
	$(CARGO) build --release --all-targets --features "$(FEATURES)"

test: deps venv engines-venv onnx-cases
	$(CARGO) test --no-fail-fast --features "$(FEATURES)"
	@# the Python package (python/) into .venv, then its pytest against the binaries just built
	"$(VENV)/bin/uv" pip install --python "$(PY)" --quiet --no-deps --no-build-isolation -e python
	SMP_BIN_DIR=$(CURDIR)/target/debug "$(PY)" -m pytest python/tests -q -p no:cacheprovider
	@# emitted engine configurations through the engines' own parsers and validators
	SMP_BIN_DIR=$(CURDIR)/target/debug "$(ENGINES_VENV)/bin/python" -m pytest tests/engines -q -p no:cacheprovider

demo: deps
	$(CARGO) build --bin smp-partition
	./target/debug/smp-partition graph models/gpt2.onnx --seq-len 128
	./target/debug/smp-partition models/gpt2.onnx --cluster cpu:4 --seq-len 128 --global-batch 16 -o target/gpt2-cpu4.plan.json
	./target/debug/smp-partition inspect target/gpt2-cpu4.plan.json

models: venv
	"$(PY)" scripts/export_models.py
	"$(PY)" scripts/make_graph_only.py --check

## Keras models converted by tf2onnx, with Keras' own outputs as references. TensorFlow pins a
## protobuf the onnx stack rejects, so it lives in its own venv, exactly scripts/keras-requirements.lock.
KERAS_VENV := .venv-keras
keras-models: venv
	@[ -x $(KERAS_VENV)/bin/python ] || python3 -m venv $(KERAS_VENV)
	$(VENV)/bin/uv pip sync --python $(KERAS_VENV)/bin/python --require-hashes scripts/keras-requirements.lock
	$(KERAS_VENV)/bin/python scripts/keras_models.py --out models/keras

## Builds smp-runner with ProcessGroupNCCL compiled in (running it needs a GPU machine).
check-cuda: venv
	$(CARGO) build --features cuda --bin smp-runner

## The wheel: release binaries in their own target dir, linked with an rpath relative to the
## installed torch wheel (site-packages/smp_partition/bin → site-packages/torch/lib), no debug info.
WHEEL_TARGET := target/wheel
wheel: deps venv
	SMP_TORCH_RPATH='$$ORIGIN/../../torch/lib' CARGO_PROFILE_RELEASE_DEBUG=0 \
	  $(CARGO) build --release --features runner --bins --target-dir $(WHEEL_TARGET)
	"$(PY)" scripts/build_wheel.py --bin-dir $(WHEEL_TARGET)/release --out dist

## Fuzzing (docs/fuzzing.md): seeds from the tools just built, then every target for
## FUZZ_SECONDS in all (FUZZ_JOBS at once); prints inputs per target, exits 1 on a crash
## (saved under target/fuzz/crashes/).
FUZZ_SECONDS ?= 600
FUZZ_JOBS ?= 1
fuzz: deps venv onnx-cases
	$(CARGO) build --features runner --bins --example fuzz
	fuzz/make-seeds.sh target/debug
	target/debug/examples/fuzz --seconds $(FUZZ_SECONDS) --jobs $(FUZZ_JOBS)

fuzz-ci:
	$(MAKE) fuzz FUZZ_SECONDS=140
