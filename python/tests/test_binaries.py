from __future__ import annotations

import os
from pathlib import Path

import pytest

import smp_partition as smp
from smp_partition._run import flag_args


def test_bin_dir_wins_and_a_missing_binary_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "smp-runner"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SMP_BIN_DIR", str(tmp_path))
    assert smp.find_binary("smp-runner") == fake
    with pytest.raises(smp.SmpError, match="smp-partition"):
        smp.find_binary("smp-partition")
    with pytest.raises(ValueError):
        smp.find_binary("ls")


def test_the_wheel_before_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smp_partition import _binaries

    monkeypatch.delenv("SMP_BIN_DIR", raising=False)
    wheel, path = tmp_path / "wheel", tmp_path / "path"
    for d in (wheel, path):
        d.mkdir()
        (d / "smp-runner").write_text("#!/bin/sh\n")
        (d / "smp-runner").chmod(0o755)
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
    assert smp.find_binary("smp-runner") == path / "smp-runner"
    monkeypatch.setattr(_binaries, "WHEEL_BIN", wheel)
    assert smp.find_binary("smp-runner") == wheel / "smp-runner"


def test_path_then_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMP_BIN_DIR", raising=False)
    fake = tmp_path / "smp-partition"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert smp.find_binary("smp-partition") == fake


def test_flags_become_cli_options() -> None:
    assert flag_args({"pp": 2, "sequence_parallel": True, "tp": None, "json": False, "memory_limit": 1.5}) == [
        "--pp", "2", "--sequence-parallel", "--memory-limit", "1.5"]
    # a list repeats the flag (the planner's `--frozen GLOB` is repeatable)
    assert flag_args({"frozen": ["wte*", "wpe*"], "trainable": ()}) == ["--frozen", "wte*", "--frozen", "wpe*"]
