"""Our own reading of the `pretrain_gpt.py` argument lists `smp-partition emit --engine megatron`
writes, built into Megatron-Core 0.16's own configuration classes so that their validation
checks them.

`parse` knows exactly the flags our writer emits (names and meanings as Megatron-LM documents
them; any other flag is refused), applies the few cross-argument rules Megatron-LM states for
them (world size over the model-parallel degrees, the fused-kernel environment, learned
positions covering the sequence), and `transformer_config` builds Megatron-Core's
`TransformerConfig` — a `ModelParallelConfig` with its tensor, pipeline, virtual, context and
expert degrees, sequence parallelism, the experts' dispatcher and combined 1F1B, recompute and
precision — whose `__post_init__` checks them
and builds the `PipelineParallelLayerLayout` of a layout string or the uneven first and last
stages. The process-group layout is Megatron-Core's `RankGenerator`; the microbatch count its
`ConstantNumMicroBatchesCalculator`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from dataclasses import dataclass
from typing import Any


class MegatronRefused(ValueError):
    """What Megatron-LM or Megatron-Core refuses in an argument list."""


def _moe_layer_freq(text: str):
    """`--moe-layer-freq` as Megatron-LM's `moe_freq_type` reads it: an integer, or a Python
    expression of a list of 0 and 1 (`([0]*3+[1]*58)`)."""
    if text.isdigit():
        return int(text)
    value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - Megatron-LM evaluates it so
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{text}: not a list of 0 and 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, exit_on_error=False)
    ints = [
        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
        "--kv-channels", "--seq-length", "--max-position-embeddings", "--num-experts", "--moe-router-topk",
        "--moe-ffn-hidden-size", "--vocab-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
        "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--context-parallel-size", "--expert-model-parallel-size",
        "--expert-tensor-parallel-size", "--micro-batch-size", "--global-batch-size", "--recompute-num-layers",
    ]
    for flag in ints:
        p.add_argument(flag, type=int)
    for flag in [
        "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--sequence-parallel", "--use-tp-pp-dp-mapping", "--use-distributed-optimizer", "--use-megatron-fsdp",
        "--bf16", "--fp16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
        "--overlap-moe-expert-parallel-comm",
    ]:
        p.add_argument(flag, action="store_true")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--tokenizer-type", choices=["NullTokenizer"])
    p.add_argument("--pipeline-model-parallel-layout")
    p.add_argument("--cp-comm-type", choices=["p2p", "a2a", "all_gather", "a2a+p2p"], default="p2p")
    p.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--data-parallel-sharding-strategy", choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--ckpt-format", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"], default="torch_dist")
    p.add_argument("--initial-loss-scale", type=float)
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    p.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=1)
    p.add_argument("--data-path", nargs="+")
    return p


@dataclass
class Parsed:
    """An argument list read: the flags' values and what Megatron-LM derives from them."""

    args: argparse.Namespace
    world: int
    data_parallel: int
    expert_data_parallel: int
    rank_order: str


def parse(words: list[str], env: dict[str, str], world: int) -> Parsed:
    """Our reading of `pretrain_gpt.py WORDS` on `world` processes with environment `env`."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = _parser().parse_args(words)
        except (argparse.ArgumentError, SystemExit) as e:
            raise MegatronRefused(f"not an argument list our writer emits: {e} {err.getvalue().strip()}") from e

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise MegatronRefused(why)

    a = args
    need(a.num_layers and a.hidden_size and a.num_attention_heads and a.seq_length, "the model's shape flags are missing")
    # gpt_layer_specs.py: a pattern names every layer
    need(not isinstance(a.moe_layer_freq, list) or len(a.moe_layer_freq) == a.num_layers,
         f"Invalid length of moe_layer_pattern: {len(a.moe_layer_freq) if isinstance(a.moe_layer_freq, list) else 0}, expected {a.num_layers}")
    need(a.micro_batch_size is not None and a.global_batch_size is not None, "--micro-batch-size and --global-batch-size are required")
    need(not (a.bf16 and a.fp16), "--bf16 and --fp16 exclude each other")
    need(a.num_query_groups is None or a.group_query_attention, "--num-query-groups takes effect only with --group-query-attention")
    need(a.tokenizer_type != "NullTokenizer" or a.vocab_size, "NullTokenizer needs --vocab-size")
    if a.position_embedding_type == "learned_absolute":
        need((a.max_position_embeddings or 0) >= a.seq_length, "learned positions must cover --seq-length")
    tp, pp, cp = a.tensor_model_parallel_size or 1, a.pipeline_model_parallel_size or 1, a.context_parallel_size or 1
    ep = a.expert_model_parallel_size or 1
    etp = a.expert_tensor_parallel_size or tp
    need(world % (tp * pp * cp) == 0, f"world size {world} is not divisible by tp × pp × cp = {tp * pp * cp}")
    need(world % (etp * ep * pp) == 0, f"world size {world} is not divisible by expert tp × ep × pp = {etp * ep * pp}")
    need(ep == 1 or a.num_experts, "--expert-model-parallel-size needs --num-experts")
    need(not a.num_experts or a.num_experts % ep == 0, "--num-experts must be divisible by --expert-model-parallel-size")
    if a.num_virtual_stages_per_pipeline_rank is not None:
        need(pp > 1, "virtual pipeline stages need pipeline parallelism")
    if cp > 1:
        need(a.seq_length % (2 * cp) == 0, "--seq-length must be divisible by 2 × context parallel size (load balancing)")
    if a.use_megatron_fsdp:
        need(a.ckpt_format == "fsdp_dtensor", "Megatron-FSDP saves only --ckpt-format fsdp_dtensor")
        need(pp == 1, "Megatron-FSDP does not run with pipeline parallelism")
        need(env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1", "Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1")
    elif tp > 1 or cp > 1:
        need(env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "tensor or context parallelism before Blackwell needs CUDA_DEVICE_MAX_CONNECTIONS=1")
    if a.sequence_parallel and tp == 1:
        # Megatron-LM turns it off where there is no tensor parallelism
        a.sequence_parallel = False
    if a.recompute_granularity == "full":
        need(a.recompute_method is not None and a.recompute_num_layers is not None, "full recompute needs --recompute-method and --recompute-num-layers")
    order = "tp-cp-ep-pp-dp" if a.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    return Parsed(a, world, world // (tp * pp * cp), world // (etp * ep * pp), order)


def transformer_config(parsed: Parsed):
    """Megatron-Core's `TransformerConfig` of the parsed arguments (its `__post_init__` checks
    them); raises what it raises."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = parsed.args
    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    kw: dict[str, Any] = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size,
        kv_channels=a.kv_channels,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        normalization=a.normalization,
        gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu,
        add_bias_linear=not a.disable_bias_linear,
        tensor_model_parallel_size=a.tensor_model_parallel_size or 1,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size or 1,
        virtual_pipeline_model_parallel_size=a.num_virtual_stages_per_pipeline_rank,
        num_layers_in_first_pipeline_stage=a.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=a.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=a.pipeline_model_parallel_layout,
        context_parallel_size=a.context_parallel_size or 1,
        cp_comm_type=a.cp_comm_type,
        expert_model_parallel_size=a.expert_model_parallel_size or 1,
        expert_tensor_parallel_size=a.expert_tensor_parallel_size,
        sequence_parallel=a.sequence_parallel,
        num_moe_experts=a.num_experts,
        moe_router_topk=a.moe_router_topk or 2,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        moe_token_dispatcher_type=a.moe_token_dispatcher_type,
        moe_layer_freq=a.moe_layer_freq,
        fp8=a.fp8_format,
        overlap_moe_expert_parallel_comm=a.overlap_moe_expert_parallel_comm,
        recompute_granularity=a.recompute_granularity,
        recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
        bf16=a.bf16,
        fp16=a.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    try:
        return TransformerConfig(**kw)
    except (ValueError, AssertionError) as e:
        raise MegatronRefused(f"Megatron-Core's TransformerConfig: {e}") from e


def data_parallel_group_size(parsed: Parsed, config) -> int:
    """The data-parallel group of Megatron-Core's `RankGenerator` for this world and order."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(
        tp=config.tensor_model_parallel_size, ep=1, dp=parsed.data_parallel, pp=config.pipeline_model_parallel_size,
        cp=config.context_parallel_size, order=parsed.rank_order,
    )
    groups = gen.get_ranks("dp")
    covered = sorted(r for g in groups for r in g)
    if covered != list(range(parsed.world)):
        raise MegatronRefused(f"the data-parallel groups do not cover the {parsed.world} ranks")
    return len(groups[0])


def blocks_per_stage(config) -> list[int]:
    """Transformer layers Megatron-Core builds per (virtual) stage, in pipeline order."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size or 1
    layout = config.pipeline_model_parallel_layout
    out = []
    for v in range(vp):
        for r in range(pp):
            if layout is not None:
                out.append(layout.layout[r][v].count(LayerType.decoder))
            else:
                try:
                    out.append(get_num_layers_to_build(config, vp_stage=v if vp > 1 else None, pp_rank=r))
                except AssertionError as e:
                    raise MegatronRefused(f"Megatron-Core's layer split: {e}") from e
    return out
