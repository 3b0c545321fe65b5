"""A model returned through `torch.compile`, the digits CNN with BatchNorm (recipes.digits_cnn):
the runner gets the compiled wrapper (its `_orig_mod` holds the parameters and buffers), and
BatchNorm's running stats are updated from inside the compiled graph.

`backend` defaults to "aot_eager" (AOTAutograd's graphs run by eager kernels: no C++ build,
seconds on a CPU); a GPU run passes `recipe.params.backend=inductor`.
"""

from __future__ import annotations

import torch
from torch import nn

from recipes.digits_cnn import build_model as build_eager
from recipes.digits_cnn import eval_dataset, train_dataset  # noqa: F401
from recipes.digits_mlp import build_optimizer, eval_step, train_step  # noqa: F401


def build_model(device: torch.device, channels: int = 16, backend: str = "aot_eager",
                **_: object) -> nn.Module:
    return torch.compile(build_eager(device, channels=channels), backend=backend)
