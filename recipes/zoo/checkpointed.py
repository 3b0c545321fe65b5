"""Activation checkpointing inside the model, on the bundled digits: each residual block runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` while training, so its forward
runs again during backward (the non-reentrant kind, the one torch recommends and DDP supports).

LayerNorm, not BatchNorm: a recomputed BatchNorm would update its running stats twice a step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from recipes.digits_mlp import build_optimizer, eval_step, train_step  # noqa: F401
from recipes.zoo.data import digits


def train_dataset(**_: object) -> TensorDataset:
    return digits(train=True)


def eval_dataset(**_: object) -> TensorDataset:
    return digits(train=False)


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                  nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class CheckpointedMLP(nn.Module):
    """Residual MLP whose blocks keep no activations while training (recomputed in backward)."""

    def __init__(self, width: int, num_blocks: int):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(num_blocks))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.training else block(h)
        return self.head(h)


def build_model(device: torch.device, width: int = 64, num_blocks: int = 3, **_: object) -> nn.Module:
    return CheckpointedMLP(width, num_blocks).to(device)
