"""`smp.launch(verify=...)` / `smp-runner launch --verify`: a plan against one process in f64
on the user's batch, before the run."""

from __future__ import annotations

import pytest
import torch

import smp_partition as smp
from conftest import needs_runner

pytestmark = needs_runner


def test_a_right_plan_verifies_and_then_runs(gpt2_plan) -> None:
    model, batch, plan = gpt2_plan
    run = smp.launch(plan, data=batch, steps=2, verify=2, progress=False)
    v = run.verify
    assert v is not None and v["passed"], v
    assert v["steps"] == 2 and len(v["plan_losses"]) == 2 == len(v["one_process_losses"])
    # every parameter compared, each difference f64 rounding
    assert v["tensors"] >= len(dict(model.named_parameters())) - 1, v
    for what in ("loss", "parameters"):
        assert 0.0 <= v[what]["rel"] <= v["tolerance"], v
    # the model's own f32 rounding, measured beside: f32 differs from f64, GPT-2 not chaotically
    assert v["tolerance"] < v["f32_drift"]["rel"] < 1e-5 and v["f32_parameter_drift"]["rel"] > 0, v
    assert len(run.losses) == 2


class _Cnn(torch.nn.Module):
    """A convolution, BatchNorm and a classifier: running statistics to verify."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(pixel_values))).flatten(1))


def _cnn_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}


def test_buffers_are_verified_and_a_difference_the_plan_announces_is_named(tmp_path) -> None:
    torch.manual_seed(0)
    model, batch = _Cnn(), _cnn_batch()
    inputs = {"pixel_values": batch["pixel_values"]}
    # pp 2 with two microbatches: one process with two microbatches computes the same statistics
    plan = smp.plan(model, inputs, cluster="cpu:2", global_batch=4, workdir=tmp_path / "pp",
                    config={"pipeline_parallel_degree": 2, "microbatches": 2})
    v = smp.verify_plan(plan, data=batch, steps=2, loss="cross-entropy", threads=1)
    assert v["passed"] and v["buffers"] is not None and v["buffers"]["rel"] <= v["tolerance"], v
    # dp 2: each replica's statistics are its half batch's, which the plan warns of
    plan = smp.plan(model, inputs, cluster="cpu:2", global_batch=4, workdir=tmp_path / "dp",
                    config={"ddp": True, "pipeline_parallel_degree": 1, "tensor_parallel_degree": 1})
    if plan.parallel.dp != 2:
        pytest.skip(f"the planner chose {plan.parallel}")
    v = smp.verify_plan(plan, data=batch, steps=2, loss="cross-entropy", threads=1)
    assert not v["passed"] and "BatchNorm" in v["expected_difference"], v
    assert v["buffers"]["rel"] > v["tolerance"], v
