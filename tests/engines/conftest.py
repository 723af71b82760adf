"""The plans whose engine configurations the engines' own code checks: the bundled graph-only
models (Llama 3 8B/70B, GPT-3 175B, Mixtral 8x7B), one request per kind of plan, and the
published runs of tests/published_runs.rs (three of Megatron-LM's Table 1 rows as `--baseline
megatron`, Llama 3 405B on 8,192 H100s), each planned and emitted for Megatron-LM, torchtitan
and DeepSpeed by the binaries of this checkout (`smp-partition`, `emit --json`).

Runs in .venv-engines (`make test`): megatron-core, torchtitan and DeepSpeed as
requirements-engines.lock pins them.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
ENGINES = ("megatron", "torchtitan", "deepspeed")


def binary(name: str) -> Path:
    """A binary of this checkout: $SMP_BIN_DIR, else target/debug."""
    d = Path(os.environ.get("SMP_BIN_DIR", REPO / "target" / "debug"))
    path = d / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it first (cargo build --features runner), or set SMP_BIN_DIR")
    return path


def smp(*args: str | Path) -> str:
    """`smp-partition ARGS`: its stdout; a failure fails the test with its stderr."""
    cmd = [str(binary("smp-partition")), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


@dataclass(frozen=True)
class Case:
    """A plan request: model, cluster and planner flags."""

    name: str
    model: str
    cluster: str
    flags: tuple[str, ...] = ()


def _gb(flags: list[str]) -> tuple[str, ...]:
    return ("--global-batch", "512", *flags)


# One request per kind of plan the writers treat differently, on each bundled model (the
# round trips of tests/engines.rs cover every request; these are what the engines' own code
# checks): automatic plans (their gaps and nearest plans), fp16 with ZeRO 1 at pp 2, context
# parallelism with ZeRO 3, interleaving with full recompute, 1F1B across spread ranks, experts
# (carved from the data ranks and folded over tensor × data ranks; their all-to-alls overlapped
# as combined 1F1B runs them; after dense blocks), Float8 linears.
# Llama 3 405B is the published run below; a 1F1B pipeline with ZeRO 1 is Mixtral's.
BUNDLED = [
    Case("llama3-8b automatic", "llama3-8b.onnx", "h100-80gb:64", _gb([])),
    Case("llama3-8b pp 2 tp 4 zero 1 fp16", "llama3-8b.onnx", "h100-80gb:64",
         _gb(["--pp", "2", "--tp", "4", "--zero", "1", "--precision", "fp16-mixed"])),
    Case("llama3-8b tp 8 cp 2 zero 3", "llama3-8b.onnx", "h100-80gb:64", _gb(["--pp", "1", "--tp", "8", "--cp", "2", "--zero", "3"])),
    Case("llama3-70b pp 4 interleaved:2 full recompute", "llama3-70b.onnx", "h100-80gb:512",
         _gb(["--pp", "4", "--tp", "8", "--schedule", "interleaved:2", "--checkpointing", "full"])),
    Case("llama3-70b pp 8 tp 4 1f1b spread", "llama3-70b.onnx", "h100-80gb:512",
         _gb(["--pp", "8", "--tp", "4", "--schedule", "1f1b", "--placement", "spread"])),
    Case("gpt3-175b automatic", "gpt3-175b.onnx", "h100-80gb:512", _gb([])),
    Case("mixtral-8x7b automatic", "mixtral-8x7b.onnx", "h100-80gb:512", _gb([])),
    Case("mixtral-8x7b pp 2 ep 8 zero 1", "mixtral-8x7b.onnx", "h100-80gb:512",
         _gb(["--pp", "2", "--tp", "1", "--ep", "8", "--zero", "1", "--schedule", "1f1b"])),
    # expert groups folded over tensor × data ranks (Megatron's --expert-tensor-parallel-size 1,
    # torchtitan's expert placement under tensor parallelism)
    Case("mixtral-8x7b pp 2 tp 2 ep 8 etp 1 zero 1", "mixtral-8x7b.onnx", "h100-80gb:512",
         _gb(["--pp", "2", "--tp", "2", "--ep", "8", "--etp", "1", "--zero", "1", "--schedule", "1f1b"])),
    # Megatron-Core's combined 1F1B: the expert all-to-alls priced beside another microbatch's
    # compute (interleaved, no full recompute, as its TransformerConfig demands)
    Case("mixtral-8x7b pp 2 interleaved:2 ep 8 combined 1F1B", "mixtral-8x7b.onnx", "h100-80gb:512",
         ("--global-batch", "2048", "--microbatches", "8", "--pp", "2", "--tp", "1", "--ep", "8", "--zero", "1",
          "--schedule", "interleaved:2", "--checkpointing", "none", "--overlap-expert-comm")),
    # the blocks' linears in fp8 (Megatron's --fp8-format; a gap elsewhere)
    Case("llama3-8b tp 2 float8 linears", "llama3-8b.onnx", "h100-80gb:64", _gb(["--pp", "1", "--tp", "2", "--float8-linears"])),
    # experts after dense blocks (Megatron's --moe-layer-freq)
    Case("deepseek-v3 ep 8", "deepseek-v3.onnx", "h100-80gb:256",
         ("--global-batch", "1024", "--pp", "1", "--tp", "1", "--ep", "8", "--zero", "3", "--memory-limit", "1000000")),
]

# tests/common/table1.rs, one row per shape of Megatron's rule: name, t, p, gpus, batch,
# microbatch size, interleaving (tensor parallelism alone; a 1F1B pipeline; interleaved 1F1B)
TABLE1 = [
    ("1.7B", 1, 1, 32, 512, 16, 1), ("39.1B", 8, 2, 512, 1536, 4, 1), ("76.1B", 8, 4, 1024, 1792, 2, 3),
]


def _table1(name: str, t: int, p: int, gpus: int, batch: int, mbs: int, v: int) -> Case:
    d = gpus // (t * p)
    return Case(f"Megatron-LM Table 1 {name}", f"megatron/gpt-{name}.onnx", f"a100-80gb:{gpus}", (
        "--global-batch", str(batch), "--seq-len", "2048", "--baseline", "megatron", "--tp", str(t), "--pp", str(p),
        "--dp", str(d), "--microbatches", str(batch // (d * mbs)), "--schedule", f"interleaved:{v}" if v > 1 else "1f1b",
        "--checkpointing", "full"))


PUBLISHED = [_table1(*r) for r in TABLE1] + [
    Case("Llama 3 405B on 8,192 H100s", "llama3-405b.onnx", "h100-80gb:8192",
         ("--global-batch", "2048", "--seq-len", "8192", "--baseline", "uniform", "--tp", "8", "--pp", "16", "--dp", "64")),
]

CASES = BUNDLED + PUBLISHED


@dataclass
class Planned:
    """A case planned, with its model's layer kinds and each engine's emission (`emit --json`)."""

    case: Case
    dir: Path
    plan: dict[str, Any]
    kinds: list[str]
    emitted: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def sent(self) -> dict[str, dict[str, Any]]:
        """Per engine, the plan its configuration runs (the nearest plan where a gap changed it)."""
        return {e: (x["nearest"] or self.plan) for e, x in self.emitted.items()}

    def files(self, engine: str) -> dict[str, str]:
        return {f["name"]: f["text"] for f in self.emitted[engine]["files"]}


def blocks_per_stage(plan: dict[str, Any], kinds: list[str]) -> list[int]:
    """Transformer blocks of each (virtual) stage, in pipeline order."""
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    return [sum(1 for l in range(s["layers"][0], s["layers"][1] + 1) if kinds[l] == "block") for s in stages]


_kinds_cache: dict[str, list[str]] = {}


def layer_kinds(model: Path) -> list[str]:
    key = str(model)
    if key not in _kinds_cache:
        graph = json.loads(smp("graph", model, "--json"))
        _kinds_cache[key] = [l["kind"] for l in graph["layers"]]
    return _kinds_cache[key]


@pytest.fixture(scope="session")
def planned(tmp_path_factory: pytest.TempPathFactory) -> list[Planned]:
    """Every case planned and emitted for the three engines."""
    out = []
    root = tmp_path_factory.mktemp("engines")
    for i, case in enumerate(CASES):
        d = root / f"case{i:02d}"
        d.mkdir()
        model = MODELS / case.model
        smp(model, "--cluster", case.cluster, *case.flags, "-o", d / "plan.json")
        p = Planned(case, d, json.loads((d / "plan.json").read_text()), layer_kinds(model))
        for engine in ENGINES:
            p.emitted[engine] = json.loads(smp("emit", d / "plan.json", "--engine", engine, "--json", "-o", d / engine))
        out.append(p)
    return out
