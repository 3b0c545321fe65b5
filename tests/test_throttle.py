"""Overshoot auto-tune."""

from __future__ import annotations

from flodl_run.elche.guard import STABLE, SUPPRESS_GROWTH, NudgeDown
from flodl_run.elche.throttle import Overshoot


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
