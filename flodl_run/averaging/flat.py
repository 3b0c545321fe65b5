"""Flat parameter storage: a model's parameters become views into one buffer per dtype.

One contiguous buffer lets a reduce be a few large collectives (not one per tensor) and the
pre-reduce scratch copy one memcpy. Owns the flattening and the buffer classification of
The buffer rule (float buffers ride the reduce, integer buffers stay local); not the reduce itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional

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


_CHUNK = 1 << 18  # 256K elements: float32 dot products this short stay accurate to ~1e-6,
                  # and their sum is accumulated in a Python float (double)


@torch.no_grad()
def _sum_squares(tensors: List[torch.Tensor], minus: Optional[List[torch.Tensor]] = None) -> float:
    total = 0.0
    for i, t in enumerate(tensors):
        flat = t.reshape(-1)
        other = None if minus is None else minus[i].reshape(-1)
        scratch = torch.empty(min(_CHUNK, flat.numel()), dtype=flat.dtype, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            piece = flat[start:start + _CHUNK]
            if other is not None:
                piece = torch.sub(piece, other[start:start + _CHUNK], out=scratch[:piece.numel()])
            total += float(torch.dot(piece.float(), piece.float()))
    return total


def relative_distance(before: List[torch.Tensor], after: List[torch.Tensor],
                      after_norm_sq: Optional[float] = None) -> float:
    """||before - after|| / ||after|| over all buffers (global L2, float64 accumulation);
    0 when ||after|| ~ 0. Pass `after_norm_sq` to reuse ||after||^2 across several `before`."""
    norm_sq = _sum_squares(after) if after_norm_sq is None else after_norm_sq
    if norm_sq <= 1e-24:
        return 0.0
    return (_sum_squares(before, minus=after) / norm_sq) ** 0.5


def squared_norm(tensors: List[torch.Tensor]) -> float:
    return _sum_squares(tensors)
