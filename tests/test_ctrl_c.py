"""What a Ctrl-C (or SIGTERM) saves: the ranks cut their windows after the batch in hand, the
coordinator reduces what they trained and saves it, and the bundle lists the samples left
untrained, so a resume trains exactly those. At the coordinator tier against scripted ranks
(a stop requested from inside a window, counted on the consensus ledger), the grace rule on
its own, and real runs (nccl_cadence, nccl_sync, cpu_async) stopped by SIGINT mid-window, one
of them resumed."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, SyncAverage
from flodl_run.contracts.checkpoint import read_meta
from flodl_run.contracts.summary import ReduceRecord
from flodl_run.control.runstate import STOP_GRACE_S, RunAborted, StopRequest
from flodl_run.observe.observer import Observer
from tests.fakes import NUM_SAMPLES, cohort, drive
from tests.support import PAIR, _live_ranks, start_cli
from tests.support import _run as run_cli_summary

EPOCH_BATCHES = NUM_SAMPLES // 8


def _stopped_mid_epoch(mode: str, stem: str, stop_at: int):
    """Two equal fakes, windows of 20 batches (4 an epoch), the stop requested right after
    rank 0's `stop_at`-th batch: the summary, the fakes and their consensus ledger."""
    elche = replace(ElCheConfig.preset(mode), anchor=20, min_anchor=20, max_anchor=20,
                    sync_average=SyncAverage.params)
    run = ExperimentConfig(elche=elche, num_epochs=2, batch_size=8, save_path=stem)
    coord, fakes, group = cohort(run, [20.0, 20.0])  # a window (400 ms) outlasts the poll (200 ms)
    fakes[0].on_batch = lambda fake: fake.batches == stop_at and coord.request_stop(
        "interrupted by SIGINT")
    summary, fakes = drive(coord, fakes)
    return summary, fakes, group


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async", "cpu_sync", "nccl_sync"])
def test_a_stop_mid_window_saves_the_trained_batches_and_lists_exactly_the_rest(tmp_path, mode):
    """Pins: a stop waited for the window's planned end (a slow recipe's window outlasted the
    grace and nothing was saved). Now the ranks end the window after the batch in hand (the
    cadence modes leave batches untrained), the run ends interrupted with a graceful_shutdown
    bundle, and what the saved consensus holds is exactly the complement of the bundle's
    uncovered ranges: epoch 0 whole, of epoch 1 each trained sample once and none listed."""
    stem = str(tmp_path / "ck")
    summary, fakes, group = _stopped_mid_epoch(mode, stem, stop_at=EPOCH_BATCHES // 2 + 5)
    assert summary.status == "interrupted", summary.message
    assert summary.message == f"interrupted by SIGINT; saved {stem}"
    meta = read_meta(stem)
    assert meta.save_reason == "graceful_shutdown" and meta.coverage.epoch == 1
    lacks = [i for _, start, end in meta.coverage.uncovered for i in range(start, end)]
    seen = group.consensus()
    assert set(seen.values()) == {1}
    assert {i for p, i in seen if p == 0} == set(range(NUM_SAMPLES))
    held = {i for p, i in seen if p == 1}
    assert held and lacks and len(lacks) == len(set(lacks))
    assert held == set(range(NUM_SAMPLES)) - set(lacks)
    if mode in ("nccl_cadence", "cpu_cadence", "cpu_async"):  # windows of 20 batches, cut short
        assert all("CutWindow" in f.orders for f in fakes) and sum(f.left for f in fakes) > 0


class _StopAtEpochEnd(Observer):
    """Requests the stop inside the reduce of epoch 0's last window (nothing left to hand out,
    no order sent on the reduce)."""

    coord = None

    def on_reduce(self, record: ReduceRecord) -> None:
        coord = self.coord
        if record.epoch == 0 and not coord.windows.uncovered() and not any(coord.holdings.chunks.values()):
            self.coord.request_stop("interrupted by SIGINT")


@pytest.mark.coordinator
def test_a_stop_after_an_epochs_last_window_resumes_at_the_next_epoch(tmp_path):
    """Pins: a stop whose reduce was the epoch's last saved that epoch with nothing listed
    uncovered, which a resume reads as the whole epoch (trained twice). The bundle now names
    the next epoch, whole, and the consensus holds epoch 0 once."""
    stem = str(tmp_path / "ck")
    stop = _StopAtEpochEnd()
    run = ExperimentConfig(elche=ElCheConfig.preset("nccl_cadence"), num_epochs=2, batch_size=8,
                           save_path=stem)
    stop.coord, fakes, group = cohort(run, [3.0, 3.0], observer=stop)
    summary, _ = drive(stop.coord, fakes)
    assert summary.status == "interrupted", summary.message
    coverage = read_meta(stem).coverage
    assert (coverage.epoch, coverage.uncovered) == (1, [])
    seen = group.consensus()
    assert set(seen) == {(0, i) for i in range(NUM_SAMPLES)} and set(seen.values()) == {1}


def test_the_stop_grace_counts_from_the_last_batch_and_a_second_request_cuts_it():
    """Pins the grace: while a rank is in a batch the deadline moves on (a batch is never cut,
    however long), once none is it runs out and the run stops unsaved, saying why; a second
    request stops at once even with a rank in a batch."""
    stop = StopRequest()
    stop.request("interrupted by SIGINT")
    stop.deadline = time.monotonic() - 1.0  # the grace ran out long ago ...
    stop.check(in_batch=True)  # ... but a rank is still in its batch
    assert stop.deadline > time.monotonic() + STOP_GRACE_S - 1.0
    stop.deadline = time.monotonic() - 1.0
    with pytest.raises(RunAborted, match=r"no save within 8s of the ranks' last batch: not saved"):
        stop.check(in_batch=False)
    stop.request("interrupted by SIGINT")
    with pytest.raises(RunAborted, match="stopped at once"):
        stop.check(in_batch=True)


def _sigint_mid_window(run_dir: Path, *overrides: str) -> dict:
    """Start a run, SIGINT it once its ranks train (the `start` event), wait for its end;
    the bundle's meta as JSON."""
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", *PAIR, *overrides)
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (events.is_file() and '"start"' in events.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)  # polling the run's own record of its start, bounded
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out
    assert _live_ranks(run_dir) == []
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    return read_meta(str(run_dir / "checkpoint"))


# one window is the whole epoch, 45 batches a rank at ~0.1 s each (the step slowed 100x)
SLOW_WINDOWS = ("cluster.emulate_slowdown=[100,100]", "batch_size=16", "num_epochs=1")


@pytest.mark.e2e
@pytest.mark.parametrize("mode,extra,resume", [("nccl_cadence", ("elche.anchor=60",), True),
                                               ("nccl_sync", ("elche.max_batch_diff=0",), False),
                                               ("cpu_async", ("elche.anchor=60",), False)])
def test_sigint_mid_window_saves_what_was_trained_and_the_resume_trains_the_rest(tmp_path, mode, extra,
                                                                                 resume):
    """Pins the reported Ctrl-C on a slow recipe (`no reduce boundary within 8s: not saved`):
    real ranks stopped mid-window save a graceful_shutdown bundle of epoch 0 whose uncovered
    ranges are disjoint, non-empty and short of the whole epoch (nccl_cadence and cpu_async:
    their one window was cut after the batch in hand; nccl_sync: its exact windows end at a
    step), and the resume trains exactly those samples, completing the epoch (one mode
    resumed: the coordinator tier pins the coverage of every mode)."""
    meta = _sigint_mid_window(tmp_path / "a", f"elche={mode}", *extra, *SLOW_WINDOWS)
    assert meta.save_reason == "graceful_shutdown" and meta.coverage.epoch == 0
    lacks = [i for _, start, end in meta.coverage.uncovered for i in range(start, end)]
    assert 0 < len(lacks) == len(set(lacks)) < 1437
    if resume:
        proc, summary = run_cli_summary(tmp_path / "b", *PAIR, f"elche={mode}", *extra,
                                        *SLOW_WINDOWS[1:], f"resume_from={tmp_path / 'a' / 'checkpoint'}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [e["samples"] for e in summary["epochs"]] == [len(lacks)]


class _StopAfterFirstRead(Observer):
    """Requests the in-process trainer's stop when it first reads the losses (50 batches)."""

    trainer = None

    def on_batch(self, epoch: int, batches_done: int, loss: float) -> None:
        self.trainer.request_stop("interrupted by SIGINT")


def test_an_in_process_stop_saves_the_batches_trained_and_the_resume_trains_the_rest(tmp_path):
    """Pins the in-process run (`cluster=solo`): a Ctrl-C raised KeyboardInterrupt wherever the
    trainer was and saved nothing. A stop request now ends it after the batch in hand, saves
    the replica with the rest of the epoch listed uncovered, and a resume trains exactly those
    positions of the pass's permutation, then the epochs after it."""
    from flodl_run.contracts.recipe import load_recipe
    from flodl_run.data.passes import permutation
    from flodl_run.rank.solo import SoloTrainer

    recipe = load_recipe("recipes.synthetic_mlp", {"num_samples": 2000, "hidden": 16, "depth": 1})
    stem = str(tmp_path / "ck")
    watch = _StopAfterFirstRead()
    config = ExperimentConfig(num_epochs=2, device="cpu", batch_size=8, save_path=stem)
    watch.trainer = SoloTrainer(config, recipe, watch)
    summary = watch.trainer.run().summary
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    meta = read_meta(stem)
    train = len(watch.trainer.train_source)
    assert meta.save_reason == "graceful_shutdown" and meta.global_step == 50
    assert (meta.coverage.epoch, meta.coverage.uncovered) == (0, [[0, 400, train]])
    resumed = SoloTrainer(replace(config, resume_from=stem, save_path=None), recipe)
    summary = resumed.run().summary
    assert summary.status == "completed"
    assert [(e.epoch, e.samples) for e in summary.epochs] == [(0, train - 400), (1, train)]
    order = permutation(train, 0, 0) % train
    assert resumed._epoch_indices(0).tolist() == order[400:].tolist()
