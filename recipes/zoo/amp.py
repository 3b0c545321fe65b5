"""Mixed precision, as torch's AMP recipe does it: an MLP on the bundled digits whose steps are
plain fp32 code; `amp: fp16` in conf/recipe/zoo_amp.yaml makes the runtime run `train_step` under
`torch.autocast(dtype=torch.float16)` and step through a `torch.amp.GradScaler`.

Under autocast the Linear layers compute in fp16 and the loss in fp32; the parameters, their
gradients and the optimizer's state stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from recipes.digits_mlp import build_optimizer, eval_step, train_step  # noqa: F401
from recipes.zoo.data import digits


def train_dataset(**_: object) -> TensorDataset:
    return digits(train=True)


def eval_dataset(**_: object) -> TensorDataset:
    return digits(train=False)


def build_model(device: torch.device, hidden: int = 256, num_layers: int = 3, **_: object) -> nn.Module:
    """Linear-ReLU layers, as in torch's AMP recipe, then a ten-class head."""
    widths = [64] + [hidden] * num_layers
    layers = [m for d_in, d_out in zip(widths, widths[1:]) for m in (nn.Linear(d_in, d_out), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(hidden, 10)).to(device)
