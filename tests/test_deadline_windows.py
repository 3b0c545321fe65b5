"""Deadline windows (elche.window_end=deadline) at the coordinator tier: scripted ranks stop a
Train order once its deadline_ms has passed (after the batch that crossed it) and report the
batches they left; the coordinator gives those samples back to the epoch's pool, so every
sample is still in the consensus exactly once, with deaths too.

A rank that slows down mid-run (`speed_at`) is what makes a deadline cut a window short: on a
steady rig ElChe's plan fits the deadline and a deadline window trains its whole count."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from typing import Dict, List

import pytest
import torch

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, WindowEnd
from flodl_run.contracts.clock import ClockEstimate, ClockSync
from flodl_run.contracts.summary import ReduceRecord
from flodl_run.contracts.wire import Train, WindowDone
from flodl_run.control.deadlines import Deadlines
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.jobs import Job, deadline_s
from tests.fakes import NUM_SAMPLES, Coverage, Fault, cohort, drive
from tests.support import PAIR
from tests.support import _run as run_cli_summary

pytestmark = pytest.mark.coordinator

DEADLINE_MODES = ["nccl_cadence", "cpu_cadence", "cpu_async"]


def _run(mode: str, speeds, faults=(), epochs: int = 2, slow=(1, 3, 12.0), elche_headroom=0.1,
         **config):
    """`speeds` fakes (ms per batch) with deadline windows; rank `slow[0]` runs at `slow[2]`
    ms per batch from its `slow[1]`-th order on, so deadlines cut its windows short. The
    summary, the fakes, their group (the consensus ledger) and the reduce records."""
    elche = replace(ElCheConfig.preset(mode), window_end=WindowEnd.deadline, anchor=4,
                    deadline_headroom=elche_headroom)
    run = ExperimentConfig(elche=elche, num_epochs=epochs, batch_size=8, **config)
    reduces = _Reduces()
    coord, fakes, group = cohort(run, speeds, faults, observer=reduces)
    rank, at, ms = slow
    fakes[rank].speed_at[at] = ms
    summary, fakes = drive(coord, fakes)
    return summary, fakes, group, reduces.records


class _Reduces(Observer):
    def __init__(self):
        self.records: List[ReduceRecord] = []

    def on_reduce(self, record: ReduceRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("mode", DEADLINE_MODES)
def test_deadline_windows_give_untrained_batches_back_and_cover_every_sample_once(mode):
    """Pins the deadline's bookkeeping: orders carry deadline_ms once ElChe timed the anchor,
    a rank that slowed leaves batches untrained (the reduce records say how many), and those
    samples are trained later by someone (not lost, not twice): each epoch's record counts the
    samples actually trained (NUM_SAMPLES, not the planned counts) and the consensus holds
    every sample once."""
    summary, fakes, group, records = _run(mode, [4.0, 4.0])
    assert summary.status == "completed", summary.message
    assert all(f.deadlines for f in fakes)
    assert fakes[1].left > 0 and fakes[0].left > 0  # rank 0 leaves the loan past its count
    assert [sum(r.left[k] for r in records) for k in range(2)] == [f.left for f in fakes]
    assert [e.samples for e in summary.epochs] == [NUM_SAMPLES] * 2
    coverage = Coverage(group, 2)
    assert coverage, coverage
    trained = sum(s[2] for f in fakes for s in f.slices)
    assert trained == 2 * NUM_SAMPLES


def test_without_headroom_a_rank_on_plan_trains_its_count_and_leaves_nothing():
    """Pins elche.deadline_headroom: at 0 an order holds the planned count, so rank 0 (steady,
    its count fits the deadline) leaves nothing; at the default 0.1 it is lent batches past
    its count (left when it is on plan, the test above), which is what lets a rank ahead of
    its plan train on to the deadline."""
    summary, fakes, group, _ = _run("nccl_cadence", [4.0, 4.0], elche_headroom=0.0)
    assert summary.status == "completed", summary.message
    assert fakes[0].left == 0 and fakes[1].left > 0
    assert [e.samples for e in summary.epochs] == [NUM_SAMPLES] * 2
    coverage = Coverage(group, 2)
    assert coverage, coverage


def test_fixed_shares_take_back_a_cut_window_into_the_ranks_own_share():
    """Pins deadline windows with progressive_dispatch off: what a cut window left goes back
    to the rank's own share (not another rank's), which the rank then trains in a later
    window, so both shares and every sample are covered once."""
    summary, fakes, group, _ = _run("nccl_cadence", [4.0, 4.0], progressive_dispatch=False)
    assert summary.status == "completed", summary.message
    assert fakes[1].left > 0
    assert [e.samples for e in summary.epochs] == [NUM_SAMPLES] * 2
    assert [sum(s[2] for s in f.slices) for f in fakes] == [NUM_SAMPLES] * 2  # half an epoch each
    coverage = Coverage(group, 2)
    assert coverage, coverage


@pytest.mark.parametrize("mode", DEADLINE_MODES)
def test_a_death_after_a_cut_window_redoes_only_what_the_rank_trained(mode):
    """Pins the holdings of a deadline window: rank 1 of three slows in its 4th order, so the
    deadline cuts that window, and dies entering the reduce after reporting it. What it held
    goes back to the pool; kept in full, the batches it had already given back were handed
    out twice (counted twice in the consensus). Each epoch's record counts every sample
    once, cpu_async's too (its tallies take a dead rank's redone reports out again)."""
    summary, fakes, group, _ = _run(mode, [4.0, 4.0, 4.0], faults=[Fault(1, "die", 4, point="reduce")],
                                    slow=(1, 4, 12.0))
    assert summary.status == "completed", summary.message
    assert summary.dead_ranks == [1]
    assert fakes[1].left > 0
    assert [e.samples for e in summary.epochs] == [NUM_SAMPLES] * 2
    coverage = Coverage(group, 2)
    assert coverage, coverage


@pytest.mark.parametrize("deadline_ms,done,elapsed_s,over", [
    (None, 2, 10.0, False),  # a count window runs every batch, however long it takes
    (5.0, 2, 0.004, False),  # before the deadline
    (5.0, 2, 0.006, True),  # the deadline passed: the batch in hand was the last
    (5.0, 4, 0.0, True),  # every batch trained, the deadline not reached
])
def test_a_rank_ends_a_window_on_its_count_or_past_its_deadline(deadline_ms, done, elapsed_s, over):
    """Pins the rank's end of a window (rank.jobs.Job): a deadline counts from the window's
    first batch; its planned count stays the most it trains; `left` is what it did not."""
    order = Train(1, 0, [(0, 0, 32)], 4, deadline_ms=deadline_ms)
    job = Job(order, [torch.arange(8)] * 4, done=done, began=100.0)
    assert job.is_over(100.0 + elapsed_s) is over
    assert job.left == 4 - done


def _estimate(offset_ns: int) -> ClockEstimate:
    """A rank's clock estimate: the coordinator's clock minus the rank's is `offset_ns`."""
    sync = ClockSync(recent=4)
    t0 = 1_000_000_000
    sync.add(t0, t0 + 50_000 + offset_ns, t0 + 60_000 + offset_ns, t0 + 110_000)  # 50 us each way
    return sync.estimate()


@pytest.mark.parametrize("offset_ns", [0, 5_000_000_123, -7_250_000_000])
def test_a_deadline_is_one_instant_on_the_coordinators_clock_whatever_the_ranks_offset(offset_ns):
    """Pins the conversion of a window's shared instant: the order carries it on the
    coordinator's clock, each rank subtracts its estimated offset (coordinator minus rank) and
    stops after the batch that ends past it, however late it began; its start, reported back,
    is the same moment on the coordinator's clock. With the sign flipped, or the offset left
    out, a rank on another host (clocks seconds apart) stops at once or never."""
    estimate = _estimate(offset_ns)
    assert estimate.offset_ns == offset_ns
    deadline_ns = 42_000_000_000  # the coordinator's perf_counter_ns at the window's end
    order = Train(1, 0, [(0, 0, 32)], 4, deadline_ms=20.0, deadline_ns=deadline_ns)
    local = deadline_s(order, estimate)
    assert local == pytest.approx((deadline_ns - offset_ns) / 1e9)
    job = Job(order, [torch.arange(8)] * 4, done=1, began=local - 0.015, deadline_s=local)
    assert not job.is_over(local - 0.001)
    assert job.is_over(local + 0.0001)
    assert job.began_ns(estimate) == pytest.approx(deadline_ns - 15_000_000, abs=1_000)
    late = Job(order, [torch.arange(8)] * 4, done=1, began=local - 0.001, deadline_s=local)
    assert late.is_over(local)  # the instant is shared: a late start does not move it
    assert deadline_s(order, None) is None  # no estimate yet: deadline_ms from the first batch


def test_the_clock_estimate_follows_the_recent_round_trips():
    """Pins the online estimate a deadline uses: the lowest-delay round trip among the recent
    ones (a drifting clock is followed), where the timeline's whole-run estimate keeps the best
    sample of the run."""
    sync, whole = ClockSync(recent=2), ClockSync()
    for t0, offset, delay in [(0, 1_000, 10_000), (10**9, 2_000, 90_000), (2 * 10**9, 3_000, 80_000)]:
        for clock in (sync, whole):
            clock.add(t0, t0 + delay + offset, t0 + delay + offset, t0 + 2 * delay)
    assert sync.estimate().offset_ns == 3_000  # the 10 us sample fell out of the recent two
    assert whole.estimate().offset_ns == 1_000


def test_a_cadence_window_ends_after_its_latest_ranks_start():
    """Pins the coordinator's instant (control.deadlines): every order of a window gets the
    same end, its planned duration after the orders went out plus the start delay of the
    latest rank in the window before (as the ranks reported it), capped at half the window
    (a longer one is a misread clock); a loan lends ceil(count x (1 + headroom)) batches on
    a deadline only."""
    deadlines = Deadlines(Recorder(), headroom=0.1)
    first = deadlines.window_ns(1, 100.0)
    sent = deadlines._sent_ns[1]
    assert first - sent == 100_000_000
    for rank, lag_ns in [(0, 2_000_000), (1, 7_000_000)]:
        deadlines.began(_done(rank, 1, began_ns=sent + lag_ns))
    second = deadlines.window_ns(2, 100.0)
    assert second - deadlines._sent_ns[2] == 107_000_000
    deadlines.began(_done(0, 2, began_ns=deadlines._sent_ns[2] + 900_000_000))
    third = deadlines.window_ns(3, 100.0)
    assert third - deadlines._sent_ns[3] == 150_000_000
    assert [deadlines.loan(c, 100.0) for c in (1, 10, 20, 47)] == [2, 11, 22, 52]
    assert deadlines.loan(47, None) == 47


def _done(rank: int, window: int, began_ns: int) -> WindowDone:
    return WindowDone(rank, window, 0, 4, 32, 10.0, 0.0, 1.0, 0.1, began_ns=began_ns)


@pytest.mark.e2e
# nccl_cadence's bound is in time (within a batch of the deadline): `apart`, as a rank of it
# preempted by a run beside it once ended its window 0.9 ms past that bound.
@pytest.mark.parametrize("mode", [pytest.param("nccl_cadence", marks=pytest.mark.apart), "cpu_async"])
def test_a_jittery_pair_with_deadline_windows_trains_every_sample_once(tmp_path, mode):
    """Pins deadline windows in real ranks, one collective and one central mode: a CPU pair
    whose steps jitter (so a deadline may cut a window) completes, each epoch trains the 1437
    digits exactly once in sum (batches a deadline left were trained by someone later, none
    twice), and the consensus evaluates. nccl_cadence also records its timeline: every rank
    ends each deadline window within one of its batches after the window's one instant (the
    coordinator's `deadline` span, on the aligned clock), and some windows were cut by it."""
    traced = ["timeline=true"] if mode == "nccl_cadence" else []
    proc, summary = run_cli_summary(tmp_path, *PAIR, f"elche={mode}", "elche.window_end=deadline",
                         "elche.anchor=2", "elche.max_anchor=4", "cluster.emulate_jitter=0.05",
                         "num_epochs=2", *traced)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["status"] == "completed", summary["message"]
    assert [e["samples"] for e in summary["epochs"]] == [1437, 1437]
    assert summary["syncs"] > 2  # past Probe: ElChe's plan had a deadline
    assert summary["final_eval"] > 0.5
    if traced:
        _stops_within_a_batch_of_the_deadline(json.loads((tmp_path / "run" / "timeline.json").read_text()))


def _stops_within_a_batch_of_the_deadline(trace: dict) -> None:
    events = trace["traceEvents"]
    slack_us = 1000 + max(c["uncertainty_ns"] for c in trace["otherData"]["clock_offsets"].values()) / 1e3
    deadline_us = {e["args"]["window"]: e["ts"] + e["dur"] for e in events if e.get("name") == "deadline"}
    batch_us: Dict[int, float] = defaultdict(float)  # each rank's longest batch (data + step)
    for e in events:
        if e.get("name") in ("data", "step"):
            batch_us[(e["pid"], e["name"])] = max(batch_us[(e["pid"], e["name"])], e["dur"])
    ends = [(e["args"]["window"], e["pid"], e["ts"]) for e in events if e.get("name") == "window_end"]
    cut = 0
    for window, pid, ts in ends:
        if window not in deadline_us:
            continue  # Probe's windows end on counts
        one_batch = batch_us[(pid, "data")] + batch_us[(pid, "step")]
        assert ts <= deadline_us[window] + one_batch + slack_us, (window, pid, ts, deadline_us[window])
        cut += ts >= deadline_us[window] - slack_us
    assert len(deadline_us) >= 2 and cut >= 1, (deadline_us, ends)
