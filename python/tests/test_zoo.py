"""The Hugging Face zoo (zoo.py) through the front door, as a user brings a model: each
architecture at a small config and the library's default init, exported by `smp.export`
(cached), planned on cpu:2 with `pipeline_parallel_degree: 2` and again with
`tensor_parallel_degree: 2` (language models also with `context_parallel_degree: 2`, each
sequence split over 2 ranks, checked to all-gather keys and values; mixture-of-experts
entries marked so also at `expert_parallel_degree: 2` and pp 2 × ep 2 on 4 ranks, each MoE
layer checked fused into one `MixtureOfExperts`), trained 5 f32 steps by `smp.launch` on 2 ranks and brought back
by `smp.load_trained` (strict), then compared with the module trained by PyTorch itself:
losses within 1e-5 relative, every parameter and every persistent buffer (BatchNorm's running
statistics; its counters exactly) within 1e-4 norm-relative (an entry whose PyTorch f32 training
drifts from its f64 training further has its own bound, `Arch.weight_tol`; elements whose true gradient is
zero only bounded: Adam scales their rounding noise to ±lr a step), and the loaded module's
eval-mode output within 1e-4 of the PyTorch-trained module's. Models with BatchNorm are planned
with one microbatch, so that each forward normalises over the whole batch as PyTorch's does. The same plans
in f64 must equal one process (`smp-runner train --dtype f64`) within 1e-9. An entry whose own
f32 training is chaotic (`Arch.f64_oracle`: PyTorch's f32 and f64 runs part by more than these
bounds) is trained in f64 and compared with PyTorch's f64 training, under the same bounds. A
model the runner cannot take yet fails with its reason."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import smp_partition as smp
import zoo
from smp_partition.trained import in_module_layout
from conftest import needs_runner

pytestmark = needs_runner

LOSS_TOL, WEIGHT_TOL, EXACT_TOL = 1e-5, 1e-4, 1e-9
#: 5 AdamW steps of lr 1e-3 on each side.
NOISE_BOUND = 2.0 * zoo.STEPS * zoo.LR
PLANS = {"pp2": {"pipeline_parallel_degree": 2, "microbatches": 2}, "tp2": {"tensor_parallel_degree": 2}}
# context parallelism splits tokens: only for models whose loss is a sum over tokens
TOKEN_PLANS = {"cp2": {"context_parallel_degree": 2}}
# rotary embeddings each plan runs fused (q's and k's in each of the 2 blocks): the half
# rotation (Llama, Qwen, Phi's and GPT-NeoX's partial rotary), GPT-J's interleaved one and
# Llama 4's complex product (exported in real arithmetic)
ROTARY = {"llama": 4, "qwen3": 4, "qwen3_moe": 4, "phi": 4, "gpt_neox": 4, "gptj": 4, "llama4": 4}
# expert parallelism: the routed experts split over 2 ranks (pp 2 × ep 2 on 4)
EXPERT_PLANS = {"ep2": {"expert_parallel_degree": 2},
                "pp2-ep2": {"pipeline_parallel_degree": 2, "microbatches": 2, "expert_parallel_degree": 2}}


def _norm_rel(got: torch.Tensor, want: torch.Tensor, scale: float = 0.0) -> float:
    g, w = got.detach().double(), want.double()
    return float((g - w).norm() / w.norm().clamp_min(max(scale, 1e-30)))


def _spread(name: str, want: dict[str, torch.Tensor]) -> float:
    """A BatchNorm running mean is compared in units of its channels' spread (the norm of the
    square root of the running variance beside it): a mean that is 0 in exact arithmetic (a 1×1
    convolution of a normalised input) holds rounding noise only, 1e-13 against a spread of 6
    in f64, and its norm-relative difference would measure the noise."""
    var = want.get(name.removesuffix("running_mean") + "running_var") if name.endswith("running_mean") else None
    return float(var.double().clamp_min(0).sqrt().norm()) if var is not None else 0.0


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], gradfree: dict[str, torch.Tensor],
             tol: float) -> tuple[float, list[str]]:
    """Worst norm-relative difference over the tensors of `want` and what exceeds `tol`;
    gradient-free elements are only bounded by NOISE_BOUND."""
    worst, errors = 0.0, []
    for name, w in want.items():
        if name not in got:
            errors.append(f"`{name}` is missing")
            continue
        g = got[name]
        if g.shape != w.shape:
            errors.append(f"`{name}`: shape {tuple(g.shape)}, expected {tuple(w.shape)}")
            continue
        free = gradfree.get(name)
        if free is not None and bool(free.any()):
            noise = float((g.detach().double() - w.double()).abs()[free].max())
            if noise > NOISE_BOUND:
                errors.append(f"`{name}`: gradient-free elements differ by {noise:.2e} > {NOISE_BOUND:.0e}")
            g, w = g[~free], w[~free]
        if w.numel() == 0:
            continue
        rel = _norm_rel(g, w, _spread(name, want))
        worst = max(worst, rel)
        if rel > tol:
            errors.append(f"`{name}` differs by {rel:.2e} norm-relative")
    return worst, errors


def _compare_buffers(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> list[str]:
    """Floating-point buffers within `tol` norm-relative, integer ones (counters) equal."""
    floats = {k: v for k, v in want.items() if v.is_floating_point()}
    _, errors = _compare(got, floats, {}, tol)
    for name, w in want.items():
        if not w.is_floating_point() and name in got and not torch.equal(got[name].to(w.dtype), w):
            errors.append(f"`{name}` is {got[name].tolist()}, PyTorch's {w.tolist()}")
    return errors


def _one_process_f64(case: zoo.Case, data: Path, out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`smp-runner train --dtype f64`: the model trained in one process (losses, weights)."""
    weights = out / "one-process.safetensors"
    done = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(case.exported.path), "--data", str(data),
                           "--loss", zoo.RUNNER_LOSS[case.arch.task], "--steps", str(zoo.STEPS), "--dtype", "f64",
                           "--threads", "1", "--json", "--save-weights", str(weights)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise smp.CommandError(["smp-runner", "train"], done.returncode, done.stderr)
    report = json.loads(done.stdout)
    return [float(s["loss"]) for s in report["steps"]], load_file(str(weights))


@pytest.fixture(scope="module", autouse=True)
def _cached() -> None:
    """The exports and PyTorch trainings, made two at a time where the cache lacks them."""
    zoo.fill_cache()


def _case(name: str) -> zoo.Case:
    """The cached case (exported, planned and launched once per architecture)."""
    return zoo.case(name)


def _fused(plan: smp.Plan) -> list[str]:
    """The fused ops of the plan, by kind (`mixture_of_experts`, `attention`, ...)."""
    return [next(iter(f["op"])) if isinstance(f["op"], dict) else f["op"] for f in plan.data["codegen"].get("fused", [])]


def _cluster(config: dict) -> str:
    """The ranks a plan's degrees take."""
    ranks = 1
    for key in ("pipeline_parallel_degree", "tensor_parallel_degree", "context_parallel_degree",
                "expert_parallel_degree"):
        ranks *= config.get(key, 1)
    return f"cpu:{ranks}"


def _layer_names(plan: smp.Plan) -> list[str]:
    return [layer["name"] for layer in plan.data["layer_strategies"]]


@pytest.mark.parametrize("name", list(zoo.archs()))
def test_zoo(name: str, tmp_path: Path) -> None:
    c = _case(name)
    data = {k: v for k, v in c.data.items() if k in c.exported.input_names or k == "labels"}
    data_file = tmp_path / "data.npz"
    import numpy as np

    np.savez(data_file, **{k: v.numpy() for k, v in data.items()})
    if c.arch.ops:
        import onnx

        held = {n.op_type for n in onnx.load(str(c.exported.path)).graph.node}
        assert set(c.arch.ops) <= held, f"the export holds none of {sorted(set(c.arch.ops) - held)}"
    exact_losses, exact = _one_process_f64(c, data_file, tmp_path)
    # the oracle: PyTorch's training, in f64 where its own f32 training is chaotic
    oracle_dtype = torch.float64 if c.arch.f64_oracle else torch.float32
    if c.arch.f64_oracle:
        losses, trained, gradfree, buffers, eval_logits = zoo.train_torch(c.arch, c.model, c.data, torch.float64)
        module = copy.deepcopy(c.model).double()
    else:
        losses, trained, gradfree, buffers, eval_logits = c.losses, c.trained, c.gradfree, c.buffers, c.eval_logits
        module = c.model
    loss = zoo.RUNNER_LOSS[c.arch.task]
    failures, measured = [], {}
    plans = (PLANS | (TOKEN_PLANS if c.arch.task in ("causal-lm", "masked-lm") else {})
             | (EXPERT_PLANS if c.arch.expert_parallel else {}))
    if zoo.has_batch_statistics(c.model):
        plans = {label: config | {"microbatches": 1} for label, config in plans.items()}
    for label, config in plans.items():
        plan = smp.plan(c.exported, zoo.inputs_of(c.data), cluster=_cluster(config), global_batch=zoo.BATCH,
                        config=config, workdir=tmp_path / label)
        moe = _fused(plan).count("mixture_of_experts")
        if moe != c.arch.moe_layers:
            failures.append(f"{label}: {moe} fused mixture-of-experts ops, expected {c.arch.moe_layers}")
        rotary = _fused(plan).count("rotary")
        if name in ROTARY and rotary != ROTARY[name]:
            failures.append(f"{label}: {rotary} fused rotary embeddings, expected {ROTARY[name]}")
        if plan.parallel.ep != config.get("expert_parallel_degree", 1):
            failures.append(f"{label}: the plan's expert parallelism is {plan.parallel.ep}")
        if c.arch.task == "seq2seq":
            # both stacks' blocks are layers the plan can cut between
            names = _layer_names(plan)
            for stack in ("encoder", "decoder"):
                assert sum(f".{stack}." in n for n in names) == 2, names
        run = smp.launch(plan, data=data_file, steps=zoo.STEPS, loss=loss, threads=1, progress=False,
                         **({"dtype": "f64"} if c.arch.f64_oracle else {}))
        if label in TOKEN_PLANS:
            # the sequence was split: every rank all-gathers keys and values
            gathers = [r.get("context_gathers", 0) for r in run.report["ranks"]]
            if not all(g > 0 for g in gathers):
                failures.append(f"{label}: the ranks all-gathered {gathers} keys and values")
        rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, losses))
        if len(run.losses) != len(losses) or rel > LOSS_TOL:
            failures.append(f"{label}: losses differ by {rel:.2e}: runner {run.losses}, torch {losses}")
        loaded = smp.load_trained(copy.deepcopy(module), run)
        worst, errors = _compare(dict(loaded.named_parameters()), trained, gradfree, c.arch.weight_tol)
        failures += [f"{label}: {e}" for e in errors]
        failures += [f"{label}: buffer {e}" for e in _compare_buffers(dict(loaded.named_buffers()), buffers,
                                                                      WEIGHT_TOL)]
        logits_rel = _norm_rel(zoo.eval_logits(loaded, {k: v.to(oracle_dtype) if v.is_floating_point() else v
                                                        for k, v in c.data.items()}), eval_logits)
        if logits_rel > WEIGHT_TOL:
            failures.append(f"{label}: the loaded module's eval-mode output differs by {logits_rel:.2e}")
        worst = max(worst, logits_rel)
        # f64: the plan equals one process
        run64 = run if c.arch.f64_oracle else smp.launch(plan, data=data_file, steps=zoo.STEPS, loss=loss, threads=1,
                                                         dtype="f64", progress=False)
        rel64 = max(abs(a - b) / abs(b) for a, b in zip(run64.losses, exact_losses))
        if rel64 > EXACT_TOL:
            failures.append(f"{label} f64: losses differ from one process by {rel64:.2e}")
        prefix = plan.prefix
        # both in the module's layout, as the gradient-free masks are
        got64 = {k[len(prefix):]: v for k, v in in_module_layout(load_file(str(run64.trained)), c.exported.path).items()}
        want64 = {k[len(prefix):]: v for k, v in in_module_layout(exact, c.exported.path).items()}
        worst64, errors = _compare(got64, want64, dict(gradfree), EXACT_TOL)
        failures += [f"{label} f64: {e}" for e in errors]
        measured[label] = (rel, worst, rel64, worst64)
    print(f"{name}: " + "; ".join(f"{k} loss {v[0]:.1e} weights {v[1]:.1e} | f64 {v[2]:.1e} {v[3]:.1e}"
                                  for k, v in measured.items()))
    assert not failures, "\n".join(failures)


def test_the_encoder_output_reaches_every_stage_that_reads_it(tmp_path: Path) -> None:
    """T5 at pp 3, the encoder on stage 0 and one decoder block on each later stage: the
    encoder's output crosses two boundaries (its cross-attention reads it on stages 1 and 2),
    and training still equals PyTorch's."""
    c = _case("t5")
    plan = smp.plan(c.exported, zoo.inputs_of(c.data), cluster="cpu:3", global_batch=zoo.BATCH,
                    config={"pipeline_parallel_degree": 3, "microbatches": 2}, layout="0-2|3|4-5", workdir=tmp_path)
    names = _layer_names(plan)
    assert [names[s["layers"][0]:s["layers"][1] + 1] for s in plan.stages] == [
        ["embedding", "model.encoder.block.0", "model.encoder.block.1"], ["model.decoder.block.0"],
        ["model.decoder.block.1", "head"]]
    run = smp.launch(plan, data=c.data, steps=zoo.STEPS, loss="seq2seq", threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, c.losses))
    assert rel <= LOSS_TOL, (run.losses, c.losses)
    trained = smp.load_trained(copy.deepcopy(c.model), run)
    worst, errors = _compare(dict(trained.named_parameters()), c.trained, c.gradfree, c.arch.weight_tol)
    assert not errors, errors


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_per_head_norms_split_with_their_heads(name: str, tmp_path: Path) -> None:
    """Qwen3 normalises q and k over each head's dims: under Megatron's split each tensor rank
    holds its heads with their norms (q, k, v by columns, attention by heads), and trains as
    PyTorch does and, in f64, as one process."""
    import numpy as np

    c = _case(name)
    data = {k: v for k, v in c.data.items() if k in c.exported.input_names or k == "labels"}
    data_file = tmp_path / "data.npz"
    np.savez(data_file, **{k: v.numpy() for k, v in data.items()})
    plan = smp.plan(c.exported, zoo.inputs_of(c.data), cluster="cpu:2", global_batch=zoo.BATCH,
                    config={"tensor_parallel_degree": 2}, workdir=tmp_path / "tp2", baseline="megatron")
    block = next(layer for layer in plan.data["layer_strategies"] if ".layers.0" in layer["name"])
    kinds = [s for _, s in block["nodes"]]
    assert kinds.count("column") >= 3 and "heads" in kinds, block
    loss = zoo.RUNNER_LOSS[c.arch.task]
    run = smp.launch(plan, data=data_file, steps=zoo.STEPS, loss=loss, threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, c.losses))
    assert len(run.losses) == len(c.losses) and rel <= LOSS_TOL, (run.losses, c.losses)
    exact_losses, _ = _one_process_f64(c, data_file, tmp_path)
    run64 = smp.launch(plan, data=data_file, steps=zoo.STEPS, loss=loss, threads=1, dtype="f64", progress=False)
    rel64 = max(abs(a - b) / abs(b) for a, b in zip(run64.losses, exact_losses))
    assert rel64 <= EXACT_TOL, (run64.losses, exact_losses)
