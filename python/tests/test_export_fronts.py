"""What `smp.export` does with modules the exporter cannot take as they are: complex-valued
rotary embeddings exported in real arithmetic (checked against the module by onnxruntime, and
in f64 against PyTorch's complex arithmetic), a complex op it does not cover refused by name,
a data-dependent shape that a fixed sequence length decides exported with a warning, and one it
does not decide refused naming the module and the construct."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import smp_partition as smp
from smp_partition import _complex

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 64, 32, 4, 2, 8


def _freqs(seq: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    angles = torch.arange(seq, dtype=dtype)[:, None] * inv
    return torch.polar(torch.ones_like(angles), angles)                    # [seq, dim/2] complex


class ComplexRotary(nn.Module):
    """Queries and keys rotated as complex numbers (the form of Llama 4 and DeepSeek-V2), then
    attention; no cast, so it runs in the dtype of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qk = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, HEADS, -1).unbind(2)                # [b, s, heads, d]
        freqs = _freqs(s, q.shape[-1], x.dtype) * 0.5 + 0.5 * _freqs(s, q.shape[-1], x.dtype)
        rot = freqs[None, :, None, :]
        q_ = torch.view_as_complex(q.reshape(b, s, HEADS, -1, 2))
        k_ = torch.view_as_complex(k.reshape(b, s, HEADS, -1, 2))
        q = torch.view_as_real(q_ * rot).flatten(3).type_as(x)
        k = torch.view_as_real(rot.conj().conj() * k_).flatten(3).type_as(x)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.out((scores @ x[:, None].expand(b, HEADS, s, HIDDEN)).mean(1))


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def test_complex_rotary_exports_in_real_arithmetic_and_matches_the_module(tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    model = ComplexRotary()
    exported = smp.export(model, _ids(), tmp_path / "rotary.onnx")
    proto = onnx.load(str(exported.path))
    tensors = [*proto.graph.value_info, *proto.graph.input, *proto.graph.output]
    complex_types = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
    assert not [v.name for v in tensors if v.type.tensor_type.elem_type in complex_types]
    session = ort.InferenceSession(str(exported.path))
    with torch.no_grad():
        for seq in (SEQ, 5):  # the sequence length stayed symbolic
            ids = _ids(seq)
            got = session.run(None, {"input_ids": ids.numpy()})[0]
            want = model.eval()(ids).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_real_pairs_equal_complex_arithmetic_in_f64() -> None:
    torch.manual_seed(0)
    model = ComplexRotary().double().eval()
    with torch.no_grad():
        want = model(_ids())
        with _complex.RealComplex() as mode:
            got = model(_ids())
    assert mode.used
    assert got.dtype == torch.float64
    assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(self.embed(input_ids).reshape(*input_ids.shape, -1, 2))
        return torch.view_as_real(z.exp()).flatten(2)


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.block(input_ids)


def test_a_complex_op_it_does_not_cover_is_refused_naming_the_op_and_module(tmp_path: Path) -> None:
    with pytest.raises(smp.SmpError) as refused:
        smp.export(Wrapped(Spectral()), _ids(), tmp_path / "spectral.onnx")
    text = str(refused.value)
    assert "`Tensor.exp` on a complex tensor" in text, text
    assert "module `block` (Spectral)" in text, text


class _EmbedOut(nn.Module):
    """An embedding and an output projection around whatever `forward` does between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)


class Windows(_EmbedOut):
    """Mixes tokens within windows whose count it reads back from a tensor (`.item()`): a
    data-dependent value with a symbolic length, a constant with a fixed one."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        windows = int(torch.tensor(x.shape[1]).div(4, rounding_mode="floor").item())
        if windows > 1:
            x = x.reshape(x.shape[0], windows, -1, 16).softmax(2).reshape(x.shape[0], -1, 16)
        return self.out(x)


class HitTokens(_EmbedOut):
    """Branches on how many tokens of the batch pass a test (as a loop over the experts a
    batch hits does): data-dependent at any length."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        hit = torch.nonzero(input_ids[0] > VOCAB // 2)
        if hit.shape[0] != 0:
            x = x * 2
        return self.out(x)


def test_a_data_dependent_shape_a_fixed_length_decides_exports_with_a_warning(tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = Wrapped(Windows())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = smp.export(model, _ids(), tmp_path / "windows.onnx")
    said = [str(w.message) for w in caught if "symbolic sequence length" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert f"fixed to the example's ({SEQ})" in said[0] and "module `block` (Windows)" in said[0], said[0]
    assert "depends on tensor values" in said[0] and ".item()" in said[0], said[0]
    got = ort.InferenceSession(str(exported.path)).run(None, {"input_ids": _ids().numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model.eval()(_ids()).numpy(), rtol=1e-5, atol=1e-6)


def test_a_shape_no_length_decides_is_refused_naming_module_and_construct(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(smp.ExportError) as refused:
            smp.export(Wrapped(HitTokens()), _ids(), tmp_path / "hits.onnx")
    text = str(refused.value)
    assert text.startswith(f"Wrapped cannot be exported to ONNX (also with the sequence length fixed to the "
                           f"example's, {SEQ})"), text
    assert "in module `block` (HitTokens)" in text, text
    assert "depends on tensor values (`Ne(u0, 0)`)" in text and "`if hit.shape[0] != 0:`" in text, text
    assert "Traceback" not in text and "\n" not in text, text
    # the exporter's own error stays attached
    assert refused.value.__cause__ is not None
    assert "GuardOnDataDependentSymNode" in repr(refused.value.__cause__.__cause__) or "data-dependent" in str(
        refused.value.__cause__)


class BFloat16Normalizer(nn.Module):
    """Embeddings scaled by a bfloat16 buffer, as RecurrentGemma's `normalizer` (a dtype numpy
    lacks, held beside float32 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("normalizer", torch.tensor(HIDDEN ** 0.5, dtype=torch.bfloat16), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids) * self.normalizer.type(torch.float32))


def test_a_bfloat16_buffer_is_recorded_and_the_export_matches_the_module(tmp_path: Path) -> None:
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    model = BFloat16Normalizer()
    exported = smp.export(model, _ids(), tmp_path / "bf16.onnx")
    proto = onnx.load(str(exported.path))
    kinds = {t.name: {p.key: p.value for p in t.metadata_props}.get("smp.kind") for t in proto.graph.initializer}
    assert [k for n, k in kinds.items() if n.endswith("embed.weight")] == ["parameter"], kinds
    with torch.no_grad():
        got = ort.InferenceSession(str(exported.path)).run(None, {"input_ids": _ids().numpy()})[0]
        np.testing.assert_allclose(got, model.eval()(_ids()).numpy(), rtol=1e-5, atol=1e-6)
