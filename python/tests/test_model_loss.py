"""A model that computes its own training loss, through the front door: a small token model
whose forward ends in PyTorch's cross entropy over the shifted logits (mean over the tokens, as a
Hugging Face causal LM given its labels computes it), so the export ends in ONNX's
`SoftmaxCrossEntropyLoss`. Exported by `smp.export`, trained 5 f32 steps with `loss="model"` in
one process and under pp 2 (2 microbatches), tp 2 (the Megatron split) and dp 2: losses within
1e-5 relative of PyTorch's own training of the module, every parameter within 1e-4
norm-relative."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import smp_partition as smp
from conftest import needs_runner
from torch_training import norm_rel, train_as_runner

pytestmark = needs_runner

H, INTER, VOCAB, SEQ, BATCH, STEPS = 16, 32, 64, 8, 4, 5
LR, WD, CLIP = 1e-3, 0.01, 1.0
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4
#: Plan label: (configuration, planner flags, the (pp, tp, dp) the plan must have).
PLANS = {
    "one-process": ({}, {}, (1, 1, 1)),
    "pp2": ({"pipeline_parallel_degree": 2, "microbatches": 2}, {}, (2, 1, 1)),
    "tp2": ({"tensor_parallel_degree": 2}, {"baseline": "megatron"}, (1, 2, 1)),
    "dp2": ({"ddp": True, "pipeline_parallel_degree": 1, "tensor_parallel_degree": 1}, {}, (1, 1, 2)),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, INTER)
        self.down = nn.Linear(INTER, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SelfScoringModel(nn.Module):
    """Token ids in, the causal-LM loss out (PyTorch's cross entropy, mean over the tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    model = SelfScoringModel().train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    work = tmp_path_factory.mktemp("model_loss")
    exported = smp.export(model, (ids,), work / "model.onnx")
    import onnx

    ops = [n.op_type for n in onnx.load(str(exported.path)).graph.node]
    assert "SoftmaxCrossEntropyLoss" in ops, ops
    data = work / "data.npz"
    name = onnx.load(str(exported.path)).graph.input[0].name
    np.savez(data, **{name: ids.numpy()})
    return model, ids, exported, data, *train_as_runner(model, lambda m: m(ids), STEPS, LR, WD, CLIP)


@pytest.mark.parametrize("label", list(PLANS))
def test_a_model_scoring_itself_trains_as_pytorch(label: str, case, tmp_path) -> None:
    model, ids, exported, data, losses, trained = case
    config, flags, degrees = PLANS[label]
    cluster = "cpu:1" if label == "one-process" else "cpu:2"
    plan = smp.plan(exported, (ids,), cluster=cluster, global_batch=BATCH, config=config, workdir=tmp_path, **flags)
    assert (plan.parallel.pp, plan.parallel.tp, plan.parallel.dp) == degrees, (label, plan.parallel)
    run = smp.launch(plan, data=data, steps=STEPS, loss="model", threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, losses))
    assert len(run.losses) == STEPS and rel <= LOSS_TOL, (label, run.losses, losses)
    got = dict(smp.load_trained(copy.deepcopy(model), run).named_parameters())
    errors = {n: norm_rel(got[n], w) for n, w in trained.items() if norm_rel(got[n], w) > WEIGHT_TOL}
    assert not errors, (label, errors)
    print(f"{label}: loss {rel:.1e} vs PyTorch")
