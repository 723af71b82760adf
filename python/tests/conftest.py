"""Shared fixtures: the binaries of this checkout and one small HF GPT-2, exported and planned
once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# the binaries this checkout built (cargo test --features runner builds both)
if "SMP_BIN_DIR" not in os.environ and (REPO / "target" / "debug" / "smp-partition").is_file():
    os.environ["SMP_BIN_DIR"] = str(REPO / "target" / "debug")


VOCAB, SEQ, BATCH = 64, 16, 8


def has_runner() -> bool:
    """Whether `smp-runner` was built (`make test FEATURES=` builds the planner alone)."""
    import smp_partition as smp

    try:
        smp.find_binary("smp-runner")
    except smp.SmpError:
        return False
    return True


needs_runner = pytest.mark.skipif(not has_runner(), reason="smp-runner not built (cargo build --features runner)")


def tiny_gpt2():
    """An HF GPT-2 from a small config at HF's default init (seed 0), dropout off."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def tokens():
    import torch

    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def gpt2_plan(tmp_path_factory: pytest.TempPathFactory):
    """(model, batch, plan): the tiny GPT-2 planned on cpu:2 with pipeline_parallel_degree 2."""
    import smp_partition as smp

    model, batch = tiny_gpt2(), tokens()
    plan = smp.plan(model, batch, cluster="cpu:2", global_batch=BATCH,
                    config={"pipeline_parallel_degree": 2, "microbatches": 4},
                    workdir=tmp_path_factory.mktemp("gpt2"))
    return model, batch, plan


def torch_losses(model, batch, steps: int) -> list[float]:
    """`steps` steps of plain PyTorch training as the runner trains: AdamW (lr 1e-3, weight
    decay 0.01 on every parameter), gradient norm clipped at 1, causal-LM loss."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses
