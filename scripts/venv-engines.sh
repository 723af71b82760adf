#!/usr/bin/env bash
# Brings .venv-engines to exactly requirements-engines.lock: the training engines (Megatron-Core,
# torchtitan, DeepSpeed) whose own code checks what `smp-partition emit` writes. Created when
# missing, synced when it differs, left untouched when it matches; installed by the project
# .venv's locked uv (make venv first). DeepSpeed comes as an sdist: built with DS_BUILD_OPS=0
# (no CUDA ops) against the lock's torch.
#
#   scripts/venv-engines.sh            sync .venv-engines to the lock
#   scripts/venv-engines.sh --lock     re-resolve requirements-engines.in, then sync
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-engines
LOCK=requirements-engines.lock
UV=.venv/bin/uv
PY="$VENV/bin/python"
PYVER=3.11
PLATFORM=x86_64-unknown-linux-gnu

[ -x "$UV" ] || { echo "venv-engines: $UV missing; run make venv first" >&2; exit 1; }
if [ "${1:-}" = "--lock" ]; then
  "$UV" pip compile requirements-engines.in --quiet --generate-hashes --python-version "$PYVER" \
    --python-platform "$PLATFORM" --custom-compile-command "make engines-lock" --output-file "$LOCK"
  echo "venv-engines: wrote $LOCK"
fi
if [ ! -x "$PY" ]; then
  echo "venv-engines: creating $VENV"
  "$UV" venv --quiet --python "$(command -v python$PYVER || command -v python3)" "$VENV"
fi
# a venv that matches the lock is left as it is (uv pip sync would check the same, slower)
stamp="$VENV/.lock-sha256"
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$PY" -c 'import megatron.core, torchtitan, deepspeed' >/dev/null 2>&1; then
  exit 0
fi
# --require-hashes: every download is checked against the lock's hashes. DeepSpeed's build
# imports torch: built without isolation, after the lock's torch is in.
DS_BUILD_OPS=0 "$UV" pip sync --python "$PY" --require-hashes "$LOCK"
echo "$want" > "$stamp"
