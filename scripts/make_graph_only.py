#!/usr/bin/env python3
"""Graph-only large models for planning: built with onnx.helper (no torch), opset 20,
bf16 weights as external data in `<name>.weights`, a file that is never written (offsets and
lengths are filled in as if it existed). Symbolic batch dim `batch`, fixed sequence length,
no Dropout. Also records each model in models/manifest.json.

    .venv/bin/python scripts/make_graph_only.py            # write models/*.onnx
    .venv/bin/python scripts/make_graph_only.py --check    # also run tiny f32 twins on onnxruntime

GPT (Megatron-style): LayerNormalization, fused QKV MatMul + bias, Split, per-head
Reshape/Transpose, scaled Q·Kᵀ, causal mask (Where), Softmax, ·V, projection, residual,
LayerNormalization, fc1 + bias, Gelu, fc2 + bias, residual; token + position embedding; final
LayerNormalization and an LM head tied to the token embedding (Transpose of `wte`).
Llama: decomposed RMSNorm, separate q/k/v with grouped-query KV heads (Expand + Reshape),
RoPE with constant tables `rope.cos`/`rope.sin` (initializers, not trained), SwiGLU MLP, untied
LM head.
Mixtral: Llama with each MLP a sparse mixture of SwiGLU experts, as `smp_partition.export` writes
one (python/smp_partition/_moe.py): router MatMul, Softmax, TopK, renormalised top-k weights,
then the dense experts (one-hot combine weights, every expert's gate_up [E, 2F, H] and down
[E, H, F] on every token, weighted sum), which the planner's fusion makes one MixtureOfExperts
op (routed pairs only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_build import (FLOAT_TYPES, REPO, GraphBuilder, float_initializer_elements, io_record,  # noqa: E402
                        update_manifest, write_model)

MODELS = REPO / "models"


def gpt_params(layers, hidden, seq, vocab):
    """Trainable parameters of the graph below (Megatron's 12lh²(1 + 13/12h + (V+s)/12lh)
    plus the final LayerNorm's 2h)."""
    h = hidden
    return 12 * layers * h * h + 13 * layers * h + (vocab + seq) * h + 2 * h


def llama_params(layers, hidden, heads, kv_heads, ffn, vocab, experts=None, head_dim=None, qk_norm=False):
    """Llama's parameters; with `experts`, each MLP is that many experts and a router; with
    `qk_norm`, an RMSNorm weight per head dimension on q and on k (Qwen3)."""
    h, d = hidden, head_dim or hidden // heads
    mlp = 3 * h * ffn if experts is None else experts * 3 * h * ffn + h * experts
    per_layer = 2 * h * heads * d + 2 * h * kv_heads * d + mlp + 2 * h + (2 * d if qk_norm else 0)
    return layers * per_layer + 2 * vocab * h + h


def sparse_moe(b, y, p, hidden, ffn, experts, top_k, seq, scope):
    """Mixtral's sparse MoE block on `y` [batch, seq, hidden], as the front door exports it."""
    h = hidden
    tokens = b.node("Reshape", [y, b.const(f"{p}.moe.tokens_shape", np.array([-1, h], np.int64))], scope)
    gate = scope + [(f"{p}.block_sparse_moe.gate", "TopKRouter")]
    logits = b.node("MatMul", [tokens, b.weight(f"{p}.block_sparse_moe.gate.weight", [h, experts])], gate)
    # the router in float32 (TopK takes no bfloat16 before opset 24), its weights back in the
    # model's type, as Qwen3-MoE's router does
    probs = b.node("Softmax", [b.node("Cast", [logits], gate, to=TensorProto.FLOAT)], gate, axis=-1)
    top, idx = b.node("TopK", [probs, b.const(f"{p}.moe.k", np.array([top_k], np.int64))], gate, n_out=2,
                      axis=-1)
    last = b.const(f"{p}.moe.last_axis", np.array([-1], np.int64))
    top = b.node("Div", [top, b.node("ReduceSum", [top, last], gate, keepdims=1)], gate)
    top = b.node("Cast", [top], gate, to=b.dtype)
    ex = scope + [(f"{p}.block_sparse_moe.experts", "Experts")]
    ids = b.const(f"{p}.moe.expert_ids", np.arange(experts, dtype=np.int64))
    hot = b.node("Cast", [b.node("Equal", [b.node("Unsqueeze", [idx, last], ex), ids], ex)], ex, to=b.dtype)
    combine = b.node("ReduceSum", [b.node("Mul", [hot, b.node("Unsqueeze", [top, last], ex)], ex),
                                   b.const(f"{p}.moe.k_axis", np.array([1], np.int64))], ex, keepdims=0)
    gate_up = b.weight(f"{p}.block_sparse_moe.experts.gate_up_proj", [experts, 2 * ffn, h])
    down = b.weight(f"{p}.block_sparse_moe.experts.down_proj", [experts, h, ffn])
    g, u = b.node("Split", [b.node("MatMul", [gate_up, b.node("Transpose", [tokens], ex, perm=[1, 0])], ex)],
                  ex, n_out=2, axis=1, num_outputs=2)
    act = b.node("Mul", [b.node("Mul", [g, b.node("Sigmoid", [g], ex)], ex), u], ex)
    y = b.node("MatMul", [down, act], ex)
    weights = b.node("Unsqueeze", [b.node("Transpose", [combine], ex, perm=[1, 0]),
                                   b.const(f"{p}.moe.expert_axis", np.array([1], np.int64))], ex)
    out = b.node("ReduceSum", [b.node("Mul", [y, weights], ex),
                               b.const(f"{p}.moe.sum_axis", np.array([0], np.int64))], ex, keepdims=0)
    out = b.node("Transpose", [out], ex, perm=[1, 0])
    return b.node("Reshape", [out, b.const(f"{p}.moe.out_shape", np.array([-1, seq, h], np.int64))], scope)


def causal_where(b, scores, prefix, seq, scope):
    """Where(tril(ones[S,S]) , scores, -inf-ish): built per block from constants."""
    shape = b.const(f"{prefix}.attn.mask_shape", np.array([seq, seq], np.int64))
    ones = b.node("ConstantOfShape", [shape], scope,
                  value=helper.make_tensor("value", TensorProto.BOOL, [1], [True]))
    mask = b.node("Trilu", [ones], scope, upper=0)
    neg = b.const(f"{prefix}.attn.mask_value", np.array(-1e4, np.float32))
    return b.node("Where", [mask, scores, neg], scope)


def build_gpt(name, layers, hidden, heads, seq, vocab, dtype=TensorProto.BFLOAT16,
              weights_file=None):
    h, a = hidden, heads
    d = h // a
    b = GraphBuilder(": GPT", dtype, f"{name}.weights", weights_file)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq])
    emb = [("embedding", "Embedding")]
    wte = b.weight("wte.weight", [vocab, h])
    wpe = b.weight("wpe.weight", [seq, h])
    pos = b.const("position_ids", np.arange(seq, dtype=np.int64))
    tok = b.node("Gather", [wte, "input_ids"], emb, axis=0)
    pe = b.node("Gather", [wpe, pos], emb, axis=0)
    x = b.node("Add", [tok, pe], emb)
    split = b.const("qkv.split", np.array([h, h, h], np.int64))
    heads_shape = b.const("heads.shape", np.array([0, 0, a, d], np.int64))
    merge_shape = b.const("merge.shape", np.array([0, 0, h], np.int64))
    for i in range(layers):
        p = f"h.{i}"
        blk = [(p, "Block")]
        ln1 = blk + [(f"{p}.ln_1", "LayerNorm")]
        att = blk + [(f"{p}.attn", "Attention")]
        ln2 = blk + [(f"{p}.ln_2", "LayerNorm")]
        mlp = blk + [(f"{p}.mlp", "MLP")]
        y = b.node("LayerNormalization", [x, b.weight(f"{p}.ln_1.weight", [h], "ones"),
                                          b.weight(f"{p}.ln_1.bias", [h], "zeros")],
                   ln1, axis=-1, epsilon=1e-5)
        qkv = b.node("MatMul", [y, b.weight(f"{p}.attn.qkv.weight", [h, 3 * h])], att)
        qkv = b.node("Add", [qkv, b.weight(f"{p}.attn.qkv.bias", [3 * h], "zeros")], att)
        q, k, v = b.node("Split", [qkv, split], att, n_out=3, axis=-1)
        q = b.node("Transpose", [b.node("Reshape", [q, heads_shape], att)], att,
                   perm=[0, 2, 1, 3])
        k = b.node("Transpose", [b.node("Reshape", [k, heads_shape], att)], att,
                   perm=[0, 2, 3, 1])
        v = b.node("Transpose", [b.node("Reshape", [v, heads_shape], att)], att,
                   perm=[0, 2, 1, 3])
        s = b.node("MatMul", [q, k], att)
        s = b.node("Mul", [s, b.const(f"{p}.attn.scale", np.array(1.0 / np.sqrt(d),
                                                                   np.float32))], att)
        s = causal_where(b, s, p, seq, att)
        s = b.node("Softmax", [s], att, axis=-1)
        o = b.node("MatMul", [s, v], att)
        o = b.node("Transpose", [o], att, perm=[0, 2, 1, 3])
        o = b.node("Reshape", [o, merge_shape], att)
        o = b.node("MatMul", [o, b.weight(f"{p}.attn.proj.weight", [h, h])], att)
        o = b.node("Add", [o, b.weight(f"{p}.attn.proj.bias", [h], "zeros")], att)
        x = b.node("Add", [x, o], blk)
        y = b.node("LayerNormalization", [x, b.weight(f"{p}.ln_2.weight", [h], "ones"),
                                          b.weight(f"{p}.ln_2.bias", [h], "zeros")],
                   ln2, axis=-1, epsilon=1e-5)
        y = b.node("MatMul", [y, b.weight(f"{p}.mlp.fc1.weight", [h, 4 * h])], mlp)
        y = b.node("Add", [y, b.weight(f"{p}.mlp.fc1.bias", [4 * h], "zeros")], mlp)
        y = b.node("Gelu", [y], mlp, approximate="tanh")
        y = b.node("MatMul", [y, b.weight(f"{p}.mlp.fc2.weight", [4 * h, h])], mlp)
        y = b.node("Add", [y, b.weight(f"{p}.mlp.fc2.bias", [h], "zeros")], mlp)
        x = b.node("Add", [x, y], blk)
    lnf = [("ln_f", "LayerNorm")]
    x = b.node("LayerNormalization", [x, b.weight("ln_f.weight", [h], "ones"),
                                      b.weight("ln_f.bias", [h], "zeros")],
               lnf, axis=-1, epsilon=1e-5)
    head = [("lm_head", "LMHead")]
    wt = b.node("Transpose", [wte], head, perm=[1, 0])
    logits = b.node("MatMul", [x, wt], head)
    b.nodes[-1].output[0] = "logits"
    out = helper.make_tensor_value_info("logits", dtype, ["batch", seq, vocab])
    return b.model(name, [ids], [out])


def rms_norm(b, x, weight, eps, exponent, axes, scope):
    sq = b.node("Pow", [x, exponent], scope)
    ms = b.node("ReduceMean", [sq, axes], scope, keepdims=1)
    r = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [ms, eps], scope)], scope)], scope)
    return b.node("Mul", [b.node("Mul", [x, r], scope), weight], scope)


def rope_tables(seq, d, theta=500000.0):
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    f = np.outer(np.arange(seq, dtype=np.float64), inv)
    emb = np.concatenate([f, f], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def token_inputs(b, seq, rope_dim, vocab, h):
    """The token ids input, the RoPE tables (`rope_dim` wide) and the embedded tokens."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq])
    cos_v, sin_v = rope_tables(seq, rope_dim)
    doc = "constant of the model (RoPE table), not trained"
    cos = b.weight("rope.cos", [seq, rope_dim], values=cos_v, doc=doc)
    sin = b.weight("rope.sin", [seq, rope_dim], values=sin_v, doc=doc)
    emb = [("embed_tokens", "Embedding")]
    x = b.node("Gather", [b.weight("embed_tokens.weight", [vocab, h]), "input_ids"], emb, axis=0)
    return ids, cos, sin, x


def build_llama(name, layers, hidden, heads, kv_heads, ffn, seq, vocab,
                dtype=TensorProto.BFLOAT16, weights_file=None, experts=None, top_k=2, head_dim=None,
                qk_norm=False):
    """Llama; with `experts`, each MLP is a sparse mixture of that many SwiGLU experts with
    `ffn` each, top-`top_k` routed (Mixtral). Qwen3's differences: `head_dim` need not be
    hidden / heads, and `qk_norm` puts an RMSNorm over each head's dimension on q and on k
    before the rotary embedding."""
    h, a, kv = hidden, heads, kv_heads
    d = head_dim or h // a
    rep = a // kv
    kind = ": Llama" if experts is None else ": Qwen3-MoE" if qk_norm else ": Mixtral"
    b = GraphBuilder(kind, dtype, f"{name}.weights", weights_file)
    ids, cos, sin, x = token_inputs(b, seq, d, vocab, h)
    q_shape = b.const("q.shape", np.array([0, 0, a, d], np.int64))
    kv_shape = b.const("kv.shape", np.array([0, 0, kv, d], np.int64))
    rep_shape = b.const("kv.repeat", np.array([1, 1, rep, 1, 1], np.int64))
    gqa_shape = b.const("kv.merged_shape", np.array([0, a, seq, d], np.int64))
    merge_shape = b.const("merge.shape", np.array([0, 0, a * d], np.int64))
    half = b.const("rope.half_split", np.array([d // 2, d // 2], np.int64))
    axes = b.const("norm.axes", np.array([-1], np.int64))
    unsq = b.const("kv.unsqueeze_axes", np.array([2], np.int64))

    def rope(t, scope):
        x1, x2 = b.node("Split", [t, half], scope, n_out=2, axis=-1)
        rot = b.node("Concat", [b.node("Neg", [x2], scope), x1], scope, axis=-1)
        return b.node("Add", [b.node("Mul", [t, cos], scope),
                              b.node("Mul", [rot, sin], scope)], scope)

    for i in range(layers):
        p = f"layers.{i}"
        blk = [(p, "DecoderLayer")]
        n1 = blk + [(f"{p}.input_layernorm", "RMSNorm")]
        att = blk + [(f"{p}.self_attn", "Attention")]
        n2 = blk + [(f"{p}.post_attention_layernorm", "RMSNorm")]
        mlp = blk + [(f"{p}.mlp", "MLP")]
        eps = b.const(f"{p}.norm.eps", np.array(1e-5, np.float32))
        two = b.const(f"{p}.norm.exponent", np.array(2.0, np.float32))
        y = rms_norm(b, x, b.weight(f"{p}.input_layernorm.weight", [h], "ones"), eps, two,
                     axes, n1)
        q = b.node("MatMul", [y, b.weight(f"{p}.self_attn.q_proj.weight", [h, a * d])], att)
        k = b.node("MatMul", [y, b.weight(f"{p}.self_attn.k_proj.weight", [h, kv * d])], att)
        v = b.node("MatMul", [y, b.weight(f"{p}.self_attn.v_proj.weight", [h, kv * d])], att)
        q = b.node("Transpose", [b.node("Reshape", [q, q_shape], att)], att, perm=[0, 2, 1, 3])
        k = b.node("Transpose", [b.node("Reshape", [k, kv_shape], att)], att, perm=[0, 2, 1, 3])
        v = b.node("Transpose", [b.node("Reshape", [v, kv_shape], att)], att, perm=[0, 2, 1, 3])
        if qk_norm:
            q = rms_norm(b, q, b.weight(f"{p}.self_attn.q_norm.weight", [d], "ones"), eps, two, axes,
                         att + [(f"{p}.self_attn.q_norm", "RMSNorm")])
            k = rms_norm(b, k, b.weight(f"{p}.self_attn.k_norm.weight", [d], "ones"), eps, two, axes,
                         att + [(f"{p}.self_attn.k_norm", "RMSNorm")])
        q, k = rope(q, att), rope(k, att)

        def repeat_kv(t):
            t = b.node("Expand", [b.node("Unsqueeze", [t, unsq], att), rep_shape], att)
            return b.node("Reshape", [t, gqa_shape], att)

        k, v = repeat_kv(k), repeat_kv(v)
        kt = b.node("Transpose", [k], att, perm=[0, 1, 3, 2])
        s = b.node("MatMul", [q, kt], att)
        s = b.node("Mul", [s, b.const(f"{p}.attn.scale", np.array(1.0 / np.sqrt(d),
                                                                   np.float32))], att)
        s = causal_where(b, s, p, seq, att)
        s = b.node("Softmax", [s], att, axis=-1)
        o = b.node("MatMul", [s, v], att)
        o = b.node("Reshape", [b.node("Transpose", [o], att, perm=[0, 2, 1, 3]), merge_shape],
                   att)
        o = b.node("MatMul", [o, b.weight(f"{p}.self_attn.o_proj.weight", [a * d, h])], att)
        x = b.node("Add", [x, o], blk)
        y = rms_norm(b, x, b.weight(f"{p}.post_attention_layernorm.weight", [h], "ones"), eps,
                     two, axes, n2)
        if experts is not None:
            moe = blk + [(f"{p}.block_sparse_moe", "SparseMoeBlock")]
            x = b.node("Add", [x, sparse_moe(b, y, p, h, ffn, experts, top_k, seq, moe)], blk)
            continue
        g = b.node("MatMul", [y, b.weight(f"{p}.mlp.gate_proj.weight", [h, ffn])], mlp)
        u = b.node("MatMul", [y, b.weight(f"{p}.mlp.up_proj.weight", [h, ffn])], mlp)
        g = b.node("Mul", [g, b.node("Sigmoid", [g], mlp)], mlp)
        y = b.node("MatMul", [b.node("Mul", [g, u], mlp),
                              b.weight(f"{p}.mlp.down_proj.weight", [ffn, h])], mlp)
        x = b.node("Add", [x, y], blk)
    nf = [("norm", "RMSNorm")]
    x = rms_norm(b, x, b.weight("norm.weight", [h], "ones"),
                 b.const("norm.eps", np.array(1e-5, np.float32)),
                 b.const("norm.exponent", np.array(2.0, np.float32)), axes, nf)
    b.node("MatMul", [x, b.weight("lm_head.weight", [h, vocab])], [("lm_head", "Linear")])
    b.nodes[-1].output[0] = "logits"
    out = helper.make_tensor_value_info("logits", dtype, ["batch", seq, vocab])
    return b.model(name, [ids], [out])


def deepseek_params(layers, dense_layers, hidden, heads, q_lora, kv_lora, rope, nope, v_dim, ffn,
                    moe_ffn, experts, shared, vocab):
    """DeepSeek-V3's parameters: latent attention, dense MLPs in the first `dense_layers`,
    routed experts (and their router) with `shared` shared experts in the others."""
    h, a = hidden, heads
    att = h * q_lora + q_lora + q_lora * a * (nope + rope) + h * (kv_lora + rope) + kv_lora \
        + kv_lora * a * (nope + v_dim) + a * v_dim * h
    dense = 3 * h * ffn
    moe = experts * 3 * h * moe_ffn + h * experts + shared * 3 * h * moe_ffn
    return layers * (att + 2 * h) + dense_layers * dense + (layers - dense_layers) * moe \
        + 2 * vocab * h + h


def build_deepseek(name, layers, dense_layers, hidden, heads, q_lora, kv_lora, rope, nope, v_dim,
                   ffn, moe_ffn, experts, top_k, shared, seq, vocab, dtype=TensorProto.BFLOAT16,
                   weights_file=None):
    """DeepSeek-V3: multi-head latent attention (q through a `q_lora` bottleneck with its
    RMSNorm; keys and values through one `kv_lora` latent with its RMSNorm, per-head `nope`
    keys and `v_dim` values expanded from it; a decoupled `rope` key shared by every head,
    broadcast over them and concatenated to each head's key), the first `dense_layers` MLPs
    dense, the others `experts` routed SwiGLU experts (top `top_k`, routed as Mixtral's above:
    the router's form does not change the plan) beside `shared` shared experts."""
    h, a = hidden, heads
    qk = nope + rope
    b = GraphBuilder(": DeepseekV3", dtype, f"{name}.weights", weights_file)
    ids, cos, sin, x = token_inputs(b, seq, rope, vocab, h)
    q_shape = b.const("q.shape", np.array([0, 0, a, qk], np.int64))
    q_split = b.const("q.split", np.array([nope, rope], np.int64))
    kv_split = b.const("kv_a.split", np.array([kv_lora, rope], np.int64))
    kv_shape = b.const("kv.shape", np.array([0, 0, a, nope + v_dim], np.int64))
    kv_heads_split = b.const("kv.split", np.array([nope, v_dim], np.int64))
    rot_shape = b.const("k_rot.shape", np.array([0, 0, 1, rope], np.int64))
    rot_heads = b.const("k_rot.heads", np.array([1, a, 1, 1], np.int64))
    merge_shape = b.const("merge.shape", np.array([0, 0, a * v_dim], np.int64))
    half = b.const("rope.half_split", np.array([rope // 2, rope // 2], np.int64))
    axes = b.const("norm.axes", np.array([-1], np.int64))

    def rope_of(t, scope):
        x1, x2 = b.node("Split", [t, half], scope, n_out=2, axis=-1)
        rot = b.node("Concat", [b.node("Neg", [x2], scope), x1], scope, axis=-1)
        return b.node("Add", [b.node("Mul", [t, cos], scope), b.node("Mul", [rot, sin], scope)], scope)

    def swiglu(y, prefix, f, scope):
        g = b.node("MatMul", [y, b.weight(f"{prefix}.gate_proj.weight", [h, f])], scope)
        u = b.node("MatMul", [y, b.weight(f"{prefix}.up_proj.weight", [h, f])], scope)
        g = b.node("Mul", [g, b.node("Sigmoid", [g], scope)], scope)
        return b.node("MatMul", [b.node("Mul", [g, u], scope), b.weight(f"{prefix}.down_proj.weight", [f, h])],
                      scope)

    for i in range(layers):
        p = f"layers.{i}"
        blk = [(p, "DecoderLayer")]
        n1 = blk + [(f"{p}.input_layernorm", "RMSNorm")]
        att = blk + [(f"{p}.self_attn", "Attention")]
        n2 = blk + [(f"{p}.post_attention_layernorm", "RMSNorm")]
        eps = b.const(f"{p}.norm.eps", np.array(1e-6, np.float32))
        two = b.const(f"{p}.norm.exponent", np.array(2.0, np.float32))
        y = rms_norm(b, x, b.weight(f"{p}.input_layernorm.weight", [h], "ones"), eps, two, axes, n1)
        # queries: low rank, normalised, per head [nope | rope]
        q = b.node("MatMul", [y, b.weight(f"{p}.self_attn.q_a_proj.weight", [h, q_lora])], att)
        q = rms_norm(b, q, b.weight(f"{p}.self_attn.q_a_layernorm.weight", [q_lora], "ones"), eps, two, axes, att)
        q = b.node("MatMul", [q, b.weight(f"{p}.self_attn.q_b_proj.weight", [q_lora, a * qk])], att)
        q = b.node("Transpose", [b.node("Reshape", [q, q_shape], att)], att, perm=[0, 2, 1, 3])
        q_pass, q_rot = b.node("Split", [q, q_split], att, n_out=2, axis=-1)
        q = b.node("Concat", [q_pass, rope_of(q_rot, att)], att, axis=-1)
        # keys and values: one latent and one rotary key for all heads
        kv = b.node("MatMul", [y, b.weight(f"{p}.self_attn.kv_a_proj_with_mqa.weight", [h, kv_lora + rope])], att)
        latent, k_rot = b.node("Split", [kv, kv_split], att, n_out=2, axis=-1)
        latent = rms_norm(b, latent, b.weight(f"{p}.self_attn.kv_a_layernorm.weight", [kv_lora], "ones"), eps,
                          two, axes, att)
        kv = b.node("MatMul", [latent, b.weight(f"{p}.self_attn.kv_b_proj.weight", [kv_lora, a * (nope + v_dim)])],
                    att)
        kv = b.node("Transpose", [b.node("Reshape", [kv, kv_shape], att)], att, perm=[0, 2, 1, 3])
        k_nope, v = b.node("Split", [kv, kv_heads_split], att, n_out=2, axis=-1)
        k_rot = b.node("Transpose", [b.node("Reshape", [k_rot, rot_shape], att)], att, perm=[0, 2, 1, 3])
        k_rot = b.node("Expand", [rope_of(k_rot, att), rot_heads], att)
        k = b.node("Concat", [k_nope, k_rot], att, axis=-1)
        s = b.node("MatMul", [q, b.node("Transpose", [k], att, perm=[0, 1, 3, 2])], att)
        s = b.node("Mul", [s, b.const(f"{p}.attn.scale", np.array(1.0 / np.sqrt(qk), np.float32))], att)
        s = b.node("Softmax", [causal_where(b, s, p, seq, att)], att, axis=-1)
        o = b.node("MatMul", [s, v], att)
        o = b.node("Reshape", [b.node("Transpose", [o], att, perm=[0, 2, 1, 3]), merge_shape], att)
        o = b.node("MatMul", [o, b.weight(f"{p}.self_attn.o_proj.weight", [a * v_dim, h])], att)
        x = b.node("Add", [x, o], blk)
        y = rms_norm(b, x, b.weight(f"{p}.post_attention_layernorm.weight", [h], "ones"), eps, two, axes, n2)
        if i < dense_layers:
            x = b.node("Add", [x, swiglu(y, f"{p}.mlp", ffn, blk + [(f"{p}.mlp", "MLP")])], blk)
            continue
        moe = blk + [(f"{p}.mlp", "MoE")]
        routed = sparse_moe(b, y, p, h, moe_ffn, experts, top_k, seq, moe)
        for j in range(shared):
            routed = b.node("Add", [routed, swiglu(y, f"{p}.mlp.shared_experts.{j}", moe_ffn,
                                                   moe + [(f"{p}.mlp.shared_experts", "MLP")])], moe)
        x = b.node("Add", [x, routed], blk)
    nf = [("norm", "RMSNorm")]
    x = rms_norm(b, x, b.weight("norm.weight", [h], "ones"), b.const("norm.eps", np.array(1e-6, np.float32)),
                 b.const("norm.exponent", np.array(2.0, np.float32)), axes, nf)
    b.node("MatMul", [x, b.weight("lm_head.weight", [h, vocab])], [("lm_head", "Linear")])
    b.nodes[-1].output[0] = "logits"
    out = helper.make_tensor_value_info("logits", dtype, ["batch", seq, vocab])
    return b.model(name, [ids], [out])


# name, layers, hidden, heads, seq, vocab (GPT); Megatron-LM Table 1 in megatron/.
GPTS = [("gpt3-175b", 96, 12288, 96, 2048, 51200), ("gpt-1t", 128, 25600, 160, 2048, 51200)]
MEGATRON = [("1.7B", 24, 2304, 24), ("3.6B", 32, 3072, 30), ("7.5B", 32, 4096, 36),
            ("18.4B", 48, 6144, 40), ("39.1B", 64, 8192, 48), ("76.1B", 80, 10240, 60),
            ("145.6B", 96, 12288, 80), ("310.1B", 128, 16384, 96), ("529.6B", 128, 20480, 105),
            ("1008B", 160, 25600, 128)]
# name, layers, hidden, heads, kv heads, ffn, seq, vocab
LLAMAS = [("llama3-70b", 80, 8192, 64, 8, 28672, 4096, 128256),
          ("llama3-8b", 32, 4096, 32, 8, 14336, 8192, 128256),
          ("llama3-405b", 126, 16384, 128, 8, 53248, 8192, 128256),
          # 70B at Llama 3's pre-training sequence, 8,192, and at its long-context stage's,
          # 131,072 (Dubey et al. 2024 §3.4): the context-parallel planner's cases
          ("llama3-70b-8k", 80, 8192, 64, 8, 28672, 8192, 128256),
          ("llama3-70b-128k", 80, 8192, 64, 8, 28672, 131072, 128256)]
# 405B at the sequences of torchtitan's context-parallel sweep (32K to 256K; 128K is also Llama 3's
# long-context stage): the published-run checks of context parallelism
LLAMAS += [(f"llama3-405b-{k}k", 126, 16384, 128, 8, 53248, k * 1024, 128256) for k in (32, 64, 128, 256)]
# name, layers, hidden, heads, kv heads, expert ffn, seq, vocab, experts, top-k (Mixtral 8×7B:
# Jiang et al. 2024, 46.7B parameters)
MIXTRALS = [("mixtral-8x7b", 32, 4096, 32, 8, 14336, 4096, 32000, 8, 2)]
# Qwen3-235B-A22B (its config.json: head dim 128 with 64 heads over hidden 4,096, QK norms, 128
# experts top 8 in every layer, 235B parameters), sequence 4,096 as Megatron-Core's published runs
QWEN3_MOES = [("qwen3-235b-a22b", dict(layers=94, hidden=4096, heads=64, kv_heads=4, ffn=1536, seq=4096,
                                       vocab=151936, experts=128, top_k=8, head_dim=128, qk_norm=True))]
# DeepSeek-V3 (DeepSeek-AI 2024, 671B parameters): its config.json's shapes, sequence 4,096
DEEPSEEKS = [("deepseek-v3", dict(layers=61, dense_layers=3, hidden=7168, heads=128, q_lora=1536, kv_lora=512,
                                  rope=64, nope=128, v_dim=128, ffn=18432, moe_ffn=2048, experts=256, top_k=8,
                                  shared=1, seq=4096, vocab=129280))]


def constants_elements(model) -> int:
    """Floating-point initializer elements that are constants, not trained parameters."""
    total = 0
    for t in model.graph.initializer:
        if t.data_type not in FLOAT_TYPES:
            continue
        if t.name.startswith("rope.") or t.name.endswith((".scale", ".mask_value", ".eps",
                                                           ".exponent")):
            total += int(np.prod(t.dims, dtype=np.int64))
    return total


def check_structure(model, name):
    # (onnx.checker refuses external data whose file is missing, by design here.)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                 data_prop=True)
    out = inferred.graph.output[0].type.tensor_type.shape
    assert len(out.dim) == 3, name


def check_on_onnxruntime():
    """Tiny float32 twins with real (random) weights must run on onnxruntime: proves the
    graphs are executable, not only well-typed."""
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as tmp:
        tiny = [("gpt", lambda f: build_gpt("tiny-gpt", 2, 32, 4, 8, 64, TensorProto.FLOAT, f)),
                ("llama", lambda f: build_llama("tiny-llama", 2, 32, 4, 2, 48, 8, 64,
                                                TensorProto.FLOAT, f)),
                ("mixtral", lambda f: build_llama("tiny-mixtral", 2, 32, 4, 2, 48, 8, 64,
                                                  TensorProto.FLOAT, f, experts=4, top_k=2)),
                ("qwen3-moe", lambda f: build_llama("tiny-qwen3-moe", 2, 32, 4, 2, 48, 8, 64,
                                                    TensorProto.FLOAT, f, experts=4, top_k=2, head_dim=16,
                                                    qk_norm=True)),
                ("deepseek", lambda f: build_deepseek("tiny-deepseek", 3, 1, 32, 4, 16, 16, 4, 4, 8, 48, 16, 4,
                                                      2, 1, 8, 64, TensorProto.FLOAT, f))]
        for kind, build in tiny:
            name = f"tiny-{kind}"
            with open(Path(tmp) / f"{name}.weights", "wb") as f:
                model = build(f)
            path = Path(tmp) / f"{name}.onnx"
            write_model(model, path)
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            ids = np.random.default_rng(0).integers(0, 64, size=(3, 8), dtype=np.int64)
            (logits,) = sess.run(None, {"input_ids": ids})
            assert logits.shape == (3, 8, 64) and np.isfinite(logits).all(), kind
            # Causality: changing the last token must not change earlier positions.
            ids2 = ids.copy()
            ids2[:, -1] = (ids2[:, -1] + 1) % 64
            (logits2,) = sess.run(None, {"input_ids": ids2})
            assert np.allclose(logits[:, :-1], logits2[:, :-1], atol=1e-5), kind
            assert not np.allclose(logits[:, -1], logits2[:, -1]), kind
            print(f"onnxruntime ok: {name} logits {logits.shape}")


def record(model, path, extra):
    rec = {"file": str(path.relative_to(REPO)), "graph_only": True, "dtype": "bfloat16",
           "opset": 20, "weights_location": f"{path.stem}.weights (never written)",
           "float_initializer_elements": float_initializer_elements(model),
           "constant_float_elements": constants_elements(model),
           "file_bytes": path.stat().st_size}
    rec.update(extra)
    rec.update(io_record(model))
    assert rec["float_initializer_elements"] == rec["formula_params"] + \
        rec["constant_float_elements"], (path, rec)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="run tiny twins on onnxruntime")
    ap.add_argument("--out", type=Path, default=MODELS)
    ap.add_argument("--only", help="write only this model (e.g. deepseek-v3)")
    args = ap.parse_args()
    if args.check:
        check_on_onnxruntime()
    entries = {}
    jobs = [(n, args.out / f"{n}.onnx", "gpt", dict(layers=l, hidden=h, heads=a, seq=s, vocab=v))
            for n, l, h, a, s, v in GPTS]
    jobs += [(f"megatron/gpt-{p}", args.out / "megatron" / f"gpt-{p}.onnx", "gpt",
              dict(layers=l, hidden=h, heads=a, seq=2048, vocab=51200, published_params=p))
             for p, a, h, l in MEGATRON]
    jobs += [(n, args.out / f"{n}.onnx", "llama",
              dict(layers=l, hidden=h, heads=a, kv_heads=kv, ffn=f, seq=s, vocab=v))
             for n, l, h, a, kv, f, s, v in LLAMAS]
    jobs += [(n, args.out / f"{n}.onnx", "mixtral",
              dict(layers=l, hidden=h, heads=a, kv_heads=kv, ffn=f, seq=s, vocab=v, experts=e, top_k=k))
             for n, l, h, a, kv, f, s, v, e, k in MIXTRALS]
    jobs += [(n, args.out / f"{n}.onnx", "qwen3-moe", cfg) for n, cfg in QWEN3_MOES]
    jobs += [(n, args.out / f"{n}.onnx", "deepseek", cfg) for n, cfg in DEEPSEEKS]
    jobs = [j for j in jobs if args.only in (None, j[0])]
    for key, path, kind, cfg in jobs:
        shape = {k: v for k, v in cfg.items() if k != "published_params"}
        if kind == "gpt":
            model = build_gpt(path.stem, **shape)
            params = gpt_params(cfg["layers"], cfg["hidden"], cfg["seq"], cfg["vocab"])
            formula = "12lh^2 + 13lh + (V+s)h + 2h (tied head, final LayerNorm)"
        elif kind == "llama":
            model = build_llama(path.stem, **shape)
            params = llama_params(cfg["layers"], cfg["hidden"], cfg["heads"], cfg["kv_heads"],
                                  cfg["ffn"], cfg["vocab"])
            formula = "l(2h^2 + 2h*kv*d + 3hF + 2h) + 2Vh + h (untied head)"
        elif kind == "deepseek":
            model = build_deepseek(path.stem, **shape)
            params = deepseek_params(**{k: v for k, v in cfg.items() if k not in ("top_k", "seq")})
            formula = ("l(latent attention + 2h) + l_dense*3hF + (l - l_dense)(E*3hF_e + hE + shared*3hF_e)"
                       " + 2Vh + h")
        else:
            model = build_llama(path.stem, **shape)
            params = llama_params(cfg["layers"], cfg["hidden"], cfg["heads"], cfg["kv_heads"],
                                  cfg["ffn"], cfg["vocab"], cfg["experts"], cfg.get("head_dim"),
                                  cfg.get("qk_norm", False))
            formula = "l(2h^2 + 2h*kv*d + E*3hF + hE + 2h) + 2Vh + h (E experts, router, untied head)"
        check_structure(model, key)
        write_model(model, path)
        entries[key] = record(model, path, {"kind": kind, **cfg, "formula_params": params,
                                            "formula": formula})
        print(f"{path.relative_to(REPO)}: {params / 1e9:.2f}B params, "
              f"{path.stat().st_size / 1e3:.0f} kB")
    update_manifest(entries)


if __name__ == "__main__":
    main()
