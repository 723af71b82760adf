"""Finding the binaries (`smp-partition`, `smp-runner`): `$SMP_BIN_DIR`, the wheel, `PATH`,
the checkout's `target/`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import SmpError

#: The binaries this package drives.
BINARIES = ("smp-partition", "smp-runner")

#: Where a wheel carries the binaries (`make wheel`).
WHEEL_BIN = Path(__file__).resolve().parent / "bin"


def repo_root() -> Path | None:
    """The smp-partition checkout this package belongs to: `$SMP_REPO`, else the directory
    above `python/` when the package is installed from a checkout (`pip install -e python`)."""
    env = os.environ.get("SMP_REPO")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent.parent
    return here if (here / "Cargo.toml").is_file() and (here / "python" / "smp_partition").is_dir() else None


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_binary(name: str) -> Path:
    """The path of binary `name`: `$SMP_BIN_DIR/name`, else the one the wheel carries
    (`smp_partition/bin/name`), else `name` on `PATH`, else the newest of the checkout's
    `target/debug/name` and `target/release/name`."""
    if name not in BINARIES:
        raise ValueError(f"unknown binary {name!r}; expected one of {', '.join(BINARIES)}")
    env = os.environ.get("SMP_BIN_DIR")
    if env:
        p = Path(env) / name
        if _executable(p):
            return p
        raise SmpError(f"$SMP_BIN_DIR={env} holds no executable `{name}`; build it (cargo build --features runner) "
                       f"or unset SMP_BIN_DIR")
    if _executable(WHEEL_BIN / name):
        return WHEEL_BIN / name
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    root = repo_root()
    built = [root / "target" / d / name for d in ("debug", "release")] if root else []
    built = [p for p in built if p.is_file()]
    if built:
        return max(built, key=lambda p: p.stat().st_mtime)
    raise SmpError(f"`{name}` not found in $SMP_BIN_DIR, the installed wheel, on PATH or in the repository's "
                   f"target/; install the wheel (make wheel) or build it with `cargo build --features runner` "
                   f"and set SMP_BIN_DIR=target/debug")


def _exec(name: str) -> None:
    import sys

    binary = WHEEL_BIN / name  # never PATH: that is this command itself
    if not _executable(binary):
        sys.exit(f"{binary} is missing: reinstall the smp-partition wheel")
    os.execv(str(binary), [str(binary), *sys.argv[1:]])


def smp_partition_main() -> None:
    """The wheel's `smp-partition` command: the binary it carries."""
    _exec("smp-partition")


def smp_runner_main() -> None:
    """The wheel's `smp-runner` command: the binary it carries."""
    _exec("smp-runner")
