"""DeepSeek-V3's latent attention as Hugging Face writes it, through the front door: the key is
built by slice assignments onto an empty tensor (`key[..., :nope] = k_nope; key[..., nope:] =
k_pe`), which the exporter writes as `ScatterND`s onto a `ConstantOfShape`. The planner reads
that chain as the `Concat` it computes, so under tensor parallelism the attention splits by
heads (`q_b_proj` and `kv_b_proj` by columns, the attention core by heads, `o_proj` by rows)
instead of staying whole. Checked: the runner's forward of the export (which rewrites the
chain) equals onnxruntime's of the export as written; the Megatron split at tp 2 trains 5 f32
steps within 1e-5 of PyTorch (losses; parameters within 1e-4 norm-relative) and, in f64, equals
one process (`smp-runner train --dtype f64`) within 1e-9."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

import smp_partition as smp
import zoo
from conftest import needs_runner

pytestmark = needs_runner

LOSS_TOL, WEIGHT_TOL, EXACT_TOL, EVAL_TOL = 1e-5, 1e-4, 1e-9, 1e-5


def _norm_rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _case_and_data(tmp_path: Path) -> tuple[zoo.Case, Path]:
    c = zoo.case("deepseek_v3")
    data = tmp_path / "data.npz"
    np.savez(data, **{k: v.numpy() for k, v in c.data.items() if k in c.exported.input_names or k == "labels"})
    return c, data


def test_the_slice_assigned_key_runs_as_onnxruntime_runs_the_export(tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    c, _ = _case_and_data(tmp_path)
    ops = [n.op_type for n in onnx.load(str(c.exported.path), load_external_data=False).graph.node]
    # one chain of two assignments per block
    assert ops.count("ScatterND") == 4 and "ConstantOfShape" in ops, sorted(set(ops))
    feeds = {k: v.numpy() for k, v in zoo.inputs_of(c.data).items() if k in c.exported.input_names}
    session = ort.InferenceSession(str(c.exported.path), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.savez(tmp_path / "in.npz", **feeds)
    done = subprocess.run([str(smp.find_binary("smp-runner")), "eval", str(c.exported.path), "--inputs",
                           str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    got = np.load(tmp_path / "out.npz")
    for name, w in want.items():
        rel = _norm_rel(got[name], w)
        assert rel <= EVAL_TOL, f"`{name}` differs from onnxruntime's by {rel:.2e}"


def _block_strategies(plan: smp.Plan) -> dict[str, list[tuple[str, str]]]:
    """Per block: the (node, strategy) of its attention's matmuls that choose a split."""
    out = {}
    for layer in plan.data["layer_strategies"]:
        if ".layers." in layer["name"]:
            out[layer["name"]] = [(n, s) for n, s in layer["nodes"] if s != "follow"]
    return out


def test_megatron_tp2_splits_the_attention_by_heads_and_trains_as_pytorch(tmp_path: Path) -> None:
    c, data = _case_and_data(tmp_path)
    plan = smp.plan(c.exported, zoo.inputs_of(c.data), cluster="cpu:2", global_batch=zoo.BATCH,
                    config={"tensor_parallel_degree": 2}, workdir=tmp_path / "tp2", baseline="megatron")
    blocks = _block_strategies(plan)
    assert len(blocks) == 2, blocks
    for name, nodes in blocks.items():
        # q_a replicated, q_b by columns, kv_a replicated, kv_b by columns, the core by heads,
        # o_proj by rows (then the MLP's or the shared expert's own)
        assert [s for _, s in nodes[:6]] == ["replicate", "column", "replicate", "column", "heads", "row"], (name, nodes)
    loss = zoo.RUNNER_LOSS[c.arch.task]
    run = smp.launch(plan, data=data, steps=zoo.STEPS, loss=loss, threads=1, progress=False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, c.losses))
    assert len(run.losses) == len(c.losses) and rel <= LOSS_TOL, (run.losses, c.losses)
    trained = smp.load_trained(copy.deepcopy(c.model), run)
    for n, p in trained.named_parameters():
        free = c.gradfree[n]
        g, w = p.detach().double()[~free], c.trained[n].double()[~free]
        if w.numel():
            r = float((g - w).norm() / w.norm().clamp_min(1e-30))
            assert r <= WEIGHT_TOL, f"`{n}` differs by {r:.2e}"
    # f64: the plan equals one process
    weights = tmp_path / "one-process.safetensors"
    done = subprocess.run([str(smp.find_binary("smp-runner")), "train", str(c.exported.path), "--data", str(data),
                           "--loss", loss, "--steps", str(zoo.STEPS), "--dtype", "f64", "--threads", "1", "--json",
                           "--save-weights", str(weights)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exact = [float(s["loss"]) for s in json.loads(done.stdout)["steps"]]
    run64 = smp.launch(plan, data=data, steps=zoo.STEPS, loss=loss, threads=1, dtype="f64", progress=False)
    rel64 = max(abs(a - b) / abs(b) for a, b in zip(run64.losses, exact))
    assert rel64 <= EXACT_TOL, (run64.losses, exact)
    got64, want64 = load_file(str(run64.trained)), load_file(str(weights))
    for n, w in want64.items():
        r = float((got64[n].double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
        assert r <= EXACT_TOL, f"f64 `{n}` differs from one process by {r:.2e}"
    print(f"deepseek_v3 megatron tp2: loss {rel:.1e}, f64 {rel64:.1e}")
