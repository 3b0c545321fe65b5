"""A small CNN with BatchNorm on the bundled 8x8 digits: exercises the buffer rule."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from recipes.digits_mlp import _digits, build_optimizer, eval_step, train_step  # noqa: F401


def train_dataset(**_: object) -> TensorDataset:
    return _digits(train=True, image=True)


def eval_dataset(**_: object) -> TensorDataset:
    return _digits(train=False, image=True)


def build_model(device: torch.device, channels: int = 16, **_: object) -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(2 * channels * 16, 10),
    )
    return model.to(device)
