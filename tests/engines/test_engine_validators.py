"""Every configuration `smp-partition emit` writes, fed to the engine's own parsing and
validation, and what the engine makes of it compared with the plan: Megatron's arguments read
by our own parser (megatron_args.py) into Megatron-Core 0.16's `TransformerConfig` (with its
`ModelParallelConfig` and `PipelineParallelLayerLayout`), its rank generator, microbatch
calculator and per-stage layer counts; torchtitan 0.3's `ConfigManager`, `ParallelDims`, its pipeline's stage
mapping and module split on the model built on the meta device; DeepSpeed 0.19's
`DeepSpeedConfig` and its pipeline partitioning functions.

The plans are conftest.py's: the bundled graph-only models and the published runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import megatron_args
from conftest import Planned, blocks_per_stage, layer_kinds, MODELS

HERE = Path(__file__).resolve().parent


def degrees(plan: dict[str, Any]) -> dict[str, Any]:
    p = plan["parallel"]
    return {k: p.get(k, 1) for k in ("pp", "tp", "dp", "cp", "ep")}


def virtual_stages(plan: dict[str, Any]) -> int:
    return int(plan["parallel"].get("virtual_stages", 1))


def recomputed_per_stage(plan: dict[str, Any], kinds: list[str]) -> list[int]:
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    return [sum(1 for l in s.get("checkpointed_layers", []) if kinds[l] == "block") for s in stages]


def launch_words(launch: str, files: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """A launch line's environment assignments and words, `$(cat FILE)` replaced by the file."""
    for name, text in files.items():
        launch = launch.replace(f"$(cat {name})", text.replace("\n", " "))
    words = shlex.split(launch)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def launcher_world(words: list[str]) -> int:
    """Processes a torchrun or deepspeed launcher starts."""
    def value(*names: str) -> int:
        for i, w in enumerate(words):
            for n in names:
                if w == n:
                    return int(words[i + 1].split(":")[-1])
                if w.startswith(n + "="):
                    return int(w.split("=", 1)[1].split(":")[-1])
        return 1
    return value("--nnodes", "--num_nodes") * value("--nproc-per-node", "--nproc_per_node", "--num_gpus")


# ---------------------------------------------------------------------------------------------
# Megatron-LM


def megatron_recomputed(config, blocks: list[int]) -> list[int]:
    """Layers Megatron-Core recomputes per (virtual) stage (full granularity)."""
    if config.recompute_granularity != "full":
        return [0] * len(blocks)
    if config.recompute_method == "uniform":
        return list(blocks)
    return [min(config.recompute_num_layers, b) for b in blocks]


def check_megatron(p: Planned) -> None:
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    e = p.emitted["megatron"]
    plan = p.sent["megatron"]
    env, words = launch_words(e["launch"], p.files("megatron"))
    world = launcher_world(words)
    assert world == p.plan["cluster"]["devices"], (world, e["launch"])
    script = words.index("pretrain_gpt.py")
    parsed = megatron_args.parse(words[script + 1:], env, world)
    config = megatron_args.transformer_config(parsed)
    args = parsed.args
    dp = megatron_args.data_parallel_group_size(parsed, config)
    d = degrees(plan)
    got = {"pp": config.pipeline_model_parallel_size, "tp": config.tensor_model_parallel_size, "dp": dp,
           "cp": config.context_parallel_size, "ep": config.expert_model_parallel_size}
    assert got == d, f"{p.case.name}: Megatron-Core runs {got}, the plan {d}"
    assert (config.virtual_pipeline_model_parallel_size or 1) == virtual_stages(plan)
    assert config.sequence_parallel == (plan["parallel"].get("sequence_parallel", False) and d["tp"] > 1)
    calc = ConstantNumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size, dp, False, 0)
    assert (args.global_batch_size, calc.num_micro_batches) == (plan["global_batch"], plan["parallel"]["microbatches"])
    blocks = blocks_per_stage(plan, p.kinds)
    if d["pp"] > 1:
        assert megatron_args.blocks_per_stage(config) == blocks, f"{p.case.name}: Megatron-Core's layers per stage"
    assert config.num_layers == sum(blocks)
    assert megatron_recomputed(config, blocks) == recomputed_per_stage(plan, p.kinds), p.case.name
    precision = plan["parallel"]["precision"]
    assert (config.bf16, config.fp16) == (precision in ("bf16", "bf16-mixed"), precision == "fp16-mixed")
    assert args.use_distributed_optimizer == (plan["parallel"]["zero"] == 1)
    assert args.use_megatron_fsdp == (plan["parallel"]["zero"] >= 2)
    # the gradients' type the plan priced: Megatron-LM's arguments.py turns fp32 main grads on
    # under --bf16 unless --grad-reduce-in-bf16, under --fp16 with
    # --accumulate-allreduce-grads-in-fp32
    fp32_grads = not args.grad_reduce_in_bf16 and (args.bf16 or args.accumulate_allreduce_grads_in_fp32)
    assert fp32_grads == plan["parallel"].get("fp32_main_grads", False), p.case.name
    # the dispatch the plan priced, and combined 1F1B where it priced the all-to-alls overlapped
    if d["ep"] > 1:
        assert config.moe_token_dispatcher_type in ("alltoall", "flex"), config.moe_token_dispatcher_type
    assert config.overlap_moe_expert_parallel_comm == plan["parallel"].get("expert_comm_overlap", False), p.case.name


# ---------------------------------------------------------------------------------------------
# torchtitan


# The compute capability of the plans' devices (H100: 9.0), which torchtitan's float8 converter
# (in its Llama 3 405B registration) asks of the machine; this one has no GPU.
PLANNED_CAPABILITY = (9, 0)


def torchtitan_parse(words: list[str]):
    import torch
    from torchtitan.components.quantization import float8
    from torchtitan.config import ConfigManager

    if not torch.cuda.is_available():
        float8.has_cuda_capability = lambda major, minor: PLANNED_CAPABILITY >= (major, minor)

    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return ConfigManager().parse_args(words)
        except SystemExit as e:
            raise ValueError(f"torchtitan's ConfigManager refused the arguments: {err.getvalue()[-2000:]}") from e


def torchtitan_model(config, blocks: int):
    """The config's model with `blocks` layers, on the meta device."""
    import copy

    import torch

    spec = config.model_spec
    model_config = copy.deepcopy(spec.model)
    if len(model_config.layers) != blocks:
        model_config.layers = [copy.deepcopy(model_config.layers[0]) for _ in range(blocks)]
    with torch.device("meta"):
        return model_config.build()


def check_torchtitan(p: Planned) -> None:
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed import pipeline_parallel as tpp
    from torchtitan.distributed.parallel_dims import ParallelDims

    e = p.emitted["torchtitan"]
    plan = p.sent["torchtitan"]
    env, words = launch_words(e["launch"], p.files("torchtitan"))
    world = launcher_world(words)
    assert world == p.plan["cluster"]["devices"]
    args = words[words.index("torchtitan.train") + 1:]
    registered = "MODULE" not in args
    if not registered:
        # torchtitan registers no model of this shape: its parallelism and training sections
        # are checked on Llama 3 8B's registration
        i = args.index("--module")
        args[i + 1] = "llama3"
        args[args.index("--config") + 1] = "llama3_8b"
    config = torchtitan_parse(args)
    par, tr = config.parallelism, config.training
    dims = ParallelDims.from_config(par, world)
    d = degrees(plan)
    assert (dims.pp, dims.tp, dims.cp, dims.ep, dims.dp_replicate * dims.dp_shard) == (d["pp"], d["tp"], d["cp"], d["ep"], d["dp"])
    zero = plan["parallel"]["zero"]
    assert dims.dp_shard * dims.cp > 1 or zero == 0 or d["dp"] * d["cp"] == 1, "ZeRO without FSDP"
    assert par.enable_sequence_parallel == (plan["parallel"].get("sequence_parallel", False) or d["tp"] == 1)
    # the trainer's batch arithmetic (trainer.py: global batch over local batch × batch degree)
    batch_degree = dims.dp_replicate * dims.dp_shard
    assert tr.global_batch_size % (tr.local_batch_size * batch_degree) == 0
    accumulation = tr.global_batch_size // (tr.local_batch_size * batch_degree)
    m = plan["parallel"]["microbatches"]
    if d["pp"] > 1:
        assert accumulation == 1 and tr.local_batch_size // par.pipeline_parallel_microbatch_size == m
        schedule = get_schedule_class(par.pipeline_parallel_schedule)
        parts = par.module_fqns_per_model_part
        per_rank = len(parts) // d["pp"]
        if issubclass(schedule, PipelineScheduleSingle):
            assert per_rank == 1
        assert per_rank == virtual_stages(plan)
        for r in range(d["pp"]):
            tpp._get_pp_rank_to_stage_indices_mapping(r, d["pp"], par.pipeline_parallel_schedule, len(parts))
        blocks = blocks_per_stage(plan, p.kinds)
        model = torchtitan_model(config, sum(blocks))
        # every module named exists, and every module of the model is in exactly one part
        named = [n for names in parts for n in names]
        for n in named:
            model.get_submodule(n)
        containers = (torch.nn.ModuleDict, torch.nn.ModuleList, tpp.ModuleDict, tpp.ModuleList)
        whole = []
        for n, c in model.named_children():
            whole += [f"{n}.{k}" for k, _ in c.named_children()] if isinstance(c, containers) else [n]
        assert sorted(named) == sorted(whole), f"{p.case.name}: parts {parts}"
        split = [tpp._split_module(model, names) for names in parts]
        got = [len(list(m.layers.children())) for m in split]
        assert got == blocks, f"{p.case.name}: torchtitan's module split {got}, the plan {blocks}"
    else:
        assert accumulation == m
    assert tr.global_batch_size == plan["global_batch"]
    recompute = any(recomputed_per_stage(plan, p.kinds))
    ac = type(config.activation_checkpoint).__qualname__ if config.activation_checkpoint is not None else None
    assert ac == ("FullAC.Config" if recompute else None), ac
    # the TOML says what the command line says
    toml = tomllib.loads(p.files("torchtitan")["torchtitan.toml"])
    for section, entries in toml.items():
        for key, value in entries.items():
            if (section, key) == ("activation_checkpoint", "mode"):
                assert value == ("full" if recompute else "none")
                continue
            assert getattr(getattr(config, section), key) == value, f"[{section}] {key}"


# ---------------------------------------------------------------------------------------------
# DeepSpeed


class DataParallelOnly:
    """The model-parallel unit DeepSpeed's config reads its data-parallel size from."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture(scope="module")
def deepspeed_comm():
    import deepspeed

    # DeepSpeed builds its shared-memory op for the CPU with the venv's ninja
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, rank=0, world_size=1, verbose=False)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def check_deepspeed(p: Planned) -> None:
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.config import DeepSpeedConfig

    e = p.emitted["deepspeed"]
    plan = p.sent["deepspeed"]
    files = p.files("deepspeed")
    _, words = launch_words(e["launch"], files)
    assert launcher_world(words) == p.plan["cluster"]["devices"]
    raw = json.loads(files["ds_config.json"])
    d = degrees(plan)
    cfg = DeepSpeedConfig(raw, mpu=DataParallelOnly(d["dp"]))
    m = plan["parallel"]["microbatches"]
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (plan["global_batch"], m)
    assert cfg.train_micro_batch_size_per_gpu * m * d["dp"] == plan["global_batch"]
    assert cfg.zero_optimization_stage == plan["parallel"]["zero"]
    precision = plan["parallel"]["precision"]
    assert (cfg.bfloat16_config.enabled, cfg.float16_config.enabled) == (precision in ("bf16", "bf16-mixed"), precision == "fp16-mixed")
    # fp32 gradients: DeepSpeed's BF16 optimizer, which it picks for bf16 at ZeRO 1 alone
    fp32_grads = cfg.grad_accum_dtype in ("fp32", "float32", "float", "torch.float32")
    assert fp32_grads == plan["parallel"].get("fp32_main_grads", False), f"{p.case.name}: grad_accum_dtype {cfg.grad_accum_dtype}"
    if fp32_grads:
        assert cfg.bfloat16_config.enabled and cfg.zero_optimization_stage == 1
    if d["tp"] > 1:
        assert cfg.tensor_parallel_config.autotp_size == d["tp"]
    if d["ep"] > 1:
        # AutoEP's own checks (its folding over the tensor ranks at pp 1, expert-tensor 1), as
        # DeepSpeedEngine runs them before building its groups
        from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

        autoep = parse_autoep_config(raw["expert_parallel"])
        assert autoep.enabled and autoep.autoep_size == d["ep"]
        validate_autoep_config(autoep, p.plan["cluster"]["devices"], d["pp"], d["tp"], d["cp"], zero_stage=cfg.zero_optimization_stage)
        if d["tp"] > 1:
            # folded: whole experts, the expert group over the stage's tensor × data ranks
            assert plan["parallel"].get("etp", d["tp"]) == 1, p.case.name
    if d["cp"] > 1:
        # deepspeed.initialize's (data, sequence) mesh
        assert (raw["data_parallel_size"], raw["sequence_parallel_size"]) == (d["dp"], d["cp"])
    pipe = cfg.pipeline
    assert pipe["stages"] == d["pp"]
    if d["pp"] > 1:
        # DeepSpeed's PipelineEngine refuses ZeRO 2 and 3 with a pipeline
        assert cfg.zero_optimization_stage < 2
        stages = sorted(plan["stages"], key=lambda s: s["index"])
        bounds = [s["layers"][0] for s in stages] + [stages[-1]["layers"][1] + 1]
        method = pipe["partition"]
        n = len(p.kinds)
        if method == "uniform":
            parts = ds_utils.partition_uniform(num_items=n, num_parts=d["pp"])
        elif method == "parameters":
            graph = layer_params(MODELS / p.case.model)
            parts = ds_utils.partition_balanced(weights=graph, num_parts=d["pp"])
        else:
            parts = list(method)
        assert list(parts) == bounds, f"{p.case.name}: DeepSpeed's partition {parts}, the plan's {bounds}"
        recompute = any(recomputed_per_stage(plan, p.kinds))
        assert pipe["activation_checkpoint_interval"] == int(recompute)
    # the pipeline module file is Python that defines the planned module
    namespace: dict[str, Any] = {}
    exec(compile(files["deepspeed_pipeline.py"], "deepspeed_pipeline.py", "exec"), namespace)
    from deepspeed.pipe import PipelineModule

    assert issubclass(namespace["PlannedPipeline"], PipelineModule)


_params_cache: dict[str, list[int]] = {}


def layer_params(model: Path) -> list[int]:
    from conftest import smp

    key = str(model)
    if key not in _params_cache:
        _params_cache[key] = [l["params"] for l in json.loads(smp("graph", model, "--json"))["layers"]]
    return _params_cache[key]


# ---------------------------------------------------------------------------------------------


def test_megatron_core_accepts_every_emitted_argument_list(planned: list[Planned]) -> None:
    for p in planned:
        check_megatron(p)


def test_torchtitan_accepts_every_emitted_job(planned: list[Planned]) -> None:
    for p in planned:
        check_torchtitan(p)


def test_deepspeed_accepts_every_emitted_config(planned: list[Planned], deepspeed_comm) -> None:
    for p in planned:
        check_deepspeed(p)


def test_megatron_core_refuses_broken_argument_lists(planned: list[Planned]) -> None:
    """The Megatron check has teeth: an emitted list with one change Megatron-Core refuses."""
    import re

    def refused(p: Planned, edit) -> str:
        env, words = launch_words(p.emitted["megatron"]["launch"], p.files("megatron"))
        world = launcher_world(words)
        words = edit(words[words.index("pretrain_gpt.py") + 1:])
        with pytest.raises(megatron_args.MegatronRefused) as e:
            parsed = megatron_args.parse(words, env, world)
            megatron_args.blocks_per_stage(megatron_args.transformer_config(parsed))
        return str(e.value)

    def set_flag(flag: str, value: str):
        def edit(words: list[str]) -> list[str]:
            i = words.index(flag)
            return words[:i + 1] + [value] + words[i + 2:]
        return edit

    def with_layout(p: Planned) -> bool:
        return "--pipeline-model-parallel-layout" in p.files("megatron")["megatron.args"]

    def with_first_last(p: Planned) -> bool:
        return "--decoder-first-pipeline-num-layers" in p.files("megatron")["megatron.args"]

    layout = next(p for p in planned if with_layout(p))
    text = layout.files("megatron")["megatron.args"]
    s = re.search(r"--pipeline-model-parallel-layout '?([^'\n]+)'?", text).group(1)
    one_less = re.sub(r"t\*(\d+)", lambda m: f"t*{int(m.group(1)) - 1}", s, count=1)
    assert "decoder layers" in refused(layout, set_flag("--pipeline-model-parallel-layout", one_less))
    uneven = next(p for p in planned if with_first_last(p))
    first = int(re.search(r"--decoder-first-pipeline-num-layers (\d+)", uneven.files("megatron")["megatron.args"]).group(1))
    assert "middle" in refused(uneven, set_flag("--decoder-first-pipeline-num-layers", str(first + 1)))
    tp8 = next(p for p in planned if degrees(p.sent["megatron"])["tp"] == 8)
    assert "tensor_model_parallel_size" in refused(tp8, set_flag("--num-attention-heads", "12"))
