"""Per-rank timing intake of ElChe: raw window timings -> smoothed ms per batch.

Owns the reading rules (divide by batches actually done, callback time excluded, first-batch
fill cost split off for cadence/async) and the trust window (mean of the last 5 valid readings,
cleared after 5 invalid ones in a row). It does not measure anything: the ranks do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

# A rank's smoothed speed is the mean of this many recent valid readings.
KEEP_READINGS = 5
# This many invalid readings in a row mean the rank's old speed no longer describes it.
CLEAR_AFTER_INVALID = 5


@dataclass(frozen=True)
class RankTiming:
    """What one rank measured over one window (all times in ms of its compute wall)."""

    rank: int
    wall_ms: float
    """Wall time of the window's training, callbacks included."""
    batches: int
    """Batches actually done in the window (not the planned count)."""
    callback_ms: float = 0.0
    """Time spent in eval/checkpoint/epoch hooks inside the window; subtracted."""
    first_batch_ms: Optional[float] = None
    """Wall of the window's first batch, which carries the fill cost; None = not measured."""
    fill_ms: Optional[float] = None
    """Or: the first batch's excess over the mean batch, already split off by the rank."""


class Reading(NamedTuple):
    """One window's verdict on a rank's speed; `ms_per_batch` None means invalid.

    A NamedTuple, not a dataclass: the sim reads a million of these (1024 ranks x 1000
    windows) and a tuple is several times cheaper to build.
    """

    ms_per_batch: Optional[float]
    fill_ms: Optional[float] = None

    @property
    def is_valid(self) -> bool:
        return self.ms_per_batch is not None


INVALID = Reading(None)


def read(wall_ms: Optional[float], batches: Optional[int], callback_ms: float = 0.0,
         first_batch_ms: Optional[float] = None, skip_first_batch: bool = False,
         fill_ms: Optional[float] = None) -> Reading:
    """ms per batch of one window; invalid when nothing usable was measured.

    With `skip_first_batch` (cadence/async) the first batch's fill cost stays out of the speed
    and comes back as `fill_ms`: from `first_batch_ms` (needs two batches: the first is left
    out), else from a `fill_ms` the rank already split off (its excess over the mean batch).
    A one-batch window without either counts whole (else a rank at anchor 1 never calibrates).
    """
    return read_columns([wall_ms], [batches], [callback_ms], [first_batch_ms], [fill_ms],
                        skip_first_batch)[0]


def read_columns(wall_ms: Sequence[Optional[float]], batches: Sequence[Optional[int]],
                 callback_ms: Optional[Sequence[Optional[float]]] = None,
                 first_batch_ms: Optional[Sequence[Optional[float]]] = None,
                 fill_ms: Optional[Sequence[Optional[float]]] = None,
                 skip_first_batch: bool = False) -> List[Reading]:
    """`read` for every rank of one window (lists indexed by rank; None = not reported).

    One loop without a call per rank: the sim reads 1024 ranks x 1000 windows.
    """
    out: List[Reading] = []
    for rank, wall in enumerate(wall_ms):
        n = batches[rank]
        if wall is None or not n or n < 1:
            out.append(INVALID)
            continue
        compute = wall - ((callback_ms[rank] or 0.0) if callback_ms is not None else 0.0)
        if not compute > 0 or compute == math.inf:  # also rejects NaN
            out.append(INVALID)
            continue
        first = first_batch_ms[rank] if skip_first_batch and first_batch_ms is not None else None
        fill = fill_ms[rank] if skip_first_batch and fill_ms is not None else None
        if first is not None and n >= 2 and 0 < first < compute:
            ms = (compute - first) / (n - 1)
            out.append(Reading(ms, first - ms if first > ms else 0.0))
        elif fill is not None and 0 <= fill < compute:
            out.append(Reading((compute - fill) / n, fill))
        else:
            out.append(Reading(compute / n))
    return out


def read_timing(timing: RankTiming, skip_first_batch: bool = False) -> Reading:
    """`read` over a RankTiming."""
    return read(timing.wall_ms, timing.batches, timing.callback_ms, timing.first_batch_ms,
                skip_first_batch, timing.fill_ms)


class TimingHistory:
    """Recent valid readings per rank, their mean, and the run of invalid readings."""

    def __init__(self, world_size: int):
        self._readings: List[List[float]] = [[] for _ in range(world_size)]
        self._fills: List[List[float]] = [[] for _ in range(world_size)]
        self._smoothed: List[Optional[float]] = [None] * world_size
        self._invalid_streak: List[int] = [0] * world_size

    @property
    def world_size(self) -> int:
        return len(self._readings)

    def record(self, rank: int, reading: Reading) -> bool:
        """Take one window's reading; True when this reading cleared the rank's history."""
        return bool(self.record_all([reading], [rank]))

    def record_all(self, readings: Sequence[Reading], ranks: Sequence[int]) -> List[int]:
        """Take the readings of `ranks` (in the same order); returns the ranks whose history an
        invalid reading just cleared."""
        cleared: List[int] = []
        streaks, smoothed = self._invalid_streak, self._smoothed
        for rank, (ms, fill) in zip(ranks, readings):
            if ms is None:
                if self.record_invalid(rank):
                    cleared.append(rank)
                continue
            streaks[rank] = 0
            kept = self._readings[rank]
            kept.append(ms)
            if len(kept) > KEEP_READINGS:
                del kept[0]
            smoothed[rank] = sum(kept) / len(kept)
            if fill is not None:
                fills = self._fills[rank]
                fills.append(fill)
                if len(fills) > KEEP_READINGS:
                    del fills[0]
        return cleared

    def record_invalid(self, rank: int) -> bool:
        """A window without a usable reading; True when it cleared the rank's history."""
        self._invalid_streak[rank] += 1
        if self._invalid_streak[rank] == CLEAR_AFTER_INVALID and self._readings[rank]:
            self._drop(rank)
            return True
        return False

    def forget(self, rank: int) -> None:
        """Drop everything known about a rank (it left the run)."""
        self._drop(rank)
        self._invalid_streak[rank] = 0

    def _drop(self, rank: int) -> None:
        self._readings[rank] = []
        self._fills[rank] = []
        self._smoothed[rank] = None

    def smoothed_ms(self, rank: int) -> Optional[float]:
        """Mean of the rank's last valid readings; None when it has none."""
        return self._smoothed[rank]

    def all_smoothed_ms(self) -> List[Optional[float]]:
        """Smoothed ms per batch of every rank (a copy)."""
        return list(self._smoothed)

    def fill_ms(self, rank: int) -> Optional[float]:
        """Mean first-batch fill cost of the rank's recent windows; None when never split off."""
        fills = self._fills[rank]
        return sum(fills) / len(fills) if fills else None

    def invalid_streak(self, rank: int) -> int:
        """Invalid readings in a row since the rank's last valid one."""
        return self._invalid_streak[rank]

    def export_state(self) -> Dict[str, Any]:
        """JSON-ready copy of the history (for the checkpoint's elche_state)."""
        return {
            "readings_ms": [list(r) for r in self._readings],
            "fill_ms": [list(f) for f in self._fills],
            "invalid_streak": list(self._invalid_streak),
        }

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "TimingHistory":
        """Inverse of export_state."""
        readings: Sequence[Sequence[float]] = state["readings_ms"]
        history = cls(len(readings))
        for rank, kept in enumerate(readings):
            history._readings[rank] = [float(x) for x in kept][-KEEP_READINGS:]
            kept_now = history._readings[rank]
            history._smoothed[rank] = sum(kept_now) / len(kept_now) if kept_now else None
        for rank, fills in enumerate(state.get("fill_ms", [])):
            history._fills[rank] = [float(x) for x in fills][-KEEP_READINGS:]
        for rank, streak in enumerate(state.get("invalid_streak", [])):
            history._invalid_streak[rank] = int(streak)
        return history
