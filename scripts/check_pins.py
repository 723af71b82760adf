#!/usr/bin/env python3
"""Exit 0 when every `name==version` given is installed at exactly that version, else name
the first mismatch on stderr and exit 1. Reads package metadata only (imports nothing big)."""

import sys
from importlib import metadata


def main(pins):
    for pin in pins:
        name, _, want = pin.partition("==")
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            print(f"venv: {name} is not installed (want {want})", file=sys.stderr)
            return 1
        # Local build tags (2.13.0+cpu) satisfy the pin.
        if have.split("+")[0] != want:
            print(f"venv: {name} {have} installed, pinned {want}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
