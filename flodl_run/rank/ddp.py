"""The manual per-rank API for loops that need per-step control (GANs, RL).

Wrap a model on each rank of an initialised torch.distributed process group, then call the
sync primitives where the loop needs them. Gradients and buffers travel as flattened buckets
(one collective per dtype, not one per tensor). No coordinator, no ElChe: the loop is yours.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn


def _flat_groups(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[torch.Tensor]]:
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def all_reduce_flat_(tensors: Sequence[torch.Tensor], scale: float,
                      group: Optional[dist.ProcessGroup]) -> None:
    """SUM-all-reduce `tensors` in one flat bucket per dtype, scaled by `scale` before the sum."""
    for same in _flat_groups(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in same]).mul_(scale)
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


class Ddp:
    """Sync primitives over one model on this rank."""

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None):
        self.model = model
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @classmethod
    def wrap(cls, model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> "Ddp":
        """Wrap and broadcast rank 0's parameters so every replica starts identical."""
        ddp = cls(model, group)
        ddp.sync_params()
        return ddp

    def sync_params(self) -> None:
        """Broadcast parameters and buffers from rank 0 (the group's first rank)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=src, group=self.group)

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def all_reduce_gradients(self) -> None:
        """grad <- mean over ranks. Call after backward, before optimizer.step()."""
        all_reduce_flat_(self._grads(), 1.0 / self.world_size, self.group)

    def weighted_all_reduce_gradients(self, batch_counts: Sequence[int]) -> None:
        """grad <- sum_r (count_r / sum count) * grad_r; `batch_counts` lists every rank's count."""
        if len(batch_counts) != self.world_size:
            raise ValueError(f"rank {self.rank}: batch_counts has {len(batch_counts)} entries, "
                             f"world size is {self.world_size}")
        total = float(sum(batch_counts))
        if total <= 0:
            raise ValueError(f"rank {self.rank}: batch_counts sum to 0")
        all_reduce_flat_(self._grads(), batch_counts[self.rank] / total, self.group)

    def sync_buffers(self) -> None:
        """Float buffers (running statistics) <- mean over ranks; integer buffers stay local."""
        floats = [b for b in self.model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            all_reduce_flat_(floats, 1.0 / self.world_size, self.group)
