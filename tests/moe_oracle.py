"""PyTorch side of the mixture-of-experts tests (tests/moe.rs), and helpers the zoo test can
call for its MoE rows.

Small Mixtral (top-2 of 4 experts, renormalised), Qwen3-MoE (top-2 of 4, `norm_topk_prob`
off), gpt-oss (top-2 of 4, experts with biases, interleaved gate and up rows and a clamped swish
gate at a limit of 0.05) and Mixtral with DeepSeek-V4's clamped SwiGLU experts (`mixtral_clamped`:
the gate clamped to at most 0.05, the up projection to ±0.05, a limit its activations reach;
PyTorch runs them through transformers' `batched_mm`, which applies the experts' own gate) at
Hugging Face's default init, with the router's auxiliary loss on
(`output_router_logits`, coefficient 0.02), eager attention, dropout off:
- exported through the front door (`smp_partition.export`: dense experts and the `aux_loss`
  output, see python/smp_partition/_moe.py);
- one fixed batch (`<name>.data.npz`, token ids);
- 5 steps of PyTorch training of the module as the runner trains (AdamW lr 1e-3, weight decay
  0.01 on every parameter, clip 1.0) with its own loss, `model(ids, labels=ids).loss`
  (cross-entropy plus `router_aux_loss_coef · aux_loss`), per microbatch and averaged over the
  microbatches by their counted tokens (`reference_losses`), for 1 and 2 microbatches.

usage: moe_oracle.py OUT_DIR
Writes OUT_DIR/cases.json: [{"name", "onnx", "data", "batch", "seq", "losses": {"1": [...],
"2": [...]}}].
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import smp_partition as smp  # noqa: E402

warnings.filterwarnings("ignore")
VOCAB, BATCH, SEQ, STEPS, SEED = 64, 4, 8, 5, 0
LR, WD, CLIP = 1e-3, 0.01, 1.0
AUX_COEF = 0.02


#: The clamped cases' limit.
LIMIT = 0.05


def configs() -> dict:
    """Name → (model class, config): small MoE causal LMs of two families."""
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=32, use_cache=False, attention_dropout=0.0,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF, bos_token_id=0, eos_token_id=0)
    return {
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)),
        "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            moe_intermediate_size=24, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False, head_dim=8, **common)),
        # experts with biases, gate and up rows interleaved and transposed, a clamped swish gate
        # at a limit its activations reach; sliding-window layers alternating with full ones
        "gpt_oss": (T.GptOssForCausalLM, T.GptOssConfig(
            intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=LIMIT, head_dim=8,
            sliding_window=4, **common)),
    }


class ClampedExperts(T.models.mixtral.modeling_mixtral.MixtralExperts):
    """Mixtral's experts with DeepSeek-V4's gate: `silu(min(g, L)) · clip(u, −L, L)`."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def build(name: str):
    """The model `name` at HF's default init (seed 0), eager attention."""
    cls, cfg = configs()["mixtral" if name == "mixtral_clamped" else name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = cls(cfg)
    if name == "mixtral_clamped":
        cfg._experts_implementation = "batched_mm"
        for m in model.modules():
            if isinstance(m, T.models.mixtral.modeling_mixtral.MixtralExperts):
                m.__class__, m.limit = ClampedExperts, LIMIT
    return model


def tokens():
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED + 1))


def reference_losses(model, ids, steps: int = STEPS, microbatches: int = 1) -> list[float]:
    """`steps` steps of PyTorch training of `model` (in place) as the runner trains it: each
    microbatch's own loss (`model(mb, labels=mb).loss`: cross-entropy plus the router's
    auxiliary loss when the config asks for it), weighted by its counted tokens over the step's,
    gradients accumulated; AdamW lr 1e-3, weight decay 0.01, clip 1.0. Returns each step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    model.train()
    parts = ids.chunk(microbatches)
    total = sum(p.shape[0] * (p.shape[1] - 1) for p in parts)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        step = 0.0
        for mb in parts:
            loss = model(mb, labels=mb).loss * (mb.shape[0] * (mb.shape[1] - 1) / total)
            loss.backward()
            step += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        losses.append(step)
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    ids = tokens()
    cases = []
    for name in [*configs(), "mixtral_clamped"]:
        path = out / f"{name}.onnx"
        smp.export(build(name), ids, path)
        np.savez(out / f"{name}.data.npz", input_ids=ids.numpy())
        losses = {str(m): reference_losses(build(name), ids, STEPS, m) for m in (1, 2)}
        cases.append({"name": name, "onnx": str(path), "data": str(out / f"{name}.data.npz"),
                      "batch": BATCH, "seq": SEQ, "losses": losses})
        print(f"{name}: losses {losses}", file=sys.stderr)
    (out / "cases.json").write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
