"""PyTorch's peer of the runner's expert parallelism (benches/expert.rs): the Mixtral sparse-MoE
block of moe_block.py (same config, HF's default init) with its experts split over 2 ranks (4
each). Each rank routes its tokens, sends the per-expert counts and then the token-expert pairs'
hidden vectors to the experts' ranks with torch.distributed.nn.functional.all_to_all_single and
per-rank split sizes (dropless, no capacity factor; autograd sends the gradients back the
reverse way), runs its experts, sends the outputs home by the reverse all-to-all, and scales
and adds them into the tokens. The router is replicated: its gradient is all-reduced. AdamW,
the global gradient norm clipped at 1, Gloo, 1 thread per rank, each rank half the batch of
batch.npz (4 × 128 tokens), MSE (summed) over the global batch's target count.

usage: moe_ep_peer.py DIR STEPS    (DIR holds batch.npz); rank 0 prints
       {"step_times_s": [...], "cpu_times_s": [...], "losses": [...]}
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers as T
from torch.distributed.nn.functional import all_to_all_single

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_block import EXPERTS, HIDDEN, INTERMEDIATE, TOP_K  # noqa: E402

warnings.filterwarnings("ignore")
WORLD, LR, WD, CLIP = 2, 1e-3, 0.01, 1.0


def block():
    """moe_block.py's block, at its init."""
    cfg = T.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(0)
    return T.MixtralForCausalLM(cfg).model.layers[0].mlp


class ExpertParallelMoE(torch.nn.Module):
    """The block with this rank's experts only; tokens travel to their experts by all-to-all."""

    def __init__(self, blk, rank: int, world: int):
        super().__init__()
        self.world, self.local = world, EXPERTS // world
        lo = rank * self.local
        self.gate = torch.nn.Parameter(blk.gate.weight.detach().clone())
        self.gate_up = torch.nn.Parameter(blk.experts.gate_up_proj.detach()[lo:lo + self.local].clone())
        self.down = torch.nn.Parameter(blk.experts.down_proj.detach()[lo:lo + self.local].clone())

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.gate).float(), dim=-1)
        w, idx = torch.topk(probs, TOP_K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // TOP_K
        counts = torch.bincount(flat, minlength=EXPERTS)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        send = counts.view(self.world, self.local).sum(1).tolist()
        recv = got.view(self.world, self.local).sum(1).tolist()
        rows = all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x[tokens], recv, send)
        # received member-major: regroup expert-major
        g = got.tolist()
        starts = np.concatenate([[0], np.cumsum(g)[:-1]])
        perm = torch.tensor([r for e in range(self.local) for j in range(self.world)
                             for r in range(starts[j * self.local + e], starts[j * self.local + e] + g[j * self.local + e])],
                            dtype=torch.long)
        rows = rows[perm]
        outs, at = [], 0
        for e in range(self.local):
            n = sum(g[j * self.local + e] for j in range(self.world))
            if n:
                gate, up = F.linear(rows[at:at + n], self.gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down[e]))
            at += n
        ys = torch.cat(outs) if outs else rows * 0
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        back = all_to_all_single(x.new_empty(len(order), x.shape[1]), ys[inverse], send, recv)
        ws = w.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, back * ws)


def worker(rank: int, world: int, d: str, steps: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batch = np.load(Path(d) / "batch.npz")
    x, t = torch.from_numpy(batch["hidden_states"]), torch.from_numpy(batch["targets"])
    total = t.numel()
    share = x.shape[0] // world
    x = x[rank * share:(rank + 1) * share].reshape(-1, HIDDEN)
    t = t[rank * share:(rank + 1) * share].reshape(-1, HIDDEN)
    m = ExpertParallelMoE(block(), rank, world)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    times, cpus, losses = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = ((m(x) - t) ** 2).sum() / total
        loss.backward()
        dist.all_reduce(m.gate.grad)
        # the global norm: the router once (rank 0), each rank its experts
        sq = m.gate_up.grad.square().sum() + m.down.grad.square().sum() + (m.gate.grad.square().sum() if rank == 0 else 0.0)
        both = torch.stack([sq.detach(), loss.detach()])
        dist.all_reduce(both)
        coef = min(1.0, CLIP / (float(both[0].sqrt()) + 1e-6))
        for p in m.parameters():
            p.grad.mul_(coef)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        losses.append(float(both[1]))
    if rank == 0:
        print(json.dumps({"step_times_s": times, "cpu_times_s": cpus, "losses": losses}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(WORLD, sys.argv[1], int(sys.argv[2]), free_port()), nprocs=WORLD)
