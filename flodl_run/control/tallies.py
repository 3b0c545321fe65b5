"""What the ranks did, tallied: per window (since the last reduce) and per epoch, from the
ranks' WindowDone reports. Plain values; the windows, the exact steps and the async chunks fill them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from flodl_run.contracts.scalars import merge
from flodl_run.contracts.wire import WindowDone


@dataclass
class WindowTally:
    """What each rank did since the last reduce."""

    batches: List[int]
    samples: List[int]
    wall_ms: List[float]
    fill_ms: List[float]
    loss_sum: List[float]
    lr: List[Optional[float]]
    scalars: Dict[str, List[float]] = field(default_factory=dict)
    left: List[int] = field(default_factory=list)
    """Batches each rank's deadline left untrained (given back to the pool)."""
    loss_batches: List[int] = field(default_factory=list)
    """The batches each rank's `loss_sum` holds (`WindowDone.loss_count`)."""

    @classmethod
    def empty(cls, n: int) -> "WindowTally":
        return cls([0] * n, [0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [None] * n, left=[0] * n,
                   loss_batches=[0] * n)

    def drop(self, ranks: Set[int]) -> None:
        """Dead ranks contributed nothing that survives: their work is redone."""
        for r in ranks:
            self.batches[r], self.samples[r], self.wall_ms[r], self.loss_sum[r] = 0, 0, 0.0, 0.0
            self.loss_batches[r] = 0

    def mean_loss(self) -> Optional[float]:
        """The mean loss of the batches that gave one so far (None: none yet)."""
        return mean_loss(self.loss_sum, self.loss_batches)

    def add(self, done: WindowDone) -> None:
        r = done.rank
        if self.batches[r] == 0:
            self.fill_ms[r] = done.fill_ms
        self.batches[r] += done.batches
        self.samples[r] += done.samples
        self.wall_ms[r] += done.wall_ms
        self.loss_sum[r] += done.loss_sum
        self.loss_batches[r] += done.loss_count
        self.lr[r] = done.lr
        self.left[r] += done.left
        merge(self.scalars, done.scalars)


@dataclass
class EpochTally:
    batches: List[int]
    samples: List[int]
    wall_ms: List[float]
    loss_sum: List[float]
    scalars: Dict[str, List[float]] = field(default_factory=dict)
    reported_loss: float = 0.0
    reported_loss_batches: int = 0
    reports: int = 0
    started: float = field(default_factory=time.perf_counter)
    loss_batches: List[int] = field(default_factory=list)
    """The batches each rank's `loss_sum` holds (`WindowDone.loss_count`)."""

    @classmethod
    def empty(cls, n: int) -> "EpochTally":
        return cls([0] * n, [0] * n, [0.0] * n, [0.0] * n, loss_batches=[0] * n)

    def mean_loss(self) -> Optional[float]:
        """The epoch's mean loss per batch over every rank's batches that gave one (a batch of
        no sample gives none); None when none did."""
        return mean_loss(self.loss_sum, self.loss_batches)

    def add_done(self, done: WindowDone) -> None:
        """cpu_async: windows straddle epochs, so epochs count WindowDone messages directly."""
        r = done.rank
        self.batches[r] += done.batches
        self.samples[r] += done.samples
        self.wall_ms[r] += done.wall_ms
        self.loss_sum[r] += done.loss_sum
        self.loss_batches[r] += done.loss_count
        merge(self.scalars, done.scalars)

    def drop_done(self, done: WindowDone) -> None:
        """cpu_async: a dead rank's reported window is redone by others (its chunk went back
        to the pool): its count leaves the epoch (user scalars, merged already, stay)."""
        r = done.rank
        self.batches[r] -= done.batches
        self.samples[r] -= done.samples
        self.wall_ms[r] -= done.wall_ms
        self.loss_sum[r] -= done.loss_sum
        self.loss_batches[r] -= done.loss_count

    def add(self, window: WindowTally) -> None:
        for r in range(len(self.batches)):
            self.batches[r] += window.batches[r]
            self.samples[r] += window.samples[r]
            self.wall_ms[r] += window.wall_ms[r]
            self.loss_sum[r] += window.loss_sum[r]
            self.loss_batches[r] += window.loss_batches[r]
        merge(self.scalars, window.scalars)


def mean_loss(loss_sum: List[float], loss_batches: List[int]) -> Optional[float]:
    """Per batch, over every rank: the losses' sum over the batches that gave one."""
    count = sum(loss_batches)
    return sum(loss_sum) / count if count else None
