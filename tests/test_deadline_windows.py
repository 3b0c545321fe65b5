"""Deadline windows (elche.window_end=deadline) at the coordinator tier: scripted ranks stop a
Train order once its deadline_ms has passed (after the batch that crossed it) and report the
batches they left; the coordinator gives those samples back to the epoch's pool, so every
sample is still in the consensus exactly once, with deaths too.

A rank that slows down mid-run (`speed_at`) is what makes a deadline cut a window short: on a
steady rig ElChe's plan fits the deadline and a deadline window trains its whole count."""

from __future__ import annotations

from dataclasses import replace
from typing import List

import pytest

import torch

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, WindowEnd
from flodl_run.contracts.summary import ReduceRecord
from flodl_run.contracts.wire import Train
from flodl_run.observe.observer import Observer
from flodl_run.rank.jobs import Job
from tests.fakes import NUM_SAMPLES, Coverage, Fault, cohort, drive
from tests.support import PAIR, _run as run_cli_summary

pytestmark = pytest.mark.coordinator

DEADLINE_MODES = ["nccl_cadence", "cpu_cadence", "cpu_async"]


def _run(mode: str, speeds, faults=(), epochs: int = 2, slow=(1, 3, 12.0), **config):
    """`speeds` fakes (ms per batch) with deadline windows; rank `slow[0]` runs at `slow[2]`
    ms per batch from its `slow[1]`-th order on, so deadlines cut its windows short. The
    summary, the fakes, their group (the consensus ledger) and the reduce records."""
    elche = replace(ElCheConfig.preset(mode), window_end=WindowEnd.deadline, anchor=4)
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
    assert fakes[1].left > 0
    assert [sum(r.left[k] for r in records) for k in range(2)] == [0, fakes[1].left]
    assert [e.samples for e in summary.epochs] == [NUM_SAMPLES] * 2
    coverage = Coverage(group, 2)
    assert coverage, coverage
    trained = sum(s[2] for f in fakes for s in f.slices)
    assert trained == 2 * NUM_SAMPLES


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


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_a_jittery_pair_with_deadline_windows_trains_every_sample_once(tmp_path, mode):
    """Pins deadline windows in real ranks, one collective and one central mode: a CPU pair
    whose steps jitter (so a deadline may cut a window) completes, each epoch trains the 1437
    digits exactly once in sum (batches a deadline left were trained by someone later, none
    twice), and the consensus evaluates."""
    proc, summary = run_cli_summary(tmp_path, *PAIR, f"elche={mode}", "elche.window_end=deadline",
                         "elche.anchor=2", "elche.max_anchor=4", "cluster.emulate_jitter=0.05",
                         "num_epochs=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["status"] == "completed", summary["message"]
    assert [e["samples"] for e in summary["epochs"]] == [1437, 1437]
    assert summary["syncs"] > 2  # past Probe: ElChe's plan had a deadline
    assert summary["final_eval"] > 0.5
