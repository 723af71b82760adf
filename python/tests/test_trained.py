from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import smp_partition as smp
from conftest import BATCH, needs_runner, tiny_gpt2, tokens, torch_losses


def _run_with(plan, trained: Path) -> smp.Run:
    return smp.Run(plan=plan, dir=trained.parent, losses=[], report={}, trained=trained)


def _trained_file(model, path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """What `smp-runner export -o trained.safetensors` writes: each parameter once, under a
    module parameter name (with the export wrapper's prefix), no buffers."""
    weights = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        weights[prefix + name] = (p.detach() + 0.5).contiguous()
    save_file(weights, str(path))
    return weights


def test_load_trained_fills_ties_and_loads_strictly(gpt2_plan, tmp_path: Path) -> None:
    plan = gpt2_plan[2]
    model = tiny_gpt2()
    path = tmp_path / "trained.safetensors"
    weights = _trained_file(model, path, plan.prefix)
    target = tiny_gpt2()
    smp.load_trained(target, _run_with(plan, path))
    for name, p in target.named_parameters(remove_duplicate=False):
        key = plan.prefix + ("transformer.wte.weight" if name == "lm_head.weight" else name)
        assert torch.equal(p, weights[key]), name
    assert target.lm_head.weight is target.transformer.wte.weight  # the tie survives


def test_load_trained_names_what_is_missing_or_unknown(gpt2_plan, tmp_path: Path) -> None:
    plan = gpt2_plan[2]
    model = tiny_gpt2()
    path = tmp_path / "trained.safetensors"
    weights = _trained_file(model, path, plan.prefix)
    del weights[plan.prefix + "transformer.h.1.mlp.c_fc.bias"]
    save_file(weights, str(path))
    with pytest.raises(smp.SmpError, match="h.1.mlp.c_fc.bias"):
        smp.load_trained(tiny_gpt2(), _run_with(plan, path))
    weights[plan.prefix + "transformer.h.1.mlp.c_fc.bias"] = torch.zeros(128)
    weights[plan.prefix + "no.such.weight"] = torch.zeros(1)
    save_file(weights, str(path))
    with pytest.raises(smp.SmpError, match="no.such.weight"):
        smp.load_trained(tiny_gpt2(), _run_with(plan, path))


@needs_runner
def test_trained_weights_come_back_into_the_module(gpt2_plan, tmp_path: Path) -> None:
    """HF GPT-2 → plan (pp 2) → launch on 2 CPU ranks, 5 steps → load_trained: the module's
    forward equals `smp-runner eval` of the exported trained.onnx (f32, 1e-5), and the losses
    equal 5 steps of plain PyTorch training (1e-5)."""
    model, batch, plan = gpt2_plan
    run = smp.launch(plan, data=batch, steps=5, checkpoint_dir=tmp_path / "ckpt")
    expected = torch_losses(copy.deepcopy(model), batch, 5)
    np.testing.assert_allclose(run.losses, expected, rtol=1e-5)
    trained = copy.deepcopy(model)
    smp.load_trained(trained, run)
    onnx_out = tmp_path / "trained.onnx"
    runner = str(smp.find_binary("smp-runner"))
    subprocess.run([runner, "export", str(tmp_path / "ckpt"), "-o", str(onnx_out)], check=True)
    probe = tokens()
    np.savez(tmp_path / "in.npz", input_ids=probe.numpy())
    subprocess.run([runner, "eval", str(onnx_out), "--inputs", str(tmp_path / "in.npz"),
                    "--outputs", str(tmp_path / "out.npz")], check=True)
    got = np.load(tmp_path / "out.npz")["logits"]
    trained.eval()
    with torch.no_grad():
        want = trained(probe).logits.numpy()
    np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-5)


class _Buffers(torch.nn.Module):
    """A parameter, a persistent buffer, a non-persistent one (as RoPE's `inv_freq`) and a
    parameter the forward pass never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.unread = torch.nn.Parameter(torch.zeros(2))
        self.register_buffer("kept", torch.arange(4.0))
        self.register_buffer("inv_freq", torch.arange(4.0) + 10, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.kept) * self.w + x * self.inv_freq


def test_non_persistent_buffers_are_never_handed_to_load_state_dict() -> None:
    from smp_partition.trained import state_dict_of

    module = _Buffers()
    tensors = {"m.w": torch.full((4,), 2.0), "m.kept": torch.zeros(4), "m.inv_freq": torch.zeros(4)}
    full = state_dict_of(module, tensors, "m.", unused=["m.unread"])
    assert set(full) == {"w", "unread", "kept"}
    module.load_state_dict(full, strict=True)
    assert torch.equal(module.w, torch.full((4,), 2.0)) and torch.equal(module.inv_freq, torch.arange(4.0) + 10)
    # a parameter the export read but the weights lack is refused, by name
    with pytest.raises(smp.SmpError, match="unread"):
        state_dict_of(_Buffers(), tensors, "m.")


def test_the_export_records_every_parameter_by_name_and_non_persistent_buffers_as_such(tmp_path: Path) -> None:
    import onnx

    from smp_partition import param_record

    exported = smp.export(_Buffers(), torch.randn(2, 4), tmp_path / "m.onnx", dynamic=False)
    records = param_record.read_record(onnx.load(str(exported.path)))
    by_param = {json.loads(r["smp.params"])[0][0]: r for r in records.values() if "smp.params" in r}
    assert by_param["model.w"]["smp.kind"] == "parameter"
    assert by_param["model.kept"]["smp.kind"] == "buffer" and "smp.persistent" not in by_param["model.kept"]
    assert by_param["model.inv_freq"]["smp.persistent"] == "false"
    assert exported.record["unused"] == ["model.unread"]


class _PartlyFrozen(torch.nn.Module):
    """A frozen layer (`requires_grad = False`, as a fine-tuning script freezes one, or a fixed
    sinusoidal table) under a trained one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)))


@needs_runner
def test_parameters_the_module_freezes_are_loaded_and_written_but_not_trained(tmp_path: Path) -> None:
    """The record marks a `requires_grad = False` parameter `smp.trainable: false`; the runner
    trains the rest as PyTorch does (f64, AdamW lr 1e-3, weight decay 0.01, clip 1: losses and
    weights 1e-9) and writes the frozen one out unchanged."""
    import onnx

    from smp_partition import param_record

    module = _PartlyFrozen().double()
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    exported = smp.export(module, x, tmp_path / "m.onnx", dynamic=False)
    records = param_record.read_record(onnx.load(str(exported.path)))
    trainable = {json.loads(r["smp.params"])[0][0]: r.get("smp.trainable", "true")
                 for r in records.values() if r.get("smp.kind") == "parameter"}
    assert trainable == {"model.frozen.weight": "false", "model.frozen.bias": "false",
                         "model.head.weight": "true", "model.head.bias": "true"}

    np.savez(tmp_path / "data.npz", **{exported.input_names[0]: x.numpy(), "labels": labels.numpy()})
    weights = tmp_path / "trained.safetensors"
    done = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(exported.path), "--data",
                           str(tmp_path / "data.npz"), "--loss", "cross-entropy", "--steps", "3", "--dtype", "f64",
                           "--threads", "1", "--json", "--save-weights", str(weights)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    losses = [s["loss"] for s in json.loads(done.stdout)["steps"]]

    ref = copy.deepcopy(module)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01, foreach=False)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=False)
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-9)

    from safetensors.torch import load_file

    got = load_file(str(weights))
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(got[f"model.{name}"].double().numpy(), p.detach().numpy(), rtol=1e-9, atol=1e-12)
    assert torch.equal(got["model.frozen.weight"].double(), module.frozen.weight)


@needs_runner
def test_an_fp16_plan_trains_as_autocast_with_grad_scaler_and_gives_fp32_masters(tmp_path: Path) -> None:
    """SMP's `fp16: true` → an fp16-mixed plan (pp 2) → launch: the losses are PyTorch's own
    recipe's (`torch.autocast("cpu", torch.float16)`, `GradScaler("cpu")`, AdamW, clip) within
    1e-2, and `load_trained` gives the fp32 master weights, trained."""
    model, batch = tiny_gpt2(), tokens()
    plan = smp.plan(model, batch, cluster="cpu:2", global_batch=BATCH,
                    config={"pipeline_parallel_degree": 2, "microbatches": 4, "fp16": True},
                    workdir=tmp_path)
    assert plan.parallel.precision == "fp16-mixed"
    run = smp.launch(plan, data=batch, steps=5)
    reference = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    expected = []
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference(batch, labels=batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        expected.append(loss.item())
    np.testing.assert_allclose(run.losses, expected, rtol=1e-2)
    assert run.losses != torch_losses(copy.deepcopy(model), batch, 5), "the plan trained in f32"
    trained = copy.deepcopy(model)
    smp.load_trained(trained, run)
    moved = 0
    for (name, p), q in zip(trained.named_parameters(), model.parameters()):
        assert p.dtype == torch.float32, name
        moved += int(not torch.equal(p, q))
    assert moved > 0
