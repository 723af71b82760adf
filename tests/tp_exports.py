"""Exports for tests/tp_default_init.rs: small Llama (4 heads, 2 KV heads, like
models/llama.onnx) and GPT-NeoX (4 heads, partial rotary, parallel residual) at Hugging Face's
default init (no perturbation: equal-valued norms and zero biases are merged by the exporter),
dropout off, eager attention, dynamic batch and sequence, with the parameter record.

usage: tp_exports.py OUT_DIR
Writes OUT_DIR/{llama,neox}.onnx.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import onnx
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from export_models import LogitsOnly  # noqa: E402
from param_record import write_record  # noqa: E402

warnings.filterwarnings("ignore")


def configs():
    common = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256,
                  max_position_embeddings=128, use_cache=False, attention_dropout=0.0)
    return {
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(num_key_value_heads=2, intermediate_size=176,
                                                    tie_word_embeddings=False, **common)),
        "neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(intermediate_size=256, hidden_dropout=0.0,
                                                       **common)),
    }


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, (cls, cfg) in configs().items():
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        model = LogitsOnly(cls(cfg), "input_ids").eval()
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=128)}
        with torch.no_grad():
            program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18, dynamic_shapes=(dims,),
                                        input_names=["input_ids"], output_names=["logits"], verbose=False)
        path = out / f"{name}.onnx"
        program.save(str(path), external_data=False)
        proto = onnx.load(str(path))
        write_record(model, proto)
        onnx.save(proto, str(path))


if __name__ == "__main__":
    main()
