"""PyTorch peers of the runner benches (benches/train_step.rs, benches/pipeline.rs) on the GPT-2
setup: HF GPT-2 (4 blocks × hidden 256, 4 heads, vocab 2048, HF's default init, dropout off,
eager attention), batch 8 × 128, AdamW lr 1e-3 weight decay 0.01, clip 1.0, causal-LM loss.

    gpt2_peer.py export DIR            the model exported with dynamic batch and sequence and
                                       the parameter record (python/smp_partition.export) as
                                       DIR/gpt2.onnx, its weights DIR/gpt2.pt, the batch
                                       DIR/batch.npz (input_ids, 8 × 128)
    gpt2_peer.py eager DIR --steps N [--threads T] [--microbatches M]
                                       PyTorch eager training, 1 process
    gpt2_peer.py pipe DIR --steps N [--microbatches M]
                                       torch.distributed.pipelining, Schedule1F1B, 2 ranks (gloo,
                                       CPU, 1 thread each), blocks split 2 | 2
Each training mode prints one JSON object: {"step_times_s": [...], "cpu_times_s": [...],
"losses": [...]} (CPU time: of the process, `time.process_time`; of the last rank for `pipe`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, VOCAB, BATCH, SEQ = 4, 256, 4, 2048, 8, 128
LR, WD, CLIP = 1e-3, 0.01, 1.0


def build() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def export(out: Path) -> None:
    sys.path.insert(0, str(REPO / "python"))
    from smp_partition.export import export as smp_export

    out.mkdir(parents=True, exist_ok=True)
    hf = build()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    smp_export(hf, (ids,), out / "gpt2.onnx", dynamic=True)
    torch.save(hf.state_dict(), out / "gpt2.pt")
    np.savez(out / "batch.npz", input_ids=ids.numpy())


def load(d: Path):
    hf = build()
    hf.load_state_dict(torch.load(d / "gpt2.pt"))
    hf.train()
    ids = torch.from_numpy(np.load(d / "batch.npz")["input_ids"]).long()
    return hf, ids


def causal_lm(logits, ids):
    v = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


def eager(d: Path, steps: int, micro: int) -> dict:
    hf, ids = load(d)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WD)
    times, cpu, losses = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        total = 0.0
        for mb in ids.chunk(micro):
            loss = causal_lm(hf(input_ids=mb, use_cache=False).logits, mb) / micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(total)
    return {"step_times_s": times, "cpu_times_s": cpu, "losses": losses}


class Stage(torch.nn.Module):
    """Blocks `lo..hi` of GPT-2; the first stage embeds, the last normalises and projects."""

    def __init__(self, hf, lo: int, hi: int):
        super().__init__()
        t = hf.transformer
        self.first, self.last = lo == 0, hi == LAYERS
        self.wte = t.wte if self.first else None
        self.wpe = t.wpe if self.first else None
        self.blocks = torch.nn.ModuleList(t.h[lo:hi])
        self.ln_f = t.ln_f if self.last else None
        # the last stage holds its own copy of the tied embedding (as a 2-stage split must)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False) if self.last else None
        if self.last:
            with torch.no_grad():
                self.lm_head.weight.copy_(t.wte.weight)

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            x = self.wte(x) + self.wpe(pos)
        s = x.shape[1]
        mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
        for b in self.blocks:
            x = b(x, attention_mask=mask)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def pipe_rank(rank: int, d: Path, steps: int, micro: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hf, ids = load(d)
    half = LAYERS // 2
    mod = Stage(hf, 0, half) if rank == 0 else Stage(hf, half, LAYERS)
    del hf
    mb = BATCH // micro
    example = ids[:mb] if rank == 0 else torch.zeros(mb, SEQ, HIDDEN)
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"), input_args=(example,))
    sched = Schedule1F1B(stage, micro, loss_fn=causal_lm)
    opt = torch.optim.AdamW(mod.parameters(), lr=LR, weight_decay=WD)
    times, cpu, losses = [], [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        if rank == 0:
            sched.step(ids)
        else:
            ls: list = []
            sched.step(target=ids, losses=ls)
            losses.append(float(sum(x.item() for x in ls)) / micro)
        # global gradient-norm clipping over both stages
        sq = torch.stack([p.grad.pow(2).sum() for p in mod.parameters() if p.grad is not None]).sum()
        dist.all_reduce(sq)
        coef = min(1.0, CLIP / (float(sq.sqrt()) + 1e-6))
        if coef < 1.0:
            for p in mod.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if rank == 1:
        out.write_text(json.dumps({"step_times_s": times, "cpu_times_s": cpu, "losses": losses}))
    dist.destroy_process_group()


def pipe(d: Path, steps: int, micro: int) -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pipe.json"
        mp.spawn(pipe_rank, args=(d, steps, micro, port, out), nprocs=2, join=True)
        return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["export", "eager", "pipe"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "export":
        export(args.dir)
        return
    if args.mode == "eager":
        res = eager(args.dir, args.steps, args.microbatches)
    else:
        res = pipe(args.dir, args.steps, max(args.microbatches, 2))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
