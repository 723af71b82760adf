"""A file exported without the front door (a plain fixed-shape `torch.onnx.export`, no
parameter record) trains by the structural rules, and the run says once, plainly, what it
cannot know: the exporter dropped GPT-2's zero Gemm biases and folded the position embedding
rows it gathered into a constant added to the token embeddings."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import smp_partition as smp
from conftest import BATCH, SEQ, needs_runner, tiny_gpt2, tokens

pytestmark = needs_runner


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_a_record_free_export_names_the_constants_it_suspects_and_the_fix(tmp_path: Path) -> None:
    batch = tokens()
    path = tmp_path / "plain.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(tiny_gpt2().eval()), (batch,), dynamo=True, opset_version=18, input_names=["input_ids"],
                          output_names=["logits"], verbose=False).save(str(path))
    plan = smp.plan(path, cluster="cpu:2", global_batch=BATCH, seq_len=SEQ,
                    config={"pipeline_parallel_degree": 2, "microbatches": 2}, workdir=tmp_path)
    lines: list[str] = []
    smp.launch(plan, data=batch, steps=1, progress=lines.append)
    said = [i for i, line in enumerate(lines) if "no parameter record" in line]
    assert len(said) == 1, lines  # once, not once per rank
    text = "\n".join(lines[said[0]:said[0] + 3])
    assert "may have dropped parameters (zero biases) or folded them into constants" in text, text
    # the position rows GPT-2 gathered at export time: a [1, SEQ, 32] constant added to the
    # token embeddings, as wide as the token table's rows
    suspect = re.search(r"`([^`]+)` \[1, " + str(SEQ) + r", 32\] \(added to activations, rows of a table\)", text)
    assert suspect, text
    assert "export it through `smp_partition.export`" in text, text


def test_dropout_in_training_is_named_with_the_fix(tmp_path: Path) -> None:
    # the export is the evaluation-mode graph: a model that drops activations in training is
    # trained without dropout by the plan, which the export says, naming where
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=32, resid_pdrop=0.1, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    with pytest.warns(UserWarning, match=r"applies dropout in training \(`transformer.h.0.attn.resid_dropout` \(p = 0.1\), "
                                         r"`transformer.h.0.mlp.dropout` \(p = 0.1\)\).*set the dropout probabilities to 0"):
        smp.export(model, tokens(), tmp_path / "m.onnx")
    # a Llama's attention dropout is a function of its attention module, named by its attribute
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64,
        max_position_embeddings=32, attention_dropout=0.2, use_cache=False))
    with pytest.warns(UserWarning, match=r"applies dropout in training \(`model.layers.0.self_attn.attention_dropout` = 0.2\)"):
        smp.export(llama, tokens(), tmp_path / "l.onnx")
    # none without dropout
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        smp.export(tiny_gpt2(), tokens(), tmp_path / "g.onnx")
