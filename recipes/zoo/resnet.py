"""torchvision's ResNet on the bundled digits: BatchNorm's buffers (float running stats and an
integer `num_batches_tracked`) beside 4.9 M parameters, the torchvision model people start from.

ResNet-10 (one BasicBlock a stage, torchvision's own widths 64-512) built from torchvision's
class, no weights downloaded; 16x16 RGB inputs keep its stem and the first stage small on CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchvision.models.resnet import BasicBlock, ResNet

from recipes.digits_mlp import build_optimizer, eval_step, train_step  # noqa: F401
from recipes.zoo.data import digit_images


def train_dataset(image_size: int = 16, num_train: int = 512, **_: object) -> TensorDataset:
    return digit_images(train=True, size=image_size, num_samples=num_train)


def eval_dataset(image_size: int = 16, **_: object) -> TensorDataset:
    return digit_images(train=False, size=image_size)


def build_model(device: torch.device, blocks_per_stage: int = 1, **_: object) -> nn.Module:
    """torchvision's ResNet with `blocks_per_stage` BasicBlocks in each of its four stages (2 is
    resnet18), ten classes, torchvision's initialisation."""
    model = ResNet(BasicBlock, [blocks_per_stage] * 4, num_classes=10)
    return model.to(device)
