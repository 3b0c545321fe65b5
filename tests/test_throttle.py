"""Overshoot auto-tune and the max_batch_diff throttle."""

from __future__ import annotations

import pytest

from flodl_run.guard import STABLE, SUPPRESS_GROWTH, NudgeDown
from flodl_run.throttle import Overshoot, must_wait, paused_ranks


def test_overshoot_auto_tune() -> None:
    """Pins auto overshoot: starts at 3, +1 per Stable verdict up to 15, unchanged on
    SuppressGrowth, back to 3 on NudgeDown."""
    budget = Overshoot.from_config(None)
    seen = []
    for _ in range(14):
        budget = budget.after(STABLE)
        seen.append(budget.batches)
    assert seen[:3] == [4, 5, 6] and seen[-3:] == [15, 15, 15]
    assert budget.after(SUPPRESS_GROWTH).batches == 15
    assert budget.after(NudgeDown(0.5)).batches == 3


def test_explicit_overshoot_disables_auto_tune() -> None:
    """Pins that an explicit elche.max_overshoot is never tuned (0 stays 0)."""
    for fixed in (0, 7):
        budget = Overshoot.from_config(fixed)
        assert budget.after(STABLE).after(NudgeDown(0.1)).batches == fixed


@pytest.mark.parametrize("done, count, overshoot, waits", [(12, 10, 3, False), (13, 10, 3, True),
                                                            (10, 10, 0, True)])
def test_must_wait(done, count, overshoot, waits) -> None:
    """Pins the async budget: a rank may run batch_counts[r] + max_overshoot batches."""
    assert must_wait(done, count, overshoot) is waits


@pytest.mark.parametrize(
    "done, counts, limit, expected",
    [
        ([20, 5], [50, 20], 10, [0]),          # 15 ahead of the slowest working rank
        ([15, 5], [50, 20], 10, []),           # exactly 10 ahead: allowed
        ([20, 5], [50, 20], None, []),         # no limit
        ([20, 20], [50, 20], 0, []),           # slowest finished: nobody to wait for
        ([3, 2, 2], [10, 10, 0], 0, [0]),      # lockstep; a dead rank (count 0) is ignored
    ],
)
def test_paused_ranks(done, counts, limit, expected) -> None:
    """Pins the throttle: a rank more than max_batch_diff ahead of the slowest rank still at
    work pauses; finished or dead ranks never hold others back."""
    assert paused_ranks(done, counts, limit) == expected
