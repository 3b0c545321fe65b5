"""Anchor auto-tune: proposal, verdict ruling, growth latch, relax_up."""

from __future__ import annotations

import pytest

from flodl_run.elche.autotune import GrowthLatch, compute_ms, overhead, propose, relax_up, rule
from flodl_run.elche.guard import STABLE, SUPPRESS_GROWTH, NudgeDown
from flodl_run.elche.phase import Phase

W, S, M = Phase.WARMUP, Phase.STABLE, Phase.MATURE


@pytest.mark.parametrize(
    "anchor, ratio, phase, first, min_a, max_a, expected",
    [
        (10, 0.06, S, False, 10, 1000, 12),    # grow by overhead / target: ceil(10 * 1.2)
        (10, 0.30, S, False, 10, 1000, 20),    # capped at 2x per cycle
        (10, 0.06, M, False, 10, 1000, 12),    # Mature: same gates as Stable
        (10, 0.05, S, False, 10, 1000, 10),    # at the target: no change
        (10, 0.09, W, False, 10, 1000, 10),    # Warmup needs > 2x target
        (10, 0.11, W, False, 10, 1000, 20),    # ... and then grows like Stable
        (10, 0.50, W, True, 10, 1000, 10),     # never on the first report
        (10, 0.50, Phase.PROBE, False, 10, 1000, 10),  # Probe: no actions
        (10, 0.02, S, False, 5, 1000, 9),      # below target / 2: shrink by 1
        (10, 0.02, S, False, 10, 1000, 10),    # ... not below min_anchor
        (10, 0.02, W, False, 5, 1000, 10),     # ... and not in Warmup
        (10, 0.03, S, False, 5, 1000, 10),     # between target/2 and target: hold
        (30, 0.01, S, False, 5, 1000, 30),     # shrink by 1 is < 5% of 30: dead zone
        (20, 0.01, S, False, 5, 1000, 19),     # 1 of 20 is exactly 5%: applies
        (100, 0.052, S, False, 10, 1000, 100),  # ceil(104) is a 4% change: dead zone
        (10, 0.30, S, False, 10, 15, 15),      # clamped to max_anchor
        (2, 0.06, S, False, 10, 1000, 4),      # below min_anchor (after a nudge): 2x cap wins
        (10, None, S, False, 10, 1000, 10),    # no overhead measured
    ],
)
def test_proposal_rule(anchor, ratio, phase, first, min_a, max_a, expected) -> None:
    """Pins the proposal rule: fire at target (Stable+) or 2x target (Warmup, not the first report),
    growth min(overhead/target, 2)x, shrink by 1 below target/2 from Stable, 5% dead zone,
    clamps to [min_anchor, max_anchor], never more than 2x."""
    assert propose(anchor, ratio, phase, 0.05, min_a, max_a, first) == expected


def test_overhead_ratio() -> None:
    """Pins overhead = sync_ms / compute_ms with compute_ms the largest rank wall minus its
    callbacks (silent ranks skipped); None when nothing was computed."""
    assert compute_ms([100.0, None, 250.0], [0.0, 0.0, 100.0]) == 150.0
    assert compute_ms([None, None]) == 0.0
    assert overhead(5.0, 250.0) == pytest.approx(0.02)
    assert overhead(5.0, 0.0) is None


@pytest.mark.parametrize(
    "anchor, proposal, verdict, latch, expected_anchor, expected_latched, nudge",
    [
        (10, 20, STABLE, GrowthLatch(), 20, False, None),            # Stable commits growth
        (10, 9, STABLE, GrowthLatch(), 9, False, None),              # ... and shrink
        (10, 20, SUPPRESS_GROWTH, GrowthLatch(), 10, True, None),    # growth dropped, latched
        (10, 9, SUPPRESS_GROWTH, GrowthLatch(), 9, True, None),      # a shrink still applies
        (10, 20, NudgeDown(0.5), GrowthLatch(), 5, True, 0.5),       # proposal dropped, then shrink
        (10, 20, NudgeDown(0.3), GrowthLatch(), 3, True, 0.3),       # ceil(10 * 0.3) = 3, not 4
        (10, 10, NudgeDown(0.01), GrowthLatch(), 1, True, 0.1),      # factor clamped to 0.1
        (1, 1, NudgeDown(0.5), GrowthLatch(), 1, True, 0.5),         # never below 1
        (10, 20, STABLE, GrowthLatch(True, 3), 10, True, None),   # latched: 4th Stable, no growth
        (10, 20, STABLE, GrowthLatch(True, 4), 20, False, None),  # the 5th re-arms and commits
    ],
)
def test_verdict_ruling(anchor, proposal, verdict, latch, expected_anchor, expected_latched,
                        nudge) -> None:
    """Pins the ruling and its order: Stable commits, SuppressGrowth vetoes growth only and
    latches, NudgeDown discards the proposal before shrinking (a stale growth never overwrites a
    nudge), and growth re-arms after 5 Stable verdicts in a row."""
    ruling = rule(anchor, proposal, verdict, latch)
    assert (ruling.anchor, ruling.latch.latched, ruling.nudge_factor) == (
        expected_anchor, expected_latched, nudge)


def test_latch_streak_resets_on_divergence() -> None:
    """Pins "5 consecutive": a SuppressGrowth in the middle restarts the count."""
    latch = GrowthLatch(True, 0)
    for verdict in (STABLE, STABLE, STABLE, SUPPRESS_GROWTH, STABLE, STABLE, STABLE, STABLE):
        latch = latch.after(verdict)
    assert latch.latched and latch.stable_streak == 4
    assert not latch.after(STABLE).latched


@pytest.mark.parametrize(
    "anchor, before, verdict, latch, phase, max_a, lead_ok, expected",
    [
        (10, 10, STABLE, GrowthLatch(), S, 1000, True, 11),        # +1 on Stable
        (10, 10, STABLE, GrowthLatch(), W, 1000, True, 10),        # not before Stable
        (10, 10, SUPPRESS_GROWTH, GrowthLatch(), S, 1000, True, 10),
        (10, 10, STABLE, GrowthLatch(True, 2), S, 1000, True, 10),  # latched
        (15, 15, STABLE, GrowthLatch(), S, 15, True, 15),          # at max_anchor
        (10, 10, STABLE, GrowthLatch(), S, 1000, False, 10),       # would break max_batch_diff
        (20, 10, STABLE, GrowthLatch(), S, 1000, True, 20),        # already grew (2x cap)
        (9, 10, STABLE, GrowthLatch(), M, 1000, True, 10),         # offsets a shrink
    ],
)
def test_relax_up(anchor, before, verdict, latch, phase, max_a, lead_ok, expected) -> None:
    """Pins relax_up: anchor + 1 on each Stable verdict from Stable on, unless latched, at
    max_anchor, already grown this cycle, or the projected lead breaks max_batch_diff."""
    assert relax_up(anchor, before, verdict, latch, phase, max_a, lead_ok) == expected


@pytest.mark.parametrize(
    "anchor, wanted, expected",
    [
        (10, [24.0, 24.0, 24.0], 24),          # agree: go to the smallest in one step
        (10, [30.0, 40.0, 44.0], 30),          # within 1.5x: the smallest of them
        (10, [30.0, 50.0, 44.0], 10),          # spread > 1.5x: no step past 2x
        (10, [200.0, 210.0, 220.0], 40),       # at most 4x per step
        (10, [24.0, 24.0], 10),                # fewer than 3 readings: no step
        (10, [10.2, 10.3, 10.4], 10),          # inside the 5% dead zone
        (10, [90.0, 24.0, 24.0, 24.0], 24),    # only the last 3 count
    ],
)
def test_agreed_anchor(anchor, wanted, expected) -> None:
    """Pins the trust-window step: 3 wanted anchors above the current one and within 1.5x of
    each other give the smallest, at most 4x the anchor; otherwise no step."""
    from flodl_run.elche.autotune import agreed_anchor

    assert agreed_anchor(anchor, wanted, 1000) == expected


def test_sized_first_anchor_takes_the_smaller_reading_and_caps() -> None:
    """Pins the first-report sizing: min(timed reduce, reported sync) / (target x compute) x
    anchor, never a shrink, at most 16x, at most max_anchor."""
    from flodl_run.elche.autotune import sized_first_anchor

    assert sized_first_anchor(10, 100.0, 500.0, 250.0, 0.05, 1000) == 80
    assert sized_first_anchor(10, 500.0, 100.0, 250.0, 0.05, 1000) == 80
    assert sized_first_anchor(10, 1.0, 100.0, 250.0, 0.05, 1000) == 10
    assert sized_first_anchor(10, 1e5, 1e5, 250.0, 0.05, 1000) == 160
    assert sized_first_anchor(10, 1e5, 1e5, 250.0, 0.05, 50) == 50
    assert sized_first_anchor(10, None, 100.0, 250.0, 0.05, 1000) == 10
