"""The parameter record: which module parameters each ONNX initializer stands for.

`torch.onnx.export(..., dynamo=True)` optimises the graph it writes: initializers with equal
values are merged (at HF's default init every LayerNorm weight is 1 and every bias 0, so one
initializer serves a dozen parameters), Linear weights are stored transposed, zero Gemm biases
are dropped, and with fixed shapes masks, RoPE caches and position embeddings gathered for the
example's positions are folded into initializers. The file alone no longer says what PyTorch
trains. `write_record(module, proto)` finds out by matching values against the module's
`named_parameters()`/`named_buffers()` (and their transposes, and rows gathered from them), uses
the exporter's own names where it kept them, and writes the answer into each initializer's
`TensorProto.metadata_props` (format: docs/parameter-record.md):

    smp.kind       parameter | buffer | constant
    smp.params     JSON list, one entry per module tensor it stands for; an entry lists that
                   tensor's names (aliases of one tied Parameter, e.g. GPT-2's wte/lm_head)
    smp.transform  identity | transpose | gather
    smp.gather     JSON {"dims": [...], "rows": [...]}: the initializer is param[rows] (axis 0),
                   rows shaped `dims` (transform gather only)
    smp.sites      JSON list parallel to smp.params: the nodes that use each (merged only)
    smp.persistent "false" on a buffer the module's state_dict leaves out (RoPE's inv_freq):
                   never handed back to `load_state_dict`
    smp.trainable  "false" on a parameter the module holds with requires_grad = False
    smp.padding_rows  JSON list of the rows of an `nn.Embedding` weight that its lookups send
                   no gradient (`padding_idx`); a tied LM head still trains them

and in the model's metadata_props `smp.param_record` = "1" and `smp.missing` (JSON list of
parameters found nowhere in the file). Zero biases the exporter dropped from Gemm nodes are
restored as initializers (recorded parameters) so that they are trained as in PyTorch.

`smp_partition.export` keeps every parameter out of the exporter's optimiser (nothing is
merged, folded or dropped) and records by name (`exact_names=True`); the project's other
export scripts use the exporter's default optimisation and the matching by value.

One implementation for every export path of the project (the scripts import it through the
shim `scripts/param_record.py`):
    from param_record import write_record
    proto = onnx.load(path); summary = write_record(module, proto); onnx.save(proto, path)
"""

from __future__ import annotations

import ast
import json
from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

VERSION = "1"
K_KIND, K_PARAMS, K_TRANSFORM, K_GATHER, K_SITES, K_PERSISTENT, K_TRAINABLE, K_PADDING = (
    "smp.kind", "smp.params", "smp.transform", "smp.gather", "smp.sites", "smp.persistent", "smp.trainable",
    "smp.padding_rows")
SCOPES = "pkg.torch.onnx.name_scopes"
#: Initializer metadata naming the values a folded initializer was computed from (the key
#: onnxscript's constant folder writes; `smp_partition.export` writes it on the transposed
#: weights it folds).
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def _groups(named):
    """[(aliases, array)] for tensors reported under one or more names (tied Parameters)."""
    by_id: dict[int, tuple[list[str], object]] = {}
    for name, t in named:
        by_id.setdefault(id(t), ([], t))[0].append(name)
    return [(sorted(names), _to_numpy(t)) for names, t in by_id.values()]


def _to_numpy(t) -> np.ndarray:
    """`t` as numpy; the dtypes numpy lacks (bfloat16, float8) as `ml_dtypes`' types of the same
    bytes, as `onnx.numpy_helper.to_array` gives their initializers."""
    import torch

    t = t.detach().cpu()
    lacking = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
    if t.dtype in lacking:
        import ml_dtypes

        raw = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8).numpy()
        return raw.view(getattr(ml_dtypes, lacking[t.dtype]))
    return t.numpy()


def _key(a: np.ndarray):
    a = np.ascontiguousarray(a)
    return (a.dtype.str, a.shape, a.tobytes())


def _names_prop(props, key: str) -> list[str]:
    """The list of names a metadata entry `key` holds as a Python literal (empty if absent)."""
    for p in props:
        if p.key == key:
            try:
                return [s for s in ast.literal_eval(p.value) if isinstance(s, str)]
            except (ValueError, SyntaxError):
                return []
    return []


def _scopes(node: onnx.NodeProto) -> list[str]:
    return _names_prop(node.metadata_props, SCOPES)


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _assign_sites(entries, consumers):
    """For a merged initializer: which consumer node is which parameter, by the node's module
    scope (the deepest scope that is the module of one of the entries)."""
    sites = [[] for _ in entries]
    for node in consumers:
        scopes = set(_scopes(node))
        best, depth = None, -1
        for i, aliases in enumerate(entries):
            for a in aliases:
                m = _module_of(a)
                if m in scopes and m.count(".") > depth:
                    best, depth = i, m.count(".")
        if best is None:
            # no scope names the module (e.g. a helper node): the first entry, as a tie
            best = 0
        sites[best].append(node.name)
    return sites


def _set(t: onnx.TensorProto, entries: dict[str, str]):
    keep = [p for p in t.metadata_props if not p.key.startswith("smp.")]
    del t.metadata_props[:]
    t.metadata_props.extend(keep)
    for k, v in entries.items():
        t.metadata_props.add(key=k, value=v)


def _buffer_entry(names: list[str], persistent: set[str]) -> dict[str, str]:
    md = {K_KIND: "buffer", K_PARAMS: json.dumps([names]), K_TRANSFORM: "identity"}
    if not any(n in persistent for n in names):
        md[K_PERSISTENT] = "false"
    return md


def write_record(module, proto: onnx.ModelProto, *, exact_names: bool = False,
                 swapped: frozenset[str] = frozenset(), deinterleaved: frozenset[str] = frozenset()) -> dict:
    """Writes the parameter record of `module`'s export `proto` (in place). Returns a summary:
    {"parameters": n, "buffers": n, "constants": n, "merged": n, "restored": [...],
     "missing": [...]}.

    With `exact_names` (an export that kept every parameter as an initializer under its own
    name, `smp_partition.export`), initializers are matched by name only: a parameter's own,
    or a 2-D parameter's transpose that names it in `FOLDED_FROM`; nothing is matched by value
    (a constant of ones is not a norm weight). Initializers named in `swapped` hold their
    parameter with its last two axes swapped (`smp.transposed`); those in `deinterleaved` then
    hold axis 1's even entries first, its odd ones after (`smp.deinterleaved`)."""
    params = _groups(module.named_parameters(remove_duplicate=False))
    buffers = _groups(module.named_buffers(remove_duplicate=False))
    persistent = set(module.state_dict().keys())
    # parameters the module holds with requires_grad = False: loaded and written out, not trained
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    padding = _padding_rows(module)
    if exact_names:
        return _record_by_name(params, buffers, persistent, frozen, padding, proto, swapped, deinterleaved)
    alias_of = {a: i for i, (names, _) in enumerate(params) for a in names}
    ident: dict[tuple, list[int]] = defaultdict(list)
    trans: dict[tuple, list[int]] = defaultdict(list)
    for i, (_, a) in enumerate(params):
        ident[_key(a)].append(i)
        if a.ndim == 2:
            trans[_key(a.T)].append(i)
    buf_ident = {_key(a): names for names, a in buffers}
    buf_named = {n: (names, _key(a)) for names, a in buffers for n in names}

    g = proto.graph
    consumers = defaultdict(list)
    for n in g.node:
        for x in n.input:
            if x:
                consumers[x].append(n)

    found: set[int] = set()
    summary = {"parameters": 0, "buffers": 0, "constants": 0, "merged": 0, "restored": [], "missing": []}
    for t in g.initializer:
        a = numpy_helper.to_array(t)
        rec = None
        kept = buf_named.get(t.name)
        if kept is not None and kept[1] == _key(a):
            # a buffer under its own name (BatchNorm's running statistics start as zeros and
            # ones, equal to many parameters): never a parameter
            _set(t, _buffer_entry(kept[0], persistent))
            summary["buffers"] += 1
            continue
        if a.dtype.kind == "f":
            hits = list(ident.get(_key(a), []))
            # the exporter's own name, when it kept one, is the first entry
            own = alias_of.get(t.name)
            if own is not None and own in hits:
                hits.remove(own)
                hits.insert(0, own)
            if a.size <= 1 and own is None:
                hits = []  # scalars match too easily: only by the exporter's name
            if hits:
                rec = ("identity", hits, None)
            elif a.ndim == 2 and trans.get(_key(a)):
                rec = ("transpose", trans[_key(a)], None)
            elif a.size > 1 and not bool((a == a.flat[0]).all()):
                rec = _gather(a, params)
        if rec is not None:
            transform, hits, gather = rec
            entries = [params[i][0] for i in hits]
            md = {K_KIND: "parameter", K_TRANSFORM: transform}
            if len(entries) > 1:
                sites = _assign_sites(entries, consumers[t.name])
                # a merged parameter no node uses was dropped by the exporter (restored below)
                hits = [i for i, s in zip(hits, sites) if s]
                entries = [params[i][0] for i in hits]
                sites = [s for s in sites if s]
                if len(entries) > 1:
                    md[K_SITES] = json.dumps(sites)
                    summary["merged"] += 1
            found.update(hits)
            md[K_PARAMS] = json.dumps(entries)
            _mark_frozen(md, entries, frozen)
            _mark_padding(md, entries, padding)
            if gather is not None:
                md[K_GATHER] = json.dumps(gather)
            _set(t, md)
            summary["parameters"] += 1
        elif _key(a) in buf_ident:
            _set(t, _buffer_entry(buf_ident[_key(a)], persistent))
            summary["buffers"] += 1
        else:
            _set(t, {K_KIND: "constant"})
            summary["constants"] += 1

    # zero biases the optimizer removed from Gemm and Conv nodes (`RemoveOptionalBiasFromGemm`)
    for i, (names, a) in enumerate(params):
        if i in found or not names[0].endswith(".bias") or a.ndim != 1 or a.any():
            continue
        mod = _module_of(names[0])
        gemms = [n for n in g.node if n.op_type in ("Gemm", "Conv") and len(n.input) == 2 and mod in _scopes(n)]
        if not gemms:
            continue
        init = numpy_helper.from_array(a.copy(), _free_name(g, names[0]))
        md = {K_KIND: "parameter", K_PARAMS: json.dumps([names]), K_TRANSFORM: "identity"}
        _mark_frozen(md, [names], frozen)
        _set(init, md)
        g.initializer.append(init)
        for n in gemms:
            n.input.append(init.name)
        found.add(i)
        summary["restored"].append(names[0])
        summary["parameters"] += 1

    summary["missing"] = [params[i][0][0] for i in range(len(params)) if i not in found]
    _set_model_meta(proto, summary["missing"])
    return summary


def _mark_frozen(md: dict[str, str], entries: list[list[str]], frozen: set[str]) -> None:
    """`smp.trainable: false` on a record whose module tensors are all frozen in the module."""
    if entries and all(any(a in frozen for a in names) for names in entries):
        md[K_TRAINABLE] = "false"


def _padding_rows(module) -> dict[str, list[int]]:
    """By the name of its weight, the padding row of each `nn.Embedding` (subclasses included:
    scaled word embeddings), `[]` for one without `padding_idx`: PyTorch's embedding backward
    skips that row."""
    import torch

    rows: dict[str, list[int]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, torch.nn.Embedding):
            p = m.padding_idx
            rows[f"{name}.weight" if name else "weight"] = [] if p is None else [int(p) + m.num_embeddings if p < 0 else int(p)]
    return rows


def _mark_padding(md: dict[str, str], entries: list[list[str]], padding: dict[str, list[int]]) -> None:
    """`smp.padding_rows` on the record of one module tensor that embeddings with a
    `padding_idx` look rows up in (under any of its aliases)."""
    if len(entries) != 1:
        return
    tables = {a: padding[a] for a in entries[0] if a in padding}
    rows = sorted({r for rs in tables.values() for r in rs})
    if not rows:
        return
    if any(not rs for rs in tables.values()):
        # the record is per tensor: every lookup of it skips the rows
        import warnings

        warnings.warn(f"embeddings {sorted(tables)} share one weight but not their padding_idx; the runner "
                      f"gives no lookup of rows {rows} a gradient (PyTorch skips them only in those with it)",
                      stacklevel=3)
    md[K_PADDING] = json.dumps(rows)


def _set_model_meta(proto: onnx.ModelProto, missing: list[str]) -> None:
    meta = {p.key: p for p in proto.metadata_props}
    for k, v in (("smp.param_record", VERSION), ("smp.missing", json.dumps(missing))):
        if k in meta:
            meta[k].value = v
        else:
            proto.metadata_props.add(key=k, value=v)


#: On the model: JSON {counter buffer: the running mean it counts the training forwards of}.
COUNTERS = "smp.counters"


def set_counters(proto: onnx.ModelProto, counters: dict[str, str]) -> None:
    """Records the BatchNorm counters (`num_batches_tracked`) of the running statistics in the
    file: PyTorch adds one per training forward of the module, and the eval-mode graph never
    reads them, so the file holds them only here."""
    meta = {p.key: p for p in proto.metadata_props}
    value = json.dumps(dict(sorted(counters.items())))
    if COUNTERS in meta:
        meta[COUNTERS].value = value
    elif counters:
        proto.metadata_props.add(key=COUNTERS, value=value)


def read_counters(proto: onnx.ModelProto) -> dict[str, str]:
    """`set_counters`' record ({} for a file without one)."""
    meta = {p.key: p.value for p in proto.metadata_props}
    try:
        found = json.loads(meta.get(COUNTERS, "{}"))
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _folded_from(t: onnx.TensorProto) -> list[str]:
    return _names_prop(t.metadata_props, FOLDED_FROM)


def _record_by_name(params, buffers, persistent: set[str], frozen: set[str], padding: dict[str, list[int]],
                    proto: onnx.ModelProto, swapped: frozenset[str] = frozenset(),
                    deinterleaved: frozenset[str] = frozenset()) -> dict:
    """`write_record(..., exact_names=True)`."""
    param_of = {a: i for i, (names, _) in enumerate(params) for a in names}
    buffer_of = {a: i for i, (names, _) in enumerate(buffers) for a in names}
    found: set[int] = set()
    summary = {"parameters": 0, "buffers": 0, "constants": 0, "merged": 0, "restored": [], "missing": []}
    for t in proto.graph.initializer:
        a = numpy_helper.to_array(t)
        source = _folded_from(t)
        if t.name in param_of:
            i = param_of[t.name]
            value = np.swapaxes(params[i][1], -1, -2) if t.name in swapped else params[i][1]
            if t.name in deinterleaved:
                value = np.concatenate([value[:, 0::2], value[:, 1::2]], axis=1)
            if _key(a) != _key(value):
                raise ValueError(f"initializer `{t.name}` does not hold the module's value of that parameter")
            md = {K_KIND: "parameter", K_TRANSFORM: "identity", K_PARAMS: json.dumps([params[i][0]])}
        elif len(source) == 1 and source[0] in param_of and a.ndim == 2:
            i = param_of[source[0]]
            if _key(a) != _key(params[i][1].T):
                raise ValueError(f"initializer `{t.name}` is folded from `{source[0]}` but is not its transpose")
            md = {K_KIND: "parameter", K_TRANSFORM: "transpose", K_PARAMS: json.dumps([params[i][0]])}
        elif t.name in buffer_of:
            _set(t, _buffer_entry(buffers[buffer_of[t.name]][0], persistent))
            summary["buffers"] += 1
            continue
        else:
            _set(t, {K_KIND: "constant"})
            summary["constants"] += 1
            continue
        _mark_frozen(md, [params[i][0]], frozen)
        _mark_padding(md, [params[i][0]], padding)
        _set(t, md)
        found.add(i)
        summary["parameters"] += 1
    summary["missing"] = [params[i][0][0] for i in range(len(params)) if i not in found]
    _set_model_meta(proto, summary["missing"])
    return summary


def drop_stack_traces(proto: onnx.ModelProto) -> None:
    """Removes torch.onnx's per-node stack traces (they name this machine's paths); the module
    scopes (`namespace`, `pkg.torch.onnx.name_scopes`) stay."""
    for node in proto.graph.node:
        keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)


def _free_name(g: onnx.GraphProto, want: str) -> str:
    used = {t.name for t in g.initializer} | {x for n in g.node for x in list(n.input) + list(n.output)}
    used |= {v.name for v in g.input}
    name, k = want, 1
    while name in used:
        name, k = f"{want}.{k}", k + 1
    return name


def _gather(a: np.ndarray, params):
    """`a` == param[rows] along axis 0 for one parameter of rank >= 2, rows found by value."""
    for i, (_, p) in enumerate(params):
        if p.ndim < 2 or p.dtype != a.dtype:
            continue
        tail = p.shape[1:]
        if a.ndim < len(tail) or tuple(a.shape[a.ndim - len(tail):]) != tuple(tail):
            continue
        dims = list(a.shape[: a.ndim - len(tail)])
        row_of = {}
        for r in range(p.shape[0]):
            row_of.setdefault(np.ascontiguousarray(p[r]).tobytes(), r)
        flat = a.reshape((-1,) + tuple(tail))
        rows = []
        for x in flat:
            r = row_of.get(np.ascontiguousarray(x).tobytes())
            if r is None:
                break
            rows.append(r)
        else:
            return ("gather", [i], {"dims": dims, "rows": rows})
    return None


def read_record(proto: onnx.ModelProto) -> dict[str, dict[str, str]]:
    """The record as {initializer name: {key: value}} (for tests and tools)."""
    return {t.name: {p.key: p.value for p in t.metadata_props if p.key.startswith("smp.")}
            for t in proto.graph.initializer}


def keep_apart(module) -> dict:
    """Gives `module`'s constant-valued parameters (norm weights of 1, biases of 0) distinct
    values, in place, for an export whose nodes must stay apart; returns their original values
    by name, for `put_back(module, proto, originals)` after the export.

    The exporter merges equal-valued initializers, and then nodes that compute the same thing
    from the same inputs: GPT-NeoX's parallel residual feeds the block input to both LayerNorms
    of a block, so at HF's default init the two become one node and `post_attention_layernorm`
    is found nowhere in the file (no record can split a node). Exported with distinct values,
    the graph keeps the module's nodes; `put_back` then writes the module's own values into the
    file, so the file holds exactly the module's parameters."""
    import torch

    originals = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                originals[name] = p.detach().clone()
                p.add_(torch.randn_like(p) * 0.02)
    return originals


def put_back(module, proto: onnx.ModelProto, originals: dict) -> None:
    """Restores `keep_apart`'s parameters in `module` and in `proto`'s initializers named after
    them. Raises if the exporter stored one under another name (then its value cannot be put
    back with certainty)."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in originals:
                p.copy_(originals[name])
    inits = {t.name: t for t in proto.graph.initializer}
    for name, value in originals.items():
        t = inits.get(name)
        if t is None:
            raise ValueError(f"keep_apart: the export stores `{name}` under another name")
        t.CopyFrom(numpy_helper.from_array(value.cpu().numpy().astype(numpy_helper.to_array(t).dtype), name))
