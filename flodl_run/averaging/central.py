"""The coordinator backend's consensus on CPU (cpu_* modes).

Owns one round of the central reduce: the work-weighted mean of the ranks' snapshots, the
float-buffer rule (equal weight among ranks that stepped), the outer step (once, here), the
divergence of each rank from the consensus, and the EASGD center for cpu_async. Plain torch
on CPU tensors; receiving snapshots and sending updates are the coordinator's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flodl_run.averaging.collective import consensus_weight
from flodl_run.averaging.flat import alignment, divergence_table, relative_distance, squared_norm
from flodl_run.averaging.outer import OuterOptimizer, same_layout


@dataclass
class Snapshot:
    """One rank's state at a reduce: flat parameters per dtype and its flat float buffers."""

    rank: int
    steps: int
    params: List[torch.Tensor]
    float_buffers: torch.Tensor
    finite: bool = True
    """False: the rank's parameters or loss were NaN/inf (it said so): weight 0 this round."""


@dataclass
class CentralResult:
    params: List[torch.Tensor]
    """What ranks adopt: the consensus after the outer step, or the EASGD center."""
    float_buffers: Optional[torch.Tensor]
    """New float buffers (None when no rank stepped: keep local ones)."""
    divergence: float
    """D = max_k ||theta_k - consensus|| / ||consensus||."""
    weights: List[float]
    outer_stepped: bool = False
    """The outer optimizer moved the parameters (ranks then reset their inner
    optimizer state when outer.reset_inner_state asks)."""
    nonfinite: List[int] = field(default_factory=list)
    """Ranks whose snapshot was non-finite: they contributed nothing and adopt the result."""


class CentralAverager:
    """State that outlives a round: the outer optimizer and the EASGD center."""

    def __init__(self, outer: OuterOptimizer, gamma: float, easgd_alpha: Optional[float]):
        self.outer = outer
        self.gamma = gamma
        self.alpha = easgd_alpha
        self.center: Optional[List[torch.Tensor]] = None
        self.start: Optional[List[torch.Tensor]] = None
        """What the ranks adopted last round (where their windows began), kept for the
        divergence's cosine/magnitude; copied into the same buffers every round."""
        self._last: Optional[tuple] = None  # (finite snapshots, consensus, result) for breakdown()

    def seed_center(self, params: Sequence[torch.Tensor]) -> None:
        """EASGD: the center starts at the initial parameters."""
        self.center = [p.clone() for p in params]

    def reduce(self, snapshots: Sequence[Snapshot],
               out: Optional[Sequence[torch.Tensor]] = None) -> Optional[CentralResult]:
        """One round; None when every weight is 0 (nobody trained). `out`: where to build the
        consensus (the coordinator's shared-memory slab, saving a copy), else new tensors."""
        weights = [consensus_weight(s.steps, self.gamma) if s.finite else 0.0 for s in snapshots]
        total = sum(weights)
        if total <= 0:
            return None
        # Only ranks with weight > 0 are summed: 0 x NaN would be NaN.
        (first, w0), *rest = [(s.params, w) for s, w in zip(snapshots, weights) if w > 0]
        consensus = [torch.mul(p, w0 / total, out=o) for p, o in zip(first, out)] if out \
            else [torch.mul(p, w0 / total) for p in first]
        for params, w in rest:
            for acc, p in zip(consensus, params):
                acc.add_(p, alpha=w / total)
        finite = [s for s in snapshots if s.finite]
        norm_sq = squared_norm(consensus)
        divergence = max(relative_distance(s.params, consensus, norm_sq) for s in finite)
        stepped = self.outer.step_(consensus)
        params = self._easgd(consensus) if self.alpha is not None else consensus
        self._last = (finite, consensus, params)
        return CentralResult(params, _mean_buffers(finite), divergence, weights, stepped,
                             [s.rank for s in snapshots if not s.finite])

    def breakdown(self) -> Dict[int, Tuple[Optional[float], Optional[float]]]:
        """The last round's divergence breakdown, rank -> (cosine, magnitude) of its window
        update against the consensus's (the global the ranks adopt, after any outer step),
        both measured from what the ranks adopted the round before; empty on the first round.
        Call it after the update went out: it costs a few passes over the parameters, off the
        round trip the ranks wait for. Then remembers this round's result as the next start."""
        if self._last is None:
            return {}
        finite, consensus, params = self._last
        self._last = None
        found = {}
        if self.start is not None:
            table = divergence_table([s.params for s in finite], consensus, self.start)
            found = {s.rank: alignment(*row[2:]) for s, row in zip(finite, table)}
        if self.start is None:
            self.start = [p.clone() for p in params]
        else:
            for mine, p in zip(self.start, params):
                mine.copy_(p)
        return found

    def _easgd(self, consensus: List[torch.Tensor]) -> List[torch.Tensor]:
        """center <- (1 - a) * center + a * m_t; replicas then blend toward the new center."""
        if self.center is None or not same_layout(self.center, consensus):
            self.center = [c.clone() for c in consensus]
            return self.center
        for center, m in zip(self.center, consensus):
            center.lerp_(m, self.alpha)
        return self.center


def blend_(local: Sequence[torch.Tensor], remote: Sequence[torch.Tensor], alpha: float) -> None:
    """Rank side: local <- (1 - alpha) * local + alpha * remote (alpha 1.0 = overwrite: a copy,
    since lerp keeps a NaN of `local` even at weight 1)."""
    with torch.no_grad():
        for mine, theirs in zip(local, remote):
            if alpha == 1.0:
                mine.copy_(theirs, non_blocking=True)
            else:
                mine.lerp_(theirs.to(mine.device, non_blocking=True), alpha)


def _mean_buffers(snapshots: Sequence[Snapshot]) -> Optional[torch.Tensor]:
    movers = [s.float_buffers for s in snapshots if s.steps > 0]
    if not movers or movers[0].numel() == 0:
        return None
    return torch.stack(movers).mean(dim=0)
