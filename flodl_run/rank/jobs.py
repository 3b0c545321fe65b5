"""The work a rank holds: Train orders cut into batches of sample indices, worked through one
batch at a time, and the diagnostic of where an idle rank's time goes.

The cut is the rank's half of the pick contract (the data plane keys and prefetches the same
batches); which slices a rank trains is the coordinator's.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from flodl_run.contracts.clock import ClockEstimate, coordinator_ns, local_s
from flodl_run.contracts.wire import Train
from flodl_run.data.passes import permutation


@dataclass
class Job:
    """One Train order being worked through, batch by batch."""

    order: Train
    batches: List[torch.Tensor]
    done: int = 0
    samples: int = 0
    loss_sum: Optional[torch.Tensor] = None
    """Sum of the window's losses, on the device (read once, when the window is done)."""
    loss_batches: int = 0
    """The batches `loss_sum` holds the losses of (those with samples that reported one)."""
    step_ms: List[float] = field(default_factory=list)
    micro: List[Any] = field(default_factory=list)
    """nccl_sync (gradients): the exact step's micro-batch of each batch (rank.exact.Micro)."""
    began: Optional[float] = None
    """perf_counter when its first batch began."""
    deadline_s: Optional[float] = None
    """A deadline window's end on this rank's perf_counter (the order's instant on the
    coordinator's clock, shifted by the estimated offset); None: no estimate yet, the
    deadline then counts `deadline_ms` from the first batch."""

    def is_over(self, now: float) -> bool:
        """Every batch trained, or (a deadline window) its deadline passed."""
        if self.done >= len(self.batches):
            return True
        if self.deadline_s is not None:
            return now >= self.deadline_s
        deadline_ms = self.order.deadline_ms
        return bool(deadline_ms) and self.began is not None and (now - self.began) * 1000.0 >= deadline_ms

    def began_ns(self, estimate: Optional[ClockEstimate]) -> Optional[int]:
        """When a deadline window's first batch began, on the coordinator's clock (None: a
        count window, or no clock estimate)."""
        if self.order.deadline_ns is None or estimate is None or self.began is None:
            return None
        return coordinator_ns(self.began, estimate)

    @property
    def left(self) -> int:
        """Batches of the order not trained (a deadline window that ended early)."""
        return len(self.batches) - self.done


def deadline_s(order: Train, estimate: Optional[ClockEstimate]) -> Optional[float]:
    """A deadline window's shared instant on this rank's perf_counter (None: a count window,
    or no clock estimate yet)."""
    if order.deadline_ns is None or estimate is None:
        return None
    return local_s(order.deadline_ns, estimate)


class BatchCutter:
    """Cuts a Train order's slices `(pass, offset, size)` of the pass's permutation into
    batches of `batch_size` indices into a dataset of `num_samples` (each slice on its own).
    A pass's permutation covers `augment` copies of the dataset; only the latest pass's is kept."""

    def __init__(self, num_samples: int, augment: int, seed: int, batch_size: int):
        self.num_samples, self.augment, self.seed = num_samples, augment, seed
        self.batch_size = batch_size
        self._perms: Dict[int, torch.Tensor] = {}

    def cut(self, order: Train) -> List[torch.Tensor]:
        batches = []
        for pass_index, offset, size in order.slices:
            indices = self._indices(pass_index, offset, size)
            batches += list(indices.split(self.batch_size))
        return batches

    def cut_sizes(self, order: Train, sizes: List[int]) -> List[torch.Tensor]:
        """The order's samples, its slices back to back, cut into batches of `sizes` (nccl_sync's
        micro-batches, step after step)."""
        indices = [self._indices(p, offset, size) for p, offset, size in order.slices]
        joined = torch.cat(indices) if indices else torch.empty(0, dtype=torch.long)
        return list(joined.split(sizes))

    def _indices(self, pass_index: int, offset: int, size: int) -> torch.Tensor:
        if pass_index not in self._perms:
            self._perms = {pass_index: permutation(self.num_samples * self.augment, self.seed,
                                                   pass_index)}
        return self._perms[pass_index][offset:offset + size] % self.num_samples


def fill_ms(step_ms: List[float]) -> float:
    """Excess of the first batch over the mean of the rest (cold caches, lazy init)."""
    if len(step_ms) < 2:
        return 0.0
    rest = sum(step_ms[1:]) / (len(step_ms) - 1)
    return max(0.0, step_ms[0] - rest)


class Waits:
    """Where an idle rank's time goes (FLODL_RUN_WAITS=1, a diagnostic): how long it waited for
    each order after each fact it sent (e.g. Reduced -> Train), and how long it spent handling
    each order; one JSON line on stderr at Stop (the rank's log)."""

    def __init__(self, on: bool):
        self.on, self.last_sent = on, "start"
        self.totals: Dict[str, List[float]] = {}

    def sent(self, what: str) -> None:
        self.last_sent = what

    def _add(self, key: str, ms: float) -> None:
        self.totals.setdefault(key, []).append(ms)

    def waited(self, message: Any, since: Optional[float], now: float) -> None:
        if self.on and since is not None:
            self._add(f"wait {self.last_sent}->{type(message).__name__}", (now - since) * 1000.0)

    def handled(self, message: Any, began: float) -> None:
        if self.on:
            self._add(f"handle {type(message).__name__}", (time.perf_counter() - began) * 1000.0)

    def report(self, rank: int) -> None:
        if self.on:
            summary = {k: {"n": len(v), "total_ms": round(sum(v), 1),
                           "median_ms": round(sorted(v)[len(v) // 2], 2)}
                       for k, v in sorted(self.totals.items())}
            print(f"rank {rank} waits: {json.dumps(summary)}", file=sys.stderr, flush=True)
