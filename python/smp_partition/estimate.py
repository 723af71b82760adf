"""`estimate`: "will this fit?" — one configuration priced without planning others
(`smp-partition MODEL --estimate`)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._run import flag_args, run
from .plan import exported_model, planner_args


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device of a pipeline rank holds, by part; `offloaded` is in host memory and
    not part of `total`."""

    params: int
    grads: int
    optimizer: int
    activations: int
    #: A checkpointed layer's activations rebuilt inside its backward (a transient).
    recompute: int
    #: The loss's copies at its backward on the rank computing it (log-probabilities and
    #: their gradients; a transient at another moment: `total` counts the larger of it and
    #: `recompute`).
    loss: int
    offloaded: int
    temporaries: int
    total: int


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank: its stages, their `[first, last]` layers, memory per device and the
    headroom left (negative: over the capacity by that much)."""

    pp_rank: int
    stages: list[int]
    layers: list[list[int]]
    memory: DeviceMemory
    headroom_bytes: int


@dataclass(frozen=True)
class Estimate:
    """The configuration's memory per device against `capacity_bytes`, and its step time.
    `repr` is the command's table."""

    fits: bool
    over_by_bytes: int
    capacity_bytes: int
    ranks: list[RankEstimate]
    step_time_s: float
    samples_per_s: float
    mfu: float
    bubble_ratio: float
    #: The configuration as the plan file spells it (`pp`, `tp`, `dp`, `zero`, `schedule`, ...).
    parallel: dict[str, Any]
    global_batch: int
    seq_len: int | None
    table: str

    def __repr__(self) -> str:
        return self.table


def estimate(model: Any, example_inputs: Any = None, *, cluster: str = "cpu:2", global_batch: int | None = None,
             config: dict[str, Any] | None = None, seq_len: int | None = None, workdir: str | Path | None = None,
             **flags: Any) -> Estimate:
    """Prices the one configuration given (`smp-partition MODEL --estimate --json`): SMP
    parameters in `config` and planner flags by keyword (`pp=2`, `tp=2`, `microbatches=4`,
    `zero=1`, `checkpointing="full"`, `precision="bf16-mixed"`), the rest at their defaults
    (pp, tp, cp, ep 1; dp the devices left; ZeRO 0; 1F1B; no recompute; no offloading).
    `model` is exported as in `plan`. Raises `CommandError` naming the setting when the
    configuration cannot be expressed."""
    out = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="smp-estimate-"))
    exported, onnx_path = exported_model(model, example_inputs, out, "estimate")
    args: list[str | Path] = [onnx_path, "--cluster", cluster, "--estimate", "--json"]
    args += planner_args(example_inputs, global_batch, seq_len, config, out,
                         exported.input_names if exported else None)
    args += flag_args(flags)
    r = json.loads(run("smp-partition", args))
    ranks = [RankEstimate(pp_rank=x["pp_rank"], stages=list(x["stages"]), layers=[list(l) for l in x["layers"]],
                          memory=DeviceMemory(**x["memory"]), headroom_bytes=int(x["headroom_bytes"]))
             for x in r["ranks"]]
    return Estimate(fits=bool(r["fits"]), over_by_bytes=int(r["over_by_bytes"]), capacity_bytes=int(r["capacity_bytes"]),
                    ranks=ranks, step_time_s=float(r["step_time_s"]), samples_per_s=float(r["samples_per_s"]),
                    mfu=float(r["mfu"]), bubble_ratio=float(r["bubble_ratio"]), parallel=dict(r["parallel"]),
                    global_batch=int(r["global_batch"]), seq_len=r["seq_len"], table=str(r["table"]))
