"""Exports for tests/cnn_training.rs: torchvision's ResNet-18 (its own init, 10 classes) in
eval mode, so BatchNormalization stays a node that reads its running statistics, with dynamic
batch and the parameter record; plus a seeded batch of 64x64 images (2x2 at the last stage: with 1x1 and 2 images per microbatch, train-mode BatchNorm saturates and its gradients are rounding noise) and labels, and PyTorch's
own training of the module on it as the oracle: 3 AdamW steps (lr 1e-3, weight decay 0.01,
gradient norm clipped to 1.0, the runner's defaults) in
float64, in train() mode, over 4 microbatches of 2 images with gradient accumulation (each
microbatch's summed loss over the batch's 8 labels), and the state_dict after them.

usage: cnn_exports.py OUT_DIR
Writes OUT_DIR/{resnet18.onnx,data.npz,torch_losses.npy,torch_state.npz}.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from param_record import write_record  # noqa: E402

warnings.filterwarnings("ignore")


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18,
                                    dynamic_shapes=({0: torch.export.Dim("batch")},),
                                    input_names=["pixels"], output_names=["logits"], verbose=False, optimize=False)
    path = out / "resnet18.onnx"
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    write_record(model, proto)
    onnx.save(proto, str(path))
    r = np.random.default_rng(5)
    pixels, labels = r.standard_normal((8, 3, 64, 64)).astype(np.float32), r.integers(0, 10, 8)
    np.savez(out / "data.npz", pixels=pixels, labels=labels)

    # PyTorch's module as it is: ONNX stores epsilon and momentum as float32 attributes, which
    # the runner reads back as the decimals written (1e-5, 0.9), not float32(1e-5)
    exact = model.double().train()
    opt = torch.optim.AdamW(exact.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    x, y = torch.from_numpy(pixels).double(), torch.from_numpy(labels)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        total = 0.0
        for mb in range(4):
            rows = slice(2 * mb, 2 * mb + 2)
            loss = torch.nn.functional.cross_entropy(exact(x[rows]), y[rows], reduction="sum") / len(y)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(exact.parameters(), 1.0, foreach=False)
        opt.step()
        losses.append(total)
    np.save(out / "torch_losses.npy", np.array(losses))
    np.savez(out / "torch_state.npz", **{k: v.detach().numpy() for k, v in exact.state_dict().items()
                                          if v.is_floating_point()})


if __name__ == "__main__":
    main()
