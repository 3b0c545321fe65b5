"""Provisional balancer adapter for the coordinator (replaced by ElChe when it lands)."""

from __future__ import annotations

from typing import List, Optional

from flodl_run.config.schema import ElCheConfig


class Balance:
    def __init__(self, config: ElCheConfig, world_size: int, epoch_batches: int, batch_size: int):
        self.config = config
        self.world_size = world_size
        self.anchor = config.anchor
        self.batch_counts = [config.anchor] * world_size
        self.ms: List[Optional[float]] = [None] * world_size
        self.phase_name = "probe"

    def on_reduce(self, wall_ms, batches, fill_ms, sync_ms, divergence, lr) -> None:
        for r in range(self.world_size):
            if batches[r] > 0:
                self.ms[r] = wall_ms[r] / batches[r]
        if all(m is not None for m in self.ms):
            slow = max(self.ms)
            self.batch_counts = [max(1, round(self.anchor * min(slow / m, 64))) for m in self.ms]

    def fastest_rank(self) -> int:
        known = [(m, r) for r, m in enumerate(self.ms) if m is not None]
        return min(known)[1] if known else 0
