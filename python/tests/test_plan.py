from __future__ import annotations

import json
import subprocess

import onnx

import smp_partition as smp
from smp_partition import param_record


def test_plan_honours_the_smp_config_and_exposes_the_file(gpt2_plan) -> None:
    _, batch, plan = gpt2_plan
    data = json.loads(plan.path.read_text())
    assert (plan.parallel.pp, plan.parallel.microbatches) == (2, 4)
    assert plan.parallel.devices == plan.devices == 2
    assert plan.global_batch == 8 and plan.seq_len == batch.shape[1]
    assert plan.predicted.step_time_s == data["predicted"]["step_time_s"] > 0
    assert plan.predicted.peak_memory_bytes == data["predicted"]["peak_memory_bytes"]
    assert [s["layers"] for s in plan.stages] == [s["layers"] for s in data["stages"]]
    assert plan.input_names == ["input_ids"]


def test_repr_is_the_inspect_table(gpt2_plan) -> None:
    plan = gpt2_plan[2]
    inspect = subprocess.run([str(smp.find_binary("smp-partition")), "inspect", str(plan.path)],
                             capture_output=True, text=True, check=True).stdout
    assert repr(plan) == inspect
    assert "pp 2" in inspect


def test_export_is_dynamic_and_carries_the_parameter_record(gpt2_plan) -> None:
    model, _, plan = gpt2_plan
    proto = onnx.load(str(plan.model_path))
    dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert all(dims) and len(set(dims)) == 2, dims  # symbolic batch and sequence
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["smp.param_record"] == "1" and json.loads(meta["smp.missing"]) == []
    # every module parameter is named by the record (the one implementation's reader)
    named = set()
    for rec in param_record.read_record(proto).values():
        if rec.get("smp.kind") == "parameter":
            for aliases in json.loads(rec["smp.params"]):
                named.update(aliases)
    expected = {plan.prefix + n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert named == expected


def test_bad_config_names_the_setting(gpt2_plan, tmp_path) -> None:
    import pytest

    with pytest.raises(smp.CommandError, match="tensor_parallel_degree"):
        smp.plan(gpt2_plan[2].model_path, cluster="cpu:2", global_batch=8, seq_len=16,
                 config={"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, workdir=tmp_path)


def test_precision_keyword_and_smp_keys_reach_the_plan(gpt2_plan, tmp_path) -> None:
    import pytest

    model = gpt2_plan[2].model_path
    # the cpu cluster's default is f32; a GPU preset's bf16-mixed
    assert gpt2_plan[2].parallel.precision == "f32"
    gpu = smp.plan(model, cluster="h100-80gb:2", global_batch=8, seq_len=16, workdir=tmp_path / "gpu")
    assert gpu.parallel.precision == "bf16-mixed"
    kw = smp.plan(model, cluster="cpu:2", global_batch=8, seq_len=16, precision="bf16", workdir=tmp_path / "kw")
    assert kw.parallel.precision == json.loads(kw.path.read_text())["parallel"]["precision"] == "bf16"
    fp16 = smp.plan(model, cluster="h100-80gb:2", global_batch=8, seq_len=16, config={"fp16": True},
                    workdir=tmp_path / "fp16")
    assert fp16.parallel.precision == "fp16-mixed"
    with pytest.raises(smp.CommandError, match="bf16"):
        smp.plan(model, cluster="cpu:2", global_batch=8, seq_len=16, precision="f32", config={"bf16": True},
                 workdir=tmp_path / "both")


def test_overlap_keywords_reach_the_plan(gpt2_plan, tmp_path) -> None:
    model = gpt2_plan[2].model_path
    plain = smp.plan(model, cluster="h100-80gb:2", global_batch=8, seq_len=16, dp=2, workdir=tmp_path / "plain")
    beside = smp.plan(model, cluster="h100-80gb:2", global_batch=8, seq_len=16, dp=2, overlap_grad_sync=True,
                      workdir=tmp_path / "beside")
    assert not plain.parallel.grad_sync_overlap and beside.parallel.grad_sync_overlap
    assert beside.predicted.step_time_s <= plain.predicted.step_time_s
    assert not beside.parallel.expert_comm_overlap


def test_emit_writes_the_engine_configuration_that_reads_back(gpt2_plan, tmp_path) -> None:
    plan = gpt2_plan[2]
    cfg = plan.emit("megatron", tmp_path / "megatron")
    assert isinstance(cfg, smp.EngineConfig) and cfg.engine == "megatron"
    args = cfg.files["megatron.args"]
    assert (tmp_path / "megatron" / "megatron.args").read_text() == args
    assert "--pipeline-model-parallel-size 2" in args.splitlines()
    assert "pretrain_gpt.py $(cat megatron.args)" in cfg.launch and cfg.notes
    # read back as a team's configuration: the same plan
    binary = str(smp.find_binary("smp-partition"))
    done = subprocess.run([binary, str(plan.model_path), "--from-engine", f"megatron:{tmp_path / 'megatron' / 'megatron.args'}",
                           "--cluster", "cpu:2", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    back = json.loads(done.stdout)
    assert [s["layers"] for s in back["stages"]] == [s["layers"] for s in plan.stages]
    assert (back["parallel"]["pp"], back["parallel"]["microbatches"]) == (plan.parallel.pp, plan.parallel.microbatches)
    if not cfg.gaps:
        assert abs(back["predicted"]["step_time_s"] / plan.predicted.step_time_s - 1) <= 1e-3
    assert cfg.write(tmp_path / "again") == [tmp_path / "again" / "megatron.args"]


def test_emit_names_and_prices_what_the_engine_cannot_express(gpt2_plan, tmp_path) -> None:
    gpipe = smp.plan(gpt2_plan[2].model_path, cluster="cpu:2", global_batch=8, seq_len=16, pp=2, microbatches=4,
                     schedule="gpipe", workdir=tmp_path)
    cfg = gpipe.emit("deepspeed")
    gap = next(g for g in cfg.gaps if "gpipe" in g.chose.lower())
    assert gap.priced and gap.step_time_s is not None and "1F1B" in gap.nearest
    assert cfg.nearest is not None and cfg.nearest["parallel"]["schedule"] == "1f1b"
    assert cfg.step_time_s == cfg.nearest["predicted"]["step_time_s"]
    assert cfg.plan_step_time_s == gpipe.predicted.step_time_s
    assert "cannot express" in str(cfg) and "ds_config.json" in cfg.files
