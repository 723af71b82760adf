"""Parameters read by elementwise ops, through the front door: a small token model whose MLP
activation reads a learned scalar inside (xIELU's `alpha_p`, through a softplus) and learned
per-channel vectors (a negative slope, a scale) along the intermediate dim. Exported by
`smp.export`, planned on cpu:2 at pp 2, tp 2 (the intermediate dim split: the vectors are
sliced with it, the scalar is replicated and its gradient summed over the tensor ranks) and
cp 2 (tp 2 as the Megatron split), trained 5 f32 steps by `smp.launch` and brought back by `smp.load_trained`: losses within
1e-5 relative of PyTorch's own training, every parameter within 1e-4 norm-relative; in f64 the
same plans equal one process (`smp-runner train --dtype f64`) within 1e-12. At ep 2 the model's
second block is a Mixtral mixture of experts (fused, its experts split over the two ranks), so
the first block's activation parameters are replicated over the expert group's data ranks."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import smp_partition as smp
from conftest import needs_runner
from torch_training import norm_rel, train_as_runner

pytestmark = needs_runner

H, INTER, VOCAB, SEQ, BATCH, STEPS = 16, 32, 64, 8, 4, 5
LR, WD, CLIP = 1e-3, 0.01, 1.0
LOSS_TOL, WEIGHT_TOL, EXACT_TOL = 1e-5, 1e-4, 1e-12
PLANS = {
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    "tp2": {"tensor_parallel_degree": 2},
    "cp2": {"context_parallel_degree": 2},
}
#: Plans of the model whose second block is a mixture of experts.
MOE_PLANS = {"ep2": {"expert_parallel_degree": 2}}
#: Planner flags per plan: at this size the planner's own choice under tp 2 replicates the MLP,
#: so the Megatron split (every MLP split by its intermediate dim) is asked for.
FLAGS = {"tp2": {"baseline": "megatron"}}


class LearnedActivation(nn.Module):
    """xIELU-like: a learned scalar inside (through a softplus), a learned per-channel negative
    slope and a learned per-channel output scale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.tensor([0.3]))
        self.slope = nn.Parameter(torch.linspace(0.05, 0.2, channels))
        self.scale = nn.Parameter(torch.linspace(0.9, 1.1, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = nn.functional.softplus(self.alpha_p)
        return torch.where(x > 0, a * x * x + 0.5 * x, self.slope * x) * self.scale


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, INTER)
        self.act = LearnedActivation(INTER)
        self.down = nn.Linear(INTER, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class MoeBlock(nn.Module):
    """A Mixtral mixture of experts (4 experts, top 2) with a residual."""

    def __init__(self) -> None:
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.moe = MixtralSparseMoeBlock(transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER,
                                                                    num_local_experts=4, num_experts_per_tok=2))
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in self.moe.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TokenModel(nn.Module):
    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([Block(), MoeBlock() if moe else Block()])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The runner's `--loss causal-lm`."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _sliced(plan: smp.Plan) -> set[str]:
    """The initializers the plan's shards slice."""
    found, stack = set(), [plan.data.get("codegen", {})]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("initializer"), str):
                found.add(x["initializer"])
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return found


def _one_process_f64(model_path: Path, data: Path, out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    weights = out / "one-process.safetensors"
    done = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(model_path), "--data", str(data), "--loss",
                           "causal-lm", "--steps", str(STEPS), "--dtype", "f64", "--threads", "1", "--json",
                           "--save-weights", str(weights)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [float(s["loss"]) for s in json.loads(done.stdout)["steps"]], load_file(str(weights))


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    model = TokenModel(moe=request.param).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    work = tmp_path_factory.mktemp("learned_activation")
    exported = smp.export(model, (ids,), work / "model.onnx")
    data = work / "data.npz"
    np.savez(data, input_ids=ids.numpy())
    losses, trained = train_as_runner(model, lambda m: _loss(m(ids), ids), STEPS, LR, WD, CLIP)
    exact_losses, exact = _one_process_f64(exported.path, data, work)
    return model, ids, exported, data, losses, trained, exact_losses, exact


@pytest.mark.parametrize(("label", "case"), [(k, False) for k in PLANS] + [(k, True) for k in MOE_PLANS],
                         indirect=["case"], ids=list(PLANS) + list(MOE_PLANS))
def test_learned_activation_parameters_train_as_pytorch(label: str, case, tmp_path: Path) -> None:
    model, ids, exported, data, losses, trained, exact_losses, exact = case
    moe = isinstance(model.blocks[1], MoeBlock)
    plan = smp.plan(exported, (ids,), cluster="cpu:2", global_batch=BATCH, config={**PLANS, **MOE_PLANS}[label],
                    workdir=tmp_path, **FLAGS.get(label, {}))
    if moe:
        fused = json.dumps(plan.data["codegen"].get("fused", []))
        assert plan.parallel.ep == 2 and "mixture_of_experts" in fused, (plan.parallel, fused)
    if label == "tp2":
        # the intermediate dim is split: the per-channel vectors are sliced with it
        sliced = _sliced(plan)
        for n in ("blocks.0.up.bias", "blocks.0.act.slope", "blocks.1.act.scale"):
            assert any(s.endswith(n) for s in sliced), (n, sorted(sliced))
    run = smp.launch(plan, data=data, steps=STEPS, loss="causal-lm", threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, losses))
    assert len(run.losses) == STEPS and rel <= LOSS_TOL, (label, run.losses, losses)
    got = dict(smp.load_trained(copy.deepcopy(model), run).named_parameters())
    initial = dict(model.named_parameters())
    errors = {n: norm_rel(got[n], w) for n, w in trained.items() if norm_rel(got[n], w) > WEIGHT_TOL}
    assert not errors, (label, errors)
    # the activation's own parameters moved, as PyTorch moved them
    for n in ("blocks.0.act.alpha_p", "blocks.0.act.slope") + (() if moe else ("blocks.1.act.scale",)):
        assert not torch.equal(got[n], initial[n]), (label, n)
    # f64: the plan equals one process
    run64 = smp.launch(plan, data=data, steps=STEPS, loss="causal-lm", threads=1, dtype="f64", progress=False)
    rel64 = max(abs(a - b) / abs(b) for a, b in zip(run64.losses, exact_losses))
    assert rel64 <= EXACT_TOL, (label, run64.losses, exact_losses)
    got64 = load_file(str(run64.trained))
    worst64 = max(norm_rel(got64[n], w) for n, w in exact.items())
    assert worst64 <= EXACT_TOL, (label, worst64)
    print(f"{label}: loss {rel:.1e} vs PyTorch; f64 loss {rel64:.1e}, weights {worst64:.1e} vs one process")
