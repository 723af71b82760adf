"""The byte-level GPT of benches/real_data.rs: Hugging Face GPT-2 with a 256-token vocabulary
(one token per byte), exported with dynamic batch and sequence and its parameter record.

    python benches/real_data_model.py OUT.onnx LAYERS HIDDEN HEADS SEQ
"""
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from smp_partition.export import export  # noqa: E402


def main() -> None:
    out, layers, hidden, heads, seq = sys.argv[1], *map(int, sys.argv[2:6])
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=hidden, n_layer=layers,
                                  n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 256, (2, seq))
    export(model, (ids,), out)
    print(sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main()
