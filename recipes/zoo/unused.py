"""A classifier with an auxiliary head that only some steps use, on the bundled digits: on a batch
whose first label is odd the reconstruction head takes no part, so its parameters get no
gradient that step. torch DDP must then be told (`find_unused_parameters: true` in
conf/recipe/zoo_unused.yaml) or it waits for their gradients forever.

The branch is in `forward`, where DDP's search for unused parameters looks (from the outputs of
the wrapped forward), and depends on the data only, so a run and its torch DDP reference take it
on the same steps.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from recipes.digits_mlp import build_optimizer, eval_step  # noqa: F401
from recipes.zoo.data import digits


def train_dataset(**_: object) -> TensorDataset:
    return digits(train=True)


def eval_dataset(**_: object) -> TensorDataset:
    return digits(train=False)


class AuxiliaryReconstruction(nn.Module):
    """forward(x) -> logits; forward(x, labels) -> the training loss: cross-entropy, plus the
    reconstruction of `x` from the hidden features when `labels[0]` is even."""

    def __init__(self, hidden: int):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, 10)
        self.decoder = nn.Linear(hidden, 64)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        features = self.encoder(x)
        logits = self.classifier(features)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits, labels)
        if labels[0] % 2 == 0:
            loss = loss + F.mse_loss(self.decoder(features), x)
        return loss


def build_model(device: torch.device, hidden: int = 128, **_: object) -> nn.Module:
    return AuxiliaryReconstruction(hidden).to(device)


def train_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)
