"""Golden traces of ElChe: whole runs of a scripted rig, reduce by reduce, against JSON
fixtures in tests/golden/.

A change in any decision (phase, anchor, anchor rank, counts, verdict, nudge, overshoot,
events) shows up as a diff against the fixture. When a change is intended, regenerate on
purpose and review the JSON diff in the PR:

    FLODL_RUN_REGEN_GOLDEN=1 python -m pytest tests/test_elche_golden.py
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from flodl_run.config.schema import ElCheConfig
from flodl_run.elche.balancer import ElChe, Plan, ReduceReport

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("FLODL_RUN_REGEN_GOLDEN") == "1"


@dataclass
class Scenario:
    """A scripted rig: per-window ms per batch, reduce cost, divergence and LR."""

    name: str
    rank_ms: List[float]
    windows: int
    sync_ms: float
    divergence: List[float]
    """D per window (the last value repeats)."""
    lr: float = 0.1
    lr_drops: List[int] = field(default_factory=list)
    skew: Optional[Dict[str, Any]] = None
    """{"rank", "factor", "windows"}: that rank reads `factor` x slower at first."""
    prior: Optional[List[float]] = None
    elche: Dict[str, Any] = field(default_factory=dict)
    """ElCheConfig fields over the nccl_cadence defaults."""
    reduce_ms: Optional[float] = None
    """One reduce timed before training, handed to ElChe (None = not measured)."""

    def ms(self, window: int) -> List[float]:
        speeds = list(self.rank_ms)
        if self.skew and window < self.skew["windows"]:
            speeds[self.skew["rank"]] *= self.skew["factor"]
        return speeds

    def lr_at(self, window: int) -> float:
        return self.lr * 0.1 ** sum(1 for w in self.lr_drops if w <= window)


RISING = [0.02] * 4 + [round(0.03 + 0.01 * i, 2) for i in range(10)] + [0.05, 0.03, 0.02]

SCENARIOS = [
    Scenario("two_ranks_10_vs_25", [10.0, 25.0], windows=30, sync_ms=30.0, divergence=[0.01]),
    Scenario("four_ranks_cold_start", [10.0, 14.0, 20.0, 25.0], windows=30, sync_ms=20.0,
             divergence=[0.01], skew={"rank": 0, "factor": 3.0, "windows": 3},
             prior=[4.0, 3.0, 2.0, 1.0]),
    Scenario("four_ranks_cold_start_no_prior", [10.0, 14.0, 20.0, 25.0], windows=30, sync_ms=20.0,
             divergence=[0.01], skew={"rank": 0, "factor": 3.0, "windows": 3}),
    Scenario("rising_divergence_lr_drop", [10.0, 25.0], windows=30, sync_ms=30.0,
             divergence=RISING, lr_drops=[15]),
    Scenario("two_ranks_timed_reduce", [10.0, 25.0], windows=30, sync_ms=30.0, divergence=[0.01],
             reduce_ms=28.0),
]


def _row(plan: Plan) -> Dict[str, Any]:
    return {
        "reduce": plan.reduce, "phase": plan.phase.label, "anchor": plan.anchor,
        "anchor_rank": plan.anchor_rank, "batch_counts": list(plan.batch_counts),
        "overhead": None if plan.overhead is None else round(plan.overhead, 6),
        "divergence": plan.divergence, "verdict": plan.verdict.label,
        "nudge_factor": None if plan.nudge_factor is None else round(plan.nudge_factor, 6),
        "max_overshoot": plan.max_overshoot, "settled": plan.settled,
        "events": [e.kind for e in plan.events],
    }


def trace(s: Scenario) -> Dict[str, Any]:
    """Run the scenario: window w runs the current plan at s.ms(w), then reports its reduce."""
    elche = ElChe(ElCheConfig(**s.elche), len(s.rank_ms), prior=s.prior, reduce_ms=s.reduce_ms)
    rows = [_row(elche.plan())]
    for w in range(s.windows):
        plan = elche.plan()
        walls = [c * m for c, m in zip(plan.batch_counts, s.ms(w))]
        d = s.divergence[min(w, len(s.divergence) - 1)]
        rows.append(_row(elche.on_reduce(ReduceReport(
            wall_ms=walls, batches=list(plan.batch_counts), sync_ms=s.sync_ms, divergence=d,
            lr=s.lr_at(w)))))
    state = json.loads(json.dumps(elche.export_state()))
    return {"scenario": s.__dict__, "trace": rows, "final_state": state}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_golden_trace(scenario: Scenario) -> None:
    """Pins ElChe's whole decision trace for a scripted rig against tests/golden/<name>.json
    (regenerate only on purpose: FLODL_RUN_REGEN_GOLDEN=1)."""
    path = GOLDEN / f"{scenario.name}.json"
    got = json.loads(json.dumps(trace(scenario)))
    if REGEN:
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"regenerated {path.name}")
    expected = json.loads(path.read_text())
    assert got["scenario"] == expected["scenario"], "the scenario changed: regenerate on purpose"
    for want, have in zip(expected["trace"], got["trace"]):
        assert have == want, f"first divergence from the golden trace at reduce {want['reduce']}"
    assert len(got["trace"]) == len(expected["trace"])
    assert got["final_state"] == expected["final_state"]


def test_golden_traces_show_the_behaviours_they_pin() -> None:
    """Pins what each fixture is for, so a regenerated fixture that lost its point fails: the
    10-vs-25 rig grows and settles at 2.5x counts; a spec prior keeps the slow rank seated
    through a cold start (without it the fast rank holds the seat until Stable); the rising
    divergence is vetoed and the LR drop nudges."""
    load = {s.name: json.loads((GOLDEN / f"{s.name}.json").read_text())["trace"] for s in SCENARIOS}
    two = load["two_ranks_10_vs_25"]
    assert two[-1]["batch_counts"][0] / two[-1]["batch_counts"][1] == pytest.approx(2.5, rel=0.1)
    assert two[-1]["anchor"] > two[0]["anchor"] and two[-1]["overhead"] <= 0.05
    assert {row["anchor_rank"] for row in load["four_ranks_cold_start"]} == {3}
    no_prior = [row["anchor_rank"] for row in load["four_ranks_cold_start_no_prior"]]
    assert no_prior[1:5] == [0] * 4 and no_prior[-1] == 3
    rising = load["rising_divergence_lr_drop"]
    assert "suppress_growth" in [row["verdict"] for row in rising]
    cliff = rising[16]  # the reduce of window 15, where the LR drops
    assert cliff["verdict"] == "nudge_down" and cliff["nudge_factor"] is not None
