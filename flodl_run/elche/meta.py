"""The LR-aware meta-controller above ElChe: nudges the anchor down on an LR
cliff or on sustained divergence, softened or sharpened by the anchor's recent trend.

Owns the rolling windows (last 3 LRs, 5 anchors, 5 verdicts), the per-phase base factors and
sustain K, and `is_settled()`. It does not apply the nudge: ElChe does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from flodl_run.elche.guard import NudgeDown, Verdict, is_divergent, verdict_from_json, verdict_to_json
from flodl_run.elche.phase import Phase

KEEP_LRS = 3
KEEP_ANCHORS = 5
KEEP_VERDICTS = 5
# An LR that fell by more than 30% since the previous reduce is a cliff (a step schedule's
# drop): the replicas are about to move differently, so the window shrinks ahead of it.
LR_CLIFF_DROP = 0.30
# Base nudge factor per phase: an untrusted phase cuts hard, a trusted one eases off.
BASE_FACTOR = {Phase.WARMUP: 0.3, Phase.STABLE: 0.5, Phase.MATURE: 0.7}
# Divergent verdicts in a row that make the pattern "sustained": more evidence early on.
SUSTAIN_K = {Phase.PROBE: 5, Phase.WARMUP: 5, Phase.STABLE: 3, Phase.MATURE: 2}
MIN_FACTOR = 0.1
MAX_FACTOR = 0.95
# |trend| under 10% means the anchor has stopped moving.
SETTLED_TREND = 0.10


@dataclass(frozen=True)
class MetaNudge:
    """The meta-controller's order for one reduce: shrink the anchor by `factor`."""

    factor: float
    reasons: Tuple[str, ...]
    """Which patterns fired: "lr_cliff", "sustained_divergence"."""


def combine(verdict: Verdict, nudge: MetaNudge) -> Verdict:
    """The verdict ElChe applies: a meta nudge replaces the guard's verdict; against a guard
    NudgeDown (the rate guard's) the smaller factor wins."""
    if isinstance(verdict, NudgeDown) and verdict.factor <= nudge.factor:
        return verdict
    return NudgeDown(nudge.factor)


def effective_factor(base: float, trend: float) -> float:
    """clamp(base - (1 - base) * trend, 0.1, 0.95): a rising anchor gets a harsher cut."""
    return _clamp(base - (1 - base) * trend)


def _clamp(factor: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, factor))


class MetaController:
    """Rolling view of LR, anchor and guard verdicts; one `observe` per reduce."""

    def __init__(self) -> None:
        self.lrs: List[float] = []
        self.anchors: List[int] = []
        self.verdicts: List[Verdict] = []

    def observe(self, phase: Phase, anchor: int, verdict: Verdict,
                lr: Optional[float] = None) -> Optional[MetaNudge]:
        """Record this reduce (anchor before any change, the guard's verdict, the LR if one
        was reported) and return a nudge when a pattern fires; never in Probe."""
        cliff = self._push_lr(lr)
        _push(self.anchors, anchor, KEEP_ANCHORS)
        _push(self.verdicts, verdict, KEEP_VERDICTS)
        if phase <= Phase.PROBE:
            return None
        sustained = self._is_sustained(phase)
        if sustained:
            # Start a fresh count: the same verdicts must not fire again on the next reduce.
            self.verdicts.clear()
        return self._nudge(phase, cliff, sustained)

    def _push_lr(self, lr: Optional[float]) -> bool:
        if lr is None:
            return False
        previous = self.lrs[-1] if self.lrs else None
        _push(self.lrs, float(lr), KEEP_LRS)
        return previous is not None and previous > 0 and lr < (1 - LR_CLIFF_DROP) * previous

    def _is_sustained(self, phase: Phase) -> bool:
        k = SUSTAIN_K[phase]
        newest = self.verdicts[-k:]
        return len(newest) == k and all(is_divergent(v) for v in newest)

    def _nudge(self, phase: Phase, cliff: bool, sustained: bool) -> Optional[MetaNudge]:
        # Both patterns use the current phase's base factor (the issue's "nudge with the
        # factor of the current phase"); see docs/elche.md.
        fired = [name for name, hit in (("lr_cliff", cliff), ("sustained_divergence", sustained))
                 if hit]
        if not fired:
            return None
        one = effective_factor(BASE_FACTOR[phase], self.trend())
        factor = one if len(fired) == 1 else _clamp(one * one)
        return MetaNudge(factor, tuple(fired))

    def trend(self) -> float:
        """(anchor now - mean of the last 5 anchors) / that mean; 0 before any anchor."""
        if not self.anchors:
            return 0.0
        mean = sum(self.anchors) / len(self.anchors)
        return (self.anchors[-1] - mean) / mean if mean > 0 else 0.0

    def is_settled(self) -> bool:
        """The anchor has stopped moving (|trend| < 0.10 over a full window of 5 anchors):
        usable as an early-stop hint, so never true before there is a window to judge."""
        return len(self.anchors) == KEEP_ANCHORS and abs(self.trend()) < SETTLED_TREND

    def export_state(self) -> Dict[str, Any]:
        return {"lrs": list(self.lrs), "anchors": list(self.anchors),
                "verdicts": [verdict_to_json(v) for v in self.verdicts]}

    def restore(self, state: Dict[str, Any]) -> None:
        self.lrs = [float(x) for x in state.get("lrs", [])][-KEEP_LRS:]
        self.anchors = [int(x) for x in state.get("anchors", [])][-KEEP_ANCHORS:]
        self.verdicts = [verdict_from_json(v) for v in state.get("verdicts", [])][-KEEP_VERDICTS:]


def _push(window: list, item: Any, keep: int) -> None:
    window.append(item)
    if len(window) > keep:
        del window[0]
