"""Exports one Mixtral sparse-MoE block (8 experts, top-2, hidden 256, expert intermediate 512,
HF's default init) through the front door (`smp_partition.export`: dense experts), with one
batch of 8 × 128 tokens' hidden states and MSE targets, for benches/moe.rs.

usage: moe_block.py OUT_DIR    writes OUT_DIR/{moe_block.onnx,batch.npz}
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
import smp_partition as smp  # noqa: E402

warnings.filterwarnings("ignore")
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, BATCH, SEQ = 256, 512, 8, 2, 8, 128


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cfg = T.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(cfg)  # HF's default init of the block's weights
    block = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    smp.export(block, x, out / "moe_block.onnx")
    np.savez(out / "batch.npz", hidden_states=x.numpy(), targets=torch.randn(BATCH, SEQ, HIDDEN, generator=g).numpy())


if __name__ == "__main__":
    main()
