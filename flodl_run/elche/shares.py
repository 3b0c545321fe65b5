"""nccl_sync's split of one global step: how many of its samples each rank computes.

Owns the two rules and the planner that picks between them once per window: the
speed-proportional share (the cold start, and partition_ratios), and the equal-time share from
each rank's fitted step cost (`stepfit`), moved at most 2x per window. Both give every member
at least one sample. Pure: timings in, integers out. Which samples they are is dispatch's; the
window length is ElChe's anchor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from flodl_run.elche.batch_counts import MAX_SPEED_RATIO
from flodl_run.elche.stepfit import StepCost, StepFit

WINDOW_CAP_MS = 2000.0
"""A window holds at most about this much compute: the control plane still hears from the ranks
every few seconds (progress, a stop at the window's end, a death's redo stays short)."""

EVEN_WITHIN = 1.10
"""Speeds within 10% of each other split a step equally: on a homogeneous rig the measured
speeds differ by noise only, and an equal split is exactly torch DDP's."""


def window_steps(anchor: int, ms_per_batch: Sequence[Optional[float]], members) -> int:
    """Steps of the next window: ElChe's anchor, at most WINDOW_CAP_MS of the slowest member's
    smoothed compute (one step until a member has a timing). A lone member has no shares to
    re-plan, so its windows run to the cap: each boundary is a control round trip and, on a
    GPU, a wait for the device that its steps do not need."""
    known = [ms for r, ms in enumerate(ms_per_batch) if ms and r in members]
    cap = max(1, int(WINDOW_CAP_MS / max(known))) if known else 1
    return cap if len(members) == 1 else max(1, min(anchor, cap))


def step_shares(total: int, ms_per_batch: Sequence[Optional[float]], members: Sequence[int],
                ratios: Optional[Sequence[float]] = None) -> List[int]:
    """Samples of a step of `total` per rank (indexed by rank, 0 for a non-member).

    Shares follow `ratios` when given, else speed (1 / ms per batch of the same size); a member
    without a timing counts at the mean speed of those with one, and with no timing at all the
    split is equal. Ratios are capped at 64x the slowest member, and every member gets at least
    one sample (each must take part in the step's all-reduce) when `total` allows. Speeds
    within EVEN_WITHIN of each other count as equal.
    """
    size = max(ms_per_batch and len(ms_per_batch) or 0, (max(members) + 1) if members else 0,
               len(ratios) if ratios else 0)
    if not members or total <= 0:
        return [0] * size
    split = largest_remainder(total, _weights(ms_per_batch, members, ratios))
    return _placed(size, members, _at_least_one(split, total))


def _at_least_one(split: List[int], total: int) -> List[int]:
    """Every member one sample at least (taken from the largest share) when `total` allows."""
    if total >= len(split):
        for i in [i for i, share in enumerate(split) if share == 0]:
            split[i] = 1
            split[max(range(len(split)), key=lambda j: split[j])] -= 1
    return split


def _placed(size: int, members: Sequence[int], split: Sequence[int]) -> List[int]:
    out = [0] * size
    for rank, share in zip(members, split):
        out[rank] = share
    return out


def _weights(ms_per_batch: Sequence[Optional[float]], members: Sequence[int],
             ratios: Optional[Sequence[float]]) -> List[float]:
    if ratios:
        speeds = [float(ratios[r]) for r in members]
    else:
        known = [1.0 / ms_per_batch[r] for r in members
                 if r < len(ms_per_batch) and ms_per_batch[r] and ms_per_batch[r] > 0]
        mean = sum(known) / len(known) if known else 1.0
        speeds = [1.0 / ms_per_batch[r] if r < len(ms_per_batch) and ms_per_batch[r]
                  and ms_per_batch[r] > 0 else mean for r in members]
    slowest = min(speeds)
    if not ratios and max(speeds) <= EVEN_WITHIN * slowest:
        return [1.0] * len(speeds)
    return [min(s, slowest * MAX_SPEED_RATIO) for s in speeds]


def largest_remainder(total: int, weights: Sequence[float]) -> List[int]:
    """Integers summing to `total`, proportional to weights (ties to the lowest index)."""
    wsum = sum(weights)
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    exact = [total * w / wsum for w in weights]
    out = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))[:total - sum(out)]:
        out[i] += 1
    return out


def equal_time(total: int, costs: Sequence[StepCost]) -> List[float]:
    """Shares of a step of `total` samples (in the costs' order, summing to `total`) at which
    every rank's step takes the same time T, the least a step can take: with each rank's time
    a + b s, T = (total + sum a/b) / sum 1/b and s = (T - a) / b. A rank whose fixed cost alone
    passes T gets one sample (every rank takes part in the all-reduce), and T is solved again
    among the others. Speeds within EVEN_WITHIN of each other at an equal split split equally
    (torch DDP's split on a homogeneous rig)."""
    count = len(costs)
    if count == 0 or total <= 0:
        return [0.0] * count
    even = [c.ms(total / count) for c in costs]
    if max(even) <= EVEN_WITHIN * min(even) or total <= count:
        return [total / count] * count
    floored: Dict[int, float] = {}
    while True:
        free = [i for i in range(count) if i not in floored]
        left = total - len(floored)
        inverse = sum(1.0 / costs[i].per_sample_ms for i in free)
        step_ms = (left + sum(costs[i].fixed_ms / costs[i].per_sample_ms for i in free)) / inverse
        shares = {i: (step_ms - costs[i].fixed_ms) / costs[i].per_sample_ms for i in free}
        low = [i for i, s in shares.items() if s < 1.0]
        if not low:
            return [floored.get(i, shares.get(i)) for i in range(count)]
        floored.update({i: 1.0 for i in low})


def bounded(previous: Sequence[float], target: Sequence[float], factor: float) -> List[float]:
    """The way from `previous` to `target` (fractions of a step, each summing to 1), as far as
    no share moves past `factor` times or 1/`factor` of its previous value: a noisy fit moves
    the split a bounded amount per window, and the sum stays the step."""
    reach = 1.0
    for old, new in zip(previous, target):
        if old <= 0 or new == old:
            continue
        limit = old * factor if new > old else old / factor
        reach = min(reach, (limit - old) / (new - old))
    return [old + reach * (new - old) for old, new in zip(previous, target)]


MAX_MOVE = 2.0
"""A share moves at most 2x (up or down) from one window to the next on the time model."""


class SharePlanner:
    """The shares of every step of nccl_sync's next window. Given each window's timings
    (`observe`), it plans by `partition_ratios` when stated; else by speed until every member
    has a fitted step cost (the first window: equal), then by equal time, moved at most
    MAX_MOVE per window from the last window's split."""

    def __init__(self, ratios: Optional[Sequence[float]] = None):
        self.ratios = list(ratios) if ratios else None
        self.fit = StepFit()
        self._last: Optional[Dict[int, float]] = None  # rank -> fraction of the full step

    def observe(self, rank: int, steps: int, samples: int, compute_ms: float) -> None:
        """One rank's window: its steps, samples and compute (the all-reduce's waits left out)."""
        self.fit.record(rank, steps, samples, compute_ms)

    def costs(self, members: Sequence[int]) -> Optional[List[StepCost]]:
        """The members' fitted step costs when the time model plans (every member has one and
        no ratios are stated); else None."""
        costs = [self.fit.cost(r) for r in members]
        return None if self.ratios or not costs or any(c is None for c in costs) else costs

    def export_state(self) -> Dict[str, Any]:
        """JSON-ready, for a bundle: the fit's points and the last split, so a resumed run plans
        its first window where the saved one left off instead of from an equal split."""
        last = None if self._last is None else {str(r): f for r, f in self._last.items()}
        return {"fit": self.fit.export_state(), "last": last}

    def load_state(self, state: Dict[str, Any]) -> None:
        self.fit.load_state(state.get("fit", {}))
        last = state.get("last")
        self._last = None if last is None else {int(r): float(f) for r, f in last.items()}

    def last_split(self) -> Dict[int, float]:
        """Each rank's fraction of the last full step planned (empty before the first)."""
        return dict(self._last or {})

    def plan(self, totals: Sequence[int], members: Sequence[int],
             ms_per_batch: Sequence[Optional[float]]) -> List[List[int]]:
        """Each step's shares (indexed by rank, 0 for a non-member) of a window whose steps
        have `totals` samples. The full step (the largest total) follows the bounded split;
        a smaller tail step is solved on its own."""
        size = max([len(ms_per_batch), max(members) + 1 if members else 0,
                    len(self.ratios) if self.ratios else 0])
        costs = self.costs(members)
        if costs is None:
            plans = {t: step_shares(t, ms_per_batch, members, self.ratios) for t in set(totals)}
            full = max(totals, default=0)
            if full > 0 and not self.ratios:
                self._last = {r: plans[full][r] / full for r in members}
            return [plans[t] for t in totals]
        return self._by_time(totals, members, costs, size)

    def _by_time(self, totals: Sequence[int], members: Sequence[int], costs: List[StepCost],
                 size: int) -> List[List[int]]:
        full = max(totals, default=0)
        plans: Dict[int, List[int]] = {}
        for total in set(totals):
            shares = equal_time(total, costs)
            if total == full and self._last is not None and set(self._last) == set(members):
                fractions = bounded([self._last[r] for r in members], [s / total for s in shares],
                                    MAX_MOVE)
                shares = [f * total for f in fractions]
            split = _at_least_one(largest_remainder(total, shares), total)
            plans[total] = _placed(size, members, split)
            if total == full:
                self._last = {r: share / total for r, share in zip(members, split)}
        return [plans[t] for t in totals]
