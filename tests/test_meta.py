"""LR-aware meta-controller."""

from __future__ import annotations

import pytest

from flodl_run.elche.guard import STABLE, SUPPRESS_GROWTH, NudgeDown
from flodl_run.elche.meta import MetaController, MetaNudge, combine, effective_factor
from flodl_run.elche.phase import Phase


@pytest.mark.parametrize(
    "phase, expected", [(Phase.WARMUP, 0.3), (Phase.STABLE, 0.5), (Phase.MATURE, 0.7)])
def test_lr_cliff_nudges_with_the_phase_factor(phase, expected) -> None:
    """Pins the LR cliff: a fall of more than 30% since the previous reduce nudges with the
    current phase's base factor (flat anchor: trend 0, so the factor is the base)."""
    meta = MetaController()
    assert meta.observe(phase, 10, STABLE, lr=0.1) is None
    nudge = meta.observe(phase, 10, STABLE, lr=0.01)
    assert nudge is not None and nudge.reasons == ("lr_cliff",)
    assert nudge.factor == pytest.approx(expected)


@pytest.mark.parametrize("new_lr, fires", [(0.071, False), (0.07, False), (0.0699, True)])
def test_lr_cliff_threshold_is_thirty_percent(new_lr, fires) -> None:
    """Pins "more than 30%": 0.1 -> 0.07 is exactly 30% and does not fire; any deeper does."""
    meta = MetaController()
    meta.observe(Phase.STABLE, 10, STABLE, lr=0.1)
    assert (meta.observe(Phase.STABLE, 10, STABLE, lr=new_lr) is not None) == fires


def test_meta_is_inactive_in_probe_and_without_lr() -> None:
    """Pins that Probe never nudges, and that a reduce without an LR cannot be a cliff."""
    meta = MetaController()
    meta.observe(Phase.PROBE, 10, STABLE, lr=0.1)
    assert meta.observe(Phase.PROBE, 10, STABLE, lr=0.001) is None
    assert meta.observe(Phase.STABLE, 10, STABLE, lr=None) is None


@pytest.mark.parametrize(
    "phase, k, base", [(Phase.WARMUP, 5, 0.3), (Phase.STABLE, 3, 0.5), (Phase.MATURE, 2, 0.7)])
def test_sustained_divergence_needs_k_verdicts(phase, k, base) -> None:
    """Pins K per phase (5/3/2): K-1 divergent verdicts do nothing, the K-th nudges with the
    phase's base factor; the count then starts over (no nudge on the very next reduce)."""
    meta = MetaController()
    for _ in range(k - 1):
        assert meta.observe(phase, 10, SUPPRESS_GROWTH) is None
    nudge = meta.observe(phase, 10, NudgeDown(0.5))
    assert nudge is not None and nudge.reasons == ("sustained_divergence",)
    assert nudge.factor == pytest.approx(base)
    assert meta.observe(phase, 10, SUPPRESS_GROWTH) is None


def test_a_stable_verdict_breaks_the_sustained_run() -> None:
    """Pins "the newest K are all divergent": one Stable among them blocks the pattern."""
    meta = MetaController()
    for verdict in (SUPPRESS_GROWTH, STABLE, SUPPRESS_GROWTH):
        assert meta.observe(Phase.STABLE, 10, verdict) is None


@pytest.mark.parametrize(
    "base, trend, expected",
    [(0.5, 0.0, 0.5), (0.5, 0.2, 0.4), (0.5, -0.2, 0.6), (0.3, 1.0, 0.1), (0.7, -2.0, 0.95)],
)
def test_effective_factor(base, trend, expected) -> None:
    """Pins clamp(base - (1 - base) * trend, 0.1, 0.95): a growing anchor gets a harsher cut."""
    assert effective_factor(base, trend) == pytest.approx(expected)


def test_both_patterns_multiply() -> None:
    """Pins the combination: LR cliff and sustained divergence at once -> product (0.5 x 0.5
    in Stable with a flat anchor), still clamped to [0.1, 0.95]."""
    meta = MetaController()
    meta.observe(Phase.STABLE, 10, SUPPRESS_GROWTH, lr=0.1)
    meta.observe(Phase.STABLE, 10, SUPPRESS_GROWTH, lr=0.1)
    nudge = meta.observe(Phase.STABLE, 10, SUPPRESS_GROWTH, lr=0.01)
    assert nudge.reasons == ("lr_cliff", "sustained_divergence")
    assert nudge.factor == pytest.approx(0.25)


def test_trend_and_is_settled() -> None:
    """Pins trend = (anchor now - mean of last 5) / mean, and is_settled() = |trend| < 0.10
    once 5 anchors are in (an early-stop hint must not fire at the start of a run)."""
    meta = MetaController()
    assert not meta.is_settled()
    for anchor in (10, 10, 10, 10):
        meta.observe(Phase.STABLE, anchor, STABLE)
    assert meta.trend() == 0.0 and not meta.is_settled()
    meta.observe(Phase.STABLE, 10, STABLE)
    assert meta.is_settled()
    meta.observe(Phase.STABLE, 20, STABLE)  # mean of 10,10,10,10,20 = 12
    assert meta.trend() == pytest.approx(8 / 12)
    assert not meta.is_settled()


def test_rising_anchor_sharpens_the_cliff_nudge() -> None:
    """Pins that the trend enters the cliff factor: an anchor that just doubled cuts harder
    than the flat-anchor base."""
    meta = MetaController()
    for anchor in (10, 10, 10, 10):
        meta.observe(Phase.STABLE, anchor, STABLE, lr=0.1)
    nudge = meta.observe(Phase.STABLE, 20, STABLE, lr=0.01)
    assert nudge.factor == pytest.approx(0.5 - 0.5 * (8 / 12))


def test_state_round_trip() -> None:
    """Pins that a resumed meta-controller keeps its windows (a cliff right after resume is
    still seen against the saved LR)."""
    meta = MetaController()
    meta.observe(Phase.STABLE, 12, SUPPRESS_GROWTH, lr=0.1)
    copy = MetaController()
    copy.restore(meta.export_state())
    assert copy.export_state() == meta.export_state()
    assert copy.observe(Phase.STABLE, 12, STABLE, lr=0.01) is not None


@pytest.mark.parametrize(
    "guard, meta_factor, expected",
    [(STABLE, 0.5, NudgeDown(0.5)), (SUPPRESS_GROWTH, 0.7, NudgeDown(0.7)),
     (NudgeDown(0.5), 0.7, NudgeDown(0.5)), (NudgeDown(0.5), 0.3, NudgeDown(0.3))],
)
def test_combine_with_the_guard_verdict(guard, meta_factor, expected) -> None:
    """Pins how a meta nudge meets the guard's verdict: it replaces Stable/SuppressGrowth, and
    against a guard NudgeDown the harsher (smaller) factor wins."""
    assert combine(guard, MetaNudge(meta_factor, ("lr_cliff",))) == expected
