"""PyTorch's peer of the runner's context parallelism (benches/context.rs): HF Llama (4 layers ×
hidden 256, 8 query heads over 2 KV heads (grouped-query attention), MLP intermediate 704, vocab
2048, RoPE, HF's default init, no dropout), batch 8 × sequence 128, causal-LM loss, AdamW
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), the global gradient norm clipped at 1.

    cp_peer.py export DIR       the model exported (python/smp_partition.export, dynamic batch and
                                sequence, eager attention) as DIR/llama.onnx, its weights
                                DIR/llama.pt, the batch DIR/batch.npz (input_ids, 8 × 128)
    cp_peer.py cp DIR STEPS     context parallelism over 2 ranks (Gloo, 1 thread each)
    cp_peer.py eager DIR STEPS  the same training in one process (1 thread), for reference
    cp_peer.py profile DIR STEPS  `eager` under torch.profiler: each aten op's self CPU ms per step

Context parallelism, written by hand (Llama-3-style all-gather of keys and values): the
sequence is cut into 2·c = 4 equal chunks and rank r holds chunks r and 2c−1−r of every
sequence (rank 0 tokens 0–31 and 96–127, rank 1 tokens 32–95), so both do the same causal
work. Each rank runs the unmodified HF LlamaForCausalLM on its 64 tokens with position ids =
their global positions (RoPE), with its attention function replaced (HF's
AttentionInterface) by one that all-gathers the keys and values of the 2 ranks
(`torch.distributed.nn.functional.all_gather` of K and V stacked, one per layer; its backward
sends the gradients back, an all-to-all and a sum on Gloo) and attends the local queries to
all 128 keys through `scaled_dot_product_attention` with the causal mask of global positions
(rows: the rank's positions, columns: the gathered ones). The loss is the sum of cross-entropy
over the rank's tokens that have a next token (position 127 has none) divided by the global
target count 8 × 127; the weight gradients are all-reduced (summed) in one flat buffer, then
clipped and stepped identically on both ranks.

Each training mode prints one JSON object: {"step_times_s": [...], "cpu_times_s": [...],
"losses": [...]} (rank 0's wall and CPU time per step; the loss of the whole batch).
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
import torch.nn.functional as F
import transformers as T

REPO = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, BATCH, SEQ = 4, 256, 8, 2, 704, 2048, 8, 128
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0
WORLD = 2

warnings.filterwarnings("ignore")


def config(attn: str = "eager") -> T.LlamaConfig:
    cfg = T.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                        num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, attention_dropout=0.0, use_cache=False,
                        tie_word_embeddings=False)
    cfg._attn_implementation = attn
    return cfg


def build(attn: str = "eager") -> T.LlamaForCausalLM:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(config(attn))


def export(out: Path) -> None:
    sys.path.insert(0, str(REPO / "python"))
    from smp_partition.export import export as smp_export

    out.mkdir(parents=True, exist_ok=True)
    hf = build()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    smp_export(hf, (ids,), out / "llama.onnx", dynamic=True)
    torch.save(hf.state_dict(), out / "llama.pt")
    np.savez(out / "batch.npz", input_ids=ids.numpy())


def load(d: Path, attn: str):
    hf = build(attn)
    hf.load_state_dict(torch.load(d / "llama.pt"))
    hf.train()
    ids = torch.from_numpy(np.load(d / "batch.npz")["input_ids"]).long()
    return hf, ids


def positions(rank: int, world: int, seq: int) -> torch.Tensor:
    """The global positions rank `rank` holds: chunks rank and 2·world−1−rank of 2·world."""
    c = seq // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def timed(steps: int, step, before=None, value=None) -> dict:
    """Runs `step()`, which trains one step and returns its loss, `steps` times: rank 0's wall
    and CPU time per step and each step's loss (`value(loss)`, else `loss.item()`), both read
    outside the timing, as is `before()` (a barrier) ahead of each step."""
    times, cpus, losses = [], [], []
    for _ in range(steps):
        if before is not None:
            before()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        losses.append(value(loss) if value is not None else loss.item())
    return {"step_times_s": times, "cpu_times_s": cpus, "losses": losses}


def gloo_mesh(rank: int, world: int, port: int):
    """One thread, this rank in a Gloo process group of `world` ranks on this host, and the
    group's 1-D CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def lm_step(hf, ids: torch.Tensor, opt, clip) -> torch.Tensor:
    """One training step of the causal LM on `ids`: its loss (mean over every next-token
    target), `clip()` between the backward and the update."""
    opt.zero_grad()
    logits = hf(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    clip()
    opt.step()
    return loss


def eager(d: Path, steps: int) -> dict:
    torch.set_num_threads(1)
    hf, ids = load(d, "sdpa")
    opt = optimizer(hf.parameters())
    return timed(steps, lambda: lm_step(hf, ids, opt, lambda: torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)))


def profile(d: Path, steps: int) -> None:
    """`eager` under torch.profiler (CPU, one warm-up step outside it): each aten op's self CPU
    time per step (ms) and calls per step, one JSON object per op, largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(1)
    hf, ids = load(d, "sdpa")
    opt = optimizer(hf.parameters())

    def step() -> None:
        opt.zero_grad()
        logits = hf(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()

    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in rows:
        if e.self_cpu_time_total > 0:
            print(json.dumps({"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps}))


def cp_rank(rank: int, world: int, d: str, steps: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    mine = positions(rank, world, SEQ)
    cols = torch.cat([positions(r, world, SEQ) for r in range(world)])
    allowed = cols[None, :] <= mine[:, None]  # [local rows, all columns], True: attend

    def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # query [B, H, Sl, D]; key, value [B, KVH, Sl, D] of the rank's tokens (RoPE applied)
        gathered = all_gather(torch.stack([key, value]))
        kv = torch.cat(gathered, dim=3)  # [2, B, KVH, S, D], columns in `cols` order
        rep = query.shape[1] // key.shape[1]
        k, v = kv[0].repeat_interleave(rep, dim=1), kv[1].repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    T.AttentionInterface.register("cp_allgather", cp_attention)
    T.AttentionMaskInterface.register("cp_allgather", lambda *a, **k: None)
    hf, ids = load(Path(d), "cp_allgather")
    total = BATCH * (SEQ - 1)
    local = ids[:, mine]
    pos = mine[None, :].expand(BATCH, -1)
    # next-token targets of the rank's positions; the sequence's last position has none
    nxt = (mine + 1).clamp(max=SEQ - 1)
    targets = torch.where((mine < SEQ - 1)[None, :], ids[:, nxt], torch.full_like(local, -100))
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = optimizer(params)
    times, cpus, losses = [], [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        logits = hf(input_ids=local, position_ids=pos, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum") / total
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        at = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[at:at + n].view_as(p.grad))
            at += n
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        losses.append(float(flat[-1]))
    if rank == 0:
        print(json.dumps({"step_times_s": times, "cpu_times_s": cpus, "losses": losses}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    mode, d = sys.argv[1], Path(sys.argv[2])
    if mode == "export":
        export(d)
    elif mode == "eager":
        print(json.dumps(eager(d, int(sys.argv[3]))), flush=True)
    elif mode == "profile":
        profile(d, int(sys.argv[3]))
    elif mode == "cp":
        import torch.multiprocessing as mp

        mp.spawn(cp_rank, args=(WORLD, str(d), int(sys.argv[3]), free_port()), nprocs=WORLD)
    else:
        sys.exit(f"unknown mode {mode}: export, cp, eager or profile")


if __name__ == "__main__":
    main()
