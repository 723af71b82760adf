"""PyTorch side of the training oracle (tests/train_oracle.rs).

For each small Hugging Face model (HF's default init, no perturbation, dropout off, eager
attention), in a fixed-shape and a dynamic-shape export variant:
- exports it with `torch.onnx.export(..., dynamo=True)` and writes the parameter record
  (scripts/param_record.py);
- writes one fixed batch (`<case>.data.npz`: the graph inputs, plus `labels` for masked-LM
  and classification);
- trains 5 steps in PyTorch (AdamW lr 1e-3, weight decay 0.01 on every parameter, clip 1.0)
  and writes the losses and the trained parameters (`<case>.trained.npz`, keyed by every
  name of each parameter, as `named_parameters(remove_duplicate=False)` of the exported
  module reports them);
- for GPT-2, Llama and BERT (fixed shapes), trains the same 5 steps in PyTorch's own
  bf16-mixed and fp16-mixed recipes (`torch.autocast("cpu")`, fp16 with
  `torch.amp.GradScaler("cpu")`) and keeps their losses (`mixed`);
- trains the same 5 steps in float64 from the same init (`<case>.trained64.npz`): how far
  PyTorch's own float32 training is from exact arithmetic, per tensor. Where an element's
  gradient cancels below float32's resolution (GPT-NeoX: one MLP weight with a gradient of
  1e-9 at step 1, where the tensor's reach 1e-2), Adam turns the rounding into a visible step
  and every later step carries it: two correct float32 trainings then differ by as much as
  PyTorch's float32 and float64 ones do.

usage: train_oracle.py OUT_DIR [MODEL ...]    (default: all but neox_parallel)
Writes OUT_DIR/cases.json: [{"case", "model", "variant", "onnx", "data", "loss", "losses",
"trained", "record"}].
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from export_models import LogitsOnly  # noqa: E402
from param_record import keep_apart, put_back, write_record  # noqa: E402

warnings.filterwarnings("ignore")
H, VOCAB, BATCH, SEQ, STEPS, SEED = 32, 64, 2, 8, 5, 0
LR, WD, CLIP = 1e-3, 0.01, 1.0
KEEP_APART = {"neox_parallel"}
MIXED = {"gpt2", "llama", "bert"}  # also trained under autocast (bf16) and GradScaler (fp16)
GRADFREE = 1e-6  # |grad| below this times the global grad norm, at every step: gradient-free


def configs():
    tok = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    rope = dict(num_hidden_layers=2, hidden_size=H, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=32, use_cache=False, **tok)
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(
            n_layer=2, n_embd=H, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, **tok), "causal-lm"),
        "opt": (T.OPTForCausalLM, T.OPTConfig(
            num_hidden_layers=2, hidden_size=H, num_attention_heads=2, ffn_dim=64,
            max_position_embeddings=32, word_embed_proj_dim=H, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, layerdrop=0.0, use_cache=False, pad_token_id=1, **tok),
            "causal-lm"),
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(
            num_key_value_heads=2, tie_word_embeddings=False, attention_dropout=0.0, **rope),
            "causal-lm"),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(
            num_key_value_heads=2, attention_dropout=0.0, **rope), "causal-lm"),
        # sequential residual; `neox_parallel` is the default parallel one, whose two LayerNorms
        # of a block read the same input: at equal weights the exporter merges the two nodes,
        # so it is exported with its nodes kept apart (param_record.keep_apart/put_back)
        "neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
            hidden_dropout=0.0, attention_dropout=0.0, use_parallel_residual=False, **rope),
            "causal-lm"),
        "neox_parallel": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
            hidden_dropout=0.0, attention_dropout=0.0, **rope), "causal-lm"),
        "phi": (T.PhiForCausalLM, T.PhiConfig(
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **rope), "causal-lm"),
        "bert": (T.BertForMaskedLM, T.BertConfig(
            num_hidden_layers=2, hidden_size=H, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, vocab_size=VOCAB), "cross-entropy"),
        "vit": (T.ViTForImageClassification, T.ViTConfig(
            image_size=16, patch_size=8, num_channels=3, hidden_size=H, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0), "cross-entropy"),
    }


def batch(name: str, gen: torch.Generator):
    if name == "vit":
        x = torch.randn(BATCH, 3, 16, 16, generator=gen)
        return x, torch.randint(0, 5, (BATCH,), generator=gen)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    if name != "bert":
        return ids, None
    masked = torch.rand(BATCH, SEQ, generator=gen) < 0.3
    masked[0, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, 1), ids), labels


def loss_of(kind: str, logits, x, labels):
    if kind == "causal-lm":
        v = logits.shape[-1]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), x[:, 1:].reshape(-1))
    v = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=-100)


def train_mixed(model, precision: str, kind: str, x, labels) -> list:
    """PyTorch's own mixed-precision recipe from the same init: forward and loss under
    `torch.autocast("cpu", low)` over the fp32 module, fp16 with `torch.amp.GradScaler("cpu")`
    (scale, unscale, clip, step, update); the losses of the steps."""
    low = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    scaler = torch.amp.GradScaler("cpu") if low == torch.float16 else None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=low):
            loss = loss_of(kind, model(x), x, labels)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def run_case(out: Path, name: str, variant: str) -> dict:
    cls, cfg, kind = configs()[name]
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    hf = cls(cfg)
    input_name = "pixel_values" if name == "vit" else "input_ids"
    model = LogitsOnly(hf, input_name).eval()
    x, labels = batch(name, torch.Generator().manual_seed(SEED + 1))
    case = f"{name}-{variant}"
    path = out / f"{case}.onnx"
    kw = {}
    if variant == "dynamic":
        dims = {0: torch.export.Dim("batch")}
        if name != "vit":
            dims[1] = torch.export.Dim("seq", max=32)
        kw["dynamic_shapes"] = (dims,)
    # nodes the exporter would merge at equal weights (GPT-NeoX's parallel residual) are
    # exported apart, and the file then holds the module's own values
    originals = keep_apart(model) if name in KEEP_APART else {}
    with torch.no_grad():
        program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18,
                                    input_names=[input_name], output_names=["logits"],
                                    verbose=False, **kw)
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    if originals:
        put_back(model, proto, originals)
    record = write_record(model, proto)
    assert not record["missing"], f"{case}: parameters not in the export: {record['missing']}"
    onnx.save(proto, str(path))

    arrays = {input_name: x.numpy()}
    if labels is not None:
        arrays["labels"] = labels.numpy()
    np.savez(out / f"{case}.data.npz", **arrays)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses = []
    # elements whose gradient is zero in exact arithmetic (an attention key bias: softmax
    # ignores a shift shared by a row) get rounding noise, which Adam scales to ±lr a step
    gradfree = {n: torch.ones_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(kind, model(x), x, labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        for n, p in model.named_parameters():
            gradfree[n] &= p.grad.abs() <= GRADFREE * norm * min(1.0, CLIP / (norm + 1e-6))
        opt.step()
        losses.append(loss.item())
    trained = {n: p.detach().numpy() for n, p in model.named_parameters(remove_duplicate=False)}
    # the same steps in float64 from the same init
    torch.manual_seed(SEED)
    exact = LogitsOnly(cls(cfg), input_name).double().train()
    opt64 = torch.optim.AdamW(exact.parameters(), lr=LR, weight_decay=WD, foreach=False)
    x64 = x.double() if x.is_floating_point() else x
    for _ in range(STEPS):
        opt64.zero_grad()
        loss_of(kind, exact(x64), x, labels).backward()
        torch.nn.utils.clip_grad_norm_(exact.parameters(), CLIP, foreach=False)
        opt64.step()
    np.savez(out / f"{case}.trained64.npz",
             **{n: p.detach().numpy() for n, p in exact.named_parameters(remove_duplicate=False)})
    aliases = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    for n, p in model.named_parameters():
        if bool(gradfree[n].any()):
            for a in aliases[id(p)]:
                trained[f"{a}#gradfree"] = gradfree[n].numpy().astype(np.uint8)
    np.savez(out / f"{case}.trained.npz", **trained)
    mixed = {}
    if variant == "fixed" and name in MIXED:
        for precision in ("bf16-mixed", "fp16-mixed"):
            torch.manual_seed(SEED)
            mixed[precision] = train_mixed(LogitsOnly(cls(cfg), input_name).train(), precision, kind, x, labels)
    return {"mixed": mixed, "case": case, "model": name, "variant": variant, "onnx": str(path),
            "data": str(out / f"{case}.data.npz"), "loss": kind, "losses": losses,
            "trained": str(out / f"{case}.trained.npz"), "trained64": str(out / f"{case}.trained64.npz"),
            "record": {k: v for k, v in record.items() if k != "restored"} | {"restored": len(record["restored"])}}


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    want = sys.argv[2:] or [m for m in configs() if m != "neox_parallel"]
    torch.set_num_threads(1)
    cases = []
    for name in want:
        for variant in ("fixed", "dynamic"):
            cases.append(run_case(out, name, variant))
            print(f"{cases[-1]['case']}: losses {cases[-1]['losses']}", file=sys.stderr)
    (out / "cases.json").write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
