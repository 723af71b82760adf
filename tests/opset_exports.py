"""Exports for tests/onnx_opsets.rs: one small transformer LM (RMS norms written out, so their
reductions carry `axes`; Split; a causal mask from Range and Unsqueeze; a softmax over the
tokens as well as the attention's) exported by torch's TorchScript exporter at opsets 11, 13
and 18, where the same module takes each opset's forms (axes as attributes or inputs, a
softmax over a middle axis behind transposes); one batch of its token ids; and single-node
models of the forms opsets before 13 write (attributes that later became inputs, Softmax's
coercion to 2-D), each with onnxruntime's outputs on fixed inputs as the reference.

usage: opset_exports.py OUT_DIR
Writes OUT_DIR/lm{11,13,18}.onnx, OUT_DIR/data.npz (input_ids, 8 x 16) and, per case NAME,
OUT_DIR/case_NAME.onnx, case_NAME.in.npz, case_NAME.out.npz; OUT_DIR/cases.txt lists them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

warnings.filterwarnings("ignore")
BATCH, SEQ, VOCAB, HIDDEN = 8, 16, 64, 16


class Block(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.ones(h))
        self.w2 = torch.nn.Parameter(torch.ones(h))
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.o = torch.nn.Linear(h, h)
        self.up = torch.nn.Linear(h, 2 * h)
        self.down = torch.nn.Linear(h, h)

    @staticmethod
    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        t, h = x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.norm(x, self.w1)).split(h, dim=-1)
        scores = (q @ k.transpose(1, 2)) / h**0.5
        pos = torch.arange(t)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        x = x + self.o(torch.softmax(scores, dim=-1) @ v)
        g, u = self.up(self.norm(x, self.w2)).chunk(2, dim=-1)
        # token-mixing weights: a softmax over the sequence, a middle axis
        mix = torch.softmax(g, dim=1)
        return x + self.down(torch.nn.functional.silu(mix * t) * u)


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block(HIDDEN), Block(HIDDEN)])
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def export_lm(out: Path):
    torch.manual_seed(0)
    model = LM().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for opset in (11, 13, 18):
        # no constant folding: every parameter stays one initializer under its module name
        torch.onnx.export(model, (ids,), str(out / f"lm{opset}.onnx"), dynamo=False, opset_version=opset,
                          do_constant_folding=False, input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    np.savez(out / "data.npz", input_ids=ids.numpy())


def f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def case(out: Path, name: str, opset: int, nodes, inputs: dict, outputs):
    graph = helper.make_graph(nodes, name, [f32(k, list(v.shape)) for k, v in inputs.items()], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    model = onnx.shape_inference.infer_shapes(model)
    path = out / f"case_{name}.onnx"
    onnx.save(model, str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, inputs)
    np.savez(out / f"case_{name}.in.npz", **inputs)
    np.savez(out / f"case_{name}.out.npz", **{o.name: g for o, g in zip(outputs, got)})
    return name


def old_forms(out: Path) -> list[str]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    n = helper.make_node
    y = lambda shape=None: [f32("y", shape)]  # noqa: E731
    return [
        case(out, "softmax_axis1_op11", 11, [n("Softmax", ["x"], ["y"], axis=1)], {"x": x}, y()),
        case(out, "softmax_axis0_op11", 11, [n("Softmax", ["x"], ["y"], axis=0)], {"x": x}, y()),
        case(out, "logsoftmax_default_op12", 12, [n("LogSoftmax", ["x"], ["y"])], {"x": x}, y()),
        case(out, "softmax_last_op11", 11, [n("Softmax", ["x"], ["y"], axis=2)], {"x": x}, y()),
        case(out, "reducesum_axes_op11", 11, [n("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)], {"x": x}, y()),
        case(out, "reducemean_axes_op13", 13, [n("ReduceMean", ["x"], ["y"], axes=[-1])], {"x": x}, y()),
        case(out, "reducemax_axes_op13", 13, [n("ReduceMax", ["x"], ["y"], axes=[0, 2], keepdims=0)], {"x": x}, y()),
        case(out, "unsqueeze_squeeze_op11", 11,
             [n("Unsqueeze", ["x"], ["u"], axes=[0, 3]), n("Squeeze", ["u"], ["y"], axes=[0])], {"x": x}, y()),
        case(out, "split_attr_op11", 11, [n("Split", ["x"], ["a", "b"], axis=2, split=[1, 3])], {"x": x},
             [f32("a", None), f32("b", None)]),
        case(out, "slice_attrs_op9", 9, [n("Slice", ["x"], ["y"], starts=[0, 1], ends=[1, 4], axes=[0, 2])], {"x": x}, y()),
        case(out, "clip_attrs_op10", 10, [n("Clip", ["x"], ["y"], min=-0.5, max=0.75)], {"x": x}, y()),
        case(out, "pad_attrs_op10", 10, [n("Pad", ["x"], ["y"], pads=[0, 1, 0, 0, 2, 1], value=1.5)], {"x": x}, y()),
        case(out, "topk_attr_op9", 9, [n("TopK", ["x"], ["y", "i"], k=2)], {"x": x},
             [f32("y", None), helper.make_tensor_value_info("i", TensorProto.INT64, None)]),
        case(out, "dropout_ratio_op10", 10, [n("Dropout", ["x"], ["y"], ratio=0.3)], {"x": x}, y()),
    ]


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    export_lm(out)
    names = old_forms(out)
    (out / "cases.txt").write_text("\n".join(names) + "\n")


if __name__ == "__main__":
    main()
