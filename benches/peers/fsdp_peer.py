"""PyTorch's peer of the runner's ZeRO 3 (benches/zero.rs): the HF Llama of `cp_peer.py`
(4 layers × hidden 256, 8 query heads over 2 KV heads, MLP intermediate 704, vocab 2048, RoPE,
HF's default init; its export, weights and batch are reused from there), batch 8 × 128 split
over 2 data-parallel ranks (4 sequences each), causal-LM loss, AdamW (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01), the global gradient norm clipped at 1 — the
runner's defaults.

    fsdp_peer.py fsdp DIR STEPS   FSDP2 over 2 ranks (Gloo, 1 thread each), on cp_peer.py's export

FSDP2 (`torch.distributed.fsdp.fully_shard`) on every decoder layer and on the root (the
embedding, final norm and lm_head), resharding after forward (ZeRO 3: each layer's parameters
all-gathered before its forward and again before its backward, gradients reduce-scattered),
f32 throughout. Each rank's loss is the mean over its 4 × 127 targets; the gradients FSDP2
averages over the ranks are those of the mean over all 8 × 127 (equal counts), and the loss
printed is that mean (one scalar all-reduce, outside the timed step). The gradient norm is
`clip_grad_norm_` on the sharded gradients (a DTensor norm: one all-reduce).

Prints one JSON object: {"step_times_s": [...], "cpu_times_s": [...], "losses": [...]}
(rank 0's wall and CPU time per step; the whole batch's loss).
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


def fsdp_rank(rank: int, world: int, d: str, steps: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    mesh = cp.gloo_mesh(rank, world, port)

    hf, ids = cp.load(Path(d), "sdpa")
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(hf, mesh=mesh, reshard_after_forward=True)
    share = ids.shape[0] // world
    mine = ids[rank * share:(rank + 1) * share]

    params = [p for p in hf.parameters() if p.requires_grad]
    opt = cp.optimizer(params)

    def step() -> torch.Tensor:
        return cp.lm_step(hf, mine, opt, lambda: torch.nn.utils.clip_grad_norm_(params, cp.CLIP))

    def whole(loss: torch.Tensor) -> float:
        both = loss.detach().clone()
        dist.all_reduce(both)
        return both.item() / world

    out = cp.timed(steps, step, before=dist.barrier, value=whole)
    if rank == 0:
        print(json.dumps(out), flush=True)
    # both ranks past their last collective before Gloo's threads go (a rank leaving early
    # aborted the other's teardown now and then)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    if len(sys.argv) != 4 or sys.argv[1] != "fsdp":
        sys.exit("usage: fsdp_peer.py fsdp DIR STEPS (the export is cp_peer.py's)")
    mp.spawn(fsdp_rank, args=(WORLD, sys.argv[2], int(sys.argv[3]), cp.free_port()), nprocs=WORLD)


if __name__ == "__main__":
    main()
