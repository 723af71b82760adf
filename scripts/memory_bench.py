#!/usr/bin/env python3
"""Memory benchmark of only-own-shard weights (not CI).

Exports a GPT-2-shaped model whose weights exceed 1 GB as ONNX external data (random init,
fixed seed), plans it for `cpu:4` under pp 4 and under pp 2 × tp 2 (Megatron split), runs each
plan for a few steps (4 ranks, 1 thread each, small batch, in each `--precision` asked: f32 by
default) and samples every rank's
`RssAnon` from /proc/PID/status. Each rank's peak, less the peak of an idle libtorch process
(a one-process run of the tiny models/gpt2.onnx for one step), is compared with what the plan
predicts for the rank: parameters + gradients + optimizer state + activations of its stages.

    .venv/bin/python scripts/memory_bench.py --out /tmp/membench \
        [--runner target/debug/smp-runner] [--old-runner /tmp/old-smp-runner] [--keep]
        [--plans pp2×tp2] [--precision f32,bf16,bf16-mixed,fp16-mixed]

Prints a Markdown table (the rows of BENCHMARKS.md). The generated model (about 1.1 GB) is
removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQ, BATCH, MICRO, STEPS = 16, 4, 2, 2


def export(out: Path, layers: int, d: int, vocab: int) -> Path:
    import torch
    import transformers

    path = out / "gpt-1g.onnx"
    if path.exists():
        return path
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=d // 64, vocab_size=vocab,
                                  n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x, use_cache=False).logits

    model = Logits(hf).eval()
    example = torch.randint(0, vocab, (2, SEQ))
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=128)}
    with torch.no_grad():
        program = torch.onnx.export(model, (example,), dynamo=True, opset_version=18,
                                    dynamic_shapes=(dims,), input_names=["input_ids"],
                                    output_names=["logits"], verbose=False)
    program.save(str(path), external_data=True)
    return path


def plan(runner_dir: Path, model: Path, out: Path, name: str, flags: list[str], micro: int) -> Path:
    p = out / f"{name}-m{micro}.json"
    cmd = [str(runner_dir / "smp-partition"), str(model), "--cluster", "cpu:4", "--seq-len", str(SEQ),
           "--global-batch", str(BATCH), "--microbatches", str(micro), "-o", str(p), *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return p


def rss_anon(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"RANK="):
            return int(e[5:])
    return None


def sampled(cmd: list[str], env: dict | None = None) -> tuple[dict[int, int], dict, float]:
    """Runs `cmd`, sampling RssAnon of it and its descendants; peak per rank (-1: no RANK)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            if pid not in ranks:
                r = rank_of(pid)
                if r is None and pid != proc.pid:
                    continue
                ranks[pid] = -1 if r is None else r
            v = rss_anon(pid)
            if v is not None:
                peaks[ranks[pid]] = max(peaks.get(ranks[pid], 0), v)
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{err.decode()[-3000:]}")
    report = json.loads(out) if out.strip() else {}
    return peaks, report, time.time() - t0


def predicted(plan_path: Path) -> dict[int, dict]:
    """Per rank: the plan's memory of its stages (params, grads, optimizer, activations)."""
    p = json.loads(plan_path.read_text())
    par = p["parallel"]
    pp, tp, dp = par["pp"], par["tp"], par["dp"]
    out = {}
    for r in range(pp * tp * dp):
        q = r // (tp * dp)
        m = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}
        for s in p["stages"]:
            if s["pp_rank"] == q:
                for k in m:
                    m[k] += s["memory_bytes"][k]
        out[r] = m
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/membench"))
    ap.add_argument("--runner", type=Path, default=REPO / "target/debug/smp-runner")
    ap.add_argument("--old-runner", type=Path, help="a runner of the whole-tensor path, measured beside it")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--label", default="only own shard", help="what --runner is called in the table")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the runs (e.g. allocator settings)")
    ap.add_argument("--plans", default="pp4,pp2×tp2", help="which plans to run")
    ap.add_argument("--microbatches", type=int, default=MICRO)
    ap.add_argument("--steps", type=int, default=STEPS, help="0: set-up (loading) alone")
    ap.add_argument("--precision", default="f32",
                    help="comma-separated training precisions to plan and run (f32, bf16, bf16-mixed, fp16-mixed)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = export(args.out, args.layers, args.d, args.vocab)
    weights = sum(f.stat().st_size for f in args.out.iterdir() if f.name.startswith(model.name) and f != model)
    print(f"model {model}: {weights / 1e9:.2f} GB external data", file=sys.stderr)
    bindir = args.runner.parent
    layouts = {
        "pp4": ["--pp", "4", "--tp", "1", "--dp", "1", "--schedule", "1f1b"],
        "pp2×tp2": ["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "1f1b", "--baseline", "megatron"],
    }
    plans = {}
    for name, flags in layouts.items():
        if name not in args.plans.split(","):
            continue
        for prec in args.precision.split(","):
            label = name if prec == "f32" and "," not in args.precision else f"{name} {prec}"
            plans[label] = plan(bindir, model, args.out, f"{name}-{prec}".replace("×", "x"), [*flags, "--precision", prec], args.microbatches)
    idle_peaks, _, _ = sampled([str(args.runner), "train", str(REPO / "models/gpt2.onnx"), "--steps", "1", "--threads", "1",
                                "--seq-len", str(SEQ), "--batch", "2"])
    idle = max(idle_peaks.values())
    print(f"idle libtorch process: RssAnon {idle / 2**20:.0f} MiB", file=sys.stderr)
    runners = [(args.label, args.runner)] + ([("whole tensors (before)", args.old_runner)] if args.old_runner else [])
    rows = []
    env = dict(e.split("=", 1) for e in args.env)
    for name, p in plans.items():
        pred = predicted(p)
        for label, exe in runners:
            cmd = [str(exe), "launch", "--nproc", "4", str(p), "--steps", str(args.steps), "--threads", "1", "--json", "--timeout", "1200"]
            peaks, report, wall = sampled(cmd, env)
            for st in report.get("ranks", []):
                print({k: st.get(k) for k in ("rank", "peak_memory_bytes", "peak_state", "resident_param_bytes", "weight_bytes_read")}, file=sys.stderr)
            for r in range(4):
                m = pred[r]
                want = m["params"] + m["grads"] + m["optimizer"] + m["activations"]
                got = peaks.get(r, 0) - idle
                read = report.get("ranks", [{}] * 4)[r].get("weight_bytes_read", {}) if report else {}
                rows.append((f"{name}, {args.microbatches} microbatch{'es' if args.microbatches > 1 else ''}, {args.steps} steps", label, r, peaks.get(r, 0), got, m, want, got / want if want else float("nan"),
                             read.get("params"), wall))
                print(rows[-1], file=sys.stderr)
    print("| plan | runner | rank | peak RssAnon | less idle | predicted params + grads + optimizer + activations | measured / predicted | parameter bytes read |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    for name, label, r, peak, got, m, want, ratio, read, _ in rows:
        parts = f"{mib(m['params'])} + {mib(m['grads'])} + {mib(m['optimizer'])} + {mib(m['activations'])} = {mib(want)}"
        print(f"| {name} | {label} | {r} | {mib(peak)} | {mib(got)} | {parts} | {ratio:.2f}× | {mib(read) if read is not None else '—'} |")
    print(f"\nidle libtorch process (one-process run of models/gpt2.onnx): RssAnon {mib(idle)}; "
          f"model: {args.layers} layers × {args.d}, vocab {args.vocab}, {weights / 1e9:.2f} GB of f32 weights as external data")
    if not args.keep:
        shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
