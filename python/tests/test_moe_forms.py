"""Mixture-of-experts routing in the forms models use. DeepSeek-V3 (group-limited top-k with a
bias correction, a shared expert; `zoo._deepseek_v3`) trains in the zoo (test_zoo.py) at pp 2,
tp 2, cp 2, ep 2 and pp 2 × ep 2, its routed experts fused into `MixtureOfExperts`; here, that
the zoo's bias correction is not inert."""

from __future__ import annotations

import torch

import zoo


def test_the_bias_correction_changes_the_routing() -> None:
    """The zoo's bias is not inert: with it the router chooses other experts than without."""
    model = zoo.build(zoo.archs()["deepseek_v3"])
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, zoo.H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, _, with_bias = gate(x)
        gate.e_score_correction_bias.zero_()
        _, _, without = gate(x)
    assert not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)


class _Unnormalised(zoo.LoopMoe):
    """`LoopMoe` whose top-k weights are the router's probabilities as they are."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in chosen.unique():
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[int(e)](x[token]) * weights[token, slot, None])
        return out.view(b, s, h)


class _SigmoidInput(zoo.LoopMoe):
    """`LoopMoe` routed as Llama 4 routes: the sigmoid of the top-k logits, scaling each token
    going into its expert."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
        weights = torch.sigmoid(top)
        out = torch.zeros_like(x)
        for e in chosen.unique():
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[int(e)](x[token] * weights[token, slot, None]))
        return out.view(b, s, h)


def _relu_experts(block: zoo.LoopMoe) -> zoo.LoopMoe:
    for expert in block.experts:
        expert.forward = lambda x, e=expert: e.w2(torch.relu(e.w1(x)) * e.w3(x))
    return block


def test_a_per_expert_loop_is_recognised_by_what_it_computes() -> None:
    """Top-k and normalisation are read off the block's output (a probe in f64), the gate and
    up projections off each expert's; a block computing anything else is left alone."""
    from smp_partition import _moe

    torch.manual_seed(0)
    blocks = {"top 2, normalised": zoo.LoopMoe(8, 6, 4, 2), "top 3, normalised": zoo.LoopMoe(8, 6, 4, 3),
              "top 2, unnormalised": _Unnormalised(8, 6, 4, 2), "top 2, sigmoid, input": _SigmoidInput(8, 6, 4, 2),
              "relu experts": _relu_experts(zoo.LoopMoe(8, 6, 4, 2))}
    found = {}
    for label, block in blocks.items():
        loops = _moe._loop_blocks(block)
        found[label] = [(b.top_k, b.scoring, b.weighting, b.order[0]) for b in loops]
    order = ("w1", "w3", "w2")
    assert found == {"top 2, normalised": [(2, "softmax-normalised", "output", order)],
                     "top 3, normalised": [(3, "softmax-normalised", "output", order)],
                     "top 2, unnormalised": [(2, "softmax", "output", order)],
                     "top 2, sigmoid, input": [(2, "sigmoid", "input", order)], "relu experts": []}
    # the dense form equals the block's loop
    for label in ("top 2, unnormalised", "top 2, sigmoid, input"):
        block = blocks[label]
        (loop,) = _moe._loop_blocks(block)
        x = torch.randn(2, 5, 8)
        with torch.no_grad():
            assert torch.allclose(loop.forward(loop.stacked_module())(x), block(x), atol=1e-6), label


class _StackedMoe(torch.nn.Module):
    """A block of stacked expert weights in Llama 4's layout (`[E, H, 2I]`, `[E, I, H]`), its
    own router and a shared expert, routed by `scoring` and weighted at `weighting`."""

    def __init__(self, h: int, i: int, e: int, k: int, weighting: str) -> None:
        super().__init__()
        self.router = torch.nn.Linear(h, e, bias=False)
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = torch.nn.Parameter(torch.randn(e, h, 2 * i) * 0.3)
        self.experts.down_proj = torch.nn.Parameter(torch.randn(e, i, h) * 0.3)
        self.shared = zoo.LoopExpert(h, i)
        self.k, self.weighting = k, weighting

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        top, chosen = torch.topk(torch.softmax(self.router(x), -1), self.k, dim=-1)
        out = self.shared(x)
        for t in range(x.shape[0]):
            for j in range(self.k):
                e, w = int(chosen[t, j]), top[t, j]
                xin = x[t] * w if self.weighting == "input" else x[t]
                gate, up = (xin @ self.experts.gate_up_proj[e]).chunk(2)
                y = (torch.nn.functional.silu(gate) * up) @ self.experts.down_proj[e]
                out[t] = out[t] + (y if self.weighting == "input" else y * w)
        return out.view(hidden_states.shape)


def test_a_stacked_weight_block_is_recognised_by_what_it_computes() -> None:
    """Llama 4's form and its variants: routing, weighting, layout and the shared expert are read
    off the block's output; the dense form equals the block."""
    from smp_partition import _moe

    torch.manual_seed(1)
    for weighting in ("input", "output"):
        block = _StackedMoe(8, 6, 4, 2, weighting)
        (found,) = _moe._stacked_blocks(block, set())
        assert (found.top_k, found.scoring, found.weighting, found.transposed, found.shared) == (
            2, "softmax", weighting, True, "shared")
        assert found.transposed_names() == ["experts.gate_up_proj", "experts.down_proj"]
        x = torch.randn(2, 5, 8)
        with torch.no_grad():
            assert torch.allclose(found.forward(found.stacked_module())(x), block(x), atol=1e-6), weighting
    # experts that are not SiLU-gated are left alone
    block = _StackedMoe(8, 6, 4, 2, "input")
    block.forward = lambda h: h * 2
    assert _moe._stacked_blocks(block, set()) == []


def test_a_router_whose_experts_all_score_alike_is_warned_about_at_export(tmp_path) -> None:
    """A zero-initialised router ties every expert score at the first step, and the exported
    top-k breaks ties otherwise than PyTorch's: the export says so, naming the router; a
    router with distinct rows (or a bias correction that parts them) is not named."""
    import warnings

    import smp_partition as smp

    arch = zoo.archs()["loop_moe"]
    model = zoo.build(arch)
    data = zoo.inputs_of(zoo.batch(arch, model))
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.zero_()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        smp.export(model, data, tmp_path / "model.onnx")
    said = [str(w.message) for w in seen if "router weight" in str(w.message)]
    assert len(said) == 1, said
    assert "`model.layers.1.mlp.gate.weight`" in said[0] and "tie" in said[0]
    # the interface form (DeepSeek-V3): a zero router, but a bias correction that parts the experts
    from smp_partition import _moe

    ds = zoo.build(zoo.archs()["deepseek_v3"])
    with torch.no_grad():
        ds.model.layers[1].mlp.gate.weight.zero_()
    experts = [(n, m, int(m.gate_up_proj.shape[0])) for n, m in _moe._experts_modules(ds)]
    assert _moe.tied_routers(ds, experts) == []
    with torch.no_grad():
        ds.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    assert _moe.tied_routers(ds, experts) == ["model.layers.1.mlp.gate.weight"]
