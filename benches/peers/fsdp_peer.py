"""PyTorch's peer of the runner's ZeRO 3 (benches/zero.rs): the HF Llama of `cp_peer.py`
(4 layers × hidden 256, 8 query heads over 2 KV heads, MLP intermediate 704, vocab 2048, RoPE,
HF's default init; its export, weights and batch are reused from there), batch 8 × 128 split
over 2 data-parallel ranks (4 sequences each), causal-LM loss, AdamW (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01), the global gradient norm clipped at 1 — the
runner's defaults.

    fsdp_peer.py fsdp DIR STEPS   FSDP2 over 2 ranks (Gloo, 1 thread each)

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
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_peer as cp  # noqa: E402  (the model, its export, load, optimizer)

warnings.filterwarnings("ignore")
WORLD = 2


def fsdp_rank(rank: int, world: int, d: str, steps: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    hf, ids = cp.load(Path(d), "sdpa")
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(hf, mesh=mesh, reshard_after_forward=True)
    share = ids.shape[0] // world
    mine = ids[rank * share:(rank + 1) * share]

    params = [p for p in hf.parameters() if p.requires_grad]
    opt = cp.optimizer(params)
    times, cpus, losses = [], [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        logits = hf(input_ids=mine, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cp.VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cp.CLIP)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    if rank == 0:
        print(json.dumps({"step_times_s": times, "cpu_times_s": cpus, "losses": losses}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    mode, d = sys.argv[1], Path(sys.argv[2])
    if mode == "export":
        cp.export(d)
    elif mode == "fsdp":
        import torch.multiprocessing as mp

        mp.spawn(fsdp_rank, args=(WORLD, str(d), int(sys.argv[3]), cp.free_port()), nprocs=WORLD)
    else:
        sys.exit(f"unknown mode {mode}: fsdp or export")


if __name__ == "__main__":
    main()
