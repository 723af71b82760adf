#!/usr/bin/env python3
"""The lent-GPU check's Python half (scripts/gpu-check.sh drives it; see docs/gpu.md).

    gpu_check.py prepare --partition BIN   here (.venv, torch 2.13): the block-stack model
                                           (graph only), the plans, the eval inputs, into
                                           target/gpu-check/bundle/
    gpu_check.py manifest                  here: scripts/gpu-check/Cargo.toml's dependencies are
                                           the main manifest's, but for tch and torch-sys
    gpu_check.py travel [--limit MIB]      here: what a device run carries (the tracked tree
                                           and the bundle), listed with the total; exits 1 over
                                           the limit
    gpu_check.py remote --runner BIN --out DIR   on the GPU machine (its python3 and torch): every
                                           check in one go; writes DIR/gpu-check.md (a Markdown
                                           fragment for BENCHMARKS.md), DIR/gpu-check.json and
                                           DIR/logs.txt

With SMP_GPU_CHECK_SMALL=1 every step uses a small block stack (its own bundle,
target/gpu-check/bundle-small), and `remote --device cpu` runs the checks on the CPU: the
rehearsal `scripts/gpu-check.sh --rehearse` runs here, so the GPU call is not the first run.

The checks: `eval` on GPU against CPU; 20 GPT-2 steps in f32 and in bf16-mixed on GPU against
the same run on CPU; a 2-stage pipeline on the one GPU (`--share-gpu`) against the one-rank
run; a bf16-mixed block stack (GPT-2 blocks, 8 × 1024) trained by the runner beside PyTorch
eager on the same module (`torch.autocast("cuda", torch.bfloat16)`, fused AdamW, clip 1.0);
per layer (one layer per pipeline stage, one microbatch, so the stages run one at a time)
the planner's predicted forward + backward time against the measured one; and last, the GPU's
bf16 matrix-product efficiency by shape (m, n, k), for the cost model's GEMM efficiency
(DIR/gemm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMALL = os.environ.get("SMP_GPU_CHECK_SMALL") == "1"
# relative to the repository root, here and there
BUNDLE = Path("target/gpu-check/bundle-small" if SMALL else "target/gpu-check/bundle")

# GPT-2 (models/gpt2.onnx): 20 steps, batch 8 × 128
GPT2 = Path("models/gpt2.onnx")
GPT2_FLAGS = ["--seq-len", "128", "--global-batch", "8"]
STEPS = 20

# the block stack: GPT-2 blocks of 1024, 16 heads, vocabulary 8192; batch 16 × 512 (the
# rehearsal's: 2 blocks of 64, batch 4 × 32, 3 steps)
if SMALL:
    BLOCKS = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 64}
    BLOCK_SEQ, BLOCK_BATCH, BLOCK_STEPS = 32, 4, 3
else:
    BLOCKS = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "vocab_size": 8192, "n_positions": 1024}
    BLOCK_SEQ, BLOCK_BATCH, BLOCK_STEPS = 512, 16, 20
BLOCK_LAYERS = BLOCKS["n_layer"] + 2  # embedding, the blocks, head

# tolerances: relative difference of GPU against CPU
TOL = {"eval": 1e-4, "f32": 1e-4, "bf16-mixed": 3e-2, "pp2": 1e-4}


def plans() -> dict[str, tuple[Path, list[str]]]:
    """Plan name → (model, planner flags)."""
    blocks = BUNDLE / "blocks.onnx"
    bflags = ["--seq-len", str(BLOCK_SEQ), "--global-batch", str(BLOCK_BATCH), "--checkpointing", "none", "--precision", "bf16-mixed"]
    layout = "|".join(str(i) for i in range(BLOCK_LAYERS))
    return {
        "gpt2-f32": (GPT2, ["--cluster", "h200:1", "--precision", "f32", *GPT2_FLAGS]),
        "gpt2-bf16-mixed": (GPT2, ["--cluster", "h200:1", "--precision", "bf16-mixed", *GPT2_FLAGS]),
        "gpt2-pp2": (GPT2, ["--cluster", "h200:2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--precision", "f32", *GPT2_FLAGS]),
        "blocks": (blocks, ["--cluster", "h200:1", *bflags]),
        "blocks-layers": (blocks, ["--cluster", f"h200:{BLOCK_LAYERS}", "--pp", str(BLOCK_LAYERS), "--layout", layout, "--microbatches", "1", "--schedule", "gpipe", *bflags]),
    }


def gpt2_config(transformers):  # noqa: ANN001 - the module, imported by the caller
    return transformers.GPT2Config(**BLOCKS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


# ---------------------------------------------------------------- here


def export_blocks(out: Path) -> None:
    """The block stack exported with the front door (parameter record kept), its weights
    moved to an external file that is then deleted: the runner gives them seeded values
    (`--init random`), and the file travels as a graph of a few hundred kB."""
    import onnx
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "python"))
    import smp_partition as smp

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config(transformers))
    ids = torch.randint(0, BLOCKS["vocab_size"], (2, 64))
    full = out.with_name("blocks.full.onnx")
    smp.export(model, ids, full)
    m = onnx.load(str(full))
    weights = out.with_name("blocks.weights")
    onnx.save_model(m, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location=weights.name, size_threshold=1024)
    full.unlink()
    weights.unlink()


def prepare(args: argparse.Namespace) -> None:
    import numpy as np

    os.chdir(REPO)
    BUNDLE.mkdir(parents=True, exist_ok=True)
    blocks = BUNDLE / "blocks.onnx"
    if not blocks.exists():
        print(f"gpu-check: exporting the block stack ({BLOCKS}) to {blocks}", flush=True)
        export_blocks(blocks)
    io = np.load(GPT2.with_suffix(".io.npz"))
    np.savez(BUNDLE / "gpt2.inputs.npz", input_ids=io["input_ids"])
    for name, (model, flags) in plans().items():
        out = BUNDLE / f"{name}.plan.json"
        r = subprocess.run([args.partition, str(model), *flags, "-o", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"gpu-check: planning {name} failed:\n{r.stderr}")
        print(f"gpu-check: planned {out}", flush=True)


def manifest(_args: argparse.Namespace) -> None:
    """Exits 1 when scripts/gpu-check/Cargo.toml's dependencies (or features) drift from the
    main manifest's other than in tch and torch-sys."""
    import tomllib

    main = tomllib.loads((REPO / "Cargo.toml").read_text())
    ours = tomllib.loads((REPO / "scripts/gpu-check/Cargo.toml").read_text())
    pinned = {"tch", "torch-sys"}
    drift = []
    for section in ["dependencies", "build-dependencies"]:
        a = {k: v for k, v in main.get(section, {}).items() if k not in pinned}
        b = {k: v for k, v in ours.get(section, {}).items() if k not in pinned}
        if a != b:
            drift.append(f"[{section}]: {sorted(set(a.items()) ^ set(b.items()), key=str) if all(isinstance(v, str) for v in {**a, **b}.values()) else 'differs'}")
    for f in ["runner", "cuda"]:
        if main["features"].get(f) != ours["features"].get(f):
            drift.append(f"feature `{f}`")
    if drift:
        sys.exit("gpu-check: scripts/gpu-check/Cargo.toml no longer matches Cargo.toml (" + "; ".join(drift) + "): copy the main manifest's dependencies (tch and torch-sys stay =0.24.0), then refresh its lock with `cargo update --manifest-path scripts/gpu-check/Cargo.toml -p NAME`")
    print("gpu-check: scripts/gpu-check/Cargo.toml agrees with Cargo.toml (tch and torch-sys at 0.24 for libtorch 2.11)")


def travel(args: argparse.Namespace) -> None:
    """Lists what a device run sends: the tracked and untracked-not-ignored files, and the
    bundle (carried); exits 1 over the limit."""
    os.chdir(REPO)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True).stdout.decode().split("\0")
    tree = [Path(p) for p in listed if p and Path(p).is_file()]
    tree_bytes = sum(p.stat().st_size for p in tree)
    carried = sorted(p for p in BUNDLE.rglob("*") if p.is_file())
    mib = 1 << 20
    print(f"the working tree: {len(tree)} files, {tree_bytes / mib:.1f} MiB (largest:)")
    for p in sorted(tree, key=lambda p: -p.stat().st_size)[:5]:
        print(f"  {p.stat().st_size / mib:8.2f} MiB  {p}")
    print(f"carried ({BUNDLE}):")
    for p in carried:
        print(f"  {p.stat().st_size / mib:8.2f} MiB  {p}")
    total = tree_bytes + sum(p.stat().st_size for p in carried)
    print(f"total {total / mib:.1f} MiB of {args.limit} MiB")
    if total > args.limit * mib:
        sys.exit(f"gpu-check: {total / mib:.1f} MiB would travel, over the {args.limit} MiB a device run carries")


# ---------------------------------------------------------------- there


class Remote:
    """Runs the checks, keeping a log and the results."""

    def __init__(self, runner: str, out: Path) -> None:
        self.runner = runner
        self.out = out
        self.log = open(out / "logs.txt", "w")
        self.results: dict[str, object] = {}
        self.lines: list[str] = []

    def run(self, what: str, cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        self.log.write(f"$ {' '.join(cmd)}\n# {what}: exit {r.returncode}, {time.time() - t0:.1f} s\n{r.stderr}\n")
        self.log.flush()
        print(f"{what}: exit {r.returncode} ({time.time() - t0:.1f} s)", flush=True)
        if r.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {r.returncode}): {r.stderr[-2000:]}")
        return r

    def report(self, what: str, cmd: list[str], timeout: float = 300) -> dict:
        return json.loads(self.run(what, [*cmd, "--json"], timeout).stdout)

    def check(self, name: str, fn) -> None:  # noqa: ANN001
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failed check must not stop the others
            self.results[name] = {"error": str(e)}
            self.lines.append(f"- **{name}**: failed: `{str(e)[-400:]}`")
            print(f"{name}: FAILED: {e}", flush=True)


def rel(a, b) -> float:  # noqa: ANN001
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def verdict(x: float, tol: float) -> str:
    return "met" if x <= tol else "**not met**"


def remote(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    os.chdir(REPO)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    R = Remote(args.runner, out)
    B = BUNDLE
    dev_ = args.device
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    head = [
        f"### GPU check ({time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}, scripts/gpu-check.sh, device `{dev_}`{', rehearsal' if SMALL else ''})",
        "",
    ]
    run = [args.runner]

    def eval_check() -> None:
        outs = {}
        for dev in dict.fromkeys(["cpu", dev_]):
            path = out / f"eval-{dev}.npz"
            R.run(f"eval --device {dev}", [*run, "eval", str(GPT2), "--inputs", str(B / "gpt2.inputs.npz"), "--outputs", str(path), "--device", dev])
            outs[dev] = np.load(path)["logits"]
        ref = np.load(GPT2.with_suffix(".io.npz"))["logits"]
        d, d_ref = rel(outs[dev_], outs["cpu"]), rel(outs[dev_], ref)
        R.results["eval"] = {"rel_gpu_cpu": d, "rel_gpu_pytorch": d_ref}
        R.lines.append(f"- **eval** (GPT-2 logits, 2 × 16): `{dev_}` against CPU {d:.2e} relative, against PyTorch's stored logits {d_ref:.2e} (goal ≤ {TOL['eval']:.0e}: {verdict(d, TOL['eval'])})")

    losses: dict[str, list[float]] = {}

    def steps_check(prec: str) -> None:
        plan = str(B / f"gpt2-{prec}.plan.json")
        got = {}
        for dev in dict.fromkeys(["cpu", dev_]):
            rep = R.report(f"gpt2 {prec} --device {dev}", [*run, "run", plan, "--steps", str(STEPS), "--device", dev])
            got[dev] = rep
            losses[f"{prec}-{dev}"] = [s["loss"] for s in rep["steps"]]
        d = rel(losses[f"{prec}-{dev_}"], losses[f"{prec}-cpu"])
        t = {dev: got[dev]["measured_step_time_s"] for dev in got}
        R.results[f"gpt2-{prec}"] = {"rel": d, "losses_cpu": losses[f"{prec}-cpu"], "losses_device": losses[f"{prec}-{dev_}"], "step_s": t}
        R.lines.append(
            f"- **GPT-2, {STEPS} steps, {prec}**: losses on `{dev_}` against CPU {d:.2e} relative at worst (goal ≤ {TOL[prec]:.0e}: {verdict(d, TOL[prec])}); "
            f"last loss {losses[f'{prec}-{dev_}'][-1]:.6f} / {losses[f'{prec}-cpu'][-1]:.6f}; step {t[dev_] * 1e3:.1f} ms ({dev_}), {t['cpu'] * 1e3:.1f} ms (CPU)"
        )

    def pp2_check() -> None:
        rep = R.report("gpt2 pp2 on one GPU", [*run, "launch", "--nproc", "2", "--device", dev_, "--share-gpu", str(B / "gpt2-pp2.plan.json"), "--steps", str(STEPS)], timeout=400)
        pp = [s["loss"] for s in rep["steps"]]
        base = losses.get(f"f32-{dev_}") or losses.get("f32-cpu")
        d = rel(pp, base) if base else float("nan")
        R.results["gpt2-pp2"] = {"rel": d, "losses": pp, "step_s": rep["measured_step_time_s"]}
        R.lines.append(
            f"- **2-stage pipeline on the one GPU** (`launch --nproc 2 --device {dev_} --share-gpu`, 1F1B, 4 microbatches, f32): losses against the one-rank run {d:.2e} relative (goal ≤ {TOL['pp2']:.0e}: {verdict(d, TOL['pp2'])}); step {rep['measured_step_time_s'] * 1e3:.1f} ms"
        )

    def blocks_check() -> None:
        rep = R.report("blocks bf16-mixed (runner)", [*run, "run", str(B / "blocks.plan.json"), "--init", "random", "--device", dev_, "--steps", str(BLOCK_STEPS)], timeout=400)
        ours = sorted(s["time_s"] for s in rep["steps"][1:])[len(rep["steps"][1:]) // 2]
        eager = eager_blocks(BLOCK_STEPS, dev_)
        tokens = BLOCK_SEQ * BLOCK_BATCH
        R.results["blocks"] = {"runner_step_s": ours, "eager_step_s": eager["step_s"], "runner_losses": [s["loss"] for s in rep["steps"]], "eager_losses": eager["losses"], "predicted_step_s": rep.get("predicted_step_time_s")}
        R.lines += [
            f"- **bf16-mixed block stack** (GPT-2 blocks: {BLOCKS['n_layer']} × {BLOCKS['n_embd']}, {BLOCKS['n_head']} heads, vocabulary {BLOCKS['vocab_size']}; batch {BLOCK_BATCH} × {BLOCK_SEQ}; AdamW, clip 1.0; median of {BLOCK_STEPS - 1} steps):",
            "",
            "  | | step | tokens/s |",
            "  |---|---|---|",
            f"  | smp-runner (`run --device {dev_}`, autocast over fp32 masters) | {ours * 1e3:.1f} ms | {tokens / ours:,.0f} |",
            f"  | PyTorch eager (`torch.autocast('{dev_}', torch.bfloat16)`, fused AdamW) | {eager['step_s'] * 1e3:.1f} ms | {tokens / eager['step_s']:,.0f} |",
            f"  | planner's prediction (h200) | {(rep.get('predicted_step_time_s') or float('nan')) * 1e3:.1f} ms | |",
            "",
            f"  Throughput ratio PyTorch / runner: {eager['step_s'] / ours:.2f} (≥ 1: the runner is at least as fast). Weights differ (the runner's seeded `--init random`, PyTorch's own init), shapes and work do not.",
        ]

    def layers_check() -> None:
        plan = json.loads((B / "blocks-layers.plan.json").read_text())
        rep = R.report(
            "blocks one layer per stage",
            [*run, "launch", "--nproc", str(BLOCK_LAYERS), "--device", dev_, "--share-gpu", str(B / "blocks-layers.plan.json"), "--init", "random", "--steps", "5", "--threads", "1"],
            timeout=500,
        )
        rows = []
        for st in plan["stages"]:
            r = st["ranks"][0]
            measured = rep["ranks"][r]["phases"]["compute_s"]
            predicted = st["forward_s"] + st["backward_s"]
            rows.append((st["index"], st["layers"], predicted, measured))
        R.results["layers"] = [{"stage": s, "layers": ly, "predicted_s": p, "measured_s": m} for s, ly, p, m in rows]
        R.lines += [
            f"- **Per layer, predicted against measured** (the block stack, one layer per pipeline stage, one microbatch of {BLOCK_BATCH} × {BLOCK_SEQ}, GPipe, so one stage computes at a time; forward + backward per step; measured with a device synchronisation after each pass; mean of 4 steps):",
            "",
            "  | layer | predicted | measured | measured / predicted |",
            "  |---|---|---|---|",
        ]
        names = ["embedding", *[f"block {i}" for i in range(BLOCKS["n_layer"])], "head"]
        for s, ly, p, m in rows:
            name = names[ly[0]] if ly[0] == ly[1] and ly[0] < len(names) else f"layers {ly}"
            R.lines.append(f"  | {name} | {p * 1e3:.3f} ms | {m * 1e3:.3f} ms | {m / p if p > 0 else float('nan'):.2f} |")
        R.lines.append("")

    R.check("eval", eval_check)
    R.check("gpt2-f32", lambda: steps_check("f32"))
    R.check("gpt2-bf16-mixed", lambda: steps_check("bf16-mixed"))
    R.check("gpt2-pp2", pp2_check)
    R.check("blocks", blocks_check)
    R.check("layers", layers_check)
    R.check("gemm", lambda: gemm_check(R, dev_))
    (out / "gpu-check.json").write_text(json.dumps(R.results, indent=1))
    text = "\n".join([*head, *R.lines, ""])
    (out / "gpu-check.md").write_text(text)
    print(text)


# the GEMM grid: tokens (m) against the weight's two sides (n, k); the rehearsal's is tiny
GEMM_SIDES = [64, 128] if SMALL else [256, 512, 1024, 2048, 4096, 8192, 16384]
# H100/H200 SXM dense bf16 peak (NVIDIA's data sheet: 989.4 TFLOP/s without sparsity)
BF16_PEAK_TFLOPS = 989.4


def gemm_check(R: Remote, device: str) -> None:
    """bf16 `m x k @ k x n` timed per shape (CUDA events, mean of the repeats after warm-ups),
    as TFLOP/s and as a fraction of the data-sheet peak; every shape in gemm.json, the cubes
    and a few token-heavy shapes in the report."""
    import torch

    if device != "cuda":
        R.lines.append("- **GEMM efficiency by shape**: skipped (needs the GPU)")
        return
    torch.manual_seed(0)
    rows = []
    for m in GEMM_SIDES:
        for n in GEMM_SIDES:
            for k in GEMM_SIDES:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                flop = 2.0 * m * n * k
                reps = max(5, min(200, int(2e12 / flop)))
                for _ in range(3):
                    torch.matmul(a, b)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    torch.matmul(a, b)
                end.record()
                torch.cuda.synchronize()
                s = start.elapsed_time(end) / 1e3 / reps
                tflops = flop / s / 1e12
                rows.append({"m": m, "n": n, "k": k, "seconds": s, "tflops": tflops, "efficiency": tflops / BF16_PEAK_TFLOPS})
    (R.out / "gemm.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16", "peak_tflops": BF16_PEAK_TFLOPS, "shapes": rows}, indent=0))
    R.results["gemm"] = {"shapes": len(rows)}
    by = {(r["m"], r["n"], r["k"]): r for r in rows}
    R.lines += [
        f"- **GEMM efficiency by shape** (bf16 `torch.matmul`, m × k by k × n, CUDA events; fraction of the {BF16_PEAK_TFLOPS} TFLOP/s data-sheet peak; all {len(rows)} shapes in gemm.json):",
        "",
        "  | m = n = k | TFLOP/s | efficiency |",
        "  |---|---|---|",
        *[f"  | {d} | {by[d, d, d]['tflops']:.0f} | {by[d, d, d]['efficiency']:.2f} |" for d in GEMM_SIDES],
        "",
    ]


def eager_blocks(steps: int, device: str) -> dict:
    """PyTorch eager on the block stack's module: bf16 autocast over fp32 weights, fused
    AdamW, clip 1.0; each step timed between device synchronisations; the median step."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config(transformers)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    ids = torch.randint(0, BLOCKS["vocab_size"], (BLOCK_BATCH, BLOCK_SEQ), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        times.append(time.perf_counter() - t0)
    timed = sorted(times[1:])
    return {"step_s": timed[len(timed) // 2], "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--partition", required=True, help="the smp-partition binary")
    sub.add_parser("manifest")
    a = sub.add_parser("travel")
    a.add_argument("--limit", type=int, default=64, help="MiB a device run carries")
    a = sub.add_parser("remote")
    a.add_argument("--runner", required=True, help="the smp-runner built for this machine's torch")
    a.add_argument("--out", required=True, help="where the report goes ($OUT)")
    a.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the rehearsal here")
    args = p.parse_args()
    {"prepare": prepare, "manifest": manifest, "travel": travel, "remote": remote}[args.cmd](args)


if __name__ == "__main__":
    main()
