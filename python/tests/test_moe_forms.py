"""Mixture-of-experts routing in the forms models use, through the front door: each model is
exported, the plan fuses its routed experts into `MixtureOfExperts` (no data-dependent shape
in the graph), and it trains as PyTorch trains it (losses within 1e-5 relative, the trained
router and expert weights within 1e-4 norm-relative after `load_trained`) at pp 2, tp 2, ep 2,
pp 2 × ep 2 and cp 2 (cp 2 also in f64 against one process).

DeepSeek-V3: sigmoid router with a bias correction (`e_score_correction_bias`) that only
chooses, group-limited top-k (`n_group` groups, the best `topk_group` of them by their two best
scores, a scatter of the chosen groups into a mask), normalised and scaled weights, a shared
expert beside the routed ones, a dense first layer; multi-head latent attention around it."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import smp_partition as smp
import zoo
from conftest import needs_runner

pytestmark = needs_runner

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def _deepseek_v3() -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=zoo.H, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        max_position_embeddings=32, use_cache=False, tie_word_embeddings=False, attention_dropout=0.0, **zoo._tok(),
        # routed experts: 4 in 2 groups, top 2 of the best group, one shared expert; layer 0 dense
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, moe_intermediate_size=32,
        # multi-head latent attention (its key/value heads are the attention heads; the
        # config's default is 128)
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    # a bias correction that changes which experts are chosen (a trained model's is never 0)
    for m in model.modules():
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
            m.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25]))
    return model


ARCH = zoo.Arch("deepseek_v3", "decoder LM, group-limited routing, shared expert, latent attention", _deepseek_v3,
                "causal-lm")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory):
    """The model, its batch, its export and PyTorch's training of it."""
    model = zoo.build(ARCH)
    data = zoo.batch(ARCH, model)
    d = tmp_path_factory.mktemp("deepseek_v3")
    exported = smp.export(model, zoo.inputs_of(data), d / "model.onnx")
    losses, trained, gradfree, _, _ = zoo.train_torch(ARCH, model, data)
    return model, data, exported, losses, trained


def _fused(plan: smp.Plan) -> list[str]:
    """The fused ops of the plan, by kind (`mixture_of_experts`, `attention`, ...)."""
    return [next(iter(f["op"])) if isinstance(f["op"], dict) else f["op"] for f in plan.data["codegen"].get("fused", [])]


def test_the_bias_correction_changes_the_routing() -> None:
    """The test's bias is not inert: with it the router chooses other experts than without."""
    model = zoo.build(ARCH)
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, zoo.H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, _, with_bias = gate(x)
        gate.e_score_correction_bias.zero_()
        _, _, without = gate(x)
    assert not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)


PLANS = {
    "pp2": ("cpu:2", {"pipeline_parallel_degree": 2, "microbatches": 2}),
    "tp2": ("cpu:2", {"tensor_parallel_degree": 2}),
    "ep2": ("cpu:2", {"expert_parallel_degree": 2}),
    # the router's GatherElements runs on the gathered tokens (flattened with the batch) and
    # its weights are cut back: checked also in f64 against one process
    "cp2": ("cpu:2", {"context_parallel_degree": 2}),
    "pp2-ep2": ("cpu:4", {"pipeline_parallel_degree": 2, "microbatches": 2, "expert_parallel_degree": 2}),
}


@pytest.mark.parametrize("label", list(PLANS))
def test_deepseek_v3_trains_as_pytorch(deepseek, label: str, tmp_path: Path) -> None:
    model, data, exported, want_losses, want = deepseek
    cluster, config = PLANS[label]
    plan = smp.plan(exported, zoo.inputs_of(data), cluster=cluster, global_batch=zoo.BATCH, config=config,
                    workdir=tmp_path)
    # the one MoE layer's routed experts are one fused op; the router stays as exported
    assert _fused(plan).count("mixture_of_experts") == 1, _fused(plan)
    assert plan.parallel.ep == config.get("expert_parallel_degree", 1)
    np.savez(tmp_path / "data.npz", input_ids=data["input_ids"].numpy())
    run = smp.launch(plan, data=tmp_path / "data.npz", steps=zoo.STEPS, loss="causal-lm", threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, want_losses))
    trained = dict(smp.load_trained(copy.deepcopy(model), run).named_parameters())
    moe = [n for n in want if ".mlp." in n and ".layers.1." in n]
    assert {n.rsplit(".", 2)[-2] for n in moe} >= {"gate", "experts"}
    worst = max(float((trained[n].detach().double() - want[n].double()).norm() / want[n].double().norm())
                for n in moe)
    print(f"deepseek_v3 {label}: losses {rel:.1e}, MoE weights {worst:.1e}")
    assert len(run.losses) == len(want_losses) and rel <= LOSS_TOL, (run.losses, want_losses)
    assert worst <= WEIGHT_TOL
    if label == "cp2":
        assert all(r.get("context_gathers", 0) > 0 for r in run.report["ranks"])
        one = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(exported.path), "--data",
                              str(tmp_path / "data.npz"), "--loss", "causal-lm", "--steps", "2", "--dtype", "f64",
                              "--threads", "1", "--json"], capture_output=True, text=True, check=True)
        exact = [float(s["loss"]) for s in json.loads(one.stdout)["steps"]]
        run64 = smp.launch(plan, data=tmp_path / "data.npz", steps=2, loss="causal-lm", threads=1, dtype="f64",
                           progress=False)
        rel64 = max(abs(a - b) / abs(b) for a, b in zip(run64.losses, exact))
        print(f"deepseek_v3 cp2 f64: {rel64:.1e} from one process")
        assert rel64 <= 1e-9, (run64.losses, exact)
