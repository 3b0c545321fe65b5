"""Anchor-rank election: which rank sets the pace of a window.

Owns the slow-cohort rule, the dominance margin that keeps a sitting anchor rank, the initial
pin (partition ratios or a spec prior) and the conditions that open an election. It does not
hold state: ElChe keeps the current anchor rank and asks here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from flodl_run.elche.phase import Phase
from flodl_run.elche.timing import column

# Ranks within 15% of the slowest form the slow cohort: close enough that noise could reorder
# them, so the sitting anchor rank keeps its seat among them.
COHORT_BAND = 0.85
# A challenger must be at least 10% slower than the sitting anchor rank to unseat it.
DOMINANCE_MARGIN = 1.10
# Reports without a valid reading from the anchor rank before it loses its pin.
DEAD_WINDOW_REPORTS = 5
# Relative slack so a reading exactly on a boundary (26.4 vs 1.1 x 24) counts as on it.
_SLACK = 1e-9


def slow_cohort(ms_per_batch: Sequence[Optional[float]]) -> List[int]:
    """Ranks whose smoothed ms per batch is >= 0.85 x the slowest; ranks without data (None or
    NaN) are out."""
    return np.flatnonzero(_cohort_mask(column(ms_per_batch))).tolist()


def _cohort_mask(ms: np.ndarray) -> np.ndarray:
    data = ~np.isnan(ms)
    if not data.any():
        return data
    floor_ms = COHORT_BAND * float(ms[data].max()) * (1 - _SLACK)
    return data & (ms >= floor_ms)


def elect(ms_per_batch: Sequence[Optional[float]], current: Optional[int]) -> Optional[int]:
    """The anchor rank given smoothed speeds (None or NaN = no data) and the sitting one.

    One cohort member wins outright. Otherwise the sitting rank stays if it is in the cohort
    and nobody is >= 10% slower than it; a challenger that slow takes the seat (the slowest
    wins, ties to the lowest index); with no sitting rank in the cohort, the lowest index wins.
    """
    ms = column(ms_per_batch)
    cohort = np.flatnonzero(_cohort_mask(ms))
    if not len(cohort):
        return None
    if len(cohort) == 1 or current is None or current not in cohort:
        return int(cohort[0])
    slowest = int(cohort[np.argmax(ms[cohort])])  # argmax: the first of equals, lowest index
    if ms[slowest] >= DOMINANCE_MARGIN * ms[current] * (1 - _SLACK):
        return slowest
    return current


def initial_pin(world_size: int, partition_ratios: Optional[Sequence[float]] = None,
                prior: Optional[Sequence[float]] = None) -> Optional[int]:
    """The anchor rank before any timing: the smallest explicit share, else the slowest rank
    of a spec prior (relative speeds, higher = faster, e.g. from the GPU model), else None
    (the first election decides). Ties go to the lowest index."""
    for values in (partition_ratios, prior):
        if values is not None and len(values) == world_size:
            return min(range(world_size), key=lambda r: (values[r], r))
    return None


def should_elect(phase: Phase, current: Optional[int], current_invalid_streak: int) -> bool:
    """Whether this reduce may move the anchor rank.

    Open from Stable on; before that only to seat a first anchor rank or to replace one that
    has given no valid reading for DEAD_WINDOW_REPORTS reports (the pin is held through Warmup
    because cold-start noise can make the fast rank look slow).
    """
    if current is None or phase >= Phase.STABLE:
        return True
    return current_invalid_streak >= DEAD_WINDOW_REPORTS
