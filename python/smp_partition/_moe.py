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
softmax, top-k, the model's own normalisation) is exported as the model computes it.

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
import json
from typing import Any, Iterator

from .errors import SmpError

#: The experts implementation the export selects.
IMPLEMENTATION = "smp_dense"
#: The graph output holding the auxiliary loss, and the model metadata key naming it.
AUX_OUTPUT, AUX_KEY = "aux_loss", "smp.aux_loss"


def dense_experts(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """transformers' experts interface (`hidden_states [N, H]`, `top_k_index` and
    `top_k_weights [N, k]`) as a dense computation over all experts; the pattern
    `passes::fuse` recognises."""
    import torch

    experts = self.gate_up_proj.shape[0]
    ids = torch.arange(experts, device=hidden_states.device)
    one_hot = (top_k_index.unsqueeze(-1) == ids).to(top_k_weights.dtype)            # [N, k, E]
    combine = (one_hot * top_k_weights.unsqueeze(-1)).sum(1)                         # [N, E]
    gate, up = torch.matmul(self.gate_up_proj, hidden_states.transpose(0, 1)).chunk(2, dim=1)
    y = torch.matmul(self.down_proj, self.act_fn(gate) * up)                         # [E, H, N]
    out = (y * combine.transpose(0, 1).unsqueeze(1)).sum(0)                          # [H, N]
    return out.transpose(0, 1).to(hidden_states.dtype)


def _experts_modules(model: Any) -> list[tuple[str, Any]]:
    """The `@use_experts_implementation` modules of `model` (they carry `has_gate`)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def _check_experts(name: str, m: Any) -> None:
    unsupported = [what for what, bad in (
        ("no gate projection", not m.has_gate), ("biases", m.has_bias), ("transposed weights", m.is_transposed),
        ("interleaved gate and up rows", not m.is_concatenated), ("a norm after each expert", m.has_post_expert_norm),
    ) if bad]
    if unsupported or not hasattr(m, "gate_up_proj") or not hasattr(m, "down_proj"):
        raise SmpError(f"experts `{name}` ({type(m).__name__}) have {', '.join(unsupported) or 'no gate_up_proj/down_proj'}; "
                       "the mixture-of-experts export takes gated experts with stacked gate_up_proj [E, 2I, H] and "
                       "down_proj [E, H, I] weights")


def _router_outputs(model: Any) -> tuple[type, int] | None:
    """The router class and the index of its logits among its outputs, as the model records
    `router_logits` (`_can_record_outputs` of its pretrained classes)."""
    for m in model.modules():
        rec = getattr(m, "_can_record_outputs", None)
        recorder = rec.get("router_logits") if isinstance(rec, dict) else None
        if isinstance(getattr(recorder, "target_class", None), type):
            return recorder.target_class, int(getattr(recorder, "index", 0) or 0)
    return None


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
        if not self.experts:
            return
        for name, m in self.experts:
            _check_experts(name, m)
        cfg = getattr(model, "config", None)
        jitter = max([getattr(cfg, "router_jitter_noise", 0.0) or 0.0]
                     + [getattr(m, "jitter_noise", 0.0) or 0.0 for m in model.modules()])
        if jitter > 0:
            raise SmpError(f"{type(model).__name__} has router jitter noise {jitter}: its routers multiply the tokens by "
                           "fresh noise in every training step, which the runner does not draw; set router_jitter_noise "
                           "to 0 to export")
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
        `torch.histc` does not export); all restored afterwards."""
        if not self.experts:
            yield
            return
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = dense_experts
        # each experts module reads its config's choice at call time (the model's, or its own
        # for a bare block)
        configs = {id(m.config): m.config for _, m in self.experts}
        before = {k: c._experts_implementation for k, c in configs.items()}
        cfg = getattr(self.model, "config", None)
        asked = getattr(cfg, "output_router_logits", False)
        hooks = []
        try:
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
            for h in hooks:
                h.remove()
            if self.totals is not None:
                cfg.output_router_logits = asked
            for k, c in configs.items():
                c._experts_implementation = before[k]

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
