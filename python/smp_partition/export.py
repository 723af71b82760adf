"""Exporting an `nn.Module` for the planner: `torch.onnx.export(..., dynamo=True)` with dynamic
batch (and sequence) dims, optimised with every parameter kept out of the optimiser's reach,
then the parameter record (docs/parameter-record.md, `param_record.py`) written by name.

The exporter's optimiser folds and merges what it takes for constants, and a parameter is one
to it: Gemma's RMSNorm `x * (1 + w)` is folded into one initializer and `w` is gone; equal
norm weights are merged into one initializer, and then nodes that compute the same thing from
it into one node; zero biases are dropped; a fixed-shape export folds the position embedding
rows it gathers. `export` hands the parameters to the optimiser as graph inputs, so it can
fold, merge or drop none of them (shapes and masks still fold), puts them back as
initializers under their own names, and folds only the transposes of 2-D weights that
`MatMul` reads (recorded as `transpose`). The file holds exactly the module's parameters.

Buffers that training moves (BatchNorm's running statistics) are held out of the optimiser the
same way: running statistics start as zeros and ones, so the optimiser would merge every
layer's into one pair and the runner would train that pair for all of them. Their counters
(`num_batches_tracked`), which the eval-mode graph never reads, are recorded on the model
(`smp.counters`) and advanced by `load_trained` as PyTorch advances them."""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

from . import _complex, _moe, _trace
from .errors import ExportError, SmpError

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
    #: `write_record`'s summary (parameters, buffers, constants, merged, restored, missing;
    #: `unused`: parameters the forward pass does not read, left out of the file).
    record: dict[str, Any] = field(default_factory=dict)


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """A tensor, a sequence of tensors or a dict of them (by input name) as a tuple."""
    import torch

    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Mapping):
        return tuple(example_inputs.values())
    if isinstance(example_inputs, Sequence):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor, a tuple of tensors or a dict of them by input name, "
                    f"got {type(example_inputs).__name__}")


def token_lengths(names: Sequence[str], inputs: Sequence[Any]) -> dict[str, int]:
    """Dim 1 of each integer input of rank >= 2 (token ids), by input name: the sequence
    dims a dynamic export makes symbolic (`seq` for the first one's length, `seq_<name>` for
    another length)."""
    return {n: int(x.shape[1]) for n, x in zip(names, inputs) if x.dim() >= 2 and not x.is_floating_point()}


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


def _wrapper(model: Any, names: list[str], kwargs: dict[str, Any],
             tracing: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Any:
    """The module the exporter traces: `model` on its inputs by name, its main output, the
    forward run inside `tracing()`."""
    import torch

    class MainOutput(torch.nn.Module):
        """Calls the model with its inputs by name and returns its main output tensor (Hugging
        Face outputs carry cache objects the exporter cannot take)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            with tracing():
                return _first_tensor(self.model(**dict(zip(names, args)), **kwargs))

    return MainOutput()


def _input_names(model: Any, example_inputs: Any) -> list[str]:
    """The forward arguments the example inputs fill: a dict's keys, else the first
    positional parameters of `forward`."""
    signature = inspect.signature(model.forward).parameters
    if isinstance(example_inputs, Mapping):
        unknown = [k for k in example_inputs if k not in signature]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in signature.values()):
            raise SmpError(f"{type(model).__name__}.forward has no argument {unknown[0]!r} (example inputs by name)")
        return list(example_inputs)
    n = len(as_tuple(example_inputs))
    params = [p for p in signature.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
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


def dropout_settings(model: Any) -> list[str]:
    """Where `model` drops activations in training: its dropout modules with p > 0, and its
    modules' own dropout probabilities above 0 (Hugging Face attention's `attention_dropout`,
    applied as a function), each by name."""
    import torch

    found = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            if m.p > 0:
                found.append(f"`{name}` (p = {m.p:g})")
            continue
        found += [f"`{name}.{k}` = {v:g}" if name else f"`{k}` = {v:g}" for k, v in vars(m).items()
                  if "dropout" in k and isinstance(v, float) and v > 0]
    return found


def warn_dropout(model: Any) -> None:
    """Warns, naming where, when `model` applies dropout in training: the export is in
    evaluation mode, so the plan trains without it."""
    import warnings

    found = dropout_settings(model)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        warnings.warn(f"{type(model).__name__} applies dropout in training ({shown}); the graph is exported in "
                      "evaluation mode, so the plan trains without dropout where PyTorch's training applies it; set "
                      "the dropout probabilities to 0 to train the same model both ways", stacklevel=3)


def running_statistics(model: Any, prefix: str = "") -> tuple[set[str], dict[str, str]]:
    """The buffers a training forward of `model` moves, by name with `prefix`: the running
    means and variances of its BatchNorm (and InstanceNorm with `track_running_stats`)
    modules; and their counters, {`num_batches_tracked`: the running mean it counts for}.
    Raises `SmpError` naming a module whose statistics are a cumulative average
    (`momentum=None`), which the runner does not compute."""
    import torch

    moved: set[str] = set()
    counters: dict[str, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.modules.batchnorm._NormBase) or not m.track_running_stats:
            continue
        if m.running_mean is None or m.running_var is None:
            continue
        base = f"{prefix}{name}." if name else prefix
        if m.momentum is None:
            raise SmpError(f"module `{name}` ({type(m).__name__}) keeps its running statistics as a cumulative "
                           "average (momentum=None), which the runner does not compute; give it a momentum "
                           "(PyTorch's default is 0.1)")
        moved |= {base + "running_mean", base + "running_var"}
        if getattr(m, "num_batches_tracked", None) is not None:
            counters[base + "num_batches_tracked"] = base + "running_mean"
    return moved, counters


def _optimize_keeping_parameters(model: Any, parameters: set[str]) -> set[str]:
    """Runs the exporter's optimiser (`onnxscript.optimizer.optimize_ir`, as `optimize=True`
    would) on `model` (an `onnx_ir.Model`) with the initializers named in `parameters` (the
    module's parameters and the buffers training moves) turned into graph inputs meanwhile, so
    that nothing folds, merges or drops them; then puts them back. Returns the names of those
    the optimised graph still reads."""
    import onnxscript.optimizer

    graph = model.graph
    held = []
    for name in [n for n in graph.initializers if n in parameters]:
        value = graph.initializers.pop(name)
        held.append((value, value.const_value))
        value.const_value = None
        graph.inputs.append(value)
    try:
        onnxscript.optimizer.optimize_ir(model)
    finally:
        read = set()
        for value, tensor in held:
            graph.inputs.remove(value)
            value.const_value = tensor
            if value.uses():
                graph.register_initializer(value)
                read.add(value.name)
    return read


def _fold_weight_transposes(proto: Any, parameters: set[str]) -> None:
    """Folds `Transpose` nodes of 2-D parameters into initializers named after the node's output
    (what the exporter's optimiser does for `MatMul`'s weights), each naming its parameter in
    `FOLDED_FROM`; a parameter then read by no node leaves the file (its transpose holds it)."""
    from onnx import numpy_helper

    from . import param_record

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in parameters:
            continue
        weight = inits.get(node.input[0])
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        if weight is None or len(weight.dims) != 2 or perm != [1, 0]:
            continue
        folded = numpy_helper.from_array(numpy_helper.to_array(weight).T.copy(), node.output[0])
        folded.metadata_props.add(key=param_record.FOLDED_FROM, value=repr([weight.name]))
        graph.initializer.append(folded)
        graph.node.remove(node)
    read = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    names = {t.name for t in kept}
    info = [v for v in graph.value_info if v.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(info)


def _owner(model: Any, name: str) -> str:
    """`name`'s module and its class, for messages: `model.layers.0.norm (GemmaRMSNorm)`."""
    path = name.rsplit(".", 1)[0] if "." in name else ""
    try:
        return f"`{path}` ({type(model.get_submodule(path)).__name__})"
    except AttributeError:
        return f"`{path}`"


def _dynamic_shapes(model: Any, names: list[str], inputs: Sequence[Any], lengths: dict[str, int]) -> Any:
    """`torch.export` dynamic shapes: dim 0 of every input the symbolic `batch`; dim 1 of the
    token inputs in `lengths` the symbolic `seq` (token inputs of the first one's length share
    it, the others get their own), at most the model's maximum positions."""
    import torch

    batch = torch.export.Dim("batch")
    max_seq = _max_positions(model)
    seq = torch.export.Dim("seq", max=max_seq) if max_seq else torch.export.Dim("seq")
    first = next(iter(lengths.values()), None)

    def dims_of(name: str) -> dict[int, Any]:
        if name not in lengths:
            return {0: batch}
        own = seq if lengths[name] == first else torch.export.Dim(f"seq_{name}", max=max_seq or None)
        return {0: batch, 1: own}

    # one entry: the wrapper's `*args`
    return (tuple(dims_of(n) for n in names),)


def _refusal(model: Any, e: BaseException, modules: _trace.ModuleStack, fixed: int | None = None) -> SmpError:
    """The exporter's failure `e` as an error naming the module and the construct."""
    for x in _trace.causes(e):
        if isinstance(x, SmpError):
            return x  # already says what and where (a complex op this export does not cover)
    where = modules.where_failed()
    tried = (f" (also with the sequence length fixed to the example's, {fixed})" if fixed is not None else "")
    advice = ("make the shape depend on input shapes only (e.g. compute every branch and mask, or pad to a fixed "
              "size), or export a module without it" if _trace.is_data_dependent(e)
              else "the exporter's error is attached as the cause")
    return ExportError(f"{type(model).__name__} cannot be exported to ONNX{tried}: torch.onnx.export stopped on "
                       f"{_trace.construct(e)}" + (f" in module {where}" if where else "") + f"; {advice}")


def export(model: Any, example_inputs: Any, path: str | Path, *, dynamic: bool = True) -> Exported:
    """Exports `model` called on `example_inputs` (a tensor, a tuple of tensors for the first
    positional arguments of `forward`, or a dict of them by argument name) to `path` (ONNX,
    weights inline) with `torch.onnx.export(..., dynamo=True)` and writes the parameter record.

    With `dynamic`, dim 0 of every input is the symbolic `batch`, and dim 1 of integer inputs
    of rank >= 2 (token ids) the symbolic `seq` (at most the model's `n_positions` or
    `max_position_embeddings`). The graph is exported in eval mode: dropout is not part of it.
    Every parameter the forward pass reads is in the file as itself (see the module doc);
    parameters it does not read are listed in `record["unused"]` (PyTorch leaves them
    untouched too, and `load_trained` keeps their values). Raises `SmpError` naming the
    parameter and its module if one the graph reads is not in the file.

    Complex values (complex rotary embeddings) are exported in real arithmetic (`_complex.py`).
    If the exporter cannot trace the symbolic sequence length, the export is tried again with
    it fixed to the example's (with a warning); if that fails too, `ExportError` names the
    module being traced and the construct, the exporter's error as its `__cause__`."""
    import onnx
    import torch

    from . import param_record

    inputs = as_tuple(example_inputs)
    names = _input_names(model, example_inputs)
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    modules = _trace.ModuleStack(model)

    @contextlib.contextmanager
    def tracing() -> Iterator[None]:
        # the module being traced (for messages); complex values as real pairs (_complex.py)
        with modules.forward(), _complex.RealComplex(modules.innermost):
            yield

    warn_dropout(model)
    # routed experts as a dense form, and the router's auxiliary loss as an output (_moe.py)
    moe = _moe.MoeExport(model, names)
    wrapper = moe.wrap(_wrapper(model, names, kwargs, tracing))
    lengths = token_lengths(names, inputs)
    dynamic_shapes = _dynamic_shapes(model, names, inputs, lengths) if dynamic else None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parameters = {PREFIX + n for n, _ in model.named_parameters(remove_duplicate=False)}
    parameters |= {PREFIX + n for n in moe.stacked}
    statistics, counters = running_statistics(model, PREFIX)

    def capture(shapes: Any) -> Any:
        # torch.export prints the partial graph of a failed attempt to stderr: a failure is
        # refused by name instead (the exporter's error its cause); a success's output is kept
        printed = io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(wrapper, inputs, dynamo=True, opset_version=OPSET, dynamic_shapes=shapes,
                                        input_names=names, output_names=["logits", *moe.output_names],
                                        verbose=False, optimize=False)
        sys.stderr.write(printed.getvalue())
        return program

    with _export_mode(model), moe.exporting(), torch.no_grad(), modules.running():
        try:
            program = capture(dynamic_shapes)
        except Exception as e:  # noqa: BLE001 - every exporter failure is refused by name below
            if not (dynamic and lengths) or any(isinstance(x, SmpError) for x in _trace.causes(e)):
                raise _refusal(model, e, modules) from e
            # a fixed sequence length decides what a symbolic one often cannot (data-dependent
            # shapes, guards on the length, value ranges)
            first = next(iter(lengths.values()))
            warnings.warn(f"{type(model).__name__}: the export with a symbolic sequence length stopped on "
                          f"{_trace.construct(e)} in module {modules.where_failed() or 'the model'}; exported "
                          f"again with the sequence length fixed to the example's ({first}): plan and train on "
                          f"sequences of exactly {first} tokens", stacklevel=2)
            modules.failed_in = None
            try:
                program = capture(_dynamic_shapes(model, names, inputs, {}))
            except Exception as again:  # noqa: BLE001
                raise _refusal(model, again, modules, fixed=first) from again
        read = _optimize_keeping_parameters(program.model, parameters | statistics)
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    _fold_weight_transposes(proto, read & parameters)
    param_record.drop_stack_traces(proto)
    record = param_record.write_record(wrapper, proto, exact_names=True,
                                       swapped=frozenset(PREFIX + n for n in moe.transposed),
                                       deinterleaved=frozenset(PREFIX + n for n in moe.deinterleaved))
    moe.record_stacked(proto, record, PREFIX)
    lost = [n for n in record["missing"] if n in read]
    if lost:
        raise SmpError(f"parameter `{lost[0][len(PREFIX):]}` of {type(model).__name__} (module "
                       f"{_owner(wrapper, lost[0])}) is read by the exported graph but is not in the file"
                       + (f" (nor {len(lost) - 1} more)" if len(lost) > 1 else "")
                       + ": the exporter's optimiser rewrote what reads it, so the file would not train it as "
                       "the module does; this is a bug of the export, please report it with the model's config")
    record["unused"] = list(record["missing"])
    if record["unused"]:
        warnings.warn(f"{type(model).__name__}: {len(record['unused'])} parameters are not read by the forward "
                      f"pass on these inputs and are left out of the file (PyTorch does not train them either): "
                      f"{', '.join(n[len(PREFIX):] for n in record['unused'][:5])}", stacklevel=2)
    # counters of the statistics the graph reads (the others' modules never run)
    record["counters"] = {c: m for c, m in counters.items() if m in read}
    param_record.set_counters(proto, record["counters"])
    moe.annotate(proto)
    onnx.save(proto, str(path))
    return Exported(path=path, input_names=names, record=record)
