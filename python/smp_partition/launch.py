"""`launch`: run a plan's ranks with `smp-runner launch`, streaming progress."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ._binaries import find_binary
from ._run import flag_args
from .errors import CommandError, RankFailed, SmpError
from .plan import Plan

_PID = re.compile(r"^smp-runner launch: rank (\d+): pid (\d+)")
_FAILED = re.compile(r"^smp-runner launch: rank (\d+) (.*?) first; the other ranks were stopped")


@dataclass
class Run:
    """A finished `launch`: its plan, the per-step losses and the runner's `--json` report."""

    plan: Plan
    dir: Path
    losses: list[float]
    report: dict[str, Any]
    checkpoint_dir: Path | None = None
    #: The final weights (`--save-weights`: safetensors under module parameter names, the
    #: tensors `smp-runner export` writes), which `load_trained` reads.
    trained: Path | None = None
    #: The ranks' process ids (all ended when `launch` returns).
    pids: dict[int, int] = field(default_factory=dict)
    #: What `launch(verify=...)` found before the run (`smp-runner launch --verify`'s report).
    verify: dict[str, Any] | None = None

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """The restarts the launcher made (`max_restarts`) and, under `elastic`, each change of
        the job's devices: `cause`, `resumed_from_step`, `checkpoint`, and for a change
        `membership` (`lost` and `joined` hosts or devices, `devices`, `plans` and `meshes`
        before and after with their `predicted_step_time_s`) and `fault_to_first_step_s`."""
        return list(self.report.get("restarts", []))

    @property
    def stragglers(self) -> list[dict[str, Any]]:
        """The ranks named stragglers, one entry per rank and window of steps."""
        return list(self.report.get("stragglers", []))


def _data_file(plan: Plan, data: Any, out: Path) -> str:
    """`data` as `--data`: a path as is; a tensor, array or dict of them as an .npz of one batch
    keyed by the graph's input names (repeated every step)."""
    if isinstance(data, (str, Path)):
        return str(data)
    import numpy as np

    arrays = data if isinstance(data, dict) else {(plan.input_names or ["input_ids"])[0]: data}
    path = out / "data.npz"
    np.savez(path, **{k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v))
                      for k, v in arrays.items()})
    return str(path)


#: The final weights of a launch, in its run directory.
TRAINED = "trained.safetensors"


def run_args(plan: Plan, *, data: Any = None, steps: int = 10, checkpoint_dir: str | Path | None = None,
             out: Path | None = None, **options: Any) -> list[str]:
    """The options every rank's `smp-runner run` gets (see `launch`)."""
    args = ["--steps", str(steps)]
    if out is not None:
        args += ["--save-weights", str(out / TRAINED)]
    if data is not None:
        args += ["--data", _data_file(plan, data, out or plan.dir)]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir)]
    return args + flag_args(options)


def verify_plan(plan: Plan, *, data: Any = None, steps: int = 3, **options: Any) -> dict[str, Any]:
    """`smp-runner launch --verify STEPS`: the plan's ranks and one process each train `steps`
    steps in f64 on `data` with `options` (as `launch` takes them); returns the report
    (`loss`, `parameters`, `buffers`: the largest relative difference of each and where;
    `passed`; `expected_difference`: why the plan says it differs, where it does). Raises
    `SmpError` when the plan differs from one process beyond f64 rounding without a reason."""
    out = plan.dir
    args = run_args(plan, data=data, steps=steps, **options)
    command = [str(find_binary("smp-runner")), "launch", "--verify", str(int(steps)), "--nproc", str(plan.devices),
               str(plan.path), *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=out)
    try:
        report = _report(done.stdout.splitlines())
    except SmpError:
        raise CommandError(command, done.returncode, done.stderr) from None
    if not report.get("passed") and not report.get("expected_difference"):
        lines = [ln.removeprefix("smp-runner: ") for ln in done.stderr.splitlines() if ln.startswith("smp-runner: ")]
        raise SmpError("the plan does not train as one process does:\n" + "\n".join(lines[-5:]))
    return report


def launch(plan: Plan, *, data: Any = None, steps: int = 10, checkpoint_dir: str | Path | None = None,
           progress: bool | Callable[[str], None] = True, max_restarts: int = 0, verify: bool | int = False,
           elastic: tuple[int, int] | None = None, rejoin_timeout: float | None = None,
           drop_stragglers: int | None = None, **options: Any) -> Run:
    """Trains `plan` on this host: `smp-runner launch --nproc N PLAN --steps STEPS ...`, one
    process per rank, and waits for it.

    `data`: a token file (`.bin`), a batch file (`.npy`, `.npz`, `.safetensors`), or tensors
    (one global batch, written as `.npz` and repeated every step); default: seeded synthetic
    data. The final weights go to `trained.safetensors` in the plan's directory (`run.trained`,
    read by `load_trained`). `checkpoint_dir` is passed as `--checkpoint-dir`. Other runner
    options by keyword
    (`lr=1e-3`, `weight_decay=0.0`, `clip=0`, `dtype="f64"`, `seed=1`, `threads=1`).
    `progress`: print the ranks' progress lines on stderr (True), or call this function with
    each line.

    A rank's failure raises `RankFailed` naming the rank; the launcher stops the other ranks,
    and any process of the job still alive afterwards is killed: none is left behind. With
    `max_restarts=N` (torchrun's name) a run that fails after it started training is started
    again from the newest complete checkpoint of `checkpoint_dir` (from the start without one),
    up to N times; `run.restarts` lists them.

    `elastic=(MIN, MAX)` (`--elastic MIN:MAX`, devices): a rank found hung (or, with
    `drop_stragglers=N`, named a straggler N windows in a row) leaves the job instead of ending
    it while MIN devices remain; the launcher plans the model again for the devices left with
    the plan's own planning request and resumes the newest complete checkpoint of
    `checkpoint_dir` on the new plan, keeping the global batch. `run.restarts` lists each change
    with its plans; `rejoin_timeout` is `--rejoin-timeout` in seconds. `startup_timeout`,
    `step_timeout` and `checkpoint_timeout` (seconds) are the launcher's phase timeouts: a rank
    past one, or silent for the step's, is named hung and (under `elastic`) dropped.
    `run.stragglers` lists the ranks named stragglers (`straggler_factor`, `straggler_window`).

    `verify=True` (or a number of steps, default 3) first checks the plan against one process
    in f64 on the same data and options (`verify_plan`), raising `SmpError` before the run if it
    trains differently; the check's report is `run.verify`."""
    # the phase timeouts are the launcher's (it watches the ranks' heartbeats), not the ranks'
    timeout_flags: list[str] = []
    for phase in ("startup", "step", "checkpoint"):
        seconds = options.pop(f"{phase}_timeout", None)
        if seconds is not None:
            timeout_flags += [f"--{phase}-timeout", str(int(seconds))]
    checked = None
    if verify:
        checked = verify_plan(plan, data=data, steps=3 if verify is True else int(verify), **options)
    out = plan.dir
    (out / TRAINED).unlink(missing_ok=True)
    launch_flags = ["--max-restarts", str(int(max_restarts))] if max_restarts else []
    if elastic is not None:
        low, high = elastic
        launch_flags += ["--elastic", f"{int(low)}:{int(high)}"]
        if rejoin_timeout is not None:
            launch_flags += ["--rejoin-timeout", str(int(rejoin_timeout))]
        if drop_stragglers is not None:
            launch_flags += ["--drop-stragglers", str(int(drop_stragglers))]
    elif rejoin_timeout is not None or drop_stragglers is not None:
        raise ValueError("rejoin_timeout and drop_stragglers apply under elastic=(MIN, MAX)")
    launch_flags += timeout_flags
    args = run_args(plan, data=data, steps=steps, checkpoint_dir=checkpoint_dir, out=out, **options)
    command = [str(find_binary("smp-runner")), "launch", "--nproc", str(plan.devices), *launch_flags,
               str(plan.path), *args, "--json", "--progress"]
    show: Callable[[str], None]
    if callable(progress):
        show = progress
    elif progress:
        def show(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    else:
        def show(line: str) -> None:
            pass

    pids: dict[int, int] = {}
    failed: list[tuple[int, str]] = []
    tail: deque[str] = deque(maxlen=200)
    stdout: list[str] = []
    # its own session: the ranks share the launcher's process group, killed as one at the end
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def read_stdout() -> None:
        assert proc.stdout is not None
        stdout.extend(proc.stdout)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.rstrip("\n")
            tail.append(line)
            if m := _PID.match(line):
                pids[int(m.group(1))] = int(m.group(2))
            elif m := _FAILED.match(line):
                failed.append((int(m.group(1)), m.group(2)))
            show(line)
        code = proc.wait()
        reader.join()
    except BaseException:
        # interrupted (Ctrl-C) or the progress callback raised: stop the job as the launcher
        # would on SIGTERM, then make sure
        _stop(proc)
        raise
    finally:
        _reap(proc, pids)
    log = "\n".join(tail)
    if failed and code != 0:
        # the last failure ended the run (earlier ones were restarted)
        raise RankFailed(failed[-1][0], failed[-1][1], log)
    if code != 0:
        raise CommandError(command, code, log)
    report = _report(stdout)
    losses = [float(s["loss"]) for s in report.get("steps", [])]
    trained = out / TRAINED
    if not trained.is_file():
        raise SmpError(f"smp-runner launch finished but wrote no {trained} (--save-weights); "
                       f"is {find_binary('smp-runner')} older than this package?")
    return Run(plan=plan, dir=out, losses=losses, report=report,
               checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None, trained=trained, pids=pids,
               verify=checked)


def _report(lines: list[str]) -> dict[str, Any]:
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                continue
    raise SmpError("smp-runner launch printed no JSON report:\n" + "".join(lines[-20:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _reap(proc: subprocess.Popen[str], pids: dict[int, int]) -> None:
    """Kills whatever is left of the job's process group and the ranks it named."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch_command(plan: Plan, hosts: list[str], *, nproc: int | None = None, port: int = 29500,
                   data: Any = None, steps: int = 10, checkpoint_dir: str | Path | None = None,
                   **options: Any) -> str:
    """The commands that run `plan` over several hosts: one `smp-runner launch` per host
    (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`, as torchrun's static
    rendezvous), and the same as one Slurm `srun` line. `nproc`: ranks per host (default: the
    plan's ranks over the hosts). Paths must be valid on every host."""
    if not hosts:
        raise ValueError("launch_command needs at least one host")
    per_host = nproc if nproc is not None else plan.devices // len(hosts)
    if per_host * len(hosts) != plan.devices:
        raise SmpError(f"the plan has {plan.devices} ranks, which {len(hosts)} hosts × {per_host} do not make")
    args = run_args(plan, data=data, steps=steps, checkpoint_dir=checkpoint_dir, **options)
    runner = "smp-runner"
    common = ["--nnodes", str(len(hosts)), "--master-addr", hosts[0], "--master-port", str(port),
              "--nproc", str(per_host)]
    lines = [f"# on {h}:\n" + shlex.join([runner, "launch", *common, "--node-rank", str(i), str(plan.path), *args])
             for i, h in enumerate(hosts)]
    srun = (f"srun --nodes={len(hosts)} --ntasks-per-node=1 bash -c "
            + shlex.quote(shlex.join([runner, "launch", *common, str(plan.path), *args]).replace(
                "--nproc", "--node-rank $SLURM_NODEID --nproc", 1)))
    return "\n".join(lines) + "\n# or, under Slurm:\n" + srun
