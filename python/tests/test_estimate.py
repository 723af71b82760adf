from __future__ import annotations

import pytest

import smp_partition as smp


def test_estimate_of_the_planned_configuration_is_the_plans_prediction(gpt2_plan, tmp_path) -> None:
    _, batch, plan = gpt2_plan
    p, stages = plan.data["parallel"], plan.data["stages"]
    recomputed = [l for s in stages for l in s["checkpointed_layers"]]
    selective = [l for s in stages for l in s.get("selective_layers", [])]
    schedule = p["schedule"] if p["schedule"] != "interleaved" else f"interleaved:{p['virtual_stages']}"
    e = smp.estimate(plan.model_path, batch, cluster="cpu:2", global_batch=8,
                     config={"pipeline_parallel_degree": 2, "microbatches": 4}, workdir=tmp_path,
                     schedule=schedule, zero=p["zero"], placement=p["placement"],
                     layout="|".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in stages),
                     recompute_layers=",".join(map(str, recomputed)) or "none",
                     **({"selective_layers": ",".join(map(str, selective))} if selective else {}),
                     offload_activations="on" if any(s.get("offloaded_layers") for s in stages) else "off")
    assert e.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert [r.memory.total for r in e.ranks] == [s["memory_bytes"]["total"] for s in stages]
    assert e.fits and e.over_by_bytes == 0 and e.parallel["pp"] == 2
    assert all(r.headroom_bytes == e.capacity_bytes - r.memory.total for r in e.ranks)
    assert "predicted   step" in repr(e)


def test_a_configuration_that_cannot_be_expressed_names_the_setting(gpt2_plan, tmp_path) -> None:
    plan = gpt2_plan[2]
    with pytest.raises(smp.CommandError, match="--microbatches"):
        smp.estimate(plan.model_path, cluster="cpu:2", global_batch=8, seq_len=16, pp=2, workdir=tmp_path)
