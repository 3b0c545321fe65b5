"""A teacher network labels Gaussian inputs; a student MLP learns them. Used by the benchmarks.

`num_samples`, `in_features`, `hidden` and `depth` set the data size and the step cost; the
data depends only on `data_seed`, so every rank and every run sees the same set.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

HELD_OUT_SHARE = 0.2


def _mlp(in_features: int, hidden: int, depth: int, num_classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _dataset(train: bool, num_samples: int = 8192, in_features: int = 64, num_classes: int = 10,
             data_seed: int = 1234, **_: object) -> TensorDataset:
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(num_samples, in_features, generator=gen)
    teacher = _mlp(in_features, 64, 2, num_classes)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        y = teacher(x).argmax(dim=1)
    cut = int(num_samples * (1 - HELD_OUT_SHARE))
    return TensorDataset(x[:cut], y[:cut]) if train else TensorDataset(x[cut:], y[cut:])


def train_dataset(**params: object) -> TensorDataset:
    return _dataset(True, **params)


def eval_dataset(**params: object) -> TensorDataset:
    return _dataset(False, **params)


def build_model(device: torch.device, in_features: int = 64, hidden: int = 512, depth: int = 3,
                num_classes: int = 10, **_: object) -> nn.Module:
    return _mlp(in_features, hidden, depth, num_classes).to(device)


def build_optimizer(parameters, lr: float = 0.05, momentum: float = 0.9, **_: object):
    return torch.optim.SGD(parameters, lr=lr, momentum=momentum)


def train_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def eval_step(model: nn.Module, batch) -> tuple[float, int]:
    x, y = batch
    return (model(x).argmax(dim=1) == y).sum().item(), len(y)
