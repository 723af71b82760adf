from __future__ import annotations

import copy
import os
import re
import signal

import pytest

import smp_partition as smp
from conftest import needs_runner, torch_losses

pytestmark = needs_runner


def test_pp2_on_two_cpu_ranks_trains_as_pytorch(gpt2_plan) -> None:
    model, batch, plan = gpt2_plan
    lines: list[str] = []
    run = smp.launch(plan, data=batch, steps=5, progress=lines.append)
    assert any(re.match(r"\[rank 1\] step 5 ", line) for line in lines), lines
    expected = torch_losses(copy.deepcopy(model), batch, 5)
    assert len(run.losses) == 5
    for got, want in zip(run.losses, expected):
        assert abs(got - want) <= 1e-5 * abs(want), (run.losses, expected)
    assert run.report["steps"][0]["step"] == 1
    assert all(not _alive(pid) for pid in run.pids.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not a process left running
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_rank_raises_naming_it_and_leaves_no_process(gpt2_plan) -> None:
    _, batch, plan = gpt2_plan
    pids: dict[int, int] = {}

    def kill_rank_0(line: str) -> None:
        if m := re.match(r"smp-runner launch: rank (\d+): pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        # rank 0 is killed once it has taken a step: the launcher sees it die first
        if line.startswith("[rank 0] step 1 "):
            os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(smp.RankFailed) as failure:
        smp.launch(plan, data=batch, steps=100_000, progress=kill_rank_0)
    assert failure.value.rank == 0
    assert "SIGKILL" in failure.value.how
    assert "rank 0" in str(failure.value)
    assert sorted(pids) == [0, 1]
    assert [pid for pid in pids.values() if _alive(pid)] == []


def test_launch_command_for_several_hosts(gpt2_plan) -> None:
    plan = gpt2_plan[2]
    text = smp.launch_command(plan, ["node-a", "node-b"], steps=3, data="tokens.bin")
    assert "smp-runner launch --nnodes 2 --master-addr node-a --master-port 29500 --nproc 1 --node-rank 1" in text
    assert "--data tokens.bin" in text and "srun --nodes=2" in text and "$SLURM_NODEID" in text
    with pytest.raises(smp.SmpError):
        smp.launch_command(plan, ["a", "b", "c"])


def test_elastic_drops_a_hung_rank_and_lists_the_change_in_run_restarts(gpt2_plan, tmp_path) -> None:
    _, batch, plan = gpt2_plan
    pids: dict[int, int] = {}
    lines: list[str] = []

    def stop_rank_1(line: str) -> None:
        lines.append(line)
        if m := re.match(r"smp-runner launch: rank (\d+): pid (\d+)", line):
            pids.setdefault(int(m.group(1)), int(m.group(2)))
        # rank 1 stops (SIGSTOP) after its third step: the launcher finds it hung and drops it
        if line.startswith("[rank 1] step 3 ") and 1 in pids:
            os.kill(pids[1], signal.SIGSTOP)

    run = smp.launch(plan, data=batch, steps=6, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1,
                     step_timeout=5, elastic=(1, 2), rejoin_timeout=2, progress=stop_rank_1)
    assert any("is hung" in line for line in lines), lines
    change = run.restarts[-1]
    assert change["membership"]["devices"] == [2, 1], change
    assert change["membership"]["lost"] == ["host 0 device 1"], change
    assert (tmp_path / "ckpt" / "plans").is_dir()
    assert run.report["steps"][-1]["step"] == 6
    assert run.losses and all(loss == loss for loss in run.losses)
    with pytest.raises(ValueError):
        smp.launch(plan, steps=1, rejoin_timeout=3)
