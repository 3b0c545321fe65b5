"""nccl_sync's time model of one rank's step: a fixed cost plus a cost per sample, fitted from
the windows the rank reported.

Owns the per-rank history of (samples per step, ms per step) points, the least-squares line
through them, its clamps and its fallbacks. Pure: window means in, a StepCost out. Which shares
the costs lead to is `shares`; measuring is the ranks'.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

KEEP_POINTS = 8
"""Windows of a rank kept for its line: at the 2 s window cap, the last ~16 s of its compute,
recent enough to follow a drifting device, enough points to average a window's noise."""

MIN_SPREAD = 0.10
"""A line needs points whose samples per step differ by at least this share of their mean;
closer together (the shares have settled) the slope is noise, and the last line's fixed cost
in samples (a / b) is kept, its level set by the points."""

MIN_POINTS = 3
"""A line needs three windows at least: two points always lie on one, noise included."""

MAX_SCATTER = 0.10
"""A line is trusted when its points scatter around it by at most this share of their mean
step time (root mean square). A loaded machine's windows vary by 30% or more: a line through
them says nothing of a fixed cost, and the last trusted shape (or the speed rule) plans."""

MAX_SLOPE_ERROR = 0.15
"""A line is trusted when its slope's standard error, times the mean samples a step, is at
most this share of the mean step time: points close together (a settled split) with a few
percent of noise give slopes that swing the fixed cost from 0 to the whole step. Measured on
bench=lm_cpu's 2.5x-slowed rank (16 samples a step, 140 ms): such lines moved its share
between 8 and 18 samples of 64 from one epoch to the next, where its speed says 18."""
MIN_PER_SAMPLE = 0.05
"""The per-sample cost is at least this share of the rank's mean ms per sample: a step whose
time does not grow with its samples would take the whole batch (a slope at or below zero is a
noisy fit, not a device)."""

Point = Tuple[float, float]  # (samples per step, ms per step) of one window


@dataclass(frozen=True)
class StepCost:
    """One rank's step: `fixed_ms + per_sample_ms * samples`, both >= 0."""

    fixed_ms: float
    per_sample_ms: float

    def ms(self, samples: float) -> float:
        return self.fixed_ms + self.per_sample_ms * samples


def fit_line(points: Sequence[Point]) -> Optional[StepCost]:
    """Least squares `t = a + b s` through the points, clamped: b at least MIN_PER_SAMPLE of
    the mean ms per sample, a at least 0 (each clamp refits the other term). None when there
    is no slope to read: fewer than MIN_POINTS points, samples per step spread less than
    MIN_SPREAD of their mean, points scattered more than MAX_SCATTER around the line, or a
    slope too uncertain for the spread of the points (MAX_SLOPE_ERROR)."""
    usable = [(s, t) for s, t in points if s > 0 and t > 0]
    n = len(usable)
    if n < MIN_POINTS:
        return None
    mean_s = sum(s for s, _ in usable) / n
    mean_t = sum(t for _, t in usable) / n
    spread = max(s for s, _ in usable) - min(s for s, _ in usable)
    if spread < MIN_SPREAD * mean_s:
        return None
    var = sum((s - mean_s) ** 2 for s, _ in usable)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in usable) / var
    scatter = (sum((t - mean_t - slope * (s - mean_s)) ** 2 for s, t in usable) / n) ** 0.5
    if scatter > MAX_SCATTER * mean_t:
        return None
    slope_error = scatter * (n / max(n - 2, 1)) ** 0.5 / var ** 0.5  # the slope's standard error
    if slope_error * mean_s > MAX_SLOPE_ERROR * mean_t:
        return None
    floor = MIN_PER_SAMPLE * mean_t / mean_s
    slope = max(slope, floor)
    fixed = mean_t - slope * mean_s
    if fixed < 0:  # the line would cross zero time above zero samples: a per-sample cost only
        return StepCost(0.0, sum(s * t for s, t in usable) / sum(s * s for s, _ in usable))
    return StepCost(fixed, slope)


def at_level(points: Sequence[Point], fixed_samples: float) -> Optional[StepCost]:
    """The cost through the points' mean whose fixed part costs as much as `fixed_samples`
    samples: the level measured now, the shape of an earlier line (0: the speed rule, all of
    the time per sample)."""
    usable = [(s, t) for s, t in points if s > 0 and t > 0]
    if not usable:
        return None
    mean_s = sum(s for s, _ in usable) / len(usable)
    mean_t = sum(t for _, t in usable) / len(usable)
    per_sample = mean_t / (fixed_samples + mean_s)
    return StepCost(fixed_samples * per_sample, per_sample)


class StepFit:
    """Each rank's recent window points and the cost they give. `record` once per window per
    rank, `cost(rank)` when planning, `forget(rank)` when it leaves."""

    def __init__(self) -> None:
        self._points: Dict[int, Deque[Point]] = {}
        self._fixed_samples: Dict[int, float] = {}  # a / b of the last line fitted

    def record(self, rank: int, steps: int, samples: int, compute_ms: float) -> None:
        """A window of `steps` steps in which the rank computed `samples` samples in
        `compute_ms` (waits at the all-reduce left out); a window without them is no point."""
        if steps <= 0 or samples <= 0 or not compute_ms > 0:
            return
        points = self._points.setdefault(rank, deque(maxlen=KEEP_POINTS))
        points.append((samples / steps, compute_ms / steps))
        line = fit_line(points)
        if line is not None:
            self._fixed_samples[rank] = line.fixed_ms / line.per_sample_ms

    def cost(self, rank: int) -> Optional[StepCost]:
        """The rank's step cost: the line through its points, else (points too close together)
        the last line's shape (a / b) at the points' level, else (no line yet) all per sample.
        None before its first point."""
        points = self._points.get(rank)
        if not points:
            return None
        return fit_line(points) or at_level(points, self._fixed_samples.get(rank, 0.0))

    def forget(self, rank: int) -> None:
        self._points.pop(rank, None)
        self._fixed_samples.pop(rank, None)

    def points(self, rank: int) -> List[Point]:
        return list(self._points.get(rank, ()))

    def export_state(self) -> Dict[str, Any]:
        """JSON-ready: each rank's points and last line's shape (ranks as strings)."""
        return {"points": {str(r): [list(p) for p in pts] for r, pts in self._points.items()},
                "fixed_samples": {str(r): f for r, f in self._fixed_samples.items()}}

    def load_state(self, state: Dict[str, Any]) -> None:
        """What `export_state` wrote; the newest KEEP_POINTS points of a rank are kept."""
        self._points = {int(r): deque(((float(s), float(t)) for s, t in pts), maxlen=KEEP_POINTS)
                        for r, pts in state.get("points", {}).items()}
        self._fixed_samples = {int(r): float(f) for r, f in state.get("fixed_samples", {}).items()}
