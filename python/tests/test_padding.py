"""`nn.Embedding(..., padding_idx=p)`: PyTorch's embedding backward skips row p, so the lookups
of the padding token give the table no gradient (with a tied LM head, the head's gradient still
reaches that row). The export records the row (`smp.padding_rows`) and the runner's Gather
honours it; trained in f64 with the padding token in the batch, one process, tensor parallel
(the vocabulary split over 2 ranks, the padding row on rank 1) and ZeRO 3 over 2 ranks equal
PyTorch's own training: losses and every weight within 1e-10."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file

import smp_partition as smp
from smp_partition import param_record
from conftest import needs_runner

pytestmark = needs_runner

V, D, PAD = 12, 8, 7  # PAD is row 1 of rank 1's half of the vocabulary at tp 2
STEPS = 4
LR, WD, CLIP = 1e-2, 0.01, 1.0
TOL = 1e-10
#: the plans of 2 ranks: the vocabulary split (Megatron's assignment) and ZeRO 3
PLANS = {"tp2": {"pp": 1, "tp": 2, "dp": 1, "baseline": "megatron"}, "zero3": {"pp": 1, "tp": 1, "dp": 2, "zero": 3}}


class _PadLM(torch.nn.Module):
    """An embedding with a padding row, a hidden layer and an LM head (its own, or the
    embedding's weight transposed)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, D, padding_idx=PAD)
        # nn.Embedding zeroes the padding row at init; make it visible to the head
        with torch.no_grad():
            self.emb.weight[PAD].normal_()
        self.fc = torch.nn.Linear(D, D)
        self.head = None if tied else torch.nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(ids)))
        return h @ self.emb.weight.T if self.head is None else self.head(h)


def _batch() -> torch.Tensor:
    ids = torch.randint(0, V, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[:, -2:] = PAD  # padded sequences
    ids[1, 0] = PAD
    return ids


def _torch_training(module: torch.nn.Module, ids: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PyTorch's training, as the runner trains: causal-LM loss, AdamW, clipping."""
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = module(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP, foreach=False)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.named_parameters()}


def _options() -> dict:
    return {"lr": LR, "weight_decay": WD, "clip": CLIP, "dtype": "f64", "threads": 1}


def _one_process(model: Path, data: Path, out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    weights = out / "one-process.safetensors"
    args = [str(smp.find_binary("smp-runner")), "train", str(model), "--data", str(data), "--steps", str(STEPS),
            "--lr", str(LR), "--weight-decay", str(WD), "--clip", str(CLIP), "--dtype", "f64", "--threads", "1",
            "--json", "--save-weights", str(weights)]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [s["loss"] for s in json.loads(done.stdout)["steps"]], load_file(str(weights))


def _padding_records(model: Path) -> dict[str, str]:
    """`smp.padding_rows` of each parameter record that has one, by module tensor; every
    initializer of a tensor must say the same."""
    out: dict[str, str] = {}
    for r in param_record.read_record(onnx.load(str(model))).values():
        if r.get("smp.kind") == "parameter":
            name = json.loads(r["smp.params"])[0][0]
            rows = r.get("smp.padding_rows")
            assert out.setdefault(name, rows) == rows, name
    return {k: v for k, v in out.items() if v}


def _difference(losses: list[float], weights: dict[str, torch.Tensor], want_losses: list[float],
                want: dict[str, torch.Tensor], prefix: str) -> tuple[float, float]:
    """(largest relative loss difference, largest absolute weight difference)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True))
    weight = max(float((weights[prefix + k].double() - w).abs().max()) for k, w in want.items())
    return loss, weight


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_padding_rows_train_as_pytorch(tied: bool, tmp_path: Path) -> None:
    module = _PadLM(tied).double()
    ids = _batch()
    want_losses, want = _torch_training(copy.deepcopy(module), ids)
    if not tied:
        # the oracle itself: no gradient reached the padding row, only weight decay
        decayed = module.emb.weight[PAD] * (1 - LR * WD) ** STEPS
        torch.testing.assert_close(want["emb.weight"][PAD], decayed, rtol=1e-14, atol=0)

    exported = smp.export(module, ids, tmp_path / "m.onnx")
    # on the embedding's weight (and its transposed copy the tied head reads), nowhere else
    assert _padding_records(exported.path) == {exported.prefix + "emb.weight": f"[{PAD}]"}

    data = tmp_path / "data.npz"
    np.savez(data, **{exported.input_names[0]: ids.numpy()})
    measured = {}
    losses, weights = _one_process(exported.path, data, tmp_path)
    measured["one process"] = _difference(losses, weights, want_losses, want, exported.prefix)
    for label, flags in PLANS.items():
        plan = smp.plan(exported, ids, cluster="cpu:2", global_batch=ids.shape[0], workdir=tmp_path / label, **flags)
        if label == "tp2":
            assert '"masked_gather"' in plan.path.read_text(), "the plan does not split the vocabulary"
        ckpt = tmp_path / label / "ckpt"
        run = smp.launch(plan, data=ids, steps=STEPS, checkpoint_dir=ckpt, progress=False, **_options())
        measured[label] = _difference(run.losses, load_file(str(run.trained)), want_losses, want, exported.prefix)
        # the trained model written out keeps the record
        out = tmp_path / label / "trained.onnx"
        subprocess.run([str(smp.find_binary("smp-runner")), "export", str(ckpt), "-o", str(out)], check=True,
                       capture_output=True)
        assert _padding_records(out) == {exported.prefix + "emb.weight": f"[{PAD}]"}
    print("; ".join(f"{k}: loss {a:.1e}, weights {b:.1e}" for k, (a, b) in measured.items()))
    for label, (loss, weight) in measured.items():
        assert loss < TOL and weight < TOL, f"{label}: losses differ by {loss:.2e}, weights by {weight:.2e}"


def test_without_the_record_the_padding_row_trains(tmp_path: Path) -> None:
    """The check above can fail: the same export with `smp.padding_rows` stripped trains the
    padding row (and, through clipping's global norm, every weight) unlike PyTorch."""
    module = _PadLM(tied=False).double()
    ids = _batch()
    want_losses, want = _torch_training(copy.deepcopy(module), ids)
    exported = smp.export(module, ids, tmp_path / "m.onnx")
    proto = onnx.load(str(exported.path))
    for t in proto.graph.initializer:
        keep = [p for p in t.metadata_props if p.key != "smp.padding_rows"]
        del t.metadata_props[:]
        t.metadata_props.extend(keep)
    stripped = tmp_path / "stripped.onnx"
    onnx.save(proto, str(stripped))
    data = tmp_path / "data.npz"
    np.savez(data, **{exported.input_names[0]: ids.numpy()})
    _, weights = _one_process(stripped, data, tmp_path)
    pad_row = float((weights[exported.prefix + "emb.weight"][PAD].double() - want["emb.weight"][PAD]).abs().max())
    assert pad_row > 1e-3, pad_row
