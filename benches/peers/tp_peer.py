"""PyTorch's peer of the runner's tensor parallelism (benches/tensor.rs): the HF Llama of
`cp_peer.py` (4 layers × hidden 256, 8 query heads over 2 KV heads, MLP intermediate 704, vocab
2048, RoPE, HF's default init; its export, weights and batch are reused from there), batch
8 × 128, causal-LM loss (mean over 8 × 127 targets), AdamW (lr 1e-3, betas (0.9, 0.999),
eps 1e-8, weight decay 0.01), the global gradient norm clipped at 1 — the runner's defaults
(src/runtime/session/options.rs, src/runtime/train/optim.rs).

    tp_peer.py tp DIR STEPS [--vocab-embed]   tensor parallelism over 2 ranks (Gloo, 1 thread each)
    tp_peer.py export DIR / eager DIR STEPS   as `cp_peer.py` (the export; one process, 1 thread)

Tensor parallelism with DTensor: a 1-D DeviceMesh("cpu", [0, 1]) and
`torch.distributed.tensor.parallel.parallelize_module` with Megatron's plan on every decoder
layer: ColwiseParallel on q/k/v/gate/up, RowwiseParallel on o/down (local outputs, so HF's
attention reshapes with -1 see 4 query heads over 1 KV head on each rank; the input's gradient
is all-reduced by DTensor in the backward). The lm_head is ColwiseParallel with its logits
all-gathered (output_layouts=Replicate()), as in the runner's plans (`codegen.shards` of layer 5:
the vocabulary split, the logits all-gathered on axis 2). The token embedding is replicated,
as the planner's own tp 2 plan does, or with `--vocab-embed` vocabulary-parallel
(RowwiseParallel(input_layouts=Replicate()): masked lookup + all-reduce), as the planner's
`--baseline megatron` plan does. RMSNorm weights stay replicated (plain tensors). Both ranks
see the whole batch (tp replicas) and compute the same loss; the gradient norm is torch's
(`clip`): the sharded gradients' squared norms summed over the mesh in one scalar all-reduce.

Prints one JSON object: {"step_times_s": [...], "cpu_times_s": [...], "losses": [...]}
(rank 0's wall and CPU time per step; the loss of the whole batch).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_peer as cp  # noqa: E402  (the model, its export, load, optimizer)

warnings.filterwarnings("ignore")
WORLD = 2


def clip(params, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over a mix of DTensor and plain gradients: the norm of
    all gradients (a sharded gradient's squared norm summed over the mesh, all in one
    all-reduce of a scalar), the coefficient clamped to 1 and always applied."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    sharded, plain = [], []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and not all(isinstance(pl, Replicate) for pl in g.placements):
            sharded.append(torch.linalg.vector_norm(g.to_local()))
        else:
            plain.append(torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g))
    sq = torch.linalg.vector_norm(torch.stack(sharded)) ** 2
    dist.all_reduce(sq)
    total = torch.sqrt(sq + torch.linalg.vector_norm(torch.stack(plain)) ** 2)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def tp_rank(rank: int, world: int, d: str, steps: int, port: int, vocab_embed: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = cp.gloo_mesh(rank, world, port)

    hf, ids = cp.load(Path(d), "sdpa")
    for layer in hf.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    top = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    if vocab_embed:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(hf, mesh, top)

    params = [p for p in hf.parameters() if p.requires_grad]
    opt = cp.optimizer(params)

    def step() -> torch.Tensor:
        return cp.lm_step(hf, ids, opt, lambda: clip(params, cp.CLIP))

    out = cp.timed(steps, step, before=dist.barrier)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    mode, d = sys.argv[1], Path(sys.argv[2])
    if mode == "export":
        cp.export(d)
    elif mode == "eager":
        print(json.dumps(cp.eager(d, int(sys.argv[3]))), flush=True)
    elif mode == "tp":
        import torch.multiprocessing as mp

        vocab_embed = "--vocab-embed" in sys.argv[4:]
        mp.spawn(tp_rank, args=(WORLD, str(d), int(sys.argv[3]), cp.free_port(), vocab_embed), nprocs=WORLD)
    else:
        sys.exit(f"unknown mode {mode}: tp, export or eager")


if __name__ == "__main__":
    main()
