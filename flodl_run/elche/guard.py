"""Convergence guards: the divergence signal D in, a verdict out.

Owns the verdict types (Stable, SuppressGrowth, NudgeDown), the three guards (none, trend,
rate) with their thresholds and streaks, and the relative-divergence formula over norms. It
does not touch tensors: the runtime computes the norms and hands over D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from flodl_run.config.schema import GuardKind

# Norms at or below this count as zero (a model at the origin has no relative divergence).
ZERO_NORM = 1e-12
# divergence_threshold when unset: replicas of plain averaging sit close to the consensus;
# EASGD keeps them on a deliberate elastic spread, so its alarm sits higher.
DEFAULT_THRESHOLD = 0.05
EASGD_THRESHOLD = 0.3


def resolved_threshold(divergence_threshold: Optional[float],
                       easgd_alpha: Optional[float]) -> float:
    """elche.divergence_threshold, or its default: 0.05, or 0.3 when easgd_alpha is set."""
    if divergence_threshold is not None:
        return divergence_threshold
    return EASGD_THRESHOLD if easgd_alpha is not None else DEFAULT_THRESHOLD


@dataclass(frozen=True)
class Stable:
    """Replicas agree: the proposal of the same reduce may land."""

    label = "stable"


@dataclass(frozen=True)
class SuppressGrowth:
    """Divergence is rising: drop a proposed growth and latch growth off."""

    label = "suppress_growth"


@dataclass(frozen=True)
class NudgeDown:
    """Shrink the anchor by `factor` (in (0, 1]), dropping whatever was proposed."""

    factor: float
    label = "nudge_down"


Verdict = Union[Stable, SuppressGrowth, NudgeDown]
STABLE = Stable()
SUPPRESS_GROWTH = SuppressGrowth()


def is_divergent(verdict: Verdict) -> bool:
    """SuppressGrowth and NudgeDown both say the replicas are drifting apart."""
    return not isinstance(verdict, Stable)


def verdict_to_json(verdict: Verdict) -> Dict[str, Any]:
    if isinstance(verdict, NudgeDown):
        return {"kind": verdict.label, "factor": verdict.factor}
    return {"kind": verdict.label}


def verdict_from_json(data: Dict[str, Any]) -> Verdict:
    kind = data["kind"]
    if kind == NudgeDown.label:
        return NudgeDown(float(data["factor"]))
    return SUPPRESS_GROWTH if kind == SuppressGrowth.label else STABLE


def divergence_from_norms(diff_norms: Sequence[float], consensus_norm: float) -> float:
    """D = max_k ||theta_k - theta*|| / ||theta*||; 0 when the consensus norm is ~0 or no rank."""
    if consensus_norm <= ZERO_NORM or not diff_norms:
        return 0.0
    return max(diff_norms) / consensus_norm


class NoGuard:
    """`none`: every reduce is Stable."""

    kind = GuardKind.none

    def observe(self, divergence: Optional[float], steps: int) -> Verdict:
        return STABLE

    def export_state(self) -> Dict[str, Any]:
        return {"kind": self.kind.value}

    def restore(self, state: Dict[str, Any]) -> None:
        pass


# trend: how many recent D values are kept, and how many must rise in a row.
TREND_KEEP = 5
TREND_RISING = 3


class TrendGuard:
    """`trend`: SuppressGrowth when the last three D strictly rise and the latest is above the
    threshold; a reduce without a D leaves the history as it was."""

    kind = GuardKind.trend

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.history: List[float] = []

    def observe(self, divergence: Optional[float], steps: int) -> Verdict:
        if divergence is None:
            return STABLE
        self.history.append(float(divergence))
        del self.history[:-TREND_KEEP]
        last = self.history[-TREND_RISING:]
        rising = len(last) == TREND_RISING and all(a < b for a, b in zip(last, last[1:]))
        return SUPPRESS_GROWTH if rising and last[-1] > self.threshold else STABLE

    def export_state(self) -> Dict[str, Any]:
        return {"kind": self.kind.value, "history": list(self.history)}

    def restore(self, state: Dict[str, Any]) -> None:
        self.history = [float(d) for d in state.get("history", [])][-TREND_KEEP:]


# rate: EMA decay of the per-step log growth rate of D, its two alarm levels, and the streak.
RATE_DECAY = 0.9
RATE_SUPPRESS = 1e-3
RATE_NUDGE = 1e-2
RATE_STREAK = 3
RATE_NUDGE_FACTOR = 0.5
# D at or below this has no meaningful log rate; the estimator starts over.
RATE_FLOOR = 1e-8


class RateGuard:
    """`rate`: EMA of lambda = ln(D_t / D_{t-1}) / k_max, bias-corrected; 3 events above 1e-3
    -> SuppressGrowth, 3 above 1e-2 -> NudgeDown(0.5) (the nudge wins). The streak that fired
    starts over, as in floDl."""

    kind = GuardKind.rate

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.previous: Optional[float] = None
        self.ema = 0.0
        self.samples = 0
        self.suppress_streak = 0
        self.nudge_streak = 0

    def observe(self, divergence: Optional[float], steps: int) -> Verdict:
        if divergence is None:
            return STABLE
        if divergence <= RATE_FLOOR or (self.previous is not None and self.previous <= RATE_FLOOR):
            self._reset()
            self.previous = float(divergence)
            return STABLE
        if self.previous is None or steps < 1:
            self.previous = float(divergence)
            return STABLE
        rate = math.log(divergence / self.previous) / steps
        self.previous = float(divergence)
        self.ema = RATE_DECAY * self.ema + (1 - RATE_DECAY) * rate
        self.samples += 1
        corrected = self.ema / (1 - RATE_DECAY ** self.samples)
        self.suppress_streak = self.suppress_streak + 1 if corrected > RATE_SUPPRESS else 0
        self.nudge_streak = self.nudge_streak + 1 if corrected > RATE_NUDGE else 0
        # A verdict spends the streak that fired it: 3 more events are needed for the next one,
        # so a run of high rates nudges once per 3 reduces, not on every reduce after the 3rd.
        # The nudge spends the suppress streak too (it already latched growth off).
        if self.nudge_streak >= RATE_STREAK:
            self.nudge_streak = self.suppress_streak = 0
            return NudgeDown(RATE_NUDGE_FACTOR)
        if self.suppress_streak >= RATE_STREAK:
            self.suppress_streak = 0
            return SUPPRESS_GROWTH
        return STABLE

    def export_state(self) -> Dict[str, Any]:
        return {"kind": self.kind.value, "previous": self.previous, "ema": self.ema,
                "samples": self.samples, "suppress_streak": self.suppress_streak,
                "nudge_streak": self.nudge_streak}

    def restore(self, state: Dict[str, Any]) -> None:
        self._reset()
        previous = state.get("previous")
        self.previous = None if previous is None else float(previous)
        self.ema = float(state.get("ema", 0.0))
        self.samples = int(state.get("samples", 0))
        self.suppress_streak = int(state.get("suppress_streak", 0))
        self.nudge_streak = int(state.get("nudge_streak", 0))


Guard = Union[NoGuard, TrendGuard, RateGuard]


def make_guard(kind: GuardKind | str, threshold: float) -> Guard:
    """The guard of `kind`; `threshold` is the resolved divergence_threshold (trend only)."""
    kind = GuardKind(kind)
    if kind is GuardKind.trend:
        return TrendGuard(threshold)
    if kind is GuardKind.rate:
        return RateGuard()
    return NoGuard()
