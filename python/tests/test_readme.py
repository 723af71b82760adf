"""README's "From a PyTorch script": both blocks run as printed, print the same losses, and the
changed lines are as the README counts them."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO, needs_runner


def _blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## From a PyTorch script\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]


def test_changed_lines_are_as_counted() -> None:
    plain, smp = (b.splitlines() for b in _blocks())
    ops = difflib.SequenceMatcher(a=plain, b=smp, autojunk=False).get_opcodes()
    changed = [(tag, i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal"]
    assert changed == [("insert", 0, 1), ("replace", 8, 6)], changed
    same = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "equal")
    assert (same, len(plain)) == (10, 18)


@needs_runner
def test_both_blocks_run_as_printed_and_agree(tmp_path: Path) -> None:
    plain, smp = _blocks()
    outs = []
    for name, code in (("plain.py", plain), ("with_smp.py", smp)):
        (tmp_path / name).write_text(code)
        done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(done.stdout)
    expected, got = _losses(outs[0]), _losses(outs[1])
    assert len(expected) == 5 and len(got) == 5, outs
    for g, e in zip(got, expected):
        assert abs(g - e) <= 1e-5 * e, (got, expected)
    assert "parallel pp 2" in outs[1]  # print(plan): the inspect table
