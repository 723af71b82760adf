"""PyTorch reference training of an exported HF model, for the runner's equivalence test and
bench: the same HF model class and config as the export (models/manifest.json), weights read
from the ONNX initializers (by the parameter record, else by name), the same data (an .npz keyed by input name), causal-LM
loss (cross-entropy of logits[:, :-1] vs ids[:, 1:]), torch.optim.AdamW and
clip_grad_norm_, no dropout.

usage: torch_reference.py MODEL.onnx --data BATCH.npz [--steps N] [--lr] [--weight-decay]
       [--clip] [--dtype f32|f64] [--precision f32|bf16-mixed|fp16-mixed]
       [--loss-scale S] [--loss-scale-window N] [--threads T] [--bench]
Mixed precision is PyTorch's own recipe: the forward and the loss under
`torch.autocast("cpu", dtype)` over the fp32 module, fp16 with `torch.amp.GradScaler("cpu")`
(unscale, clip, step, update).
Prints one JSON object: {"losses": [...], "step_times_s": [...], "trained": [names...],
"loss_scales": [...], "skipped": [...]} (the scale each step's loss was multiplied by, and
whether the scaler skipped its update; fp16 only).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers
from onnx import numpy_helper


def build(model_path: Path):
    manifest = json.loads((model_path.parent / "manifest.json").read_text())
    rec = next((r for r in manifest.get("models", manifest).values() if isinstance(r, dict)
                and Path(r.get("file", "")).name == model_path.name), None)
    if rec is None:
        sys.exit(f"{model_path.name} is not in {model_path.parent / 'manifest.json'}")
    cls = getattr(transformers, rec["hf_class"])
    cfg_cls = cls.config_class
    cfg = cfg_cls(**rec["config"])
    cfg._attn_implementation = "eager"
    return cls(cfg)


def load_onnx_weights(hf, model_path: Path):
    """Copies the initializer standing for each HF parameter (by the parameter record, else
    named `model.<param>` or `<param>`) into it; every parameter must get one (a tied parameter
    needs only one of its names in the file)."""
    inits = {}
    for t in onnx.load(str(model_path)).graph.initializer:
        value = numpy_helper.to_array(t)
        inits[t.name] = value
        # the parameter record: the module tensors an initializer stands for (several when the
        # exporter merged equal values); only untransformed ones are copied by alias
        rec = {p.key: p.value for p in t.metadata_props}
        if rec.get("smp.transform", "identity") == "identity":
            for aliases in json.loads(rec.get("smp.params", "[]")):
                for alias in aliases:
                    inits.setdefault(alias, value)
    names_of = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), (p, []))[1].append(name)
    missing = []
    with torch.no_grad():
        for p, names in names_of.values():
            src = next((inits[k] for n in names for k in ("model." + n, n) if k in inits), None)
            if src is None:
                missing.append(names[0])
                continue
            p.copy_(torch.from_numpy(np.array(src)))
    if missing:
        sys.exit(f"no initializer for parameters {missing}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--precision", choices=["f32", "bf16-mixed", "fp16-mixed"], default="f32")
    ap.add_argument("--loss-scale", type=float, default=65536.0)
    ap.add_argument("--loss-scale-window", type=int, default=2000)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--bench", action="store_true", help="also report per-step wall times")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf = build(args.model)
    load_onnx_weights(hf, args.model)
    if args.dtype == "f64":
        hf = hf.double()
    hf.train()
    data = np.load(args.data)
    ids = torch.from_numpy(np.array(data["input_ids"])).long()
    opt = torch.optim.AdamW(hf.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            foreach=False)
    low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(args.precision)
    scaler = None
    if args.precision == "fp16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=args.loss_scale,
                                      growth_interval=args.loss_scale_window)
    losses, times, scales, skipped = [], [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=low or torch.float32, enabled=low is not None):
            logits = hf(input_ids=ids, use_cache=False).logits
            v = logits.shape[-1]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
        if scaler is None:
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), args.clip, foreach=False)
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), args.clip, foreach=False)
            scaler.step(opt)
            scaler.update()
            scales.append(before)
            # a skipped step is one whose update backed the scale off
            skipped.append(scaler.get_scale() < before)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    trained = sorted(n for n, _ in hf.named_parameters())
    print(json.dumps({"losses": losses, "step_times_s": times, "trained": trained,
                      "loss_scales": scales, "skipped": skipped}))


if __name__ == "__main__":
    main()
