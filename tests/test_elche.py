"""ElChe end to end over its pure API: phases, election, counts, verdicts, state."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import List, Optional, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_run.config.schema import ElCheConfig, GuardKind, Mode, SyncAverage
from flodl_run.elche.balancer import ElChe, Plan, ReduceReport
from flodl_run.elche.guard import STABLE, NudgeDown
from flodl_run.elche.phase import Phase
from flodl_run.elche.timing import RankTiming


def report(plan: Plan, ms: Sequence[Optional[float]], sync_ms: float = 5.0,
           divergence: Optional[float] = None, lr: Optional[float] = None) -> ReduceReport:
    """What the ranks would report after running `plan` at `ms` per batch (None = silent)."""
    walls = [None if m is None else c * m for c, m in zip(plan.batch_counts, ms)]
    batches = [None if m is None else c for c, m in zip(plan.batch_counts, ms)]
    return ReduceReport(wall_ms=walls, batches=batches, sync_ms=sync_ms,
                        divergence=divergence, lr=lr)


def run(elche: ElChe, windows: int, ms, **kwargs) -> List[Plan]:
    plans = []
    for w in range(windows):
        speeds = ms(w) if callable(ms) else ms
        plans.append(elche.on_reduce(report(elche.plan(), speeds, **kwargs)))
    return plans


def test_phase_follows_calibrations() -> None:
    """Pins the phase machine: Probe before any report, Warmup from the 1st calibration,
    Stable from the 5th, Mature from the 20th, and `phase >= Phase.STABLE` comparisons."""
    elche = ElChe(ElCheConfig(), 2)
    assert elche.plan().phase is Phase.PROBE
    phases = [p.phase for p in run(elche, 25, [10.0, 25.0])]
    assert phases[0] is Phase.WARMUP and phases[3] is Phase.WARMUP
    assert phases[4] is Phase.STABLE and phases[18] is Phase.STABLE
    assert phases[19] is Phase.MATURE and phases[-1] >= Phase.STABLE
    first = run(ElChe(ElCheConfig(), 2), 1, [10.0, 25.0])[0]
    assert [e.kind for e in first.events] == ["phase", "anchor_rank"]


def test_report_without_valid_reading_is_not_a_calibration() -> None:
    """Pins "calibration = successful timing report": a reduce where no rank reported usable
    timing does not advance the phase."""
    elche = ElChe(ElCheConfig(), 2)
    assert elche.on_reduce(report(elche.plan(), [None, None])).phase is Phase.PROBE
    assert elche.calibration_count == 0


def test_probe_takes_no_actions() -> None:
    """Pins "Probe: no actions": reduces without any valid timing keep the anchor, the growth
    latch and the overshoot even when the guard already sees D rising."""
    elche = ElChe(ElCheConfig(mode=Mode.cpu_async, easgd_alpha=0.5, divergence_threshold=0.05), 2)
    for d in (0.06, 0.07, 0.08):
        plan = elche.on_reduce(report(elche.plan(), [None, None], sync_ms=100.0, divergence=d))
    assert plan.phase is Phase.PROBE and plan.verdict.label == "suppress_growth"
    assert (plan.anchor, plan.max_overshoot, elche.latch.latched) == (10, 3, False)


def test_two_ranks_10_vs_25_get_a_2_5x_count_ratio() -> None:
    """Pins speed-proportional counts: the 10 ms rank runs 2.5x the 25 ms anchor rank."""
    plans = run(ElChe(ElCheConfig(), 2), 6, [10.0, 25.0])
    assert plans[0].batch_counts == (25, 10) and plans[-1].anchor_rank == 1


def test_pin_holds_through_warmup_without_prior() -> None:
    """Pins the Warmup pin: rank 0 looks slowest (cold start, 3 windows) at the first election
    and keeps the seat through Warmup even after it speeds up; the election opens at Stable."""
    skewed = lambda w: [30.0 if w < 3 else 10.0, 25.0]  # noqa: E731
    plans = run(ElChe(ElCheConfig(), 2), 6, skewed)
    assert [p.anchor_rank for p in plans] == [0, 0, 0, 0, 1, 1]


def test_spec_prior_pins_the_slow_rank_through_cold_start() -> None:
    """Pins the spec prior: with rank 1 known slower, a 3-window cold start on rank 0 never
    moves the anchor rank (the Stable election sees rank 0 within 10% and keeps the seat)."""
    skewed = lambda w: [30.0 if w < 3 else 10.0, 25.0]  # noqa: E731
    elche = ElChe(ElCheConfig(), 2, prior=[2.0, 1.0])
    assert elche.plan().anchor_rank == 1
    assert {p.anchor_rank for p in run(elche, 30, skewed)} == {1}


def test_dead_window_escape_reelects_in_warmup() -> None:
    """Pins the escape: the pinned anchor rank gives no valid reading for 5 reports -> the
    seat goes to the slowest rank with data, even while Warmup holds the pin."""
    elche = ElChe(ElCheConfig(), 3, prior=[3.0, 2.0, 1.0])
    plans = run(elche, 1, [None, None, None]) + run(elche, 4, [10.0, 20.0, None])
    assert [p.anchor_rank for p in plans] == [2, 2, 2, 2, 1]
    assert plans[-1].phase is Phase.WARMUP


def test_guard_vetoes_overhead_growth() -> None:
    """Pins guard authority: overhead says grow (0.12 > 0.05) but D has risen above the
    threshold for three reduces -> SuppressGrowth and the anchor stays, where the same reduce
    with a flat D doubles it (meta-controller off to isolate the guard)."""
    anchors = {}
    for name, series in (("rising", (0.02, 0.03, 0.04, 0.05, 0.06, 0.07)), ("flat", (0.01,) * 6)):
        elche = ElChe(ElCheConfig(meta_controller=False), 2, prior=[2.0, 1.0])
        for d in series[:-1]:  # into Stable at a low overhead (0.024): no proposal
            elche.on_reduce(report(elche.plan(), [10.0, 25.0], sync_ms=6.0, divergence=d))
        last = report(elche.plan(), [10.0, 25.0], sync_ms=30.0, divergence=series[-1])
        plan = elche.on_reduce(last)
        anchors[name] = plan.anchor
        if name == "rising":
            assert plan.verdict.label == "suppress_growth"
            assert "growth_suppressed" in [e.kind for e in plan.events]
    assert anchors == {"rising": 10, "flat": 20}


def test_nudge_is_not_overwritten_by_a_stale_growth() -> None:
    """Pins discard-then-nudge: an LR cliff in the same reduce as an overhead growth proposal
    shrinks the anchor by the phase factor; the 2x proposal is dropped, not applied after."""
    elche = ElChe(ElCheConfig(), 2, prior=[2.0, 1.0])
    run(elche, 6, [10.0, 25.0], lr=0.1)
    plan = elche.on_reduce(report(elche.plan(), [10.0, 25.0], sync_ms=100.0, lr=0.01))
    assert plan.verdict == NudgeDown(0.5) and plan.nudge_factor == 0.5
    assert plan.anchor == 5 and plan.batch_counts == (12, 5)


def test_sync_modes_keep_their_anchor() -> None:
    """Pins that sync modes that average replicas (cpu_sync, floDl's nccl_sync) never tune the
    anchor (they reduce once every rank stepped) while still measuring speeds and planning
    proportional counts."""
    for config in (ElCheConfig.cpu_sync(), replace(ElCheConfig.nccl_sync(), sync_average=SyncAverage.params)):
        plans = run(ElChe(config, 2), 10, [10.0, 25.0], sync_ms=50.0, lr=0.1)
        assert {p.anchor for p in plans} == {1}
        assert plans[-1].batch_counts == (2, 1)


def test_exact_sync_tunes_its_window_but_takes_no_verdicts() -> None:
    """Pins nccl_sync's exact path: its anchor is the window's steps between two control round
    trips, so it grows while the round trip costs more than the overhead target; the replicas
    never drift apart, so every verdict is Stable (no guard, no meta-controller nudge)."""
    plans = run(ElChe(ElCheConfig.nccl_sync(), 2), 10, [10.0, 25.0], sync_ms=50.0, lr=0.1)
    assert plans[-1].anchor > 1
    assert {str(p.verdict) for p in plans} == {str(STABLE)}


def test_partition_ratios_seed_the_probe_then_measurement_corrects_them() -> None:
    """Pins stated shares as a starting point: the Probe window runs the ratios (the smallest
    share runs the anchor and is the anchor rank), the first report's speeds set the counts
    (the pin held through Warmup), and from Stable the election seats the measured slowest."""
    elche = ElChe(ElCheConfig(partition_ratios=[3.0, 1.0, 2.0]), 3)
    assert elche.plan().anchor_rank == 1 and elche.plan().batch_counts == (30, 10, 20)
    plans = run(elche, 8, [50.0, 10.0, 10.0])
    assert plans[0].anchor_rank == 1 and plans[0].batch_counts == (2, 10, 10)
    assert plans[-1].anchor_rank == 0 and plans[-1].batch_counts == (10, 50, 50)


def test_forget_rank_reseats_and_recounts() -> None:
    """Pins rank death: the dead rank plans 0 batches and loses its timing; if it was the
    anchor rank the slowest survivor takes the seat at once."""
    elche = ElChe(ElCheConfig(), 3, prior=[3.0, 2.0, 1.0])
    run(elche, 3, [10.0, 20.0, 25.0])
    plan = elche.forget_rank(2)
    assert plan.anchor_rank == 1 and plan.batch_counts == (20, 10, 0)
    assert elche.smoothed_ms()[2] is None
    assert [e.kind for e in plan.events] == ["rank_forgotten", "anchor_rank"]
    assert run(elche, 1, [10.0, 20.0, 5.0])[0].batch_counts == (20, 10, 0)


def test_a_resume_rejoins_every_rank_a_saved_run_had_lost() -> None:
    """Pins the resume of a bundle saved after a death (a stop that let a hung rank go, a
    shutdown_with_save): its elche_state kept the rank dead, so the resumed run, all of whose
    ranks are fresh, never gave that rank a batch. It now plans the anchor's count for it
    until its speed is measured, and counts it by speed from then on."""
    elche = ElChe(ElCheConfig(), 3, prior=[3.0, 2.0, 1.0])
    run(elche, 3, [10.0, 20.0, 25.0])
    elche.forget_rank(2)
    resumed = ElChe.from_state(ElCheConfig(), json.loads(json.dumps(elche.export_state())))
    assert resumed.plan().batch_counts[2] == 0
    plan = resumed.rejoin_all()
    assert plan.batch_counts == (20, 10, 10) and resumed.alive == [True, True, True]
    assert [e.kind for e in plan.events] == ["rank_rejoined"]
    assert run(resumed, 1, [10.0, 20.0, 5.0])[0].batch_counts == (20, 10, 40)


def test_window_never_exceeds_the_epoch() -> None:
    """Pins the one-epoch cap, including a new cap handed over with a report."""
    elche = ElChe(ElCheConfig(), 2, epoch_batches=21)
    assert sum(run(elche, 3, [10.0, 25.0])[-1].batch_counts) == 21
    capped = elche.on_reduce(replace(report(elche.plan(), [10.0, 25.0]), epoch_batches=7))
    assert capped.batch_counts == (5, 2)


def test_overshoot_only_in_cpu_async() -> None:
    """Pins max_overshoot in the plan: auto from 3 in cpu_async (+1 per Stable), None elsewhere."""
    elche = ElChe(ElCheConfig.cpu_async(), 2)
    assert elche.plan().max_overshoot == 3
    assert run(elche, 2, [10.0, 25.0])[-1].max_overshoot == 5
    assert run(ElChe(ElCheConfig(), 2), 1, [10.0, 25.0])[0].max_overshoot is None


@pytest.mark.parametrize(
    "config, threshold, floor",
    [(ElCheConfig(), 0.05, 10), (ElCheConfig.cpu_async(), 0.3, 10),
     (ElCheConfig(divergence_threshold=0.2, min_anchor=4), 0.2, 4)],
)
def test_auto_knobs_resolve(config, threshold, floor) -> None:
    """Pins the auto values ElChe resolves itself: divergence_threshold 0.05 (0.3 with
    easgd_alpha), min_anchor = anchor."""
    elche = ElChe(config, 2)
    assert (elche.threshold, elche.min_anchor) == (threshold, floor)


def test_from_timings_builds_the_columns() -> None:
    """Pins the per-rank constructor: RankTiming records land in their rank's column and a
    missing rank is None (no report)."""
    built = ReduceReport.from_timings(
        [RankTiming(rank=2, wall_ms=100.0, batches=4, callback_ms=5.0)], 3, sync_ms=2.0, lr=0.1)
    assert built.wall_ms == [None, None, 100.0] and built.batches == [None, None, 4]
    assert built.callback_ms == [0.0, 0.0, 5.0] and built.lr == 0.1


def _speeds(w: int) -> List[float]:
    return [10.0 + (w % 3), 25.0, 17.0]


def test_state_round_trip_continues_identically() -> None:
    """Pins resume: export_state -> JSON -> from_state gives the same phase, calibration and
    anchor, and the next plans equal those of the uninterrupted run (guard history included)."""
    config = ElCheConfig(convergence_guard=GuardKind.rate, relax_up=True)
    a = ElChe(config, 3, prior=[3.0, 1.0, 2.0])
    divergence = lambda w: 0.01 * 1.3 ** w  # noqa: E731
    for w in range(12):
        a.on_reduce(report(a.plan(), _speeds(w), sync_ms=20.0, divergence=divergence(w), lr=0.1))
    state = json.loads(json.dumps(a.export_state()))
    assert state["phase"] == "stable" and state["calibration_count"] == 12
    b = ElChe.from_state(config, state, world_size=3)
    assert b.plan().batch_counts == a.plan().batch_counts and b.plan().phase is Phase.STABLE
    for w in range(12, 20):
        rep = report(a.plan(), _speeds(w), sync_ms=20.0, divergence=divergence(w), lr=0.1)
        assert a.on_reduce(rep) == b.on_reduce(rep)


def test_state_keeps_no_knobs_and_checks_world_size() -> None:
    """Pins that knobs come from the resumed run's config (a lower max_anchor applies at once)
    and that a different world size is refused."""
    a = ElChe(ElCheConfig(), 2)
    run(a, 6, [10.0, 25.0], sync_ms=60.0)
    state = a.export_state()
    assert "max_anchor" not in state and "overhead_target" not in state
    b = ElChe.from_state(ElCheConfig(max_anchor=12), state)
    assert b.anchor <= 12
    with pytest.raises(ValueError, match="world size 2"):
        ElChe.from_state(ElCheConfig(), state, world_size=4)


# ---- invariants under random inputs --------------------------------------------------------

configs = st.builds(
    ElCheConfig,
    mode=st.sampled_from(list(Mode)),
    anchor=st.integers(1, 40),
    max_anchor=st.integers(40, 200),
    overhead_target=st.sampled_from([0.01, 0.05, 0.2, 0.5]),
    max_batch_diff=st.one_of(st.none(), st.integers(0, 30)),
    relax_up=st.booleans(),
    convergence_guard=st.sampled_from(list(GuardKind)),
    meta_controller=st.booleans(),
)
reading = st.one_of(st.none(), st.floats(0.5, 200.0))
window = st.tuples(
    st.lists(reading, min_size=6, max_size=6),           # ms per rank (None = silent)
    st.floats(0.0, 500.0),                              # sync_ms
    st.one_of(st.none(), st.floats(0.0, 1.0)),          # D
    st.sampled_from([None, 0.1, 0.05, 0.001]),          # lr
    st.one_of(st.none(), st.integers(0, 5)),            # rank to forget before the reduce
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, world_size=st.integers(1, 6),
       windows=st.lists(window, min_size=1, max_size=30),
       cap=st.one_of(st.none(), st.integers(1, 400)))
def test_invariants_under_random_reports(config, world_size, windows, cap) -> None:
    """Pins the invariants whatever the inputs: living counts >= 1 and summing within the
    window cap; anchor in [1, max_anchor]; phase never regresses; no growth on the first
    report; at most 2x growth per cycle unless the last 3 wanted anchors agree (then at most 4x
and never past the smallest of them); a NudgeDown lands as exactly its shrink (a stale
    proposal never overwrites it in the same cycle)."""
    elche = ElChe(config, world_size, epoch_batches=cap)
    previous = elche.plan()
    for i, (ms, sync_ms, divergence, lr, dead) in enumerate(windows):
        if dead is not None and dead < world_size and sum(elche.alive) > 1:
            previous = elche.forget_rank(dead)
        plan = elche.on_reduce(report(previous, ms[:world_size], sync_ms, divergence, lr))
        _check(plan, previous, elche, config, cap, first=(i == 0))
        previous = plan


def _check(plan: Plan, previous: Plan, elche: ElChe, config: ElCheConfig, cap, first: bool) -> None:
    living = [c for c, up in zip(plan.batch_counts, elche.alive) if up]
    assert all(c >= 1 for c in living)
    assert all(c == 0 for c, up in zip(plan.batch_counts, elche.alive) if not up)
    if cap is not None:
        assert sum(living) <= max(cap, len(living))
    assert 1 <= plan.anchor <= config.max_anchor
    assert plan.phase >= previous.phase
    if plan.anchor > 2 * previous.anchor:  # only an agreeing trust window steps past 2x
        wanted = elche.wanted[-3:]
        assert len(wanted) == 3 and max(wanted) <= 1.5 * min(wanted)
        assert plan.anchor <= min(4 * previous.anchor, math.ceil(min(wanted)))
    if first and elche.calibration_count <= 1:
        assert plan.anchor <= previous.anchor
    if isinstance(plan.verdict, NudgeDown) and not config.mode.is_sync:
        factor = min(1.0, max(0.1, plan.verdict.factor))
        assert plan.anchor == max(1, math.ceil(previous.anchor * factor - 1e-9))


def _anchors(elche: ElChe, syncs: Sequence[float], ms=(10.0, 25.0)) -> List[int]:
    return [elche.on_reduce(report(elche.plan(), list(ms), sync_ms=s)).anchor for s in syncs]


def test_first_anchor_sized_from_the_reduce_timed_before_training() -> None:
    """Pins the cold start: with one reduce timed before training, the first report sizes the
    anchor at once to where the reduce costs the target share (100 ms over 5% of 25 ms per
    batch: 80), instead of doubling over several reduces; without it the first report never
    grows the anchor (floDl's rule)."""
    sized = ElChe(ElCheConfig(), 2, reduce_ms=100.0)
    assert _anchors(sized, [100.0] * 4) == [80, 80, 80, 80]
    assert sized.plan().batch_counts == (200, 80)
    assert _anchors(ElChe(ElCheConfig(), 2), [100.0])[0] == 10


@pytest.mark.parametrize("spike_at", [0, 1, 2])
@pytest.mark.parametrize("reduce_ms", [5.0, None])
def test_one_10x_sync_spike_early_moves_the_anchor_at_most_2x(spike_at, reduce_ms) -> None:
    """Pins the noise protection the cold start keeps: a single 10x sync spike on one of the
    first reports (reduce 5 ms, spike 50 ms, 250 ms of compute) never takes the anchor past 2x
    its start, whether or not a reduce was timed before training."""
    syncs = [50.0 if i == spike_at else 5.0 for i in range(6)]
    assert max(_anchors(ElChe(ElCheConfig(), 2, reduce_ms=reduce_ms), syncs)) <= 20


def test_a_spike_in_the_reduce_timed_before_training_is_ignored() -> None:
    """Pins the sizing on the smaller of the two readings: a 10x spike in the reduce timed
    before training (50 ms) against a first report of 5 ms moves nothing."""
    assert _anchors(ElChe(ElCheConfig(), 2, reduce_ms=50.0), [5.0] * 3) == [10, 10, 10]


def test_agreeing_trust_window_steps_past_the_2x_cap() -> None:
    """Pins the larger growth step: once the last 3 reduces agree (within 1.5x) on the anchor
    they want (60 ms sync over 5% of 25 ms: 48), growth goes there in one step (at most 4x),
    where the 2x rule alone would take 20 -> 40 -> 48."""
    anchors = _anchors(ElChe(ElCheConfig(), 2), [60.0] * 4)
    assert anchors == [10, 20, 48, 48]


def test_sync_modes_get_no_actionable_verdict() -> None:
    """Pins that sync modes report D but always a Stable verdict and no nudge: their anchor is
    not a cadence, so a SuppressGrowth or NudgeDown there would claim an action never taken."""
    elche = ElChe(ElCheConfig(mode=Mode.cpu_sync, anchor=1, convergence_guard=GuardKind.rate), 2)
    rising = [0.01 * math.exp(0.5 * i) for i in range(8)]
    plans = [elche.on_reduce(report(elche.plan(), [10.0, 25.0], divergence=d, lr=0.1 / (i + 1)))
             for i, d in enumerate(rising)]
    assert {p.verdict.label for p in plans} == {"stable"}
    assert all(p.nudge_factor is None for p in plans) and plans[-1].divergence == rising[-1]
    assert "nudge" not in {e.kind for p in plans for e in p.events}
