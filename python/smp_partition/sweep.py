"""`sweep`: "what should I rent?" — one model planned on many clusters (`smp-partition sweep`)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ._run import flag_args, run
from .export import export
from .plan import planner_args


@dataclass(frozen=True)
class Sweep:
    """The sweep's rows (one dict per cluster: devices, pp/tp/dp, step_time_s, tokens_per_s,
    mfu, peak_memory_bytes, cost_per_step_usd, cost_per_million_tokens_usd, or `error`), its
    table text (`repr`) and the SVG chart's path."""

    rows: list[dict[str, Any]]
    table: str
    svg: Path | None
    wall_s: float

    def best(self, by: str = "cost_per_million_tokens_usd") -> dict[str, Any]:
        """The planned row with the least `by` (default: cost per 1M tokens)."""
        rows = [r for r in self.rows if r.get(by) is not None]
        if not rows:
            raise ValueError(f"no row has `{by}`")
        return min(rows, key=lambda r: r[by])

    def __repr__(self) -> str:
        return self.table


def sweep(model: Any, example_inputs: Any = None, *, clusters: Sequence[str], global_batch: int | None = None,
          seq_len: int | None = None, config: dict[str, Any] | None = None, svg: str | Path | None = None,
          workdir: str | Path | None = None, **flags: Any) -> Sweep:
    """Plans `model` (an ONNX path, or an `nn.Module` with `example_inputs`, exported as in
    `plan`) on every cluster of `clusters` (`"a100-80gb:256,512,1024"`, `"h100-80gb:256"`,
    ...): `smp-partition sweep`. `svg`: where to draw the chart. Other planner flags by
    keyword, SMP parameters in `config`, as in `plan`."""
    out = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="smp-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    names = None
    if isinstance(model, (str, Path)):
        onnx_path = Path(model)
    else:
        if example_inputs is None:
            raise TypeError("sweep(model, example_inputs, ...): example inputs are needed to export a module")
        exported = export(model, example_inputs, out / "model.onnx")
        onnx_path, names = exported.path, exported.input_names
    args: list[str | Path] = ["sweep", onnx_path, "--clusters", *clusters]
    args += planner_args(example_inputs, global_batch, seq_len, config, out, names)
    if svg is not None:
        args += ["-o", svg]
    args += flag_args(flags) + ["--json"]
    result = json.loads(run("smp-partition", args))
    return Sweep(rows=list(result["rows"]), table=result["table"], svg=Path(svg) if svg else None,
                 wall_s=float(result["wall_s"]))
