"""Mixture-of-experts models through the front door (used by `export`).

transformers runs a model's routed experts through an experts implementation chosen by
`set_experts_implementation` (`@use_experts_implementation` classes: Mixtral, Qwen-MoE, OLMoE,
DeepSeek, ...). Its default, `grouped_mm`, is an opaque custom op that torch.onnx cannot export;
`eager` loops over the experts a batch hits, which is data-dependent control flow. The export
selects `smp_dense` instead (registered here, set on each experts module's config for the
export only, so a bare MoE block exports too): every expert's gated MLP on every token, weighted
by a one-hot of the router's choices — numerically the module (a token's unchosen experts get
weight 0), in ops every ONNX runtime executes. The planner's fusion pass
(`passes::fuse`, see its module docs for the exact pattern) turns each such block into one
`MixtureOfExperts` op whose kernel runs only the routed tokens. The router itself (logits,
softmax, top-k, the model's own normalisation) is exported as the model computes it. Experts
stored transposed (`is_transposed`: `[E, H, 2I]`, `[E, I, H]`) are exported in the dense form's
layout, named in `smp.transposed` as stacked-weight blocks' are (below). A gate function of the
class's own that computes the clamped SwiGLU of DeepSeek-V4 and GLM-5, or gpt-oss's clamped swish
`g'·σ(α·g')·(clip(u, ±L) + 1)` (`gate_form`, on a probe in f64), exports as the dense form with its
clamps, which the fusion pass fuses with the limit (and α). Biases are added in the dense form
after each projection, and gate and up rows stored interleaved (gpt-oss) are exported gate rows
first, named in `smp.deinterleaved`. Experts-interface classes outside those forms — any other
gate function, a gate activation other than SiLU, no gate, a norm after each expert — are
exported as transformers' own experts function computes them (`dense_general`: the module's own
gate, weights in their stored layout), which the fusion pass leaves as ops: they run densely, and
the export warns so, naming them.

Per-expert modules looped over the experts a batch hits (Mixtral's earlier form, and models
written that way): a block holding a router weight `[E, H]` and an `nn.ModuleList` of E gated
MLPs (three bias-free linears, `down(silu(gate(x)) * up(x))`) is recognised by what it
computes: on a probe in f64, each expert must equal that MLP (gate and up told apart so), and
the block must equal some top-k routing (the softmax's top-k, normalised or not, or the sigmoid
of the top logits) weighting each expert's output or the token entering it. For the export only,
the list is swapped for its stacked weights, `gate_up_proj [E, 2I, H]` and `down_proj
[E, H, I]` under the list's name, and the block computes the dense form above; the file's
metadata `smp.stacked` names the module tensors each stacked weight is made of, and
`load_trained` splits the trained ones back. A block that matches no such form is left as it
is (its export then meets the data-dependent loop and is refused by name).

Stacked-weight blocks with their own routing (Llama 4's form, and models written that way): a
block holding a router weight `[E, H]`, one child with two 3-D weights of E experts (a gate-up
and a down projection, `[E, 2I, H]`/`[E, H, I]` or transposed `[E, H, 2I]`/`[E, I, H]`) and
optionally one shared expert is recognised by what it computes: on a probe in f64 the block must
equal some top-k routing — the sigmoid of the top logits, or the softmax's top-k, normalised or
not — weighting either each expert's output or the token entering it (Llama 4 scales the token:
`Σ expert(w·x)`), plus the shared expert. For the export only it computes the dense form above
(`dense_experts`, or `dense_experts_input` for input weighting, which `passes::fuse` records as
`weighting = "input"`); transposed weights are exported as `[E, 2I, H]`/`[E, H, I]` under their
own names, the file's metadata `smp.transposed` names them, and `load_trained` transposes the
trained ones back.

The same form with the two weights in two children of the block (JetMoE: `input_linear`,
`output_linear`), and with a bias `[H]` of the block's own added to the experts' sum, is
recognised the same way; the bias is drawn at random on the probe, so a form without it cannot
match a block that adds it.

Mixtures of attention heads (JetMoE's attention): a module with `map` (each token's k routed
query projections, `[B, S, k, O]`, its router logits and the routing) and `reduce` (the k
attention outputs' routed output projections, weighted by the router, summed, plus a bias), a
router weight `[E, H]` and two children holding one weight each, `[E, O, H]` and `[E, H, O]`.
Recognised on a probe in f64 against the module's own `map` and `reduce`, both are replaced for
the export by dense ones (`_HeadsBlock.methods`): every expert's projection as one matrix
product over the stacked weights, the chosen ones picked (and weighted) by a one-hot. No fused
op covers them: they run densely, E/k times their routed FLOPs, and the export warns so.

The auxiliary load-balancing loss. When the model's config asks for it
(`output_router_logits`), Hugging Face adds `router_aux_loss_coef · aux` to the loss of every
forward, with `aux = E · Σ_e f_e · P_e`: `f_e` the share of top-k choices that went to expert
e and `P_e` its mean router probability, both over every token of every MoE layer
(`load_balancing_loss_func`). The export computes the same value in the graph: a hook on each
router adds its layer's choice counts and probability sums to running totals (so only two
E-vectors cross each pipeline stage), and the graph gets a second, scalar output `aux_loss`
from them. The file's metadata `smp.aux_loss` names the output and its coefficient; the
runner's loss of a microbatch is then the model's own `loss + coef · aux_loss` of that
microbatch, averaged over microbatches and replicas by their counted tokens, as the main loss
is (Hugging Face's gradient accumulation). With one microbatch it is the loss of
`model(ids, labels=ids)`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from typing import Any, Iterator, NamedTuple

from .errors import SmpError

#: The experts implementation the export selects.
IMPLEMENTATION = "smp_dense"
#: The graph output holding the auxiliary loss, and the model metadata key naming it.
AUX_OUTPUT, AUX_KEY = "aux_loss", "smp.aux_loss"


def dense_experts(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """transformers' experts interface (`hidden_states [N, H]`, `top_k_index` and
    `top_k_weights [N, k]`) as a dense computation over all experts: for experts of a form
    `passes::fuse` fuses (`gate_form`), its exact pattern; for any other, `dense_general`."""
    import torch

    experts = _expert_count(self)
    ids = torch.arange(experts, device=hidden_states.device)
    one_hot = (top_k_index.unsqueeze(-1) == ids).to(top_k_weights.dtype)            # [N, k, E]
    combine = (one_hot * top_k_weights.unsqueeze(-1)).sum(1)                         # [N, E]
    form = _FORMS.get(id(self), GateForm("silu"))
    if form is None:
        return dense_general(self, hidden_states, combine)
    # weights in the fused layout (`MoeExport._interface`): gate_up [E, 2I, H], gate rows first
    gate_up = torch.matmul(self.gate_up_proj, hidden_states.transpose(0, 1))         # [E, 2I, N]
    if form.biases:
        gate_up = gate_up + self.gate_up_proj_bias.unsqueeze(-1)
    gate, up = gate_up.chunk(2, dim=1)
    if form.limit is not None:  # the clamped forms
        gate, up = gate.clamp(max=form.limit), up.clamp(min=-form.limit, max=form.limit)
    if form.kind == "clamped_swish":
        h = gate * torch.sigmoid(gate * form.alpha) * (up + 1)
    else:
        h = torch.nn.functional.silu(gate) * up
    y = torch.matmul(self.down_proj, h)                                              # [E, H, N]
    if form.biases:
        y = y + self.down_proj_bias.unsqueeze(-1)
    out = (y * combine.transpose(0, 1).unsqueeze(1)).sum(0)                          # [H, N]
    return out.transpose(0, 1).to(hidden_states.dtype)


class GateForm(NamedTuple):
    """A form of experts the fused `MixtureOfExperts` op computes: its activation (`kind`:
    "silu", "clamped_silu" or "clamped_swish", with its `limit` and swish `alpha`), whether
    the experts carry biases, and whether the module stores its gate and up rows interleaved
    (gate, up, gate, ...), which the export de-interleaves (gate rows first)."""

    kind: str
    limit: float | None = None
    alpha: float | None = None
    biases: bool = False
    interleaved: bool = False


#: `gate_form` of each experts-interface module being exported, by id (`MoeExport.forms`,
#: decided before tracing: its probe does not trace); the stacked modules of recognised blocks
#: are of the SiLU form.
_FORMS: dict[int, GateForm | None] = {}


def _positive_attr(m: Any, names: tuple[str, ...]) -> float | None:
    """The one positive number `m` holds under any of `names` (None: none, or several differing)."""
    found = {float(v) for k in names if isinstance(v := getattr(m, k, None), (int, float))
             and not isinstance(v, bool) and v > 0}
    return found.pop() if len(found) == 1 else None


def gate_form(m: Any) -> GateForm | None:
    """The fused `MixtureOfExperts` form that experts-interface module `m` computes: "silu" for
    `silu(gate)·up` (the interface's default gate with a SiLU activation); for a gate function of
    the class's own, recognised on a probe in f64, "clamped_silu" for `silu(min(gate, L))·clip(up,
    −L, L)` (DeepSeek-V4's and GLM-5's) and "clamped_swish" for `g·σ(α·g)·(clip(up, −L, L) + 1)`
    with `g = min(gate, L)` (gpt-oss's, its gate and up rows interleaved); biases or not. `None`
    where the fused kernel does not compute the experts: no gate, a norm after each expert, any
    other gate."""
    import torch
    from transformers.integrations import moe

    if not m.has_gate or getattr(m, "has_post_expert_norm", False):
        return None
    biases = bool(m.has_bias)
    default = getattr(moe, "_default_apply_gate", None)
    gate = getattr(type(m), "_apply_gate", default)
    if gate is default:
        return GateForm("silu", biases=biases) if _is_silu(getattr(m, "act_fn", None)) else None
    limit = _positive_attr(m, ("limit", "swiglu_limit"))
    if limit is None:
        return None
    alpha = _positive_attr(m, ("alpha", "swiglu_alpha"))
    # the gate acts elementwise on the two halves of its input's last axis: any even width probes it
    probe = torch.randn(64, 16, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2 * limit
    try:
        with torch.no_grad():
            got = m._apply_gate(probe)
    except Exception:  # noqa: BLE001 - a gate that cannot take a probe is not a known form
        return None
    if not isinstance(got, torch.Tensor):
        return None
    for interleaved in (False, True):
        g, u = (probe[:, 0::2], probe[:, 1::2]) if interleaved else probe.chunk(2, dim=-1)
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        forms = [GateForm("clamped_silu", limit, biases=biases, interleaved=interleaved)]
        scale = alpha if alpha is not None else _swish_scale(got, g, u)
        if scale is not None:
            forms.append(GateForm("clamped_swish", limit, scale, biases, interleaved))
        for form in forms:
            want = torch.nn.functional.silu(g) * u if form.kind == "clamped_silu" else g * torch.sigmoid(g * scale) * (u + 1)
            if got.shape == want.shape and bool(torch.allclose(got.double(), want, rtol=1e-12, atol=1e-12 * limit)):
                return form
    return None


def _swish_scale(got: Any, g: Any, u: Any) -> float | None:
    """The α a gate output `got` would have as `g·σ(α·g)·(u + 1)` (a class holding α as a
    constant, not an attribute), from the probe's well-conditioned entries; None where there is
    none (the caller checks the whole probe against it)."""
    import torch

    if got.shape != g.shape:
        return None
    ratio = got.double() / (g * (u + 1))
    usable = (g.abs() > 1e-3) & ((u + 1).abs() > 1e-3) & (ratio > 1e-6) & (ratio < 1 - 1e-6)
    if not bool(usable.any()):
        return None
    estimates = torch.logit(ratio[usable]) / g[usable]
    return float(estimates.median()) if bool(torch.isfinite(estimates).all()) else None


def _is_silu(act: Any) -> bool:
    """Whether `act` computes SiLU, on a probe (the fused kernel's only gate activation)."""
    import torch

    if not callable(act):
        return False
    # f32 whatever the default dtype (a model built under float64 is probed the same way)
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float32)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001 - an activation that cannot take a probe is not SiLU
        return False
    return isinstance(got, torch.Tensor) and got.shape == probe.shape and bool(
        torch.allclose(got.float(), torch.nn.functional.silu(probe), rtol=1e-6, atol=1e-7))


def _expert_count(m: Any) -> int:
    return int((m.gate_up_proj if getattr(m, "has_gate", True) else m.up_proj).shape[0])


def _unfused_parts(m: Any) -> list[str]:
    """What keeps experts module `m` from the fused form, in words."""
    from transformers.integrations import moe

    default = getattr(moe, "_default_apply_gate", None)
    own = m.has_gate and getattr(type(m), "_apply_gate", default) is not default
    return [what for what, present in (
        ("no gate projection", not m.has_gate),
        ("a gate function of their own (`_apply_gate`) other than the clamped SiLU and clamped swish the kernel "
         "computes", own),
        ("a gate activation other than SiLU", m.has_gate and not own and not _is_silu(getattr(m, "act_fn", None))),
        ("a norm after each expert", getattr(m, "has_post_expert_norm", False)),
    ) if present]


def dense_general(self: Any, hidden_states: Any, combine: Any) -> Any:
    """Any experts-interface module as transformers' own experts function computes it (the
    module's gate function or activation, biases, weights in their stored layout, a norm after
    each expert), on every token for every expert, weighted by `combine [N, E]`. Not fused:
    it runs as the ops it exports to."""
    import torch

    def linear(x: Any, w: Any) -> Any:  # x [.., N, in] by each expert's weight
        return torch.matmul(x, w if self.is_transposed else w.transpose(1, 2))

    if self.has_gate:
        h = linear(hidden_states, self.gate_up_proj)                                 # [E, N, 2I]
        if self.has_bias:
            h = h + self.gate_up_proj_bias.unsqueeze(1)
        h = self._apply_gate(h)                                                     # [E, N, I]
    else:
        h = linear(hidden_states, self.up_proj)
        if self.has_bias:
            h = h + self.up_proj_bias.unsqueeze(1)
        h = self.act_fn(h)
    y = linear(h, self.down_proj)                                                   # [E, N, H]
    if self.has_bias:
        y = y + self.down_proj_bias.unsqueeze(1)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    out = (y * combine.transpose(0, 1).unsqueeze(-1)).sum(0)                         # [N, H]
    return out.to(hidden_states.dtype)


def dense_experts_input(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """`dense_experts` with the router's weights scaling each token going into its experts
    (`Σ_j expert_j(w_j·x)`) instead of their outputs."""
    import torch

    experts = self.gate_up_proj.shape[0]
    ids = torch.arange(experts, device=hidden_states.device)
    one_hot = (top_k_index.unsqueeze(-1) == ids).to(top_k_weights.dtype)            # [N, k, E]
    combine = (one_hot * top_k_weights.unsqueeze(-1)).sum(1)                         # [N, E]
    scaled = combine.transpose(0, 1).unsqueeze(1) * hidden_states.transpose(0, 1)   # [E, H, N]
    gate, up = torch.matmul(self.gate_up_proj, scaled).chunk(2, dim=1)
    y = torch.matmul(self.down_proj, self.act_fn(gate) * up)                         # [E, H, N]
    return y.sum(0).transpose(0, 1).to(hidden_states.dtype)


def _experts_modules(model: Any) -> list[tuple[str, Any]]:
    """The `@use_experts_implementation` modules of `model` (they carry `has_gate`)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def _check_experts(name: str, m: Any) -> None:
    first = "gate_up_proj" if m.has_gate else "up_proj"
    if not hasattr(m, first) or not hasattr(m, "down_proj"):
        raise SmpError(f"experts `{name}` ({type(m).__name__}) have no {first}/down_proj; the mixture-of-experts "
                       "export takes stacked expert weights: gate_up_proj [E, 2I, H] (or up_proj [E, I, H]) and "
                       "down_proj [E, H, I], or both transposed")


def warn_unfused(model: Any, experts: list[tuple[str, Any]], forms: dict) -> None:
    """Warns, once per experts class, that experts outside the fused forms (`forms`: each
    module's `gate_form`, by id) run densely."""
    import warnings

    seen = set()
    for name, m in experts:
        if forms[id(m)] is not None or type(m) in seen:
            continue
        seen.add(type(m))
        count = _expert_count(m)
        top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        share = f" ({count}/{top_k} = {count / top_k:.3g}× the routed FLOPs)" if top_k else ""
        warnings.warn(f"{type(model).__name__}: experts `{name}` ({type(m).__name__}) have "
                      f"{', '.join(_unfused_parts(m))}, which the fused expert kernel does not compute; they train "
                      f"as exported, densely: every expert on every token{share}, and expert parallelism is not "
                      "available for them", stacklevel=4)


def _router_outputs(model: Any) -> tuple[type, int] | None:
    """The router class and the index of its logits among its outputs, as the model records
    `router_logits` (`_can_record_outputs` of its pretrained classes)."""
    for m in model.modules():
        rec = getattr(m, "_can_record_outputs", None)
        recorder = rec.get("router_logits") if isinstance(rec, dict) else None
        if isinstance(getattr(recorder, "target_class", None), type):
            return recorder.target_class, int(getattr(recorder, "index", 0) or 0)
    return None


def tied_routers(model: Any, experts: list[tuple[str, Any, int]]) -> list[str]:
    """Routers whose every expert scores the same on every token: in the block around each
    experts module (`(name, module, experts)`), a weight `[E, H]` whose E rows are identical
    (zero-initialised), with every `[E]` bias or correction beside it constant."""
    named = dict(model.named_modules())
    out = []
    for name, module, count in experts:
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        block = named.get(parent, model)
        inside = {id(p) for p in module.parameters()}
        tensors = [(n, t) for n, t in [*block.named_parameters(), *block.named_buffers()] if id(t) not in inside]
        routers = [n for n, t in tensors if t.dim() == 2 and t.shape[0] == count and t.shape[1] > 1]
        biases = [t for _, t in tensors if t.dim() == 1 and t.shape[0] == count]
        for n, t in tensors:
            if n in routers and bool((t == t[:1]).all()) and all(bool((b == b[:1]).all()) for b in biases):
                out.append(f"{parent}.{n}" if parent else n)
    return out


def warn_tied_routers(model: Any, experts: list[tuple[str, Any, int]]) -> None:
    """Warns, naming each router of `tied_routers`, that training will not follow PyTorch's."""
    import warnings

    for name in tied_routers(model, experts):
        warnings.warn(f"{type(model).__name__}: router weight `{name}` is the same for every expert (zero-initialised?), "
                      "so every token's expert scores tie at the first step; the exported top-k takes the lower "
                      "expert index first where PyTorch's topk may not, so training will not follow PyTorch's from "
                      "that step; initialise the router's weights (e.g. normal, std 0.02) or load trained ones",
                      stacklevel=4)


#: Model metadata: JSON {stacked weight: [[module tensors of expert e, concatenated on dim 0]]}.
STACKED_KEY = "smp.stacked"
#: The model metadata key listing the expert weights exported with their last two axes swapped.
TRANSPOSED_KEY = "smp.transposed"
#: The model metadata key listing the expert weights exported with their gate and up rows
#: de-interleaved (axis 1: the module's even entries, then its odd ones).
DEINTERLEAVED_KEY = "smp.deinterleaved"


class _LoopBlock:
    """One recognised per-expert-loop block (see the module docs)."""

    def __init__(self, name: str, block: Any, list_name: str, router: str, bias: str | None,
                 order: list[tuple[str, str, str]], top_k: int, scoring: str, weighting: str, with_logits: bool) -> None:
        self.name, self.block, self.list_name = name, block, list_name
        self.router, self.bias, self.order = router, bias, order
        self.top_k, self.scoring, self.weighting, self.with_logits = top_k, scoring, weighting, with_logits

    def path(self, tensor: str) -> str:
        return f"{self.name}.{tensor}" if self.name else tensor

    def stacked(self) -> dict[str, list[list[str]]]:
        """{stacked weight: per expert, the module tensors it concatenates} (module names)."""
        lst = self.path(self.list_name)
        return {f"{lst}.gate_up_proj": [[f"{lst}.{e}.{g}.weight", f"{lst}.{e}.{u}.weight"]
                                        for e, (g, u, _) in enumerate(self.order)],
                f"{lst}.down_proj": [[f"{lst}.{e}.{d}.weight"] for e, (_, _, d) in enumerate(self.order)]}

    def stacked_module(self) -> Any:
        import torch

        experts = getattr(self.block, self.list_name)

        class Stacked(torch.nn.Module):
            """The experts' weights stacked (dense_experts reads these names)."""

            def __init__(self, order: list[tuple[str, str, str]]) -> None:
                super().__init__()
                mods = [dict(m.named_children()) for m in experts]
                self.gate_up_proj = torch.nn.Parameter(torch.stack(
                    [torch.cat([m[g].weight, m[u].weight]) for m, (g, u, _) in zip(mods, order)]).detach().clone())
                self.down_proj = torch.nn.Parameter(
                    torch.stack([m[d].weight for m, (_, _, d) in zip(mods, order)]).detach().clone())
                self.act_fn = torch.nn.functional.silu

        return Stacked(self.order)

    def forward(self, stacked: Any) -> Any:
        import torch

        block, top_k, scoring, with_logits = self.block, self.top_k, self.scoring, self.with_logits
        router, bias_name = self.router, self.bias
        dense = dense_experts_input if self.weighting == "input" else dense_experts

        def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            # read through the module at call time, so that the exporter sees parameters
            weight = block.get_parameter(router)
            bias = block.get_parameter(bias_name) if bias_name else None
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            logits = torch.nn.functional.linear(x, weight, bias)
            top, index = _routed(logits, top_k, scoring)
            y = dense(stacked, x, index, top.to(x.dtype)).reshape(hidden_states.shape)
            return (y, logits) if with_logits else y

        return forward


#: Routing rules a recognised block is tried against (`_routed`), and where its weights apply.
_SCORINGS = ("softmax-normalised", "softmax", "sigmoid")
_WEIGHTINGS = ("output", "input")


def _routed(logits: Any, top_k: int, scoring: str) -> tuple[Any, Any]:
    """(weights, indices) `[N, k]` of the router's `logits` under `scoring`: the softmax's top-k,
    renormalised over the k or not, or the sigmoid of the top-k logits."""
    import torch

    if scoring == "sigmoid":
        top, index = torch.topk(logits, top_k, dim=-1)
        return torch.sigmoid(top.float()).to(logits.dtype), index
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, index = torch.topk(probs, top_k, dim=-1)
    if scoring == "softmax-normalised":
        top = top / top.sum(dim=-1, keepdim=True)
    return top, index


def _gated_order(expert: Any) -> tuple[str, str, str] | None:
    """(gate, up, down) child names if `expert` computes `down(silu(gate(x)) * up(x))` with three
    bias-free linears (checked on a probe in f64), else None."""
    import copy

    import torch

    lins = [(n, m) for n, m in expert.named_children() if isinstance(m, torch.nn.Linear)]
    if len(lins) != 3 or any(m.bias is not None for _, m in lins) or sum(1 for _ in expert.parameters()) != 3:
        return None
    e = copy.deepcopy(expert).double().eval()
    mods = dict(e.named_children())
    for d, _ in lins:
        a, b = [n for n, _ in lins if n != d]
        h = mods[a].in_features
        if (mods[a].weight.shape != mods[b].weight.shape or mods[d].in_features != mods[a].out_features
                or mods[d].out_features != h):
            continue
        probe = torch.randn(5, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            try:
                want = e(probe)
            except Exception:  # noqa: BLE001 - an expert that does not take [N, H] is not one
                return None
            for g, u in ((a, b), (b, a)):
                got = mods[d](torch.nn.functional.silu(mods[g](probe)) * mods[u](probe))
                if isinstance(want, torch.Tensor) and got.shape == want.shape and torch.allclose(
                        got, want, rtol=1e-10, atol=1e-12):
                    return g, u, d
    return None


def _loop_blocks(model: Any) -> list[_LoopBlock]:
    """The per-expert-loop blocks of `model` (module docs), recognised by what they compute."""
    import torch

    out = []
    for name, block in model.named_modules():
        lists = [(n, m) for n, m in block.named_children() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2]
        if len(lists) != 1:
            continue
        list_name, experts = lists[0]
        count = len(experts)
        inside = {id(p) for p in experts.parameters()}
        outside = [(n, p) for n, p in block.named_parameters() if id(p) not in inside]
        routers = [n for n, p in outside if p.dim() == 2 and p.shape[0] == count]
        if len(routers) != 1 or len(outside) > 2:
            continue
        router = routers[0]
        bias = router[:-len("weight")] + "bias" if router.endswith("weight") else None
        bias = bias if bias in dict(outside) else None
        if len(outside) == 2 and bias is None:
            continue
        order = [_gated_order(m) for m in experts]
        if any(o is None for o in order) or any(not p.requires_grad for p in experts.parameters()):
            continue
        probed = _probe(block, dict(outside)[router].shape[1], seed=1)
        if probed is None or probed.main.shape != probed.x.shape:
            continue
        copied, probe, want, with_logits = probed.copied, probed.x, probed.want, probed.with_logits
        found = None
        for top_k, scoring, weighting in itertools.product(range(1, count + 1), _SCORINGS, _WEIGHTINGS):
            candidate = _LoopBlock(name, copied, list_name, router, bias, order, top_k, scoring, weighting, with_logits)
            with torch.no_grad():
                got = candidate.forward(candidate.stacked_module())(probe)
            # f32 steps inside a block (its softmax) round at 1e-7; a wrong top-k or
            # normalisation is off by O(1)
            if _same_outputs(got, want, with_logits):
                found = (top_k, scoring, weighting)
                break
        if found:
            out.append(_LoopBlock(name, block, list_name, router, bias, order, *found, with_logits))
    return out


class _StackedBlock:
    """One recognised stacked-weight block with its own routing (see the module docs). With
    `experts_name` None the two weights are in two children of the block (JetMoE's
    `input_linear`/`output_linear`) and `weights` are their paths in the block."""

    def __init__(self, name: str, block: Any, experts_name: str | None, weights: tuple[str, str], transposed: bool,
                 router: str, shared: str | None, top_k: int, scoring: str, weighting: str, flat: bool,
                 with_logits: bool, bias: str | None = None) -> None:
        self.name, self.block, self.experts_name, self.weights = name, block, experts_name, weights
        self.transposed, self.router, self.shared = transposed, router, shared
        self.top_k, self.scoring, self.weighting = top_k, scoring, weighting
        self.flat, self.with_logits, self.bias = flat, with_logits, bias

    def path(self, tensor: str) -> str:
        return f"{self.name}.{tensor}" if self.name else tensor

    def experts(self) -> tuple[str, Any]:
        """(module name, a module holding exactly the experts' weights)."""
        import torch

        if self.experts_name is not None:
            return self.path(self.experts_name), getattr(self.block, self.experts_name)
        owners = [w.rsplit(".", 1)[0] for w in self.weights]
        return self.path(owners[0]), torch.nn.ModuleList([self.block.get_submodule(o) for o in owners])

    def transposed_names(self) -> list[str]:
        """The exported weights stored with their last two axes swapped (module names)."""
        if not self.transposed:
            return []
        return [self.path(f"{self.experts_name}.{w}") for w in self.weights]

    def stacked_module(self) -> Any:
        """The experts' weights in the dense form's layout, `[E, 2I, H]` and `[E, H, I]`, under
        their own names (the experts module itself when they already are; the block, for
        weights in two children)."""
        import torch

        if self.experts_name is None:
            return self.block
        experts = getattr(self.block, self.experts_name)
        if not self.transposed:
            return experts
        names = self.weights

        class Stacked(torch.nn.Module):
            """The experts' weights, each with its last two axes swapped."""

            def __init__(self) -> None:
                super().__init__()
                for attr in names:
                    w = getattr(experts, attr).transpose(1, 2)
                    setattr(self, attr, torch.nn.Parameter(w.detach().clone().contiguous()))

        return Stacked()

    def forward(self, stacked: Any) -> Any:
        import torch

        import types

        block, router, shared_name, bias = self.block, self.router, self.shared, self.bias
        top_k, scoring, with_logits, flat = self.top_k, self.scoring, self.with_logits, self.flat
        dense = dense_experts_input if self.weighting == "input" else dense_experts
        gate_up_name, down_name = self.weights

        def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            # read through the modules at call time, so that the exporter sees parameters
            view = types.SimpleNamespace(gate_up_proj=stacked.get_parameter(gate_up_name),
                                         down_proj=stacked.get_parameter(down_name), act_fn=torch.nn.functional.silu)
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            logits = torch.nn.functional.linear(x, block.get_parameter(router))
            top, index = _routed(logits, top_k, scoring)
            y = dense(view, x, index, top.to(x.dtype))
            if bias is not None:
                y = y + block.get_parameter(bias)
            if shared_name is not None:
                y = y + block.get_submodule(shared_name)(x)
            y = y if flat else y.reshape(hidden_states.shape)
            return (y, logits) if with_logits else y

        return forward


def _chained_pair(block: Any) -> tuple[str, str] | None:
    """(gate-up path, down path) where two children of `block` each hold one weight, 3-D, of
    one expert count, chaining as `[E, 2I, H]`·`[E, H, I]`; else None."""
    ws = []
    for n, m in block.named_children():
        params = list(m.named_parameters())
        if len(params) == 1 and params[0][1].dim() == 3:
            ws.append((f"{n}.{params[0][0]}", params[0][1]))
    if len(ws) != 2 or ws[0][1].shape[0] != ws[1][1].shape[0]:
        return None
    for (a, wa), (b, wb) in ((ws[0], ws[1]), (ws[1], ws[0])):
        (_, p, q), (_, r, t) = wa.shape, wb.shape
        if p == 2 * t and q == r and p != q:
            return a, b
    return None


def _gate_up_down(experts: Any) -> tuple[tuple[str, str], bool] | None:
    """((gate-up name, down name), transposed) of a module holding exactly two 3-D weights of
    one expert count whose shapes chain as `[E, 2I, H]`·`[E, H, I]` or transposed
    `[E, H, 2I]`·`[E, I, H]`, else None."""
    ws = [(n, p) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3]
    if len(ws) != 2 or sum(1 for _ in experts.parameters()) != 2 or ws[0][1].shape[0] != ws[1][1].shape[0]:
        return None
    for (a, wa), (b, wb) in ((ws[0], ws[1]), (ws[1], ws[0])):
        (_, p, q), (_, r, t) = wa.shape, wb.shape
        if p == 2 * t and q == r and p != q:  # [E, 2I, H], [E, H, I]
            return (a, b), False
        if q == 2 * r and p == t and p != q:  # [E, H, 2I], [E, I, H]
            return (a, b), True
    return None




class _Probed:
    """A block's f64 copy run on a probe `x [2, 3, H]`: what it returned (`want`), its main
    output, and whether it returned router logits beside it."""

    def __init__(self, copied: Any, x: Any, want: Any) -> None:
        self.copied, self.x, self.want = copied, x, want
        self.with_logits = isinstance(want, tuple) and len(want) == 2
        self.main = want[0] if self.with_logits else want


def _probe(block: Any, hidden: int, seed: int, randomised: tuple[str, ...] = ()) -> _Probed | None:
    """`block` run in f64 on a random probe of hidden size `hidden`, or None when it does not
    take hidden states and return a tensor (then it is no mixture-of-experts block). The
    parameters named in `randomised` are drawn at random first (a zero-initialised bias would
    otherwise match a form without it)."""
    import copy

    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, hidden, dtype=torch.float64, generator=gen)
    copied = copy.deepcopy(block).double().eval()
    with torch.no_grad():
        for n in randomised:
            p = copied.get_parameter(n)
            p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=gen))
    try:
        with torch.no_grad():
            want = copied(x)
    except Exception:  # noqa: BLE001 - a block that does not take hidden states is not one
        return None
    probed = _Probed(copied, x, want)
    return probed if isinstance(probed.main, torch.Tensor) else None


def _same_outputs(got: Any, want: Any, with_logits: bool) -> bool:
    """A candidate form's outputs on the probe equal the block's (and its router logits, when
    it returns them), within the rounding of the f32 steps inside a block."""
    import torch

    g, w = (got[0], want[0]) if with_logits else (got, want)
    ok = isinstance(w, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-7)
    if ok and with_logits:
        ok = isinstance(want[1], torch.Tensor) and want[1].numel() == got[1].numel() and torch.allclose(
            got[1], want[1].reshape(got[1].shape), rtol=1e-5, atol=1e-7)
    return ok


def _stacked_blocks(model: Any, taken: set[int]) -> list[_StackedBlock]:
    """The stacked-weight blocks of `model` (module docs), recognised by what they compute;
    experts modules in `taken` (the experts interface's) are left to it."""
    import torch

    out = []
    for name, block in model.named_modules():
        children = dict(block.named_children())
        found = [(n, m, _gate_up_down(m)) for n, m in children.items() if id(m) not in taken]
        found = [(n, m, g) for n, m, g in found if g is not None]
        pair = _chained_pair(block) if not found else None
        if pair is not None:
            # the two weights in two children: the experts are those children
            owners = [w.split(".", 1)[0] for w in pair]
            experts_name, weights, transposed = None, pair, False
            expert_params = [p for o in owners for p in children[o].parameters()]
            count = block.get_parameter(pair[0]).shape[0]
        elif len(found) == 1:
            experts_name, experts, (weights, transposed) = found[0]
            owners = [experts_name]
            expert_params = list(experts.parameters())
            count = getattr(experts, weights[0]).shape[0]
        else:
            continue
        if any(not p.requires_grad for p in expert_params) or any(id(children[o]) in taken for o in owners):
            continue
        inside = {id(p) for p in expert_params}
        routers = [n for n, p in block.named_parameters() if id(p) not in inside and p.dim() == 2 and p.shape[0] == count]
        others = [n for n, m in children.items() if n not in owners and any(True for _ in m.parameters())
                  and not any(r.startswith(n + ".") for r in routers)]
        if len(routers) != 1 or len(others) > 1:
            continue
        router = routers[0]
        router_owner = router.rsplit(".", 1)[0] if "." in router else None
        if router_owner is not None and sum(1 for _ in block.get_submodule(router_owner).parameters()) != 1:
            continue  # a router with a bias or a correction: not a form tried here
        hidden = block.get_parameter(router).shape[1]
        # a bias of the block's own, `[H]`, added to the experts' sum (JetMoE), drawn at random
        # on the probe so that a form without it cannot match
        own = [n for n, p in block.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == hidden]
        own = own if len(own) == 1 else []
        probed = _probe(block, hidden, seed=2, randomised=tuple(own))
        if probed is None or probed.main.numel() != probed.x.numel():
            continue
        copied, probe, want, with_logits = probed.copied, probed.x, probed.want, probed.with_logits
        flat = probed.main.shape != probe.shape
        shared = others[0] if others else None
        match = None
        for bias, top_k, scoring, weighting in itertools.product([None] + own, range(1, count + 1), _SCORINGS,
                                                                 _WEIGHTINGS):
            c = _StackedBlock(name, copied, experts_name, weights, transposed, router, shared, top_k, scoring,
                              weighting, flat, with_logits, bias)
            with torch.no_grad():
                got = c.forward(c.stacked_module())(probe)
            if _same_outputs(got, want, with_logits):
                match = (top_k, scoring, weighting)
                break
        if match:
            out.append(_StackedBlock(name, block, experts_name, weights, transposed, router, shared, *match, flat,
                                     with_logits, bias))
    return out


#: Router settings that make training draw at random: noise on the router's input (Mixtral's
#: `jitter_noise`, PhiMoE's `input_jitter_noise`) or the margin within which PhiMoE's SparseMixer
#: samples among near-best experts (`router_jitter_noise`); at 0 each trains as it evaluates.
_NOISE_ATTRS = ("jitter_noise", "input_jitter_noise", "router_jitter_noise")


def _training_differs(block: Any, hidden: int, zero_noise: bool) -> str | None:
    """What of `block` (an f64 copy, its dropout off) differs between two training-mode
    forwards and backwards on one probe, or between training and evaluation mode ("its output
    differs", "its gradients differ"), else None; tried as the block is and with its scores
    nearly tied (every 2-D weight reading the hidden state drawn to its rows' mean, the router's
    among them, where a sampling router samples and a top-k one still chooses alike). With `zero_noise`, the noise
    attributes of `_NOISE_ATTRS` are set to 0 on the copy first. A block that does not take
    hidden states alone gives None."""
    for tied in (False, True):
        differs = _differs_once(block, hidden, zero_noise, tied)
        if differs is not None:
            return differs
    return None


def _differs_once(block: Any, hidden: int, zero_noise: bool, tied: bool) -> str | None:
    """One probe of `_training_differs`."""
    import copy

    import torch

    copied = copy.deepcopy(block).double()
    if tied:
        with torch.no_grad():
            for p in copied.parameters():
                if p.dim() == 2 and p.shape[1] == hidden:
                    mean = p.mean(dim=0, keepdim=True)
                    p.copy_(mean + 1e-3 * (p - mean))
    for m in copied.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"  # the copy's own config: grouped_mm takes no f64
        for attr in _NOISE_ATTRS if zero_noise else ():
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, hidden, dtype=torch.float64, generator=gen)
    params = [p for p in copied.parameters() if p.requires_grad]

    def run(training: bool, seed: int) -> tuple[Any, list[Any]] | None:
        copied.train(training)
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_(True)
        try:
            y = copied(xi * 1.0)  # not the leaf itself: routers may scale their input in place
        except Exception:  # noqa: BLE001 - a block that does not take hidden states alone
            return None
        y = y[0] if isinstance(y, tuple) else y
        if not isinstance(y, torch.Tensor) or not y.requires_grad:
            return None
        weights = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(6))
        grads = torch.autograd.grad((y * weights).sum(), [xi, *params], allow_unused=True)
        return y.detach(), [g for g in grads if g is not None]

    with torch.random.fork_rng():
        runs = [run(True, 11), run(True, 12), run(False, 11)]
    if any(r is None for r in runs):
        return None
    (y0, g0) = runs[0]
    for y, g in runs[1:]:
        if not torch.allclose(y, y0, rtol=1e-9, atol=1e-12):
            return "its output differs"
        if len(g) != len(g0) or not all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(g, g0)):
            return "its gradients differ"
    return None


def check_deterministic_training(model: Any, name: str, block: Any) -> None:
    """Raises `SmpError` naming mixture-of-experts block `name` when it trains otherwise than
    its evaluation-mode graph computes (sampled routing, noise on the tokens, a gradient of its
    own in training): the export is that graph, which the runner trains, so PyTorch's training
    would not be followed. The fix is named when zeroing the router's noise removes it."""
    hidden = next((int(p.shape[-1]) for p in block.parameters() if p.dim() == 2), None)
    differs = _training_differs(block, hidden, zero_noise=False) if hidden is not None else None
    if differs is None:
        return
    what = f"`{name}` ({type(block).__name__})" if name else type(block).__name__
    found = f"{differs} between training-mode runs, or from evaluation mode, on the same tokens"
    if _training_differs(block, hidden, zero_noise=True) is None:
        noise = sorted({f"{a} = {getattr(m, a)}" for m in block.modules() for a in _NOISE_ATTRS
                        if isinstance(getattr(m, a, None), float) and getattr(m, a) > 0})
        raise SmpError(f"{type(model).__name__}: mixture-of-experts block {what} trains otherwise than it evaluates "
                       f"({found}: {', '.join(noise)} draws at random in training), while the runner trains the "
                       "evaluation-mode graph; with them at 0 it trains as it evaluates: set them to 0 in the config "
                       "(router_jitter_noise, input_jitter_noise) to export")
    raise SmpError(f"{type(model).__name__}: mixture-of-experts block {what} trains otherwise than it evaluates "
                   f"({found}, with its routers' noise settings at 0: routing sampled in training, or a gradient "
                   "estimator of its own), while the runner trains the evaluation-mode graph; no setting of the "
                   "model makes the two the same, so it cannot be trained as PyTorch trains it")


class _HeadsBlock:
    """One recognised mixture of attention heads (module docs): `map` gives each token k routed
    query projections, `reduce` sums the k attention outputs' routed output projections,
    weighted by the router, plus the block's bias."""

    def __init__(self, name: str, block: Any, weights: tuple[str, str], router: str, bias: str | None,
                 top_k: int, scoring: str) -> None:
        self.name, self.block, self.weights, self.router = name, block, weights, router
        self.bias, self.top_k, self.scoring = bias, top_k, scoring

    def experts(self) -> int:
        return int(self.block.get_parameter(self.weights[0]).shape[0])

    def methods(self) -> tuple[Any, Any]:
        """The dense `map` and `reduce`: every expert's projection on every token (as plain
        matrix products over the stacked weights), the routed ones picked by a one-hot."""
        import torch

        block, (w_in, w_out), router, bias = self.block, self.weights, self.router, self.bias
        top_k, scoring = self.top_k, self.scoring

        def map(layer_input: Any) -> Any:  # noqa: A001 - the module's own method name
            b, n, h = layer_input.shape
            x = layer_input.reshape(-1, h)
            logits = torch.nn.functional.linear(x, block.get_parameter(router))
            top, index = _routed(logits, top_k, scoring)
            weight = block.get_parameter(w_in)  # [E, O, H]
            e, o = weight.shape[0], weight.shape[1]
            every = (x @ weight.reshape(e * o, h).t()).reshape(-1, e, o)
            picked = torch.nn.functional.one_hot(index, e).to(x.dtype) @ every  # [N, k, O]
            return picked.reshape(b, n, top_k, o), logits, (index, top.to(x.dtype))

        def reduce(layer_input: Any, topo: Any) -> Any:
            b, n, k, o = layer_input.shape
            index, top = topo
            weight = block.get_parameter(w_out)  # [E, H, O]
            e, h = weight.shape[0], weight.shape[1]
            routed = torch.nn.functional.one_hot(index, e).to(layer_input.dtype) * top.unsqueeze(-1)  # [N, k, E]
            per_expert = routed.transpose(1, 2) @ layer_input.reshape(-1, k, o)  # [N, E, O]
            y = per_expert.reshape(-1, e * o) @ weight.transpose(1, 2).reshape(e * o, h)
            if bias is not None:
                y = y + block.get_parameter(bias)
            return y.reshape(b, n, h)

        return map, reduce


def _heads_blocks(model: Any) -> list[_HeadsBlock]:
    """The mixtures of attention heads of `model`: modules with `map` and `reduce`, a router
    weight `[E, H]` and two children each holding one weight of E experts, `[E, O, H]` and
    `[E, H, O]`, whose dense `map` and `reduce` equal the module's own on a probe in f64."""
    import copy

    import torch

    out = []
    for name, block in model.named_modules():
        if not (callable(getattr(block, "map", None)) and callable(getattr(block, "reduce", None))):
            continue
        ws = [(f"{n}.{q}", p) for n, m in block.named_children() for q, p in m.named_parameters() if p.dim() == 3]
        if len(ws) != 2:
            continue
        (a, wa), (c, wc) = ws
        if wa.shape[1:] != wc.shape[1:][::-1]:
            continue
        e, hidden = wa.shape[0], wa.shape[2]
        routers = [n for n, p in block.named_parameters() if p.dim() == 2 and tuple(p.shape) == (e, hidden)]
        own = [n for n, p in block.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == hidden]
        if len(routers) != 1 or len(own) > 1:
            continue
        copied = copy.deepcopy(block).double().eval()
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(2, 3, hidden, dtype=torch.float64, generator=gen)
        with torch.no_grad():  # a zero bias would match the forms without it
            for n in own:
                copied.get_parameter(n).copy_(torch.randn(hidden, dtype=torch.float64, generator=gen))
        try:
            with torch.no_grad():
                q, logits, topo = copied.map(x)
                heads = torch.randn(q.shape, dtype=torch.float64, generator=gen)
                want = copied.reduce(heads, topo)
        except Exception:  # noqa: BLE001 - not a mixture of heads by this protocol
            continue
        match = None
        for bias, top_k, scoring in itertools.product([None] + own, range(1, e + 1), _SCORINGS):
            if top_k != q.shape[2]:
                continue
            m_map, m_reduce = _HeadsBlock(name, copied, (a, c), routers[0], bias, top_k, scoring).methods()
            with torch.no_grad():
                got_q, got_logits, got_topo = m_map(x)
                got = m_reduce(heads, got_topo)
            if (got_q.shape == q.shape and torch.allclose(got_q, q, rtol=1e-5, atol=1e-7)
                    and torch.allclose(got_logits, logits.reshape(got_logits.shape).to(got_logits.dtype), rtol=1e-5, atol=1e-7)
                    and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-7)):
                match = (bias, top_k, scoring)
                break
        if match:
            bias, top_k, scoring = match
            out.append(_HeadsBlock(name, block, (a, c), routers[0], bias, top_k, scoring))
    return out


def warn_dense_heads(model: Any, heads: list[_HeadsBlock]) -> None:
    """Warns that each mixture of attention heads runs densely, naming it."""
    import warnings

    for h in heads:
        e = h.experts()
        warnings.warn(f"{type(model).__name__}: mixture of attention heads `{h.name}` ({type(h.block).__name__}) is "
                      f"exported densely: every expert's query and output projection on every token ({e}/{h.top_k} = "
                      f"{e / h.top_k:.3g}× their routed FLOPs), the routed ones picked by a one-hot; it trains as "
                      "the module does, without expert parallelism", stacklevel=4)


class _Totals:
    """Running sums of the routers' statistics during one forward (see the module docs)."""

    def __init__(self, experts: int, top_k: int) -> None:
        self.experts, self.top_k = experts, top_k
        self.mask: Any = None
        self.reset()

    def reset(self) -> None:
        self.counts: Any = None
        self.probs: Any = None
        self.rows: Any = 0

    def add(self, logits: Any) -> None:
        import torch

        probs = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(probs, self.top_k, dim=-1)
        ids = torch.arange(self.experts, device=logits.device)
        hits = (chosen.reshape(-1, 1) == ids).to(torch.float32)                      # [N·k, E]
        if self.mask is None:
            counts, prob_sum, rows = hits.sum(0), probs.float().sum(0), probs.shape[0]
        else:
            flat = self.mask.reshape(-1).to(torch.float32)
            counts = (hits * flat.repeat_interleave(self.top_k).unsqueeze(-1)).sum(0)
            prob_sum, rows = (probs.float() * flat.unsqueeze(-1)).sum(0), flat.sum()
        first = self.counts is None
        self.counts = counts if first else self.counts + counts
        self.probs = prob_sum if first else self.probs + prob_sum
        self.rows = rows if first else self.rows + rows

    def loss(self) -> Any:
        """`load_balancing_loss_func` of the totals."""
        import torch

        if self.counts is None:
            raise SmpError("the model's config asks for the router's auxiliary loss, but no router ran in the export")
        tokens_per_expert = self.counts / self.rows
        router_prob_per_expert = self.probs / self.rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.experts


def fused_layout(m: Any, form: GateForm) -> dict[str, Any]:
    """The weights of experts module `m` (of fused form `form`) that the export holds in another
    layout than the module's, in the fused op's: gate_up `[E, 2I, H]` and down `[E, H, I]`
    (transposed from `[E, H, 2I]`, `[E, I, H]`), gate rows before up rows (de-interleaved along
    axis 1, the gate-up bias with them). `load_trained` undoes both (`smp.transposed`,
    `smp.deinterleaved`)."""
    out = {}
    if m.is_transposed:
        for w in ("gate_up_proj", "down_proj"):
            out[w] = getattr(m, w).detach().transpose(1, 2).contiguous()
    if form.interleaved:
        for w in ("gate_up_proj",) + (("gate_up_proj_bias",) if form.biases else ()):
            t = out.get(w, getattr(m, w).detach())
            out[w] = deinterleave(t)
    return out


def deinterleave(t: Any) -> Any:
    """`t` with axis 1's even entries first, then its odd ones."""
    import torch

    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


class MoeExport:
    """What the export of one model does about its routed experts (nothing for a model
    without them): the experts implementation, the router hooks, the extra output."""

    def __init__(self, model: Any, input_names: list[str]) -> None:
        self.model = model
        self.experts = _experts_modules(model)
        self.totals: _Totals | None = None
        self.coefficient: float | None = None
        self.mask_input = "attention_mask" if "attention_mask" in input_names else None
        self.input_names = input_names
        self.forms: dict[int, tuple[str, float | None] | None] = {}
        self.loops = _loop_blocks(model)
        if self.loops:
            warn_tied_routers(model, [(b.path(b.list_name), getattr(b.block, b.list_name), len(getattr(b.block, b.list_name)))
                                      for b in self.loops])
        self.blocks = _stacked_blocks(model, {id(m) for _, m in self.experts})
        self.heads = _heads_blocks(model)
        warn_dense_heads(model, self.heads)
        self._checked: set[type] = set()
        for b in [*self.loops, *self.blocks]:
            self._check_training(b.name, b.block)
        if self.blocks:
            warn_tied_routers(model, [(*b.experts(), int(b.stacked_module().get_parameter(b.weights[0]).shape[0]))
                                      for b in self.blocks])
        if not self.experts:
            return
        for name, m in self.experts:
            _check_experts(name, m)
        #: each experts-interface module's `gate_form`, by id (None: it runs densely)
        self.forms = {id(m): gate_form(m) for _, m in self.experts}
        warn_unfused(model, self.experts, self.forms)
        warn_tied_routers(model, [(n, m, _expert_count(m)) for n, m in self.experts])
        cfg = getattr(model, "config", None)
        named = dict(model.named_modules())
        for name, _ in self.experts:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            self._check_training(parent, named.get(parent, model))
        if getattr(cfg, "output_router_logits", False):
            router = _router_outputs(model)
            coefficient = getattr(model, "router_aux_loss_coef", getattr(cfg, "router_aux_loss_coef", None))
            top_k = getattr(cfg, "num_experts_per_tok", None)
            experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
            if router is None or coefficient is None or not top_k or not experts:
                raise SmpError(f"{type(model).__name__}'s config asks for the router's auxiliary loss "
                               "(output_router_logits), but the model does not say where its router logits are or "
                               "their coefficient (router_aux_loss_coef); set output_router_logits = False to train "
                               "without it")
            self.router, self.logits_index = router
            self.coefficient = float(coefficient)
            self.totals = _Totals(int(experts), int(top_k))

    def _check_training(self, name: str, block: Any) -> None:
        """`check_deterministic_training` on the first block of each class: the check copies
        the block in f64 and runs it up to six times, and blocks of one class train alike."""
        if type(block) not in self._checked:
            self._checked.add(type(block))
            check_deterministic_training(self.model, name, block)

    @property
    def stacked(self) -> dict[str, list[list[str]]]:
        """{stacked weight: per expert, its module tensors} of the per-expert-loop blocks."""
        return {k: v for b in self.loops for k, v in b.stacked().items()}

    @property
    def transposed(self) -> list[str]:
        """The exported expert weights stored with their last two axes swapped (module names):
        those of stacked-weight blocks and of experts-interface modules marked `is_transposed`."""
        interface = [f"{name}.{w}" for name, m in self.experts if m.is_transposed and self.forms[id(m)] for w in ("gate_up_proj", "down_proj")]
        return interface + [n for b in self.blocks for n in b.transposed_names()]

    @property
    def deinterleaved(self) -> list[str]:
        """The exported expert weights whose axis 1 (gate-up rows, in the exported layout) holds
        the module's even entries first, then its odd ones: the gate-up weights and biases of
        experts that store their gate and up rows interleaved (module names)."""
        return [f"{name}.{w}" for name, m in self.experts if (f := self.forms[id(m)]) is not None and f.interleaved
                for w in ("gate_up_proj",) + (("gate_up_proj_bias",) if f.biases else ())]

    @property
    def output_names(self) -> list[str]:
        """Graph outputs after the main one."""
        return [AUX_OUTPUT] if self.totals is not None else []

    def wrap(self, wrapper: Any) -> Any:
        """`wrapper` (the export's module returning the main output), returning the auxiliary
        loss too when there is one. The parameters keep their names."""
        if self.totals is None:
            return wrapper
        import torch

        totals, mask_at = self.totals, (self.input_names.index(self.mask_input) if self.mask_input else None)

        class WithAuxLoss(torch.nn.Module):
            """The main output and the router's load-balancing loss."""

            def __init__(self) -> None:
                super().__init__()
                self.model = wrapper.model
                self._main = (wrapper,)

            def forward(self, *args: Any) -> Any:
                totals.reset()
                totals.mask = args[mask_at] if mask_at is not None else None
                main = self._main[0](*args)
                return main, totals.loss()

        return WithAuxLoss()

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Dense experts, router hooks, and the model's own auxiliary loss off (its
        `torch.histc` does not export), per-expert-loop blocks stacked; all restored afterwards."""
        with self._stacking():
            if not self.experts:
                yield
                return
            with self._interface():
                yield

    @contextlib.contextmanager
    def _stacking(self) -> Iterator[None]:
        """Each per-expert-loop block as its stacked dense form, each stacked-weight block as
        its dense form (module docs)."""
        swapped, forwards = [], []
        try:
            for b, child in [(b, b.list_name) for b in self.loops] + [(b, b.experts_name) for b in self.blocks]:
                stacked = b.stacked_module()
                if child is not None:
                    swapped.append((b.block, child, getattr(b.block, child)))
                    setattr(b.block, child, stacked)
                b.block.forward = b.forward(stacked)
                forwards.append(b.block)
            for h in self.heads:
                h.block.map, h.block.reduce = h.methods()
            yield
        finally:
            for block, child, original in swapped:
                setattr(block, child, original)
            for block in forwards:
                del block.forward
            for h in self.heads:
                for method in ("map", "reduce"):
                    h.block.__dict__.pop(method, None)

    @contextlib.contextmanager
    def _interface(self) -> Iterator[None]:
        """The experts interface as `smp_dense`."""
        import torch
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = dense_experts
        # each experts module reads its config's choice at call time (the model's, or its own
        # for a bare block)
        configs = {id(m.config): m.config for _, m in self.experts}
        before = {k: c._experts_implementation for k, c in configs.items()}
        cfg = getattr(self.model, "config", None)
        asked = getattr(cfg, "output_router_logits", False)
        hooks = []
        # experts of a fused form hold its layout for the export: transposed ones (`[E, H, 2I]`,
        # `[E, I, H]`) swap their last axes, interleaved gate and up rows are put gate rows first;
        # others are exported as stored (`dense_general` reads either)
        fused = [m for _, m in self.experts if self.forms[id(m)] is not None]
        held = ("gate_up_proj", "down_proj", "gate_up_proj_bias")
        originals = [{w: getattr(m, w) for w in held if hasattr(m, w)} for m in fused]
        try:
            for m in fused:
                for w, t in fused_layout(m, self.forms[id(m)]).items():
                    setattr(m, w, torch.nn.Parameter(t))
            _FORMS.update(self.forms)
            for c in configs.values():
                c._experts_implementation = IMPLEMENTATION
            if self.totals is not None:
                cfg.output_router_logits = False
                totals, index = self.totals, self.logits_index
                for m in self.model.modules():
                    if isinstance(m, self.router):
                        hooks.append(m.register_forward_hook(lambda _m, _a, out: totals.add(out[index])))
            yield
        finally:
            for _, m in self.experts:
                _FORMS.pop(id(m), None)
            for m, before_export in zip(fused, originals):
                for w, t in before_export.items():
                    setattr(m, w, t)
            for h in hooks:
                h.remove()
            if self.totals is not None:
                cfg.output_router_logits = asked
            for k, c in configs.items():
                c._experts_implementation = before[k]

    def record_stacked(self, proto: Any, record: dict, prefix: str) -> None:
        """Marks each stacked weight of `proto` a trained parameter under its own name, writes
        `smp.stacked`, and drops the module tensors it stands for from `record["missing"]`;
        writes `smp.transposed` and `smp.deinterleaved` for the weights exported so."""
        self._record_transposed(proto, prefix)
        if not self.loops:
            return
        from . import param_record as pr

        stacked = {prefix + k: [[prefix + n for n in parts] for parts in v] for k, v in self.stacked.items()}
        for t in proto.graph.initializer:
            if t.name in stacked:
                del t.metadata_props[:]
                pr._set(t, {pr.K_KIND: "parameter", pr.K_TRANSFORM: "identity", pr.K_PARAMS: json.dumps([[t.name]])})
                record["parameters"] += 1
                record["constants"] -= 1
        absent = [k for k in stacked if k not in {t.name for t in proto.graph.initializer}]
        if absent:
            raise SmpError(f"the stacked expert weights {absent} are not in the exported file; this is a bug of the "
                           "export, please report it with the model")
        parts = {n for v in stacked.values() for e in v for n in e}
        record["missing"] = [n for n in record["missing"] if n not in parts]
        pr._set_model_meta(proto, record["missing"])
        proto.metadata_props.add(key=STACKED_KEY, value=json.dumps(stacked))

    def _record_transposed(self, proto: Any, prefix: str) -> None:
        """Writes `smp.transposed` and `smp.deinterleaved` for the weights exported so."""
        initializers = {t.name for t in proto.graph.initializer}
        for key, what, names in ((TRANSPOSED_KEY, "transposed", self.transposed),
                                 (DEINTERLEAVED_KEY, "de-interleaved", self.deinterleaved)):
            if not names:
                continue
            names = [prefix + n for n in names]
            absent = [n for n in names if n not in initializers]
            if absent:
                raise SmpError(f"the {what} expert weights {absent} are not in the exported file; this is a bug of "
                               "the export, please report it with the model")
            proto.metadata_props.add(key=key, value=json.dumps(names))

    def annotate(self, proto: Any) -> None:
        """Writes `smp.aux_loss` into the model's metadata (docs/parameter-record.md)."""
        if self.totals is None:
            return
        entry = json.dumps([{"output": AUX_OUTPUT, "coefficient": self.coefficient}])
        for p in proto.metadata_props:
            if p.key == AUX_KEY:
                p.value = entry
                return
        proto.metadata_props.add(key=AUX_KEY, value=entry)
