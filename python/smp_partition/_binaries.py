"""Finding the built binaries (`smp-partition`, `smp-runner`) and the repository's scripts."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

from .errors import SmpError

#: The binaries this package drives.
BINARIES = ("smp-partition", "smp-runner")


def repo_root() -> Path | None:
    """The smp-partition checkout this package belongs to: `$SMP_REPO`, else the directory
    above `python/` when the package is installed from a checkout (`pip install -e python`)."""
    env = os.environ.get("SMP_REPO")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent.parent
    return here if (here / "scripts" / "param_record.py").is_file() else None


def find_binary(name: str) -> Path:
    """The path of binary `name`: `$SMP_BIN_DIR/name`, else `name` on `PATH`, else the newest
    of the repository's `target/debug/name` and `target/release/name`."""
    if name not in BINARIES:
        raise ValueError(f"unknown binary {name!r}; expected one of {', '.join(BINARIES)}")
    env = os.environ.get("SMP_BIN_DIR")
    if env:
        p = Path(env) / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
        raise SmpError(f"$SMP_BIN_DIR={env} holds no executable `{name}`; build it (cargo build --features runner) "
                       f"or unset SMP_BIN_DIR")
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    root = repo_root()
    built = [root / "target" / d / name for d in ("debug", "release")] if root else []
    built = [p for p in built if p.is_file()]
    if built:
        return max(built, key=lambda p: p.stat().st_mtime)
    raise SmpError(f"`{name}` not found on PATH, in $SMP_BIN_DIR or in the repository's target/; build it with "
                   f"`cargo build --features runner` and set SMP_BIN_DIR=target/debug")


def param_record() -> ModuleType:
    """`scripts/param_record.py` of the repository: the one implementation of the parameter
    record (docs/parameter-record.md), shared with scripts/export_models.py."""
    root = repo_root()
    path = root / "scripts" / "param_record.py" if root else None
    if path is None or not path.is_file():
        raise SmpError("scripts/param_record.py not found: install this package from a checkout "
                       "(pip install -e python) or set SMP_REPO to the checkout")
    spec = importlib.util.spec_from_file_location("smp_param_record", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
