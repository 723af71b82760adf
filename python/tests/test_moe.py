"""Mixture-of-experts models through the front door (`_moe.py`): the export is the module (logits
and the router's auxiliary loss, checked on onnxruntime against Hugging Face), names the
auxiliary loss for the runner, exports a bare MoE block, and refuses what it cannot train."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import transformers

import smp_partition as smp


def _mixtral(**extra):
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=48, vocab_size=64, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2, use_cache=False, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def test_export_is_the_module_with_its_auxiliary_loss(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _mixtral(output_router_logits=True, router_aux_loss_coef=0.02)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    exported = smp.export(model, ids, tmp_path / "mixtral.onnx")
    proto = onnx.load(str(exported.path))
    assert [o.name for o in proto.graph.output] == ["logits", "aux_loss"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["smp.aux_loss"]) == [{"output": "aux_loss", "coefficient": 0.02}]
    assert exported.record["missing"] == []
    # the experts implementation is restored: the module still trains as before
    assert model.config._experts_implementation != "smp_dense" and model.config.output_router_logits
    with torch.no_grad():
        want = model.eval()(ids, labels=ids)
    # another batch and sequence than the example: the export is dynamic
    sess = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    logits, aux = sess.run(None, {"input_ids": ids.numpy()})
    assert np.abs(logits - want.logits.numpy()).max() < 1e-5
    assert abs(float(aux) - want.aux_loss.item()) < 1e-6 * abs(want.aux_loss.item())
    other = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(other, labels=other)
    logits, aux = sess.run(None, {"input_ids": other.numpy()})
    assert np.abs(logits - want.logits.numpy()).max() < 1e-5
    assert abs(float(aux) - want.aux_loss.item()) < 1e-6 * abs(want.aux_loss.item())


def test_a_bare_block_exports_without_an_auxiliary_loss(tmp_path: Path) -> None:
    import onnxruntime as ort

    block = _mixtral().model.layers[0].mlp
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    exported = smp.export(block, x, tmp_path / "block.onnx")
    proto = onnx.load(str(exported.path))
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert "smp.aux_loss" not in {p.key for p in proto.metadata_props}
    (y,) = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"]).run(None, {"hidden_states": x.numpy()})
    with torch.no_grad():
        assert np.abs(y - block(x).numpy()).max() < 1e-5


def test_router_jitter_is_refused_with_the_fix(tmp_path: Path) -> None:
    model = _mixtral(router_jitter_noise=0.1)
    with pytest.raises(smp.SmpError, match=r"`model.layers.0.mlp` \(MixtralSparseMoeBlock\) trains otherwise than it "
                                           r"evaluates \(its output differs.*jitter_noise = 0.1 draws at random.*set "
                                           r"them to 0"):
        smp.export(model, torch.zeros(1, 4, dtype=torch.long), tmp_path / "m.onnx")


def test_routing_sampled_in_training_is_refused_with_the_setting_that_removes_it(tmp_path: Path) -> None:
    # PhiMoE's SparseMixer samples its experts (Gumbel) among those within a margin of the best
    # (`router_jitter_noise`, not noise on the tokens) and has a gradient estimator of its own
    # (Heun's method) in training; at margin 0 only the best remains and it trains as it evaluates
    def phimoe(margin: float) -> Any:
        cfg = transformers.PhimoeConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=48, vocab_size=64, max_position_embeddings=32,
                                        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=margin,
                                        use_cache=False)
        torch.manual_seed(0)
        return transformers.PhimoeForCausalLM(cfg)

    model = phimoe(0.01)
    with pytest.raises(smp.SmpError, match=r"`model.layers.0.mlp` \(PhimoeSparseMoeBlock\) trains otherwise than it "
                                           r"evaluates .*router_jitter_noise = 0.01 draws at random.*set them to 0"):
        smp.export(model, torch.zeros(1, 4, dtype=torch.long), tmp_path / "m.onnx")
    # the check leaves the module as it was
    assert model.training and model.model.layers[0].mlp.router.router_jitter_noise == 0.01
    smp.export(phimoe(0.0), torch.zeros(1, 4, dtype=torch.long), tmp_path / "m0.onnx")


def _experts_class(form: str):
    """A transformers experts-interface class of one form the fused kernel does not take, with
    transformers' own `batched_mm` as its reference forward."""
    from transformers.integrations.moe import use_experts_implementation

    flags = {"clamped-gate": {}, "biases-interleaved": dict(is_concatenated=False, is_transposed=True, has_bias=True),
             "ungated": dict(has_gate=False), "post-norm": dict(has_post_expert_norm=True), "gelu-gate": {}}[form]

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            e, h, i = 4, 16, 12
            g = torch.Generator().manual_seed(5)
            first = "gate_up_proj" if flags.get("has_gate", True) else "up_proj"
            rows = 2 * i if first == "gate_up_proj" else i
            shape = (e, h, rows) if flags.get("is_transposed") else (e, rows, h)
            setattr(self, first, torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.3))
            self.down_proj = torch.nn.Parameter(torch.randn(*((e, i, h) if flags.get("is_transposed") else (e, h, i)), generator=g) * 0.3)
            if flags.get("has_bias"):
                setattr(self, first + "_bias", torch.nn.Parameter(torch.randn(e, rows, generator=g) * 0.3))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(e, h, generator=g) * 0.3)
            self.act_fn = torch.nn.functional.gelu if form in ("ungated", "gelu-gate") else torch.nn.SiLU()
            self.limit = 0.2
            if form == "post-norm":
                self.post_expert_norm = torch.nn.LayerNorm(h)

        if form == "clamped-gate":
            # DeepSeek-V4's, GLM-5's and Step-3's form: the interface's layout, a gate of its own
            def _apply_gate(self, gate_up):
                gate, up = gate_up.chunk(2, dim=-1)
                return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        elif form == "biases-interleaved":
            # gpt-oss's: gate and up rows interleaved, a clamped, scaled sigmoid gate
            def _apply_gate(self, gate_up):
                gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
                return (up + 1) * gate * torch.sigmoid(gate * 1.702)

    return use_experts_implementation(**flags)(Experts)


class _Block(torch.nn.Module):
    """A softmax top-2 router over 4 experts of `form`."""

    def __init__(self, form: str) -> None:
        super().__init__()
        config = transformers.PretrainedConfig()
        config._experts_implementation = "batched_mm"
        self.config = config
        self.router = torch.nn.Linear(16, 4, bias=False)
        torch.nn.init.normal_(self.router.weight, std=0.5, generator=torch.Generator().manual_seed(6))
        self.experts = _experts_class(form)(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, 16)
        weights, index = torch.topk(torch.softmax(self.router(x), dim=-1), 2, dim=-1)
        return self.experts(x, index, weights).reshape(hidden_states.shape)


@pytest.mark.parametrize("form", ["clamped-gate", "biases-interleaved", "ungated", "post-norm", "gelu-gate"])
def test_experts_of_every_form_export_as_the_module_computes_them(form: str, tmp_path: Path) -> None:
    # the dense form once multiplied act(gate)·up whatever the module's own gate: a clamped gate
    # (DeepSeek-V4) exported without its clamp, silently
    import onnxruntime as ort

    block = _Block(form)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(7))
    if form in ("clamped-gate", "biases-interleaved"):
        # the fused kernel computes these: their dense form carries the two clamps, no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exported = smp.export(block, x, tmp_path / "block.onnx")
        clips = [n for n in onnx.load(str(exported.path)).graph.node if n.op_type == "Clip"]
        assert len(clips) == 2
    else:
        with pytest.warns(UserWarning, match="densely: every expert on every token"):
            exported = smp.export(block, x, tmp_path / "block.onnx")
    assert block.config._experts_implementation == "batched_mm"
    (y,) = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"]).run(None, {"hidden_states": x.numpy()})
    with torch.no_grad():
        want = block(x).numpy()
    assert np.abs(want).max() > 1e-2
    assert np.abs(y - want).max() < 1e-5 * np.abs(want).max()
    if form == "clamped-gate":
        # the clamp binds: without it the block computes something else
        with torch.no_grad():
            block.experts.limit = 1e9
            assert np.abs(block(x).numpy() - want).max() > 1e-2 * np.abs(want).max()


def test_interleaved_experts_are_exported_gate_rows_first_and_given_back_as_the_module_holds_them(tmp_path: Path) -> None:
    # gpt-oss's layout: [E, H, 2I] with gate and up columns alternating; the fused op takes
    # [E, 2I, H], gate rows first
    from onnx import numpy_helper

    from smp_partition.trained import in_module_layout

    block = _Block("biases-interleaved")
    exported = smp.export(block, torch.randn(2, 8, 16), tmp_path / "block.onnx")
    proto = onnx.load(str(exported.path))
    meta = {p.key: json.loads(p.value) for p in proto.metadata_props if p.key.startswith("smp.")}
    names = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in proto.graph.initializer}
    gate_up, bias = (next(n for n in names if n.endswith(w)) for w in ("experts.gate_up_proj", "experts.gate_up_proj_bias"))
    assert set(meta["smp.deinterleaved"]) == {gate_up, bias} and gate_up in meta["smp.transposed"]
    module = block.experts
    i = module.down_proj.shape[1]
    # exported: rows 0..I the module's even columns (gate), rows I..2I its odd ones (up)
    assert torch.equal(names[gate_up][:, :i], module.gate_up_proj.detach()[:, :, 0::2].transpose(1, 2))
    assert torch.equal(names[gate_up][:, i:], module.gate_up_proj.detach()[:, :, 1::2].transpose(1, 2))
    assert torch.equal(names[bias][:, :i], module.gate_up_proj_bias.detach()[:, 0::2])
    back = in_module_layout({k: names[k] for k in (gate_up, bias)}, exported.path)
    assert torch.equal(back[gate_up], module.gate_up_proj.detach()) and torch.equal(back[bias], module.gate_up_proj_bias.detach())


def test_jetmoe_heads_and_experts_export_as_the_module_computes_them(tmp_path: Path) -> None:
    # JetMoE: a mixture of attention heads (routed query and output projections, `map` and
    # `reduce`) and experts whose weights sit in two modules, each with a bias after the sum;
    # the biases are drawn non-zero, so a form that dropped them would differ
    import onnxruntime as ort

    cfg = transformers.JetMoeConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    kv_channels=8, intermediate_size=48, vocab_size=64, max_position_embeddings=32,
                                    num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.bias") or name.endswith("experts.bias"):
                p.normal_(std=0.5)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"mixture of attention heads `model.layers.0.self_attention.experts` \(JetMoeMoA\) "
                                         r"is exported densely"):
        exported = smp.export(model, ids, tmp_path / "jetmoe.onnx")
    assert exported.record["missing"] == []
    # both dense: the module's own routing (sorting the pairs by expert, splitting them by the
    # routed counts, adding them back by index) reaches the graph nowhere
    ops = {n.op_type for n in onnx.load(str(exported.path)).graph.node}
    assert ops.isdisjoint({"Sort", "ScatterND", "ScatterElements"}), ops
    sess = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    for batch in (ids, torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))):
        with torch.no_grad():
            want = model(batch).logits.numpy()
        got = sess.run(None, {"input_ids": batch.numpy()})[0]
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    # the module is given back as it was
    assert "map" not in model.model.layers[0].self_attention.experts.__dict__
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_the_gate_activation_is_recognised_under_a_float64_default() -> None:
    """A model built with `torch.set_default_dtype(torch.float64)` probes its experts' gate
    activation in f32 all the same (the probe once mixed f64 and f32 and raised)."""
    from smp_partition import _moe

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _moe._is_silu(torch.nn.SiLU())
        assert not _moe._is_silu(torch.nn.GELU())
    finally:
        torch.set_default_dtype(before)
