# smp-partition — set-up, build, test, demo. Non-interactive and idempotent: each target
# installs only what is missing (apt packages, the project .venv), then runs.
#
#   make demo     system packages + build, then graph, plan and inspect of models/gpt2.onnx
#   make test     system packages + .venv + ONNX conformance cases, then cargo test
#   make models   regenerate models/ (not part of test)
#   make check-cuda  build smp-runner with NCCL (feature cuda) against the NVIDIA wheels' headers

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

# apt packages the build needs (HiGHS via cmake + bindgen/libclang; Gloo headers for c10d).
APT_PACKAGES := cmake libclang-dev libgloo-dev
# Python packages (tests, fixtures, libtorch for the runner), pinned.
PYTHON_PINS := torch==2.13.0 onnx==1.23.2 onnxruntime==1.32.0 onnxscript==0.7.2 transformers==5.24.0
# Cargo features for build and test: the libtorch runner is on by default (`make test FEATURES=` skips it).
FEATURES ?= runner

VENV := .venv
PY := $(VENV)/bin/python
CACHE := .cache
CARGO ?= cargo
ONNX_CASES := tests/data/onnx-cases

# torch-sys finds libtorch through the venv's torch (python on PATH).
export LIBTORCH_USE_PYTORCH := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: deps venv onnx-cases build test demo models help cuda-headers check-cuda

help:
	@sed -n '1,8p' Makefile

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

## Project .venv with the pinned packages: created when missing, re-pinned when the pins change.
venv: | deps
	@if [ ! -x "$(PY)" ]; then echo "venv: creating $(VENV)"; python3 -m venv "$(VENV)"; fi; \
	if ! "$(PY)" scripts/check_pins.py $(PYTHON_PINS); then \
	  echo "venv: installing $(PYTHON_PINS)"; \
	  "$(PY)" -m pip install -q --disable-pip-version-check $(PYTHON_PINS); \
	  "$(PY)" scripts/check_pins.py $(PYTHON_PINS); \
	fi; \
	mkdir -p $(CACHE); echo "$(PYTHON_PINS)" > $(CACHE)/venv.pins

## ONNX operator conformance cases from the installed onnx wheel (stamped, gitignored).
onnx-cases: venv
	@"$(PY)" scripts/gen_onnx_cases.py --out $(ONNX_CASES)

build: deps venv
	$(CARGO) build --release --all-targets --features "$(FEATURES)"

test: deps venv onnx-cases
	$(CARGO) test --features "$(FEATURES)"

demo: deps venv
	$(CARGO) build --bin smp-partition
	./target/debug/smp-partition graph models/gpt2.onnx --seq-len 128
	./target/debug/smp-partition models/gpt2.onnx --cluster cpu:4 --seq-len 128 --global-batch 16 -o target/gpt2-cpu4.plan.json
	./target/debug/smp-partition inspect target/gpt2-cpu4.plan.json

models: venv
	"$(PY)" scripts/export_models.py
	"$(PY)" scripts/make_graph_only.py --check

## CUDA/NCCL headers for feature `cuda`: torch's wheel brings the CUDA runtime and NCCL headers;
## the compiler's crt and CCCL headers come from the NVIDIA wheels of the same CUDA version.
cuda-headers: venv
	@ver=$$("$(PY)" -c 'import importlib.metadata as m; v=m.version("nvidia-cuda-runtime").split("."); print(v[0]+"."+v[1])'); \
	"$(PY)" -c 'import importlib.metadata as m; m.version("nvidia-cuda-crt"); m.version("nvidia-cuda-cccl")' 2>/dev/null || \
	  "$(PY)" -m pip install -q --disable-pip-version-check "nvidia-cuda-crt==$$ver.*" "nvidia-cuda-cccl==$$ver.*"

## Builds smp-runner with ProcessGroupNCCL compiled in (running it needs a GPU machine).
check-cuda: cuda-headers
	$(CARGO) build --features cuda --bin smp-runner
