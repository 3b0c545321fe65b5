"""Per-rank data-plane metrics: what a rank's data plane counts, and their per-epoch roll-up.

Owns the counters (data-starve ms, rows by cache tier, the delivery mode), the WindowDone
fields they travel in and the coordinator-side tally that turns them into per-rank EpochRecord
fields. Plain values: no clock, no torch; the data plane does the measuring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

TIERS = ("vram", "ram", "disk")
"""Where a delivered row can come from besides the data set itself (the `source`)."""


def _zero_hits() -> Dict[str, int]:
    return {tier: 0 for tier in TIERS}


@dataclass
class DataStats:
    """A rank's counters since they were last taken."""

    starve_ms: float = 0.0
    """Time the steps waited for their batches."""
    rows: int = 0
    """Rows delivered."""
    hits: Dict[str, int] = field(default_factory=_zero_hits)
    """Rows served by each tier."""
    delivery: str = "streaming"
    """resident or streaming (the mode now, not a count)."""

    def add(self, tier: str, rows: int) -> None:
        if tier in self.hits:
            self.hits[tier] += rows

    def take(self) -> Dict[str, Any]:
        """The WindowDone fields of the counters so far; resets them (not the mode)."""
        out = {"data_starve_ms": self.starve_ms, "data_rows": self.rows,
               "data_hits": dict(self.hits), "delivery": self.delivery}
        self.starve_ms, self.rows, self.hits = 0.0, 0, _zero_hits()
        return out

    def take_epoch(self) -> Dict[str, List[Any]]:
        """The EpochRecord fields of a one-rank run (solo); resets the counters."""
        return _fields([self.take()])


def hit_rates(rows: int, hits: Dict[str, int]) -> Dict[str, float]:
    """Share of the rows each tier served (0.0 with no rows)."""
    return {tier: (hits.get(tier, 0) / rows if rows else 0.0) for tier in TIERS}


def _fields(per_rank: List[Dict[str, Any]]) -> Dict[str, List[Any]]:
    return {
        "per_rank_data_starve_ms": [r["data_starve_ms"] for r in per_rank],
        "per_rank_delivery": [r["delivery"] for r in per_rank],
        "per_rank_cache_hit_rate": [hit_rates(r["data_rows"], r["data_hits"]) for r in per_rank],
    }


class DataTally:
    """Coordinator side: sums the data fields of WindowDone messages per epoch and rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._epochs: Dict[int, List[Dict[str, Any]]] = {}

    def add(self, done: Any) -> None:
        """Count one WindowDone (any object with its data fields, rank and epoch)."""
        ranks = self._epochs.setdefault(done.epoch, [_empty() for _ in range(self.world_size)])
        if not 0 <= done.rank < self.world_size:
            return
        entry = ranks[done.rank]
        entry["data_starve_ms"] += done.data_starve_ms
        entry["data_rows"] += done.data_rows
        for tier, count in done.data_hits.items():
            entry["data_hits"][tier] = entry["data_hits"].get(tier, 0) + count
        if done.delivery:
            entry["delivery"] = done.delivery

    def epoch_fields(self, epoch: int) -> Dict[str, List[Any]]:
        """Per-rank EpochRecord fields of `epoch` (zeros for a rank that sent nothing)."""
        ranks = self._epochs.pop(epoch, None) or [_empty() for _ in range(self.world_size)]
        return _fields(ranks)


def _empty() -> Dict[str, Any]:
    return {"data_starve_ms": 0.0, "data_rows": 0, "data_hits": _zero_hits(), "delivery": ""}
