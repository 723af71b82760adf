"""Mixture-of-experts models through the front door (`_moe.py`): the export is the module (logits
and the router's auxiliary loss, checked on onnxruntime against Hugging Face), names the
auxiliary loss for the runner, exports a bare MoE block, and refuses what it cannot train."""

from __future__ import annotations

import json
from pathlib import Path

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
    with pytest.raises(smp.SmpError, match="router_jitter_noise to 0"):
        smp.export(model, torch.zeros(1, 4, dtype=torch.long), tmp_path / "m.onnx")
