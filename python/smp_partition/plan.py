"""`plan`: export a PyTorch module and plan it with `smp-partition`."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._run import flag_args, run
from .export import Exported, as_tuple, export, token_lengths


@dataclass(frozen=True)
class Parallel:
    """The plan's parallel configuration (plan-format.md, `parallel`)."""

    pp: int
    tp: int
    dp: int
    zero: int
    microbatches: int
    schedule: Any
    sequence_parallel: bool
    #: The training precision the plan was priced for and the runner executes: `f32`, `bf16`,
    #: `bf16-mixed` or `fp16-mixed` (docs/precision.md).
    precision: str
    #: Context-parallel degree: ranks each microbatch's sequence is split over.
    cp: int = 1
    #: Expert-parallel degree: ranks a mixture-of-experts layer's experts are split over,
    #: carved from the data-parallel ranks (divides `dp`).
    ep: int = 1
    #: Whether the plan priced each layer's gradient reduction beside the rest of its backward,
    #: as the engines run it (`overlap_grad_sync=True`; the runner reduces after the backward).
    grad_sync_overlap: bool = False
    #: Whether it priced the expert all-to-alls beside another microbatch's compute, as
    #: Megatron-Core's combined 1F1B runs them (`overlap_expert_comm=True`).
    expert_comm_overlap: bool = False

    @property
    def devices(self) -> int:
        """Ranks the plan runs on (pp × tp × cp × dp)."""
        return self.pp * self.tp * self.cp * self.dp


@dataclass(frozen=True)
class Predicted:
    """The cost model's prediction for one optimizer step (plan-format.md, `predicted`)."""

    step_time_s: float
    samples_per_s: float
    bubble_ratio: float
    peak_memory_bytes: int
    mfu: float
    hfu: float


class Plan:
    """A plan file written by `smp-partition`, with the model it was made for.

    `repr(plan)` is `smp-partition inspect`'s table; `plan.parallel`, `plan.predicted`,
    `plan.stages` and `plan.data` (the whole file as a dict) expose its figures."""

    def __init__(self, path: str | Path, model_path: str | Path | None = None, *,
                 input_names: list[str] | None = None, prefix: str = "") -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = json.loads(self.path.read_text())
        self.model_path = Path(model_path) if model_path else Path(self.data["model"]["path"])
        #: The graph's input names (for data given as tensors).
        self.input_names = input_names or []
        #: Prefix of the recorded parameter names (the export wrapper's attribute, `model.`).
        self.prefix = prefix
        self._inspect: str | None = None

    @property
    def dir(self) -> Path:
        """The directory holding the plan (runs write beside it)."""
        return self.path.parent

    @property
    def parallel(self) -> Parallel:
        p = self.data["parallel"]
        return Parallel(pp=p["pp"], tp=p["tp"], dp=p["dp"], zero=p["zero"], microbatches=p["microbatches"],
                        schedule=p["schedule"], sequence_parallel=p.get("sequence_parallel", False),
                        precision=p["precision"], cp=p.get("cp", 1), ep=p.get("ep", 1),
                        grad_sync_overlap=p.get("grad_sync_overlap", False),
                        expert_comm_overlap=p.get("expert_comm_overlap", False))

    @property
    def predicted(self) -> Predicted:
        p = self.data["predicted"]
        return Predicted(step_time_s=p["step_time_s"], samples_per_s=p["samples_per_s"],
                         bubble_ratio=p["bubble_ratio"], peak_memory_bytes=p["peak_memory_bytes"],
                         mfu=p["mfu"], hfu=p.get("hfu", 0.0))

    @property
    def stages(self) -> list[dict[str, Any]]:
        """The pipeline stages (layers, ranks, times, memory), as in the file."""
        return list(self.data["stages"])

    @property
    def global_batch(self) -> int:
        return int(self.data["global_batch"])

    @property
    def seq_len(self) -> int | None:
        return self.data.get("seq_len")

    @property
    def devices(self) -> int:
        return self.parallel.devices

    def inspect(self) -> str:
        """`smp-partition inspect PLAN`: stages, bottleneck, memory, communication, proof."""
        if self._inspect is None:
            self._inspect = run("smp-partition", ["inspect", self.path])
        return self._inspect

    def __repr__(self) -> str:
        return self.inspect()

    def emit(self, engine: str, output: str | Path | None = None, *, cluster: str | None = None) -> EngineConfig:
        """`smp-partition emit PLAN --engine ENGINE`: the plan as the configuration of `engine`
        (`"megatron"`, `"torchtitan"`, `"deepspeed"` or `"smp"`), with what that engine cannot
        express, priced, and the nearest configuration it can run (docs/engines.md). `output`:
        a directory to write the files into as well. `cluster` prices on another cluster
        (default: the plan's)."""
        args: list[str | Path] = ["emit", self.path, "--engine", engine, "--model", self.model_path, "--json"]
        if output is not None:
            args += ["-o", Path(output)]
        if cluster is not None:
            args += ["--cluster", cluster]
        return EngineConfig.from_json(json.loads(run("smp-partition", args)))


#: The engines as their users call them.
ENGINE_TITLES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "deepspeed": "DeepSpeed", "smp": "SMP"}


@dataclass(frozen=True)
class Gap:
    """One thing an engine cannot express of a plan: what the plan chose, why the engine
    cannot say it, what its configuration says instead, and the predicted step with only that
    change (`None`: not priced alone)."""

    field: str
    chose: str
    why: str
    nearest: str
    priced: bool
    step_time_s: float | None


@dataclass(frozen=True)
class EngineConfig:
    """A plan as an engine's configuration (`Plan.emit`)."""

    engine: str
    #: File name → text (`megatron.args`, `torchtitan.toml`, `ds_config.json`, `smp.json`, ...).
    files: dict[str, str]
    #: The launch line that runs the files.
    launch: str
    #: What the user supplies that the plan does not decide (data, tokenizer, model code).
    notes: list[str]
    #: What the engine cannot express; empty when it expresses the whole plan.
    gaps: list[Gap]
    #: The plan's predicted step time, seconds.
    plan_step_time_s: float
    #: The predicted step time of what the configuration runs (the nearest plan), seconds.
    step_time_s: float
    #: The plan the configuration runs when a gap changed it (as a plan file's dict), else None.
    nearest: dict[str, Any] | None
    #: Peak and available bytes per device when the nearest plan does not fit, else None.
    over_memory: tuple[int, int] | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineConfig:
        over = d.get("over_memory")
        return cls(engine=d["engine"], files={f["name"]: f["text"] for f in d["files"]}, launch=d["launch"],
                   notes=list(d["notes"]),
                   gaps=[Gap(g["field"], g["chose"], g["why"], g["nearest"], g["priced"], g["step_time_s"])
                         for g in d["gaps"]],
                   plan_step_time_s=d["plan_step_time_s"], step_time_s=d["step_time_s"], nearest=d.get("nearest"),
                   over_memory=(over["peak_bytes"], over["limit_bytes"]) if over else None)

    def write(self, directory: str | Path) -> list[Path]:
        """Writes the files into `directory` (created if missing); returns their paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in self.files.items():
            (out / name).write_text(text)
            paths.append(out / name)
        return paths

    def __str__(self) -> str:
        title = ENGINE_TITLES.get(self.engine, self.engine)
        lines = [f"{title} cannot express {g.chose} ({g.why}); nearest: {g.nearest}" for g in self.gaps]
        for name, text in self.files.items():
            lines += [f"--- {name} ---", text.rstrip("\n")]
        lines.append(f"launch: {self.launch}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def planner_args(example_inputs: Any, global_batch: int | None, seq_len: int | None,
                 config: dict[str, Any] | None, out: Path, input_names: list[str] | None = None) -> list[str | Path]:
    """The planner options `plan` and `sweep` share: `--global-batch`, `--seq-len` (by default
    dim 1 of integer example inputs, i.e. token ids; a token input of another length binds its
    own dim `seq_<name>` with `--dim`, as `export` names it) and `--config` (the SMP
    parameters, written to `out/smp.json`)."""
    dims: dict[str, int] = {}
    if example_inputs is not None:
        inputs = as_tuple(example_inputs)
        names = input_names or [f"input{i}" for i in range(len(inputs))]
        lengths = token_lengths(names, inputs)
        first = next(iter(lengths.values()), None)
        if seq_len is None:
            seq_len = first
        dims = {f"seq_{n}": length for n, length in lengths.items() if length != first}
    args: list[str | Path] = []
    if global_batch is not None:
        args += ["--global-batch", str(global_batch)]
    if seq_len is not None:
        args += ["--seq-len", str(seq_len)]
    for name, value in dims.items():
        args += ["--dim", f"{name}={value}"]
    if config:
        (out / "smp.json").write_text(json.dumps(config, indent=2))
        args += ["--config", out / "smp.json"]
    return args


def exported_model(model: Any, example_inputs: Any, out: Path, caller: str) -> tuple[Exported | None, Path]:
    """`model` as the ONNX file the planner reads: an `Exported` as it is, a path as given, an
    `nn.Module` exported into `out/model.onnx` on `example_inputs`."""
    out.mkdir(parents=True, exist_ok=True)
    exported: Exported | None = None
    if isinstance(model, Exported):
        exported = model
    elif not isinstance(model, (str, Path)):
        if example_inputs is None:
            raise TypeError(f"{caller}(model, example_inputs, ...): example inputs are needed to export a module")
        exported = export(model, example_inputs, out / "model.onnx")
    return exported, Path(exported.path if exported else model).resolve()


def plan(model: Any, example_inputs: Any = None, *, cluster: str = "cpu:2", global_batch: int | None = None,
         config: dict[str, Any] | None = None, seq_len: int | None = None, precision: str | None = None,
         workdir: str | Path | None = None, **flags: Any) -> Plan:
    """Exports `model` (an `nn.Module` called on `example_inputs`; or an `Exported` from
    `export`; or the path of an ONNX file) and plans it on `cluster` (`smp-partition MODEL
    --cluster CLUSTER ...`).

    `config` holds SageMaker model-parallel parameters by their SMP names
    (`pipeline_parallel_degree`, `tensor_parallel_degree`, `microbatches`, `pipeline`,
    `ddp`, `fp16`, `bf16`, ...), passed as `--config`; the CLI accepts and checks them.
    `precision` (`"f32"`, `"bf16"`, `"bf16-mixed"`, `"fp16-mixed"`) is `--precision`: the
    training precision the plan is priced for (default: the cluster's, bf16-mixed on GPUs and
    f32 on `cpu`; SMP's `fp16`/`bf16` keys say it too, and a disagreement is an error);
    `plan.parallel.precision` shows it. Other planner flags go by keyword (`pp=2`,
    `schedule="1f1b"`, `memory_limit=16`, `sequence_parallel=True`).
    `seq_len` defaults to dim 1 of integer example inputs (token ids). Files go to `workdir`
    (default: a new temporary directory): `model.onnx`, `smp.json`, `plan.json`."""
    out = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="smp-"))
    exported, onnx_path = exported_model(model, example_inputs, out, "plan")
    args: list[str | Path] = [onnx_path, "--cluster", cluster, "-o", out / "plan.json"]
    args += planner_args(example_inputs, global_batch, seq_len, config, out,
                         exported.input_names if exported else None)
    if precision is not None:
        args += ["--precision", str(precision)]
    args += flag_args(flags)
    run("smp-partition", args)
    return Plan(out / "plan.json", onnx_path,
                input_names=exported.input_names if exported else [],
                prefix=exported.prefix if exported else "")
