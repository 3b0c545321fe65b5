"""A frozen feature extractor under a trainable head (`requires_grad_(False)`, as fine-tuning a
pretrained backbone does) on the bundled digits: parameters that no step may change, which torch
DDP leaves out of its reducer and the optimizer never sees.

The backbone is random (seeded, so every rank builds the same one): random ReLU features are
enough for a linear head to read the digits.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import TensorDataset

from recipes.digits_mlp import eval_step, train_step  # noqa: F401
from recipes.zoo.data import digits

BACKBONE_SEED = 7  # the "pretrained" weights: fixed, the same whatever the run's seed


def train_dataset(**_: object) -> TensorDataset:
    return digits(train=True)


def eval_dataset(**_: object) -> TensorDataset:
    return digits(train=False)


def build_model(device: torch.device, hidden: int = 256, **_: object) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(BACKBONE_SEED)
        backbone = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    backbone.requires_grad_(False)
    model = nn.Sequential(OrderedDict(backbone=backbone, head=nn.Linear(hidden, 10)))
    return model.to(device)


def build_optimizer(parameters, lr: float = 0.05, momentum: float = 0.9, **_: object):
    """SGD over the trainable parameters only. (torch's optimizers also skip a parameter whose
    `.grad` is None, so passing all of them would leave the frozen ones alone as well; filtering
    says so, and keeps momentum buffers off them.)"""
    return torch.optim.SGD([p for p in parameters if p.requires_grad], lr=lr, momentum=momentum)
