"""The weighted consensus among ranks over torch.distributed (NCCL on CUDA, Gloo on CPU).

The weighted average: all-reduce [w_k, moved_k], pre-scale each rank's flat buffers by w_k / sum w,
all-reduce SUM; float buffers equal-weighted among the ranks that stepped. Owns one reduce on
one rank; when to reduce is the coordinator's call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from flodl_run.averaging.flat import FlatParams, relative_distance


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or timed out); the replica was restored."""


def consensus_weight(steps: int, gamma: float) -> float:
    """w_k = 0 if n_k == 0 else n_k ** gamma."""
    return 0.0 if steps <= 0 else float(steps) ** gamma


@dataclass(frozen=True)
class ReduceOutcome:
    applied: bool
    """False when every weight was 0 (nobody trained): parameters untouched."""
    weight: float
    total_weight: float
    divergence: float
    """This rank's ||theta_before - consensus|| / ||consensus||."""
    scratch: Optional[List[torch.Tensor]]
    """Pre-reduce parameters (for a retry after a rank death)."""


def weighted_reduce_(flat: FlatParams, steps: int, gamma: float,
                     group: Optional[dist.ProcessGroup] = None) -> ReduceOutcome:
    """Replace this rank's parameters and float buffers by the cohort's consensus, in place."""
    device = flat.buffers[0].device
    weight = consensus_weight(steps, gamma)
    moved = 1.0 if steps > 0 else 0.0
    meta = torch.tensor([weight, moved], dtype=torch.float64, device=device)
    try:
        dist.all_reduce(meta, group=group)
    except Exception as exc:  # a peer died before anything moved: the replica is untouched
        raise CollectiveError(str(exc)) from exc
    total_weight, movers = float(meta[0]), float(meta[1])
    if total_weight <= 0.0:
        return ReduceOutcome(False, weight, 0.0, 0.0, None)
    scratch = flat.clone()
    stats = flat.flat_float_buffers().clone() if flat.float_buffers else None
    try:
        for buf in flat.buffers:
            buf.mul_(weight / total_weight)
            dist.all_reduce(buf, group=group)
        _reduce_float_buffers_(flat, moved / movers, group)
    except Exception as exc:  # a peer died mid-reduce: leave this replica as it was
        flat.copy_(scratch)
        if stats is not None:
            flat.load_float_buffers_(stats)
        raise CollectiveError(str(exc)) from exc
    return ReduceOutcome(True, weight, total_weight, relative_distance(scratch, flat.buffers), scratch)


def _reduce_float_buffers_(flat: FlatParams, share: float, group: Optional[dist.ProcessGroup]) -> None:
    """Running statistics: equal weight among ranks that stepped, never gamma-weighted."""
    if not flat.float_buffers:
        return
    device = flat.buffers[0].device
    stats = flat.flat_float_buffers().to(device).mul_(share)
    dist.all_reduce(stats, group=group)
    flat.load_float_buffers_(stats)
