"""Per-rank timing intake of ElChe: raw window timings -> smoothed ms per batch.

Owns the reading rules (divide by batches actually done, callback time excluded, first-batch
fill cost split off for cadence/async) and the trust window (mean of the last 5 valid readings,
cleared after 5 invalid ones in a row). It does not measure anything: the ranks do. Readings
and histories are numpy columns indexed by rank (NaN = no value), one operation per window for
all ranks: the sim reads 1024 ranks x 1000 windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

# A rank's smoothed speed is the mean of this many recent valid readings.
KEEP_READINGS = 5
# This many invalid readings in a row mean the rank's old speed no longer describes it.
CLEAR_AFTER_INVALID = 5


def column(values: Sequence[Optional[float]]) -> np.ndarray:
    """A per-rank list (or array) as a float column; None becomes NaN."""
    return np.asarray(values, dtype=float)


def known(value: Any) -> Optional[float]:
    """A column entry as a float, or None for NaN (and for None)."""
    return None if value is None or value != value else float(value)


def callback_column(callback_ms: Optional[Sequence[Optional[float]]], size: int) -> np.ndarray:
    """Per-rank callback ms: an absent column or entry counts 0; a NaN stays NaN (no reading)."""
    if callback_ms is None:
        return np.zeros(size)
    return np.array([0.0 if c is None else c for c in callback_ms], dtype=float)


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
    """One window's verdict on one rank's speed; `ms_per_batch` None means invalid."""

    ms_per_batch: Optional[float]
    fill_ms: Optional[float] = None

    @property
    def is_valid(self) -> bool:
        return self.ms_per_batch is not None


INVALID = Reading(None)


class Readings(NamedTuple):
    """One window's readings of every rank as columns: ms per batch (NaN = invalid) and the
    fill cost split off the first batch (NaN = none)."""

    ms_per_batch: np.ndarray
    fill_ms: np.ndarray

    def reading(self, rank: int) -> Reading:
        ms = known(self.ms_per_batch[rank])
        return INVALID if ms is None else Reading(ms, known(self.fill_ms[rank]))


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
                        skip_first_batch).reading(0)


def read_columns(wall_ms: Sequence[Optional[float]], batches: Sequence[Optional[int]],
                 callback_ms: Optional[Sequence[Optional[float]]] = None,
                 first_batch_ms: Optional[Sequence[Optional[float]]] = None,
                 fill_ms: Optional[Sequence[Optional[float]]] = None,
                 skip_first_batch: bool = False) -> Readings:
    """`read` for every rank of one window (columns indexed by rank; None = not reported)."""
    wall = column(wall_ms)
    n = column(batches)
    compute = wall - callback_column(callback_ms, len(wall))
    # NaN fails every comparison: an unreported wall or count, or a NaN wall, reads invalid.
    valid = (n >= 1) & (compute > 0) & (compute != np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        ms = np.where(valid, compute / n, np.nan)
        fill = np.full(len(wall), np.nan)
        if skip_first_batch and fill_ms is not None:
            split = column(fill_ms)
            own = valid & (split >= 0) & (split < compute)
            ms = np.where(own, (compute - split) / n, ms)
            fill = np.where(own, split, fill)
        if skip_first_batch and first_batch_ms is not None:  # wins over a rank's own split
            first = column(first_batch_ms)
            timed = valid & (n >= 2) & (first > 0) & (first < compute)
            rest = (compute - first) / (n - 1)
            ms = np.where(timed, rest, ms)
            fill = np.where(timed, np.where(first > rest, first - rest, 0.0), fill)
    return Readings(ms, fill)


def read_timing(timing: RankTiming, skip_first_batch: bool = False) -> Reading:
    """`read` over a RankTiming."""
    return read(timing.wall_ms, timing.batches, timing.callback_ms, timing.first_batch_ms,
                skip_first_batch, timing.fill_ms)


def _push(kept: np.ndarray, count: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """Append values[r] to each row r of `rows` (a mask), dropping the oldest of a full row."""
    full = rows & (count == KEEP_READINGS)
    kept[full, :-1] = kept[full, 1:]
    count[full] -= 1
    index = np.flatnonzero(rows)
    kept[index, count[index]] = values[index]
    count[index] += 1


def _means(kept: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Mean of the first count[r] entries of each row, summed oldest first as sum() does (the
    result must match the per-rank code to the last bit: the golden traces pin it)."""
    total = np.zeros(len(count))
    for j in range(KEEP_READINGS):
        total += np.where(j < count, kept[:, j], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(count > 0, total / count, np.nan)


class TimingHistory:
    """Recent valid readings per rank, their mean, and the run of invalid readings."""

    def __init__(self, world_size: int):
        self._kept = np.full((world_size, KEEP_READINGS), np.nan)
        self._count = np.zeros(world_size, dtype=np.int64)
        self._fills = np.full((world_size, KEEP_READINGS), np.nan)
        self._fill_count = np.zeros(world_size, dtype=np.int64)
        self._smoothed = np.full(world_size, np.nan)
        self._invalid_streak = np.zeros(world_size, dtype=np.int64)

    @property
    def world_size(self) -> int:
        return len(self._count)

    def record(self, rank: int, reading: Reading) -> bool:
        """Take one window's reading; True when this reading cleared the rank's history."""
        ms = np.full(self.world_size, np.nan)
        fill = np.full(self.world_size, np.nan)
        ms[rank] = np.nan if reading.ms_per_batch is None else reading.ms_per_batch
        fill[rank] = np.nan if reading.fill_ms is None else reading.fill_ms
        ranks = np.zeros(self.world_size, dtype=bool)
        ranks[rank] = True
        return bool(self.record_columns(Readings(ms, fill), ranks))

    def record_columns(self, readings: Readings, ranks: np.ndarray) -> List[int]:
        """Take the readings of the ranks where the mask `ranks` is set; returns the ranks whose
        history an invalid reading just cleared (ascending)."""
        ms, fill = readings
        valid = ranks & ~np.isnan(ms)
        invalid = ranks & ~valid
        self._invalid_streak[valid] = 0
        _push(self._kept, self._count, valid, ms)
        _push(self._fills, self._fill_count, valid & ~np.isnan(fill), fill)
        self._smoothed[valid] = _means(self._kept[valid], self._count[valid])
        self._invalid_streak[invalid] += 1
        cleared = np.flatnonzero(invalid & (self._invalid_streak == CLEAR_AFTER_INVALID)
                                 & (self._count > 0))
        for rank in cleared:
            self._drop(rank)
        return cleared.tolist()

    def record_invalid(self, rank: int) -> bool:
        """A window without a usable reading; True when it cleared the rank's history."""
        return self.record(rank, INVALID)

    def forget(self, rank: int) -> None:
        """Drop everything known about a rank (it left the run)."""
        self._drop(rank)
        self._invalid_streak[rank] = 0

    def _drop(self, rank: int) -> None:
        self._kept[rank] = np.nan
        self._fills[rank] = np.nan
        self._count[rank] = self._fill_count[rank] = 0
        self._smoothed[rank] = np.nan

    def smoothed_ms(self, rank: int) -> Optional[float]:
        """Mean of the rank's last valid readings; None when it has none."""
        return known(self._smoothed[rank])

    def all_smoothed_ms(self) -> List[Optional[float]]:
        """Smoothed ms per batch of every rank (a copy; None = no valid reading kept)."""
        return [known(ms) for ms in self._smoothed.tolist()]

    def smoothed_column(self) -> np.ndarray:
        """Smoothed ms per batch of every rank as a column (a copy; NaN = none kept)."""
        return self._smoothed.copy()

    def fill_ms(self, rank: int) -> Optional[float]:
        """Mean first-batch fill cost of the rank's recent windows; None when never split off."""
        count = self._fill_count[rank]
        return float(sum(self._fills[rank, :count].tolist()) / count) if count else None

    def invalid_streak(self, rank: int) -> int:
        """Invalid readings in a row since the rank's last valid one."""
        return int(self._invalid_streak[rank])

    def export_state(self) -> Dict[str, Any]:
        """JSON-ready copy of the history (for the checkpoint's elche_state)."""
        return {
            "readings_ms": [self._kept[r, :c].tolist() for r, c in enumerate(self._count)],
            "fill_ms": [self._fills[r, :c].tolist() for r, c in enumerate(self._fill_count)],
            "invalid_streak": self._invalid_streak.tolist(),
        }

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "TimingHistory":
        """Inverse of export_state."""
        readings: Sequence[Sequence[float]] = state["readings_ms"]
        history = cls(len(readings))
        for rank, kept in enumerate(readings):
            _load(history._kept, history._count, rank, kept)
        for rank, fills in enumerate(state.get("fill_ms", [])):
            _load(history._fills, history._fill_count, rank, fills)
        history._smoothed = _means(history._kept, history._count)
        for rank, streak in enumerate(state.get("invalid_streak", [])):
            history._invalid_streak[rank] = int(streak)
        return history


def _load(kept: np.ndarray, count: np.ndarray, rank: int, values: Sequence[float]) -> None:
    """Put a saved row back (its last KEEP_READINGS values)."""
    recent = [float(x) for x in values][-KEEP_READINGS:]
    kept[rank, :len(recent)] = recent
    count[rank] = len(recent)
