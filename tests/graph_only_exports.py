"""Exports for tests/split_graph_only.rs: tiny twins of the graph-only Llama exports
(scripts/make_graph_only.py's `build_llama`, the builder of models/llama3-*.onnx) with real
float32 weights, so that their tensor splits can run: 8 query heads over 2 grouped-query KV
heads (`repeat_kv` as Expand(Unsqueeze(kv), [1, 1, rep, 1, 1]) and a Reshape to a constant
[0, heads, seq, d]), RoPE on constant tables, SwiGLU, untied head; fixed sequence 16, symbolic
batch.

A DeepSeek-V3 twin (`build_deepseek`): latent attention over 4 heads (q and kv through
16-wide low-rank bottlenecks, the 4-dim rotary key shared by the heads), a dense first layer,
then 4 routed experts top 2 beside a shared expert.

Also a twin whose 3 KV heads neither divide nor are divided by t = 2 (6 query heads).

usage: graph_only_exports.py OUT_DIR
Writes OUT_DIR/{llama-gqa,deepseek-mla,llama-kv3}.onnx and their external data OUT_DIR/*.weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

from onnx import TensorProto

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_graph_only import build_deepseek, build_llama  # noqa: E402
from onnx_build import write_model  # noqa: E402


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, layers, hidden, heads, kv in [("llama-gqa", 4, 64, 8, 2), ("llama-kv3", 2, 48, 6, 3)]:
        with open(out / f"{name}.weights", "wb") as f:
            model = build_llama(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                                ffn=2 * hidden, seq=16, vocab=256, dtype=TensorProto.FLOAT,
                                weights_file=f)
        write_model(model, out / f"{name}.onnx")
    with open(out / "deepseek-mla.weights", "wb") as f:
        model = build_deepseek("deepseek-mla", layers=2, dense_layers=1, hidden=32, heads=4, q_lora=16, kv_lora=16,
                               rope=4, nope=4, v_dim=8, ffn=48, moe_ffn=16, experts=4, top_k=2, shared=1, seq=16,
                               vocab=256, dtype=TensorProto.FLOAT, weights_file=f)
    write_model(model, out / "deepseek-mla.onnx")


if __name__ == "__main__":
    main()
