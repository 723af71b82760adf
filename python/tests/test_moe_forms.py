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
