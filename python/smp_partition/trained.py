"""`load_trained`: a run's trained weights back into the `nn.Module`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterable

from ._binaries import find_binary
from ._run import run as run_binary
from .errors import SmpError
from .launch import Run


def export_trained(run: Run, path: str | Path | None = None) -> Path:
    """`smp-runner export CHECKPOINT_DIR -o trained.safetensors`: the run's last checkpoint as
    one file of weights under module parameter names (docs/checkpoints.md). Needs a run
    launched with `checkpoint_dir`."""
    if run.checkpoint_dir is None:
        raise SmpError("the run kept no checkpoint: launch it with checkpoint_dir=... to export one")
    target = Path(path) if path else run.dir / "trained.safetensors"
    runner = find_binary("smp-runner")
    help_text = subprocess.run([str(runner), "--help"], capture_output=True, text=True).stdout
    if not any(line.strip().startswith("export") for line in help_text.splitlines()):
        raise SmpError(f"{runner} has no `export` subcommand (checkpoint export); build a runner that has it")
    run_binary("smp-runner", ["export", run.checkpoint_dir, "-o", target])
    return target


def unused_parameters(model_path: str | Path) -> list[str]:
    """The parameters the export of `model_path` left out because its forward pass does not
    read them (the record's `smp.missing`; `smp_partition.export` refuses any other loss)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    return list(json.loads(meta.get("smp.missing", "[]")))


def counters(model_path: str | Path) -> dict[str, str]:
    """The BatchNorm counters the export of `model_path` recorded (`smp.counters`):
    {`num_batches_tracked` buffer: the running mean whose training forwards it counts}."""
    import onnx

    from .param_record import read_counters

    return read_counters(onnx.load(str(model_path), load_external_data=False))


def stacked_experts(model_path: str | Path) -> dict[str, list[list[str]]]:
    """The stacked expert weights of the export `model_path` (`smp.stacked`): {stacked weight:
    per expert, the module tensors concatenated on dim 0}."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    entry = next((p.value for p in proto.metadata_props if p.key == "smp.stacked"), None)
    return json.loads(entry) if entry else {}


def transposed_experts(model_path: str | Path) -> list[str]:
    """The expert weights the export `model_path` stored with their last two axes swapped
    (`smp.transposed`)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    entry = next((p.value for p in proto.metadata_props if p.key == "smp.transposed"), None)
    return json.loads(entry) if entry else []


def deinterleaved_experts(model_path: str | Path) -> list[str]:
    """The expert weights the export `model_path` stored with their gate and up rows
    de-interleaved (`smp.deinterleaved`: axis 1 holds the module's even entries, then its odd
    ones)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    entry = next((p.value for p in proto.metadata_props if p.key == "smp.deinterleaved"), None)
    return json.loads(entry) if entry else []


def reinterleaved(tensors: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`tensors` with axis 1 of each of `names` interleaved back (the first half's entries at
    the even places, the second half's at the odd ones)."""
    out = dict(tensors)
    for k in names:
        if k not in tensors:
            continue
        t = tensors[k]
        if t.shape[1] % 2:
            raise SmpError(f"trained `{k}` has {t.shape[1]} gate and up rows, which do not halve")
        half = t.shape[1] // 2
        back = t.clone()
        back[:, 0::2], back[:, 1::2] = t[:, :half], t[:, half:]
        out[k] = back
    return out


def in_module_layout(tensors: dict[str, Any], model_path: str | Path) -> dict[str, Any]:
    """Trained `tensors` of the export `model_path` in its module's layout: expert weights
    interleaved back, transposed back and split back into their module tensors, in the reverse
    order of the export's."""
    tensors = reinterleaved(tensors, deinterleaved_experts(model_path))
    return unstacked(untransposed(tensors, transposed_experts(model_path)), stacked_experts(model_path))


def untransposed(tensors: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`tensors` with each of `names` given back its module layout (last two axes swapped)."""
    return {k: (v.transpose(-2, -1).contiguous() if k in names else v) for k, v in tensors.items()}


def unstacked(tensors: dict[str, Any], stacked: dict[str, list[list[str]]]) -> dict[str, Any]:
    """`tensors` with each stacked expert weight split back into its module tensors."""
    if not stacked:
        return tensors
    out = {k: v for k, v in tensors.items() if k not in stacked}
    for name, experts in stacked.items():
        if name not in tensors:
            continue
        whole = tensors[name]
        if whole.shape[0] != len(experts):
            raise SmpError(f"trained `{name}` has {whole.shape[0]} experts, the export stacked {len(experts)}")
        for e, parts in enumerate(experts):
            rows = whole[e].shape[0] // len(parts)
            for i, part in enumerate(parts):
                out[part] = whole[e][i * rows:(i + 1) * rows].clone()
    return out


def training_forwards(run: Run) -> int:
    """How many training forwards each module of `run` made on the replica whose buffers the
    trained weights hold: one per microbatch of every step (a resumed run's steps count from
    the start), as PyTorch's `num_batches_tracked` counts them."""
    steps = [int(s.get("step", 0)) for s in run.report.get("steps", [])]
    return (max(steps) if steps else 0) * max(1, int(run.plan.parallel.microbatches))


def state_dict_of(module: Any, tensors: dict[str, Any], prefix: str = "", unused: Iterable[str] = ()) -> dict[str, Any]:
    """`module`'s full state dict from `tensors` (trained parameters under module parameter
    names, optionally prefixed): names lose `prefix`; a tied parameter given under one of its
    names fills its aliases; buffers the file lacks (not trained) keep the module's values,
    and non-persistent buffers (no part of `state_dict`) are left out; parameters in `unused`
    (not read by the exported forward pass, so not trained) keep the module's values.
    Raises `SmpError` naming any other parameter the file lacks or any name the module lacks."""
    if prefix and tensors and all(k.startswith(prefix) for k in tensors):
        tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    unused = {u[len(prefix):] if prefix and u.startswith(prefix) else u for u in unused}
    params = dict(module.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, p in params.items():
        aliases.setdefault(id(p), []).append(name)
    current = module.state_dict(keep_vars=True)
    non_persistent = {n for n, _ in module.named_buffers(remove_duplicate=False)} - set(current)
    tensors = {k: v for k, v in tensors.items() if k not in non_persistent}
    unknown = sorted(k for k in tensors if k not in current)
    if unknown:
        raise SmpError(f"the trained weights hold tensors {type(module).__name__} does not have: {unknown[:10]}")
    out: dict[str, Any] = {}
    missing = []
    for name, value in current.items():
        if name in tensors:
            out[name] = tensors[name]
        elif name in params:
            given = [a for a in aliases[id(params[name])] if a in tensors]
            if given:
                out[name] = tensors[given[0]]
            elif any(a in unused for a in aliases[id(params[name])]):
                out[name] = value.detach()  # not read by the forward pass: untrained, as in PyTorch
            else:
                missing.append(name)
        else:
            out[name] = value.detach()  # a buffer: not trained
    if missing:
        raise SmpError(f"the trained weights lack parameters of {type(module).__name__}: {missing[:10]}")
    return out


def load_trained(model: Any, run: Run, *, path: str | Path | None = None) -> Any:
    """Loads `run`'s trained weights into `model` (the module given to `plan`) with
    `load_state_dict(strict=True)` and returns it.

    Parameters and the buffers training moves (BatchNorm's running statistics) come back under
    their own names; BatchNorm's `num_batches_tracked` advances by the run's training forwards.
    The weights come from `path` if given, else from the run's final weights (`run.trained`:
    every `launch` writes them, one tensor per module parameter, whole, under its module name),
    else from `smp-runner export` of the run's checkpoint directory."""
    from safetensors.torch import load_file

    if path is not None:
        source = Path(path)
    elif run.trained is not None:
        source = run.trained
    elif run.checkpoint_dir is not None:
        source = run.trained = export_trained(run)
    else:
        raise SmpError("the run has no final weights (run.trained) and kept no checkpoint; launch it with "
                       "smp_partition.launch, which writes them")
    if not source.is_file():
        raise SmpError(f"the run's weights file {source} does not exist")
    tensors = load_file(str(source))
    if run.plan.model_path.is_file():
        tensors = in_module_layout(tensors, run.plan.model_path)
    unused = unused_parameters(run.plan.model_path) if run.plan.model_path.is_file() else []
    full = state_dict_of(model, tensors, run.plan.prefix, unused)
    if run.plan.model_path.is_file():
        forwards = training_forwards(run)
        prefix = run.plan.prefix
        for counter in counters(run.plan.model_path):
            name = counter[len(prefix):] if counter.startswith(prefix) else counter
            if name in full and counter not in tensors and name not in tensors:
                full[name] = full[name] + forwards
    model.load_state_dict(full, strict=True)
    return model
