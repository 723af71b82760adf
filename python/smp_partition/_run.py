"""Running the binaries."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ._binaries import find_binary
from .errors import CommandError


def run(binary: str, args: list[str | Path]) -> str:
    """Runs `binary args`, returns its stdout; raises `CommandError` with its stderr on failure."""
    command = [str(find_binary(binary)), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CommandError(command, done.returncode, done.stderr)
    return done.stdout


def flag_args(flags: dict[str, object]) -> list[str]:
    """`{"pp": 2, "sequence_parallel": True, "frozen": ["wte*", "wpe*"]}` →
    `["--pp", "2", "--sequence-parallel", "--frozen", "wte*", "--frozen", "wpe*"]`
    (`None` and `False` are left out; a list or tuple repeats the flag)."""
    out: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out
