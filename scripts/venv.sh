#!/usr/bin/env bash
# Brings .venv to exactly requirements.lock: creates it when missing, bootstraps the locked uv
# (hash-checked, by pip), then `uv pip sync` installs what differs from the lock and removes
# third-party packages the lock does not list. A venv that already matches is left untouched.
#
#   scripts/venv.sh            sync .venv to the lock
#   scripts/venv.sh --lock     re-resolve requirements.in into requirements.lock, then sync
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
LOCK=requirements.lock
PY="$VENV/bin/python"
# The lock is for this interpreter and platform (the dev and CI machines: CPython 3.11, x86_64 Linux).
PYVER=3.11
PLATFORM=x86_64-unknown-linux-gnu

if [ ! -x "$PY" ]; then
  echo "venv: creating $VENV"
  python3 -m venv "$VENV"
fi

# uv's locked version and hashes, read from the lock's `uv==` block.
uv_block=$("$PY" - "$LOCK" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"^uv==\S+(?: \\\n\s+--hash=\S+)+", text, re.M)
if not m:
    sys.exit(f"venv: {sys.argv[1]} does not pin uv; run `make lock`")
print(m.group(0).replace("\\\n", " "))
PYEOF
)
uv_version=$(sed -E 's/^uv==([^ ]+).*/\1/' <<<"$uv_block")
if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  echo "venv: installing uv $uv_version (hash-checked)"
  req=$(mktemp); trap 'rm -f "$req"' EXIT
  echo "$uv_block" > "$req"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r "$req"
fi

if [ "${1:-}" = "--lock" ]; then
  "$VENV/bin/uv" pip compile requirements.in --quiet --generate-hashes --python-version "$PYVER" \
    --python-platform "$PLATFORM" --custom-compile-command "make lock" --output-file "$LOCK"
  echo "venv: wrote $LOCK"
fi

# --require-hashes: every download is checked against the lock's hashes.
"$VENV/bin/uv" pip sync --python "$PY" --require-hashes "$LOCK"
