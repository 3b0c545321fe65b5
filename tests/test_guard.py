"""Convergence guards and verdicts."""

from __future__ import annotations

import math

import pytest

from flodl_run.config.schema import GuardKind
from flodl_run.elche.guard import (
    STABLE,
    SUPPRESS_GROWTH,
    NoGuard,
    NudgeDown,
    RateGuard,
    TrendGuard,
    divergence_from_norms,
    make_guard,
    verdict_from_json,
    verdict_to_json,
)


def _labels(guard, series, steps=10):
    return [guard.observe(d, steps).label for d in series]


@pytest.mark.parametrize(
    "series, expected_last",
    [
        # three strictly rising, latest above the 0.05 threshold -> SuppressGrowth
        ([0.03, 0.04, 0.06], "suppress_growth"),
        # rising but the latest is not above the threshold (0.05 is not > 0.05)
        ([0.03, 0.04, 0.05], "stable"),
        # above the threshold but not strictly rising (a flat step)
        ([0.06, 0.07, 0.07], "stable"),
        ([0.09, 0.08, 0.10], "stable"),
        # only two values: not enough evidence
        ([0.06, 0.07], "stable"),
        # only the last three count: an old dip does not matter
        ([0.2, 0.01, 0.06, 0.07, 0.08], "suppress_growth"),
    ],
)
def test_trend_guard_rule(series, expected_last) -> None:
    """Pins the trend rule: >= 3 values, last three strictly increasing, latest > threshold."""
    assert _labels(TrendGuard(0.05), series)[-1] == expected_last


def test_trend_guard_keeps_five_and_skips_missing_d() -> None:
    """Pins the trend history: 5 values kept (what the checkpoint saves); a reduce without D
    neither appends nor breaks a rising run."""
    guard = TrendGuard(0.05)
    for d in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06):
        guard.observe(d, 10)
    assert guard.history == [0.02, 0.03, 0.04, 0.05, 0.06]
    assert guard.observe(None, 10) is STABLE
    assert guard.observe(0.07, 10) is SUPPRESS_GROWTH
    copy = TrendGuard(0.05)
    copy.restore(guard.export_state())
    assert copy.history == guard.history


def test_no_guard_is_always_stable() -> None:
    """Pins `none`: even a steep rise stays Stable."""
    assert set(_labels(NoGuard(), [0.1, 0.5, 1.0, 5.0])) == {"stable"}


def _geometric(rate_per_step: float, steps: int, count: int, start: float = 0.01):
    return [start * math.exp(rate_per_step * steps * i) for i in range(count)]


@pytest.mark.parametrize(
    "rate_per_step, expected",
    [
        # lambda 5e-4 < 1e-3: stable throughout
        (5e-4, ["stable"] * 9),
        # lambda 5e-3: above 1e-3 from the first event -> SuppressGrowth on the 3rd event, then
        # the streak starts over: the next one fires 3 events later, not on every event
        (5e-3, ["stable"] * 3 + ["suppress_growth"] + ["stable"] * 2 + ["suppress_growth"]
         + ["stable"] * 2),
        # lambda 2e-2: above 1e-2 -> NudgeDown(0.5) on the 3rd event (the nudge wins and spends
        # both streaks), again 3 events later
        (2e-2, ["stable"] * 3 + ["nudge_down"] + ["stable"] * 2 + ["nudge_down"] + ["stable"] * 2),
    ],
)
def test_rate_guard_thresholds_and_streak(rate_per_step, expected) -> None:
    """Pins `rate`: lambda = ln(D_t/D_t-1)/k_max, bias-corrected EMA, 3 events above 1e-3 ->
    SuppressGrowth, 3 above 1e-2 -> NudgeDown(0.5). The first D only seeds the estimator. A
    streak resets when its verdict fires (floDl), so a sustained rate does not fire on every
    later reduce."""
    guard = RateGuard()
    got = [guard.observe(d, 10) for d in _geometric(rate_per_step, 10, 9)]
    assert [v.label for v in got] == expected
    if "nudge_down" in expected:
        assert got[3] == NudgeDown(0.5)


def test_rate_guard_bias_correction() -> None:
    """Pins bias correction: after one event the corrected EMA equals that event's lambda
    (uncorrected it would be 10x smaller and miss the 1e-3 alarm)."""
    guard = RateGuard()
    guard.observe(0.01, 10)
    guard.observe(0.01 * math.exp(0.02 * 10), 10)
    assert guard.ema / (1 - 0.9 ** guard.samples) == pytest.approx(0.02)


def test_rate_guard_resets_at_tiny_divergence() -> None:
    """Pins the reset: D <= 1e-8 on either side restarts the estimator and the streaks."""
    guard = RateGuard()
    for d in _geometric(2e-2, 10, 3):
        guard.observe(d, 10)
    assert guard.nudge_streak == 2
    assert guard.observe(1e-9, 10) is STABLE
    assert (guard.samples, guard.nudge_streak, guard.ema) == (0, 0, 0.0)
    assert guard.observe(0.01, 10) is STABLE and guard.samples == 0


def test_rate_guard_state_round_trip() -> None:
    """Pins that a resumed rate guard continues its streak (no fresh 3-event grace)."""
    guard = RateGuard()
    for d in _geometric(2e-2, 10, 3):
        guard.observe(d, 10)
    copy = RateGuard()
    copy.restore(guard.export_state())
    next_d = _geometric(2e-2, 10, 4)[-1]
    assert copy.observe(next_d, 10) == guard.observe(next_d, 10) == NudgeDown(0.5)


@pytest.mark.parametrize(
    "diff_norms, consensus_norm, expected",
    [([0.1, 0.3, 0.2], 2.0, 0.15), ([0.5], 1e-13, 0.0), ([], 1.0, 0.0)],
)
def test_divergence_from_norms(diff_norms, consensus_norm, expected) -> None:
    """Pins D = max_k ||theta_k - theta*|| / ||theta*||, and 0 for a ~zero consensus."""
    assert divergence_from_norms(diff_norms, consensus_norm) == pytest.approx(expected)


def test_make_guard_and_verdict_json() -> None:
    """Pins the guard factory by kind and the verdict JSON used in checkpoints."""
    assert isinstance(make_guard(GuardKind.trend, 0.05), TrendGuard)
    assert isinstance(make_guard("rate", 0.05), RateGuard)
    assert isinstance(make_guard("none", 0.05), NoGuard)
    for verdict in (STABLE, SUPPRESS_GROWTH, NudgeDown(0.3)):
        assert verdict_from_json(verdict_to_json(verdict)) == verdict
