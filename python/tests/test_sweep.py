from __future__ import annotations

import xml.etree.ElementTree as ET

import smp_partition as smp


def test_sweep_rows_equal_single_plans_and_the_chart_parses(gpt2_plan, tmp_path) -> None:
    plan = gpt2_plan[2]
    svg = tmp_path / "sweep.svg"
    result = smp.sweep(plan.model_path, clusters=["a100-80gb:1,2", "h100-80gb:2"], global_batch=8, seq_len=16,
                       svg=svg, workdir=tmp_path)
    assert [r["cluster"] for r in result.rows] == ["a100-80gb:1", "a100-80gb:2", "h100-80gb:2"]
    for row in result.rows:
        single = smp.plan(plan.model_path, cluster=row["cluster"], global_batch=8, seq_len=16,
                          workdir=tmp_path / row["cluster"].replace(":", "-"))
        assert (row["pp"], row["tp"], row["dp"]) == (single.parallel.pp, single.parallel.tp, single.parallel.dp)
        assert row["step_time_s"] == single.predicted.step_time_s
        assert row["cost_per_step_usd"] > 0
    assert repr(result).splitlines()[0].startswith("cluster")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "a100-80gb" in texts and "h100-80gb" in texts
    assert result.best()["cost_per_million_tokens_usd"] == min(r["cost_per_million_tokens_usd"] for r in result.rows)
