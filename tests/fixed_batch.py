"""Exports for tests/fixed_batch.rs: one small GPT-2 (HF's default init, dropout off, eager
attention) exported twice with the parameter record (scripts/param_record.py): with the batch
fixed at 8 (torch.onnx's default: reshape targets and the causal mask hold the batch) and with
a dynamic batch; one batch of token ids; and a tiny model that reshapes its batch into a later
dim ([B, S, H] -> [S, B, H] -> [S*B, H]), which cannot be rebound.

usage: fixed_batch.py OUT_DIR
Writes OUT_DIR/{fixed,dynamic,flat}.onnx and OUT_DIR/data.npz (input_ids, 8 x 16).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from export_models import LogitsOnly  # noqa: E402
from param_record import write_record  # noqa: E402

warnings.filterwarnings("ignore")
BATCH, SEQ, VOCAB = 8, 16, 64


def export(model, x, path: Path, dynamic: bool):
    kw = {"dynamic_shapes": ({0: torch.export.Dim("batch")},)} if dynamic else {}
    with torch.no_grad():
        program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18, input_names=["input_ids"],
                                    output_names=["logits"], verbose=False, **kw)
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    write_record(model, proto)
    onnx.save(proto, str(path))


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.emb(ids).transpose(0, 1).reshape(SEQ * BATCH, 16)
        return self.head(h).reshape(SEQ, BATCH, VOCAB).transpose(0, 1)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, use_cache=False, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    model = LogitsOnly(T.GPT2LMHeadModel(cfg), "input_ids").eval()
    x = torch.randint(2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    export(model, x, out / "fixed.onnx", dynamic=False)
    export(model, x, out / "dynamic.onnx", dynamic=True)
    export(Flat().eval(), x, out / "flat.onnx", dynamic=False)
    np.savez(out / "data.npz", input_ids=x.numpy())


if __name__ == "__main__":
    main()
