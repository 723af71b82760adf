"""Architectures the zoo does not hold, tried as a new user would: each Hugging Face model class
of the installed transformers built from a small config made generically (2 layers, hidden 32,
4 heads, the zoo's batch), exported through the front door, planned on cpu:2 at pp 2, tp 2 and
(token models) cp 2, trained 5 f32 steps by `smp.launch` and compared with PyTorch's own
training of the same module (losses within 1e-5 relative, as the zoo). Every architecture ends
in one line: its worst loss difference per plan, or the first refusal met, verbatim.

    PYTHONPATH=python:python/tests .venv/bin/python scripts/survey.py [--out survey.md] [NAME ...]

Not part of `make test`: it takes about a minute of one core per architecture. Each runs in a
subprocess of its own with a time limit, so one hung export costs only its limit.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "python"), str(REPO / "python" / "tests")]

import zoo  # noqa: E402  (the zoo's batch, loss and PyTorch training)

#: Small settings by the config's standard names (the config's attribute_map renames them).
SMALL = dict(num_hidden_layers=2, hidden_size=zoo.H, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64, vocab_size=zoo.VOCAB, head_dim=8,
             use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
             # encoder-decoder stacks that name each side's depth and heads
             encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             # mixture of experts
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
             first_k_dense_replace=1, n_group=2, topk_group=1, moe_layer_freq=1,
             # multi-head latent attention
             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
             # vision
             image_size=zoo.IMAGE, num_channels=3, patch_size=4)
#: Per-stage lists (a vision model's stages) are kept at their length, one block each.
DEPTH_LISTS = ("depths", "num_layers_per_stage", "layers")
LOSS_TOL, EXACT_TOL = 1e-5, 1e-9
PLANS = {"pp2": {"pipeline_parallel_degree": 2, "microbatches": 2}, "tp2": {"tensor_parallel_degree": 2},
         "cp2": {"context_parallel_degree": 2}}


def candidates() -> dict[str, tuple[str, str]]:
    """name -> (model class, task) for causal LMs and image classifiers the zoo lacks; composite
    (multimodal) configs are left out."""
    from transformers.models.auto import modeling_auto as auto

    out: dict[str, tuple[str, str]] = {}
    held = set(zoo.archs())
    for mapping, task in ((auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal-lm"),
                          (auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "image")):
        for name, cls in mapping.items():
            if name.replace("-", "_") not in held and isinstance(cls, str):
                out.setdefault(name, (cls, task))
    return out


def small_config(cfg_cls):
    """`cfg_cls` at the zoo's sizes: every setting of SMALL/STAGES the constructor takes (by its
    own name or its attribute_map's), every dropout off."""
    params = inspect.signature(cfg_cls.__init__).parameters
    amap = getattr(cfg_cls, "attribute_map", {}) or {}
    kw = {}
    for key, value in SMALL.items():
        name = key if key in params else amap.get(key)
        if name in params and not isinstance(params[name].default, (list, tuple)):
            kw[name] = value
    for p, param in params.items():
        if isinstance(param.default, (list, tuple)) and ("drop" in p):
            continue
        if "dropout" in p or "pdrop" in p or p in ("drop_path_rate", "layerdrop"):
            kw[p] = 0.0
        elif p in DEPTH_LISTS and isinstance(param.default, (list, tuple)):
            kw[p] = [1] * len(param.default)
    if "kv_lora_rank" in params and "num_attention_heads" in kw:  # latent attention: one key/value head per head
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if getattr(cfg_cls, "sub_configs", None):
        raise RuntimeError("composite (multimodal) config: left out")
    try:
        cfg = cfg_cls(**kw)
    except Exception as e:  # noqa: BLE001 - configs validate in their own error classes
        default = getattr(cfg_cls(), "layer_types", None) if "layer_types" in str(e) else None
        if "attention_layers" in str(e) and "attention_types" in params:
            # GPT-Neo's per-layer pattern, [[kinds, repeats]]: one global and one local layer
            cfg = cfg_cls(**kw, attention_types=[[["global", "local"], 1]])
        elif default:
            # hybrids whose per-layer pattern is as long as their default depth: two layers of
            # it, one of each of its first two kinds (a Mamba and an attention layer, say)
            other = next((t for t in default if t != default[0]), default[0])
            cfg = cfg_cls(**kw, layer_types=[default[0], other])
        else:
            raise
    cfg.num_labels = zoo.CLASSES
    return cfg


def small_model(model_cls):
    """`model_cls` at `small_config`, with what a user would set where the module's own
    constructor refuses the generic config: the default rotary for each layer type where the
    modeling code reads `rope_parameters[layer_type]` and the default holds none; Reformer's
    axial grid; `is_decoder` for a causal-LM head on an encoder stack; X-MOD's default
    language."""
    cfg = small_config(model_cls.config_class)
    for _ in range(3):  # each error below names one setting to fix; then try again
        try:
            model = model_cls(cfg)
            break
        except KeyError as e:
            kinds = set(getattr(cfg, "layer_types", None) or [])
            if not e.args or e.args[0] not in kinds:
                raise
            cfg.rope_parameters = {k: {"rope_type": "default", "rope_theta": 10000.0} for k in kinds}
        except (AssertionError, ValueError) as e:
            if "axial_pos_embds" in str(e):
                # Reformer: axial position embeddings whose grid is the trained sequence (training
                # checks it) and whose widths sum to the hidden size; one layer of each attention
                cfg.axial_pos_embds_dim, cfg.axial_pos_shape = (zoo.H // 2, zoo.H // 2), (2, zoo.SEQ // 2)
                cfg.attn_layers = ["local", "lsh"]
                cfg.num_hidden_layers = len(cfg.attn_layers)
            elif "is_decoder" in str(e):  # a causal-LM head on a stack that must be told so
                cfg.is_decoder = True
            else:
                raise
    else:
        model = model_cls(cfg)
    # X-MOD's adapters run the language set as the default (its config lists them)
    if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):
        model.set_default_language(cfg.languages[0])
    return model


def one(name: str, cls_name: str, task: str) -> dict:
    """Export, train in PyTorch and through each plan: the row of `name`."""
    import torch
    import transformers

    import smp_partition as smp

    torch.set_num_threads(1)
    model_cls = getattr(transformers, cls_name)
    arch = zoo.Arch(name, "survey", lambda: small_model(model_cls), task)
    row: dict = {"name": name, "class": cls_name}
    try:
        model = zoo.build(arch)
        data = zoo.batch(arch, model)
        with torch.no_grad():  # the generic small config must run in PyTorch itself
            zoo.logits_of(model, data)
    except Exception as e:  # noqa: BLE001 - one row per architecture
        if task != "image":
            return row | {"stage": "config", "error": zoo.reason(e)}
        # vision models whose windows, strides or patch grid need their own image size
        try:
            arch, model, data = at_own_image_size(name, model_cls)
            row["image"] = data["pixel_values"].shape[-1]
        except Exception:  # noqa: BLE001
            return row | {"stage": "config", "error": zoo.reason(e)}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exported = smp.export(model, zoo.inputs_of(data), d / "model.onnx")
        except Exception as e:  # noqa: BLE001
            return row | {"stage": "export", "error": why(e)}
        try:
            torch_losses = zoo.train_torch(arch, model, data)[0]
        except Exception as e:  # noqa: BLE001
            return row | {"stage": "pytorch", "error": zoo.reason(e)}
        import numpy as np

        np.savez(d / "data.npz", **{k: v.numpy() for k, v in data.items()
                                   if k in exported.input_names or k == "labels"})
        row["plans"] = {}
        # BatchNorm normalises over what one forward sees: one microbatch, as the zoo plans it
        single = {"microbatches": 1} if zoo.has_batch_statistics(model) else {}
        for label, config in PLANS.items():
            config = config | single
            if label == "cp2" and task != "causal-lm":
                continue
            try:
                plan = smp.plan(exported, zoo.inputs_of(data), cluster="cpu:2", global_batch=zoo.BATCH,
                                config=config, workdir=d / label)
            except Exception as e:  # noqa: BLE001
                row["plans"][label] = f"plan: {why(e)}"
                continue
            try:
                run = smp.launch(plan, data=d / "data.npz", steps=zoo.STEPS, loss=zoo.RUNNER_LOSS[task],
                                 threads=1, progress=False)
            except Exception as e:  # noqa: BLE001
                row["plans"][label] = f"run: {why(e)}"
                continue
            rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run.losses, torch_losses))
            row["plans"][label] = rel
            if rel > LOSS_TOL:
                # against the loss's own scale (its first step): a loss trained near 0 turns
                # the logits' f32 rounding into a large relative difference
                scaled = max(abs(a - b) for a, b in zip(run.losses, torch_losses)) / abs(torch_losses[0])
                row.setdefault("scaled", {})[label] = scaled
                row.setdefault("f64", {})[label] = f64_check(plan, d, task, arch, model, data)
    return row


def at_own_image_size(name: str, model_cls):
    """The small config with the model's own image and patch sizes, and a batch of such images
    (zoo's labels and seed): (arch, model, data), or the exception PyTorch raises."""
    import torch

    def config():
        cfg = small_config(model_cls.config_class)
        own = model_cls.config_class()
        for key in ("image_size", "patch_size", "patch_sizes", "strides", "patch_stride", "window_size"):
            if hasattr(own, key):
                setattr(cfg, key, getattr(own, key))
        return cfg

    arch = zoo.Arch(name, "survey", lambda: model_cls(config()), "image")
    model = zoo.build(arch)
    size = model.config.image_size
    size = size[0] if isinstance(size, (list, tuple)) else int(size)
    if size > 512:
        raise ValueError(f"its own image size, {size}, is too large for the survey")
    gen = torch.Generator().manual_seed(zoo.SEED + 1)
    data = {"pixel_values": torch.randn(zoo.BATCH, 3, size, size, generator=gen),
            "labels": torch.randint(0, zoo.CLASSES, (zoo.BATCH,), generator=gen)}
    with torch.no_grad():
        zoo.logits_of(model, data)
    return arch, model, data


def f64_check(plan, d: Path, task: str, arch, model, data) -> str:
    """Where f32 is outside tolerance: the plan in f64 against one process in f64 (the runner's
    own oracle) and PyTorch's f32 against its f64 (how chaotic the model's training is)."""
    import torch

    import smp_partition as smp

    rel = lambda x, y: max(abs(a - b) / abs(b) for a, b in zip(x, y))  # noqa: E731
    try:
        one = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(d / "model.onnx"),
                              "--data", str(d / "data.npz"), "--loss", zoo.RUNNER_LOSS[task], "--steps",
                              str(zoo.STEPS), "--dtype", "f64", "--threads", "1", "--json"],
                             capture_output=True, text=True, check=True)
        one_losses = [s["loss"] for s in json.loads(one.stdout)["steps"]]
        run64 = smp.launch(plan, data=d / "data.npz", steps=zoo.STEPS, loss=zoo.RUNNER_LOSS[task], threads=1,
                           dtype="f64", progress=False)
        text = f"f64 plan vs one process {rel(run64.losses, one_losses):.1e}"
    except Exception as e:  # noqa: BLE001
        return f"f64 check failed: {why(e)}"
    try:
        t32 = zoo.train_torch(arch, model, data)[0]
        t64 = zoo.train_torch(arch, model, data, torch.float64)[0]
        text += f", PyTorch f32 vs its own f64 {rel(t32, t64):.1e}"
        text += f", PyTorch f64 vs itself with weights moved 1e-15 {rel(f64_sensitivity(arch, model, data), t64):.1e}"
    except Exception:  # noqa: BLE001 - PyTorch cannot train every module in f64
        pass
    return text


def f64_sensitivity(arch, model, data) -> list[float]:
    """PyTorch's f64 losses with every weight moved by a random relative 1e-15 (a few ulps, as
    a different order of summation moves them): how far the model's own f64 training carries
    rounding, the bound any f64 comparison of it can hold."""
    import copy

    import torch

    moved = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(p * 1e-15 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return zoo.train_torch(arch, moved, data, torch.float64)[0]


def why(e: BaseException) -> str:
    """The innermost reason, with a failed command's last stderr lines (where the cause is)."""
    text = zoo.reason(e)
    stderr = getattr(e, "stderr", None) or getattr(e, "log", None)
    if stderr:
        tail = [ln.strip() for ln in str(stderr).strip().splitlines() if ln.strip()][-2:]
        text = f"{type(e).__name__}: {' / '.join(tail)}"
    return text[:900]


def verdict(row: dict) -> str:
    """One line: `trains as PyTorch`, the worst difference, or the first refusal."""
    if "error" in row:
        return f"{row['stage']}: {row['error']}"
    parts = []
    for label, v in row["plans"].items():
        text = f"{label} {v:.1e}" if isinstance(v, float) else f"{label} {v}"
        if label in row.get("f64", {}):
            text += f" ({row['f64'][label]}, {row['scaled'][label]:.1e} of the first loss)"
        parts.append(text)
    return "; ".join(parts)


def passed(row: dict) -> bool:
    return "error" not in row and all(isinstance(v, float) and v <= LOSS_TOL for v in row["plans"].values())


def f64_only(row: dict) -> bool:
    """Outside tolerance in f32 only: every such plan equals one process in f64 (≤ 1e-9, or
    within what moving PyTorch's weights by 1e-15 does to its own f64 training), and either
    PyTorch's own f32 run drifts from its f64 run by at least as much or the difference is
    within tolerance of the loss's first value (a loss trained near 0)."""
    if passed(row) or "error" in row or not all(isinstance(v, float) for v in row["plans"].values()):
        return False
    for label, v in row["plans"].items():
        if v <= LOSS_TOL:
            continue
        note = row.get("f64", {}).get(label, "")
        try:
            exact = float(note.split("one process ")[1].split(",")[0])
            drift = float(note.split("its own f64 ")[1].split(",")[0])
            moved = float(note.split("moved 1e-15 ")[1]) if "moved 1e-15 " in note else 0.0
        except (IndexError, ValueError):
            return False
        near_zero = row.get("scaled", {}).get(label, 1.0) <= LOSS_TOL
        if exact > max(EXACT_TOL, moved) or (drift < v / 10 and not near_zero):
            return False
    return True


def status(row: dict) -> str:
    return "PASS" if passed(row) else "PASS in f64 (PyTorch's own f32 is as far from f64)" if f64_only(row) else "FAIL"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per architecture")
    ap.add_argument("--one", nargs=3, metavar=("NAME", "CLASS", "TASK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    todo = candidates()
    names = args.names or sorted(todo)
    rows = []
    for name in names:
        if name not in todo:
            rows.append({"name": name, "class": "?", "stage": "survey", "error": "not a causal LM or image classifier "
                         "of the installed transformers, or already in the zoo"})
            continue
        cls_name, task = todo[name]
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name, cls_name, task], capture_output=True,
                                  text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "name": name, "class": cls_name, "stage": "crash",
                "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
        except subprocess.TimeoutExpired:
            row = {"name": name, "class": cls_name, "stage": "timeout", "error": f"over {args.timeout} s"}
        rows.append(row)
        print(f"{name}: {status(row)}: {verdict(row)}", flush=True)
    table = ["| architecture | class | trains as PyTorch | worst loss difference per plan, or the refusal |", "|---|---|---|---|"]
    table += [f"| {r['name']} | {r['class']} | { {'PASS': 'yes', 'FAIL': 'no'}.get(status(r), 'in f64') } | {verdict(r).replace('|', '/')} |"
              for r in rows]
    ok, f64 = sum(passed(r) for r in rows), sum(f64_only(r) for r in rows)
    table.append(f"\n{ok} of {len(rows)} train as PyTorch (≤ 1e-5 relative loss at every plan); {f64} more equal "
                 "one process in f64 where f32 cannot hold them (PyTorch's own f32 training drifts from its "
                 "f64 as far, or the loss trains near 0).")
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
