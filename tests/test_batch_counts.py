"""Per-rank batch counts."""

from __future__ import annotations

import pytest

from flodl_run.elche.batch_counts import cap_to_window, next_counts, ratio_counts, target_count


@pytest.mark.parametrize(
    "anchor, ms, slow_ms, expected",
    [
        (10, 10.0, 25.0, 25),      # 2.5x faster -> 2.5x the batches
        (10, 25.0, 25.0, 10),      # the anchor rank's own speed
        (10, None, 25.0, 10),      # unknown speed -> the anchor
        (10, 30.0, 25.0, 8),       # slower than the anchor rank (within the cohort band)
        (10, 0.1, 25.0, 640),      # capped at 64x
        (1, 100.0, 25.0, 1),       # never below 1
    ],
)
def test_target_count(anchor, ms, slow_ms, expected) -> None:
    """Pins target = max(1, round(anchor * min(slow / m, 64))), anchor when m is unknown."""
    assert target_count(anchor, ms, slow_ms) == expected


def _next(current, ms, calibrated=None, anchor=10, step=0, diff=None, alive=None):
    alive = alive or [True] * len(current)
    calibrated = calibrated or [True] * len(current)
    return next_counts(current, anchor, 1, ms, alive, calibrated, step, diff)


def test_dead_zone_keeps_counts_within_five_percent() -> None:
    """Pins the 5% dead zone: 25 -> 26 (4%) is kept, 25 -> 27 (8%) applies; an uncalibrated
    rank takes its first target whatever the difference."""
    assert _next([25, 10], [10.0 * 25 / 26, 25.0]) == [25, 10]
    assert _next([25, 10], [10.0 * 25 / 27, 25.0]) == [27, 10]
    assert _next([10, 10], [10.0 * 10 / 10.4, 25.0], calibrated=[False, False]) == [26, 10]


def test_max_batch_diff_limits_each_update() -> None:
    """Pins the max_batch_diff clamp: one update moves a count at most M away from where the
    anchor's own step carries it; M = 0 keeps lockstep even when the anchor changes."""
    assert _next([10, 10], [10.0, 25.0], diff=4) == [14, 10]
    assert _next([14, 10], [10.0, 25.0], diff=4) == [18, 10]
    assert _next([10, 10], [10.0, 25.0], diff=0, anchor=20, step=10) == [20, 20]


def test_dead_ranks_get_zero() -> None:
    """Pins that a dead rank plans no work and living ones keep at least one batch."""
    assert _next([25, 10, 7], [10.0, 25.0, 400.0], alive=[False, True, True]) == [0, 10, 1]


@pytest.mark.parametrize(
    "counts, cap, expected",
    [
        ([25, 10], 100, [25, 10]),          # under the cap: untouched
        ([60, 24], 42, [30, 12]),           # proportional scale-down, exact
        ([50, 20, 7], 30, [21, 7, 2]),      # floors 19, 7, 2; the remainder 2 to the largest
        ([1000, 1, 1, 1], 10, [7, 1, 1, 1]),   # floors of 1 taken back from the largest
        ([3, 3, 3], 2, [1, 1, 1]),          # more ranks than batches: everyone runs one
        ([5, 0, 5], 4, [2, 0, 2]),          # dead ranks stay at 0
    ],
)
def test_cap_to_window(counts, cap, expected) -> None:
    """Pins the one-epoch cap: scale down proportionally (floor, min 1, remainder to the
    largest) so a window never exceeds the epoch."""
    assert cap_to_window(counts, cap) == expected


def test_ratio_counts() -> None:
    """Pins explicit shares: the smallest living share runs the anchor, others in proportion."""
    assert ratio_counts(10, [0.5, 0.2, 0.3], [True, True, True]) == [25, 10, 15]
    assert ratio_counts(10, [0.5, 0.2, 0.3], [True, False, True]) == [17, 0, 10]
