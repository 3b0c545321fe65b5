"""Flat parameter storage: a model's parameters become views into one buffer per dtype.

One contiguous buffer lets a reduce be a few large collectives (not one per tensor) and the
pre-reduce scratch copy one memcpy. Owns the flattening and the buffer classification of
DESIGN §7.2 (float buffers ride the reduce, integer buffers stay local); not the reduce itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

import torch
from torch import nn


class FlatParams:
    """The parameters of `model`, re-homed as views into flat per-dtype buffers.

    Must be built after the model is on its device and before anything caches parameter
    storage; the optimizer keeps working because the Parameter objects stay the same.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = OrderedDict()
        for p in model.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers: List[torch.Tensor] = []
        for params in by_dtype.values():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            offset = 0
            for p in params:
                n = p.numel()
                p.data = flat[offset:offset + n].view_as(p)
                offset += n
            self.buffers.append(flat)
        self.float_buffers = [b for b in model.buffers() if b.is_floating_point()]

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def clone(self) -> List[torch.Tensor]:
        return [b.clone() for b in self.buffers]

    def copy_(self, source: List[torch.Tensor]) -> None:
        for dst, src in zip(self.buffers, source):
            dst.copy_(src)

    def flat_float_buffers(self) -> torch.Tensor:
        """The float buffers (BatchNorm running stats) as one new flat tensor (may be empty)."""
        if not self.float_buffers:
            return torch.empty(0)
        return torch.cat([b.detach().reshape(-1).float() for b in self.float_buffers])

    def load_float_buffers_(self, flat: torch.Tensor) -> None:
        offset = 0
        for b in self.float_buffers:
            n = b.numel()
            b.copy_(flat[offset:offset + n].view_as(b))
            offset += n


def relative_distance(before: List[torch.Tensor], after: List[torch.Tensor]) -> float:
    """||before - after|| / ||after|| over all buffers (global L2); 0 when ||after|| ~ 0."""
    diff_sq = sum(float(torch.sum((b.double() - a.double()) ** 2)) for b, a in zip(before, after))
    norm_sq = sum(float(torch.sum(a.double() ** 2)) for a in after)
    if norm_sq <= 1e-24:
        return 0.0
    return (diff_sq / norm_sq) ** 0.5
