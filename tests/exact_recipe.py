"""A recipe for the exactness tests of nccl_sync: a small MLP on fixed random data, with SGD
(momentum) or AdamW, so a run's parameters can be compared with a single process's."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

NUM_SAMPLES = 725  # 11 global steps of 64 and a last one of 21 samples


def train_dataset(**_: object) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 12, generator=gen)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def build_model(device: torch.device, hidden: int = 32, middle: bool = False, **_: object) -> nn.Module:
    """`middle`: one more hidden layer (hidden x hidden): at 600 it is past DDP's first 1 MiB
    bucket, so the model's gradients come in two buckets."""
    inner = [nn.Linear(hidden, hidden), nn.Tanh()] if middle else []
    return nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), *inner, nn.Linear(hidden, 3)).to(device)


def build_optimizer(parameters, optimizer: str = "sgd", lr: float = 0.05, **_: object):
    if optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(parameters, lr=lr, momentum=0.9)


def train_step(model: nn.Module, batch, door: str = "call") -> torch.Tensor:
    """`door`: call the model (`model(x)`, through its hooks) or its `forward` directly, as a
    model's own method does (past them)."""
    x, y = batch
    logits = model.forward(x) if door == "forward" else model(x)
    return nn.functional.cross_entropy(logits, y)
