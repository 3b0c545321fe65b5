"""Anchor-rank election: which rank sets the pace of a window.

Owns the slow-cohort rule, the dominance margin that keeps a sitting anchor rank, the initial
pin (partition ratios or a spec prior) and the conditions that open an election. It does not
hold state: ElChe keeps the current anchor rank and asks here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from flodl_run.elche.phase import Phase

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
    """Ranks whose smoothed ms per batch is >= 0.85 x the slowest; ranks without data are out."""
    known = [ms for ms in ms_per_batch if ms is not None]
    if not known:
        return []
    floor_ms = COHORT_BAND * max(known) * (1 - _SLACK)
    return [r for r, ms in enumerate(ms_per_batch) if ms is not None and ms >= floor_ms]


def elect(ms_per_batch: Sequence[Optional[float]], current: Optional[int]) -> Optional[int]:
    """The anchor rank given smoothed speeds (None = no data) and the sitting anchor rank.

    One cohort member wins outright. Otherwise the sitting rank stays if it is in the cohort
    and nobody is >= 10% slower than it; a challenger that slow takes the seat (the slowest
    wins, ties to the lowest index); with no sitting rank in the cohort, the lowest index wins.
    """
    cohort = slow_cohort(ms_per_batch)
    if not cohort:
        return None
    if len(cohort) == 1:
        return cohort[0]
    if current is not None and current in cohort:
        current_ms = ms_per_batch[current]
        slowest = max(cohort, key=lambda r: (ms_per_batch[r], -r))
        if ms_per_batch[slowest] >= DOMINANCE_MARGIN * current_ms * (1 - _SLACK):
            return slowest
        return current
    return cohort[0]


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
