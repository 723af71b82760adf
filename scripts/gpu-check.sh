#!/usr/bin/env bash
# The runner on a lent single-GPU machine (docs/gpu.md, "gpu-check.sh"). That machine has its
# own torch (2.11.0+cu130, Python 3.12), no Rust and no network; so everything is built here and
# travels in target/gpu-check/bundle (the device run's `carry`), and the checks run there in
# one call.
#
#   scripts/gpu-check.sh --dry-run    here: torch 2.11.0's libtorch (pip download, headers and
#                                     libraries only), a stripped smp-runner built against it in
#                                     its own tree (scripts/gpu-check/: own manifest and lock,
#                                     tch 0.24), the block-stack model, the plans; then lists what
#                                     would travel and checks it fits (64 MiB). Exit 0 when ready.
#   scripts/gpu-check.sh --remote     there (the device run's command, from the repository root,
#                                     carrying target/gpu-check/bundle): every check, the report
#                                     as Markdown in $OUT/gpu-check.md (with gpu-check.json, logs.txt)
#   scripts/gpu-check.sh --rehearse   here: the same build with a small block stack, then the
#                                     remote part on the CPU with the very binary that travels
#                                     (libtorch 2.11 from the download, its CUDA runtime from
#                                     .venv's NVIDIA wheels), to try everything but the GPU
#
# Environment: SMP_GPU_TORCH=DIR uses an unpacked torch 2.11.0 (DIR/include, DIR/lib) instead of
# downloading one; CARGO as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GC=target/gpu-check
BUNDLE=$GC/bundle
[[ ${1:-} == --rehearse ]] && export SMP_GPU_CHECK_SMALL=1 && BUNDLE=$GC/bundle-small
TORCH_VERSION=2.11.0
CARGO=${CARGO:-cargo}

die() { echo "gpu-check: $*" >&2; exit 1; }

# torch 2.11.0's include/ and lib/ (the wheel of PyPI's default CUDA build, as the GPU machine's)
torch_dir() {
  if [[ -n "${SMP_GPU_TORCH:-}" ]]; then
    [[ -f "$SMP_GPU_TORCH/lib/libtorch_cpu.so" ]] || die "SMP_GPU_TORCH=$SMP_GPU_TORCH holds no lib/libtorch_cpu.so; point it at an unpacked torch $TORCH_VERSION (the wheel's torch/ folder)"
    echo "$SMP_GPU_TORCH"
    return
  fi
  local dir=$ROOT/$GC/torch-$TORCH_VERSION
  if [[ ! -f $dir/torch/lib/libtorch_cpu.so ]]; then
    echo "gpu-check: downloading torch==$TORCH_VERSION (the wheel alone, about 530 MB; no CUDA packages)" >&2
    mkdir -p "$GC/wheel"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 "torch==$TORCH_VERSION" -d "$GC/wheel" >&2
    local whl
    whl=$(ls "$GC"/wheel/torch-"$TORCH_VERSION"-*.whl | head -1)
    # headers and libraries only (about 1 GB unpacked)
    python3 - "$whl" "$dir" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [m for m in z.namelist() if m.startswith(("torch/include/", "torch/lib/")) or m == "torch/version.py"])
PY
    rm -f "$whl"
  fi
  echo "$dir/torch"
}

build_bundle() {
  local torch
  torch=$(torch_dir)
  if [[ -f $torch/version.py ]]; then
    grep -q "__version__ = '$TORCH_VERSION" "$torch/version.py" || die "$torch is not torch $TORCH_VERSION: $(grep __version__ "$torch/version.py")"
  fi
  python3 scripts/gpu_check.py manifest
  echo "gpu-check: building smp-runner against torch $TORCH_VERSION ($torch) in scripts/gpu-check/" >&2
  # LIBTORCH, not the venv's torch; an rpath of $ORIGIN only (the GPU machine's torch is found
  # through LD_LIBRARY_PATH, set by --remote); libtorch's own CUDA dependencies are not here
  # to link against, so undefined symbols inside libtorch's libraries are allowed
  (cd scripts/gpu-check && env -u LIBTORCH_USE_PYTORCH LIBTORCH="$torch" LIBTORCH_CXX11_ABI=1 \
    SMP_TORCH_RPATH='$ORIGIN' RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined" \
    "$CARGO" build --release --locked --bin smp-runner --target-dir "$ROOT/$GC/cargo")
  mkdir -p "$BUNDLE"
  cp "$GC/cargo/release/smp-runner" "$BUNDLE/smp-runner"
  # the compiler, for the plans (this checkout's lock, no libtorch)
  "$CARGO" build --locked --bin smp-partition
  local py=.venv/bin/python
  [[ -x $py ]] || die "no .venv (make venv): the block stack is exported with this checkout's torch"
  "$py" scripts/gpu_check.py prepare --partition target/debug/smp-partition
}

case "${1:-}" in
  --dry-run)
    build_bundle
    python3 scripts/gpu_check.py travel
    echo
    echo "gpu-check: ready. On a session lent the GPU machine, run (one call, about 5 minutes):"
    echo "  run(command=\"bash scripts/gpu-check.sh --remote\", carry=[\"$BUNDLE\"], timeout_s=540)"
    echo "then copy \$OUT/gpu-check.md (files_at) into BENCHMARKS.md."
    ;;
  --remote)
    py=python3
    "$py" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('$TORCH_VERSION') else f'gpu-check: this machine has torch {v}; the bundle is built for $TORCH_VERSION (rebuild it with SMP_GPU_TORCH)')"
    torch_lib=$("$py" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    # libtorch's CUDA libraries come from the NVIDIA wheels beside torch (also in their rpath)
    nvidia=$("$py" -c 'import torch, os, glob; b = os.path.dirname(os.path.dirname(torch.__file__)); print(":".join(sorted(glob.glob(os.path.join(b, "nvidia", "*", "lib")))))')
    export LD_LIBRARY_PATH="$torch_lib${nvidia:+:$nvidia}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    bin=$BUNDLE/smp-runner
    [[ -x $bin ]] || die "$bin is missing: carry $BUNDLE (scripts/gpu-check.sh --dry-run builds it)"
    out=${OUT:-$GC/out}
    mkdir -p "$out"
    { nvidia-smi -L || true; "$bin" --version; ldd "$bin" | grep -E "torch|c10|not found" || true; } 2>&1 | tee "$out/machine.txt"
    PYTHONUNBUFFERED=1 "$py" scripts/gpu_check.py remote --runner "$bin" --out "$out"
    ;;
  --rehearse)
    build_bundle
    torch=$(torch_dir)
    nvidia=$(ls -d "$ROOT"/.venv/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null | paste -sd: -)
    LD_LIBRARY_PATH="$torch/lib${nvidia:+:$nvidia}" PYTHONUNBUFFERED=1 \
      .venv/bin/python scripts/gpu_check.py remote --runner "$BUNDLE/smp-runner" --out "$GC/rehearsal" --device cpu
    ;;
  *)
    sed -n '2,/^set -e/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
