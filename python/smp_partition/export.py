"""Exporting an `nn.Module` for the planner: `torch.onnx.export(..., dynamo=True)` with dynamic
batch (and sequence) dims, then the parameter record (docs/parameter-record.md) written by the
repository's one implementation, `scripts/param_record.py` (as scripts/export_models.py does)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import _moe
from ._binaries import param_record
from .errors import SmpError

#: ONNX opset of the exports (as scripts/export_models.py).
OPSET = 18
#: The wrapper's attribute holding the user's module: recorded names start with it.
PREFIX = "model."


@dataclass(frozen=True)
class Exported:
    """An exported model: the file, its graph input names, and what the record says."""

    path: Path
    input_names: list[str]
    #: Prefix of the recorded parameter names (the export wrapper's attribute).
    prefix: str = PREFIX
    #: `write_record`'s summary (parameters, buffers, constants, merged, restored, missing).
    record: dict[str, Any] = field(default_factory=dict)


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """A tensor or a sequence of tensors as a tuple."""
    import torch

    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Sequence):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}")


def _first_tensor(out: Any) -> Any:
    """The main output: `.logits` of a Hugging Face output, the first of a tuple or dict."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        return _first_tensor(next(iter(out.values())))
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    raise SmpError(f"the model returned {type(out).__name__}; return a tensor (or an object with `.logits`)")


def _wrapper(model: Any, names: list[str], kwargs: dict[str, Any]) -> Any:
    import torch

    class MainOutput(torch.nn.Module):
        """Calls the model with its inputs by name and returns its main output tensor (Hugging
        Face outputs carry cache objects the exporter cannot take)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return _first_tensor(self.model(**dict(zip(names, args)), **kwargs))

    return MainOutput()


def _input_names(model: Any, n: int) -> list[str]:
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < n:
        raise SmpError(f"{type(model).__name__}.forward takes {len(params)} positional inputs, {n} example inputs given")
    return [p.name for p in params[:n]]


def _max_positions(model: Any) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 1:
            return v
    return None


@contextlib.contextmanager
def _export_mode(model: Any) -> Iterator[None]:
    """Eval mode (no dropout in the graph) and, for Hugging Face models, eager attention
    (plain MatMul/Softmax, which the runner executes); both restored afterwards."""
    training = model.training
    cfg = getattr(model, "config", None)
    attn = getattr(cfg, "_attn_implementation", None)
    switch = attn not in (None, "eager") and hasattr(model, "set_attn_implementation")
    model.eval()
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(attn)
        model.train(training)


def export(model: Any, example_inputs: Any, path: str | Path, *, dynamic: bool = True) -> Exported:
    """Exports `model` called on `example_inputs` to `path` (ONNX, weights inline) with
    `torch.onnx.export(..., dynamo=True)` and writes the parameter record.

    With `dynamic`, dim 0 of every input is the symbolic `batch`, and dim 1 of integer inputs
    of rank >= 2 (token ids) the symbolic `seq` (at most the model's `n_positions` or
    `max_position_embeddings`). The graph is exported in eval mode: dropout is not part of it.
    Raises `SmpError` if a parameter of the module is found nowhere in the file."""
    import onnx
    import torch

    inputs = as_tuple(example_inputs)
    names = _input_names(model, len(inputs))
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    # routed experts as a dense form, and the router's auxiliary loss as an output (_moe.py)
    moe = _moe.MoeExport(model, names)
    wrapper = moe.wrap(_wrapper(model, names, kwargs))
    dynamic_shapes = None
    if dynamic:
        batch = torch.export.Dim("batch")
        max_seq = _max_positions(model)
        seq = torch.export.Dim("seq", max=max_seq) if max_seq else torch.export.Dim("seq")
        # one entry: the wrapper's `*args`
        dynamic_shapes = (tuple(
            {0: batch, **({1: seq} if x.dim() >= 2 and not x.is_floating_point() else {})} for x in inputs),)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _export_mode(model), moe.exporting(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(wrapper, inputs, dynamo=True, opset_version=OPSET,
                                    dynamic_shapes=dynamic_shapes, input_names=names,
                                    output_names=["logits", *moe.output_names], verbose=False)
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    param_record().drop_stack_traces(proto)
    record = param_record().write_record(wrapper, proto)
    if record["missing"]:
        raise SmpError(f"parameters not in the export of {type(model).__name__}: {record['missing']} "
                       "(see docs/parameter-record.md, 'Merged nodes')")
    moe.annotate(proto)
    onnx.save(proto, str(path))
    return Exported(path=path, input_names=names, record=record)
