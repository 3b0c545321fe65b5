"""Anchor auto-tune: an overhead-driven proposal, then the verdict's ruling.

Owns the overhead ratio, the proposal rule (phase gates, 2x growth cap, shrink by 1, 5% dead
zone, clamps), the cold-start steps past the 2x cap (a first anchor sized from a reduce timed
before training; larger steps when the trust window agrees), the growth latch, the
discard-then-nudge order and relax_up. It does not compute verdicts (see `guard` and `meta`)
or batch counts (see `batch_counts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from flodl_run.elche.guard import NudgeDown, Stable, SuppressGrowth, Verdict
from flodl_run.elche.phase import Phase
from flodl_run.elche.timing import callback_column, column

# One cycle may at most double the anchor: an ungated multiplicative rule once jumped the
# anchor from 10 to 22 on one noisy early reading.
MAX_GROWTH = 2.0
# In Warmup growth needs overhead above twice the target (early readings are noisy).
WARMUP_MARGIN = 2.0
# Anchor changes smaller than 5% of the current anchor are no-ops.
DEAD_ZONE = 0.05
# Consecutive Stable verdicts that re-arm growth after a SuppressGrowth or a nudge.
REARM_AFTER = 5
# Nudge factors are clamped to this range before they shrink the anchor.
MIN_NUDGE = 0.1
# Float slack for ceil(): 10 * 0.3 is 3.0000000000000004 and must stay 3.
_CEIL_SLACK = 1e-9
# Cold start, beyond the 2x cap. The first report may size the anchor straight from a reduce
# timed before training, but only by the smaller of that cost and the first report's sync: one
# spike in either reading cannot move it. Later, growth may take up to 4x in one step when the
# last 3 reduces (the trust window) agree, within 1.5x of each other, on the anchor they want.
COLD_START_GROWTH = 16.0
TRUST_WINDOW = 3
AGREEMENT = 1.5
AGREED_GROWTH = 4.0


def ceil_int(value: float) -> int:
    """ceil() that ignores float noise just above an integer."""
    return math.ceil(value - _CEIL_SLACK)


def compute_ms(wall_ms: Sequence[Optional[float]],
               callback_ms: Optional[Sequence[Optional[float]]] = None) -> float:
    """The window's compute time: the largest rank wall minus its callback time (0 if none)."""
    spent = column(wall_ms) - callback_column(callback_ms, len(wall_ms))
    return float(np.max(spent, initial=0.0, where=spent > 0))  # NaN (no wall) fails > 0


def overhead(sync_ms: float, compute_ms: float) -> Optional[float]:
    """Share of compute the reduce costs: sync_ms / compute_ms; None when nothing was computed."""
    if compute_ms <= 0 or sync_ms is None or sync_ms < 0:
        return None
    return sync_ms / compute_ms


def propose(anchor: int, overhead_ratio: Optional[float], phase: Phase, target: float,
            min_anchor: int, max_anchor: int, first_report: bool) -> int:
    """The anchor this reduce's overhead asks for (== `anchor` means no proposal).

    Grow when overhead > target from Stable on, or > 2x target in Warmup except on the first
    report; by min(overhead / target, 2) x, clamped to [min_anchor, max_anchor] and never more
    than doubling. Shrink by 1 (not below min_anchor) when overhead < target / 2 from Stable
    on. A change smaller than 5% of the anchor is dropped.
    """
    if overhead_ratio is None or phase < Phase.WARMUP:
        return anchor
    proposal = anchor
    fire_at = target if phase >= Phase.STABLE else WARMUP_MARGIN * target
    may_grow = phase >= Phase.STABLE or not first_report
    if may_grow and overhead_ratio > fire_at:
        grown = ceil_int(anchor * min(overhead_ratio / target, MAX_GROWTH))
        proposal = min(max(grown, min_anchor), max_anchor, int(MAX_GROWTH * anchor))
    elif overhead_ratio < target / 2 and phase >= Phase.STABLE:
        proposal = max(min_anchor, anchor - 1)
        proposal = min(proposal, anchor)
    if abs(proposal - anchor) < DEAD_ZONE * anchor:
        return anchor
    return proposal


def wanted_anchor(anchor: int, overhead_ratio: Optional[float], target: float) -> Optional[float]:
    """The anchor at which this reduce's overhead would meet the target: anchor x overhead /
    target (the reduce cost over the target share of one batch). None without a reading."""
    if overhead_ratio is None or target <= 0:
        return None
    return anchor * overhead_ratio / target


def sized_first_anchor(anchor: int, reduce_ms: Optional[float], sync_ms: float,
                       window_compute_ms: float, target: float, max_anchor: int) -> int:
    """The first report's anchor from a reduce timed before training (`reduce_ms`) and the Probe
    window's compute: the anchor whose compute makes min(reduce_ms, sync_ms) the target share,
    at most 16x the current one. Never shrinks; `anchor` when either reading is missing."""
    if reduce_ms is None or reduce_ms <= 0 or window_compute_ms <= 0 or sync_ms is None:
        return anchor
    wanted = wanted_anchor(anchor, min(reduce_ms, sync_ms) / window_compute_ms, target)
    if wanted is None or wanted <= anchor * (1 + DEAD_ZONE):
        return anchor
    return max(anchor, min(ceil_int(wanted), int(COLD_START_GROWTH * anchor), max_anchor))


def agreed_anchor(anchor: int, wanted: Sequence[float], max_anchor: int) -> int:
    """A larger growth step when the trust window agrees: the last 3 wanted anchors all above
    the current one (past the 5% dead zone) and within 1.5x of each other give the smallest of
    them, at most 4x the current anchor. Otherwise `anchor` (the 2x rule of `propose` applies)."""
    recent = list(wanted[-TRUST_WINDOW:])
    if len(recent) < TRUST_WINDOW or min(recent) <= anchor * (1 + DEAD_ZONE):
        return anchor
    if max(recent) > AGREEMENT * min(recent):
        return anchor
    return max(anchor, min(ceil_int(min(recent)), int(AGREED_GROWTH * anchor), max_anchor))


@dataclass(frozen=True)
class GrowthLatch:
    """Growth is latched off by SuppressGrowth or a nudge until 5 Stable verdicts in a row."""

    latched: bool = False
    stable_streak: int = 0

    def after(self, verdict: Verdict) -> "GrowthLatch":
        """The latch once `verdict` is counted (the 5th Stable re-arms in the same cycle)."""
        if isinstance(verdict, Stable):
            streak = self.stable_streak + 1
            return GrowthLatch(self.latched and streak < REARM_AFTER, streak)
        return GrowthLatch(True, 0)


@dataclass(frozen=True)
class Ruling:
    """What the verdict made of a proposal."""

    anchor: int
    latch: GrowthLatch
    nudge_factor: Optional[float] = None
    """The clamped factor a NudgeDown applied, if any."""
    dropped_growth: bool = False
    """A proposed growth was vetoed (by the verdict or the latch)."""


def rule(anchor: int, proposal: int, verdict: Verdict, latch: GrowthLatch) -> Ruling:
    """Commit or veto `proposal` under `verdict`, in discard-then-nudge order.

    Stable commits (a growth only while the latch is open); SuppressGrowth drops a growth, keeps
    a shrink and latches; NudgeDown drops the proposal first, latches, then shrinks the anchor
    by its factor (bypassing min_anchor, never below 1) so a stale growth cannot undo it.
    """
    latch = latch.after(verdict)
    grows = proposal > anchor
    if isinstance(verdict, NudgeDown):
        factor = min(1.0, max(MIN_NUDGE, verdict.factor))
        return Ruling(max(1, ceil_int(anchor * factor)), latch, factor, dropped_growth=grows)
    if grows and (isinstance(verdict, SuppressGrowth) or latch.latched):
        return Ruling(anchor, latch, dropped_growth=True)
    return Ruling(proposal, latch)


def relax_up(anchor: int, before: int, verdict: Verdict, latch: GrowthLatch, phase: Phase,
             max_anchor: int, lead_allows: bool) -> int:
    """relax_up: one more batch on a Stable verdict from Stable on, unless growth is latched,
    the anchor is at max_anchor, this cycle already grew it (the 2x cap), or the projected
    lead would break max_batch_diff."""
    if (not isinstance(verdict, Stable) or latch.latched or phase < Phase.STABLE
            or anchor >= max_anchor or anchor > before or not lead_allows):
        return anchor
    return anchor + 1
