"""The bundled tiny Llama trained a few steps by DeepSpeed from the configuration `emit` writes
for a two-stage pipeline plan on two CPU ranks (Gloo), against `smp-runner` training the same
plan from the same weights on the same batch: the same losses, step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import MODELS, binary, smp

HERE = Path(__file__).resolve().parent
STEPS, BATCH, SEQ = 4, 8, 16


def runner(*args: str | Path, cwd: Path) -> str:
    cmd = [str(binary("smp-runner")), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def last_json(text: str) -> dict:
    return json.loads([l for l in text.splitlines() if l.startswith("{")][-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(dir, plan, data, initial weights, runner losses) of the tiny Llama at pp 2 on cpu:2."""
    d = tmp_path_factory.mktemp("tiny")
    model = MODELS / "llama.onnx"
    smp(model, "--cluster", "cpu:2", "--pp", "2", "--global-batch", str(BATCH), "--microbatches", "4",
        "--seq-len", str(SEQ), "-o", d / "plan.json")
    ids = np.random.default_rng(1).integers(0, 256, size=(BATCH, SEQ), dtype=np.int64)
    np.savez(d / "data.npz", input_ids=ids)
    # the model's own weights under its module's parameter names: no step taken
    runner("train", model, "--batch", str(BATCH), "--steps", "0", "--data", d / "data.npz",
           "--save-weights", d / "init.safetensors", "--json", cwd=d)
    # no clipping: DeepSpeed's pipeline engine clips by the first stage's gradient norm alone
    report = last_json(runner("launch", "--nproc", "2", d / "plan.json", "--steps", str(STEPS), "--data", d / "data.npz",
                              "--clip", "0", "--json", cwd=d))
    losses = [float(s["loss"]) for s in report["steps"]]
    return d, d / "plan.json", d / "data.npz", d / "init.safetensors", losses


def test_deepspeed_trains_the_emitted_pipeline_as_the_runner_does(tiny) -> None:
    d, plan, data, weights, expected = tiny
    emitted = d / "deepspeed"
    smp("emit", plan, "--engine", "deepspeed", "-o", emitted)
    out = d / "deepspeed-losses.json"
    # DeepSpeed builds its shared-memory op for the CPU with the venv's ninja
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 500), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"], str(HERE / "deepspeed_train.py"),
           "--emitted", str(emitted), "--weights", str(weights), "--data", str(data), "--steps", str(STEPS), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=d, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    got = json.loads(out.read_text())
    stages = sorted(json.loads(plan.read_text())["stages"], key=lambda s: s["index"])
    assert got["parts"] == [s["layers"][0] for s in stages] + [stages[-1]["layers"][1] + 1]
    assert len(got["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], expected), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: DeepSpeed {got['losses']}, smp-runner {expected}"
