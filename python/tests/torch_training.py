"""PyTorch's side of the tests that train a module with the runner and compare: the runner's
training written in PyTorch (AdamW with weight decay on every parameter, the global gradient norm
clipped, no foreach kernels), and the distance the tests hold trained weights to."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def train_as_runner(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], steps: int, lr: float,
                    weight_decay: float, clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` steps of a copy of `model` on the loss `loss_of(model)`: the losses and the trained
    parameters by name."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖, in f64."""
    g, w = got.detach().double(), want.double()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))
