#!/usr/bin/env python3
"""Small real exports with weights: HF GPT-2, BERT, Llama (grouped-query attention), ViT, OPT,
Phi and RoBERTa,
HF's default init (fixed seed; the exporter merges equal-valued parameters such as norm
weights of 1 and zero biases, and the parameter record each file carries unties them), no
dropout, eval mode, `torch.onnx.export(..., dynamo=True)` at
opset 18 with symbolic batch (and sequence) dims, weights inline. For each model also writes
`models/<name>.io.npz` (inputs keyed by graph input names and outputs keyed by graph output
names, computed by onnxruntime at batch 2, seq 16) and records it in models/manifest.json.

    .venv/bin/python scripts/export_models.py [NAME ...]     # default: all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_build import (REPO, float_initializer_elements, io_record, untied_float_elements,  # noqa: E402
                        update_manifest)
from param_record import drop_stack_traces, write_record  # noqa: E402

MODELS = REPO / "models"
OPSET = 18
SEED = 0
BATCH, SEQ = 2, 16


class LogitsOnly(torch.nn.Module):
    """Returns only the logits: HF outputs carry cache objects the exporter can't take."""

    def __init__(self, model, input_name):
        super().__init__()
        self.model = model
        self.input_name = input_name

    def forward(self, x):
        kwargs = {self.input_name: x}
        if self.input_name == "input_ids":
            kwargs["use_cache"] = False
        return self.model(**kwargs).logits


def gpt2():
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=255, eos_token_id=255,
                                  use_cache=False)
    return cfg, transformers.GPT2LMHeadModel(cfg), "input_ids", cfg.n_positions


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=256,
                                  max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return cfg, transformers.BertForMaskedLM(cfg), "input_ids", cfg.max_position_embeddings


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=176,
                                   vocab_size=256, max_position_embeddings=128,
                                   attention_dropout=0.0, use_cache=False,
                                   tie_word_embeddings=False)
    return cfg, transformers.LlamaForCausalLM(cfg), "input_ids", cfg.max_position_embeddings


def vit():
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=256, num_labels=10, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    return cfg, transformers.ViTForImageClassification(cfg), "pixel_values", None


def opt():
    cfg = transformers.OPTConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                 ffn_dim=256, word_embed_proj_dim=64, vocab_size=256,
                                 max_position_embeddings=128, dropout=0.0,
                                 attention_dropout=0.0, activation_dropout=0.0,
                                 layerdrop=0.0, use_cache=False)
    return cfg, transformers.OPTForCausalLM(cfg), "input_ids", cfg.max_position_embeddings


def phi():
    cfg = transformers.PhiConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                 intermediate_size=256, vocab_size=256,
                                 max_position_embeddings=128, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attention_dropout=0.0, use_cache=False)
    return cfg, transformers.PhiForCausalLM(cfg), "input_ids", cfg.max_position_embeddings


def roberta():
    cfg = transformers.RobertaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=256, vocab_size=256,
                                     max_position_embeddings=130, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    # RoBERTa's positions start after the padding index: 128 tokens need 130 positions.
    return cfg, transformers.RobertaForMaskedLM(cfg), "input_ids", 128


BUILDERS = {"gpt2": gpt2, "bert": bert, "llama": llama, "vit": vit, "opt": opt, "phi": phi,
            "roberta": roberta}


def build_model(name: str):
    """The HF model exactly as exported (same seed, same weights), in eval mode: for PyTorch
    reference runs (`sys.path.insert(0, "scripts"); from export_models import build_model`).
    Returns (config, hf_model, input_name, max_seq)."""
    torch.manual_seed(SEED)
    cfg, hf, input_name, max_seq = BUILDERS[name]()
    cfg._attn_implementation = "eager"  # plain MatMul/Softmax attention, no fused SDPA
    hf.eval()
    return cfg, hf, input_name, max_seq


def export(name: str) -> dict:
    cfg, hf, input_name, max_seq = build_model(name)
    model = LogitsOnly(hf, input_name).eval()
    gen = torch.Generator().manual_seed(SEED)
    batch = torch.export.Dim("batch")
    if input_name == "input_ids":
        example = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        dims = {0: batch, 1: torch.export.Dim("seq", max=max_seq)}
    else:
        example = torch.randn(BATCH, cfg.num_channels, cfg.image_size, cfg.image_size,
                              generator=gen)
        dims = {0: batch}
    path = MODELS / f"{name}.onnx"
    with torch.no_grad():
        expected = model(example).numpy()
        program = torch.onnx.export(model, (example,), dynamo=True, opset_version=OPSET,
                                    dynamic_shapes=(dims,), input_names=[input_name],
                                    output_names=["logits"], verbose=False)
    program.save(str(path), external_data=False)

    proto = onnx.load(str(path))
    drop_stack_traces(proto)
    # which module parameters each initializer stands for (docs/parameter-record.md)
    record = write_record(model, proto)
    assert not record["missing"], f"{name}: parameters not in the export: {record['missing']}"
    onnx.save(proto, str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = sorted({n.op_type for n in proto.graph.node})
    assert "Dropout" not in ops, f"{name}: Dropout in graph"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {proto.graph.input[0].name: example.numpy()}
    outputs = dict(zip([o.name for o in proto.graph.output], sess.run(None, feeds)))
    got = outputs["logits"]
    rel = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
    assert rel <= 1e-4, f"{name}: onnxruntime differs from torch, norm-relative {rel:.2e}"
    np.savez(MODELS / f"{name}.io.npz", **feeds, **outputs)

    rec = {"file": str(path.relative_to(REPO)), "kind": name, "graph_only": False,
           "dtype": "float32", "opset": OPSET, "seed": SEED,
           "hf_class": type(hf).__name__, "config": hf.config.to_diff_dict(),
           "float_initializer_elements": float_initializer_elements(proto),
           "untied_float_elements": untied_float_elements(proto),
           "torch_parameters": sum(p.numel() for p in hf.parameters()),
           "layers": cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.n_layer,
           "ops": ops, "reference": f"models/{name}.io.npz",
           "reference_shapes": {k: list(v.shape) for k, v in {**feeds, **outputs}.items()},
           "onnxruntime_vs_torch_rel": rel, "file_bytes": path.stat().st_size}
    rec.update(io_record(proto))
    print(f"{path.relative_to(REPO)}: {rec['torch_parameters']} torch params, "
          f"{rec['float_initializer_elements']} float initializer elements, "
          f"{rec['file_bytes'] / 1e3:.0f} kB, ort vs torch {rel:.1e}")
    return {name: rec}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"any of {', '.join(BUILDERS)} (default: all)")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in BUILDERS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; choose from {', '.join(BUILDERS)}")
    torch.set_num_threads(1)
    for name in args.names or list(BUILDERS):
        update_manifest(export(name))


if __name__ == "__main__":
    main()
