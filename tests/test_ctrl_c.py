"""What a Ctrl-C (or SIGTERM) saves: the ranks cut their windows after the batch in hand, the
coordinator reduces what they trained and saves it, and the bundle lists the samples left
untrained, so a resume trains exactly those. At the coordinator tier against scripted ranks
(a stop requested from inside a window, counted on the consensus ledger), the grace rule on
its own, and real runs (nccl_cadence, nccl_sync, cpu_async) stopped by SIGINT mid-window, one
of them resumed. And that a stop always saves what can be saved and always ends: a
rank stuck in an eval or a batch is let go and the others save, a second signal cuts a hung
save or leaves a stuck coordinator behind, an epoch whose last reduce the stop followed is
closed before the save, and a resumed run's progress starts where the bundle left it."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, MaxFailureConfig, SyncAverage
from flodl_run.contracts.checkpoint import read_meta
from flodl_run.contracts.summary import ReduceRecord
from flodl_run.contracts.wire import new_secret
from flodl_run.control.coordinator import Coordinator
from flodl_run.control.runstate import STOP_GRACE_S, RunAborted, StopRequest
from flodl_run.observe.observer import Observer
from tests.fakes import NUM_SAMPLES, Fault, cohort, drive
from tests.support import PAIR, REPO, _live_ranks, start_cli
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
@pytest.mark.parametrize("mode,average", [
    ("nccl_cadence", SyncAverage.params), ("cpu_sync", SyncAverage.params),
    ("nccl_sync", SyncAverage.params), ("nccl_sync", SyncAverage.grads)])
def test_a_stop_after_an_epochs_last_window_closes_it_and_resumes_at_the_next_epoch(tmp_path, mode, average):
    """Pins: a stop whose reduce was the epoch's last saved that epoch with nothing listed
    uncovered, which a resume reads as the whole epoch (trained twice). The bundle then named
    the next epoch, but the epoch's close never ran (no eval, no epoch_fn, no
    summary record for samples the weights hold). Now the epoch closes first (its record and
    eval), then the bundle names the next epoch, whole; the consensus holds epoch 0 once."""
    stem = str(tmp_path / "ck")
    stop = _StopAtEpochEnd()
    run = ExperimentConfig(elche=replace(ElCheConfig.preset(mode), sync_average=average),
                           num_epochs=2, batch_size=8, save_path=stem, epoch_callback_policy="rank:0")
    stop.coord, fakes, group = cohort(run, [3.0, 3.0], observer=stop)
    summary, _ = drive(stop.coord, fakes)
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert [(e.epoch, e.eval, e.samples) for e in summary.epochs] == [(0, 0.5, NUM_SAMPLES)]
    assert fakes[0].evaluations == 1
    coverage = read_meta(stem).coverage
    assert (coverage.epoch, coverage.uncovered) == (1, [])
    if average is SyncAverage.params:  # the scripted ranks' ledger counts averaged replicas
        seen = group.consensus()
        assert set(seen) == {(0, i) for i in range(NUM_SAMPLES)} and set(seen.values()) == {1}


def test_the_stop_grace_counts_from_the_last_batch_and_a_second_request_cuts_it():
    """Pins the grace: while a rank is in a batch the deadline moves on (a batch is never cut,
    however long), once none is it runs out (the caller then lets go of what holds the stop
    up, or gives up: the run stops unsaved, saying why); a second request stops at once even
    with a rank in a batch."""
    stop = StopRequest()
    stop.request("interrupted by SIGINT")
    stop.deadline = time.monotonic() - 1.0  # the grace ran out long ago ...
    assert stop.check(in_batch=True) is False  # ... but a rank is still in its batch
    assert stop.deadline > time.monotonic() + STOP_GRACE_S - 1.0
    stop.deadline = time.monotonic() - 1.0
    assert stop.check(in_batch=False) is True
    with pytest.raises(RunAborted, match=r"no save within 8s of the ranks' last batch: not saved"):
        stop.give_up()
    stop.request("interrupted by SIGINT")
    with pytest.raises(RunAborted, match="stopped at once"):
        stop.check(in_batch=True)


def test_a_second_request_cuts_a_save_under_way_a_grace_after_the_first():
    """Pins the rule: a save under way is never cut by the first request, nor by a
    second within the grace of the first; a second request after that grace (or the grace
    running out after a second request) cuts it, naming the save."""
    patient = StopRequest(grace_s=60.0)
    patient.request("interrupted by SIGTERM")
    with patient.while_saving("the checkpoint save of ck"):
        patient.request("interrupted by SIGINT")  # within the first's grace: the save may finish
        assert patient.check() is False
    late = StopRequest(grace_s=0.0)  # every second request comes after the grace
    late.request("interrupted by SIGTERM")
    with late.while_saving("the checkpoint save of ck"):
        assert late.check() is False  # the first request never cuts a save
        late.request("interrupted by SIGINT")
        with pytest.raises(RunAborted) as cut:
            late.check()
    assert cut.value.reason == ("interrupted by SIGTERM; then SIGINT (stopped at once, cutting the "
                                "checkpoint save of ck: not saved)")


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "nccl_sync", "cpu_async"])
def test_a_stop_while_a_ranks_eval_hangs_lets_it_go_and_saves_what_the_others_hold(tmp_path, mode):
    """Pins: a stop while the callback rank's eval hung (a recipe's eval_step or
    epoch_fn that never returns) waited for the eval's limit (300 s and more), ran out of its
    grace and ended `no save within 8s of the ranks' last batch: not saved`, losing every
    finished epoch. Now the rank is declared hung once the grace runs out, and the survivor
    saves the consensus it holds: epoch 1 (the eval hung at its close) closes without its eval,
    the bundle names epoch 2, and the saved consensus holds epochs 0 and 1 once each, and of
    epoch 2 exactly what the bundle does not list uncovered."""
    stem = str(tmp_path / "ck")
    elche = replace(ElCheConfig.preset(mode), sync_average=SyncAverage.params)
    run = ExperimentConfig(elche=elche, num_epochs=4, batch_size=8, save_path=stem,
                           epoch_callback_policy="rank:1")
    hang = Fault(rank=1, kind="hang", at=2, point="evaluate")  # at epoch 1's close
    coord, fakes, group = cohort(run, [3.0, 3.0], faults=[hang])
    coord.stop.grace_s = 1.0
    fakes[1].on_stuck = lambda fake: coord.request_stop("interrupted by SIGINT")
    summary, fakes = drive(coord, fakes)
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert summary.dead_ranks == [1] and fakes[1].fate.startswith("hang at evaluate 2")
    records = [(e.epoch, e.eval) for e in summary.epochs]
    assert records[:2] == [(0, 0.5), (1, None)]
    # cpu_async trains on while an epoch closes: under load its survivor may close epoch 2 (with
    # its eval) before the grace runs out; the bundle then starts at the next one
    assert len(records) == 2 or mode == "cpu_async" and all(v is not None for _, v in records[2:])
    resume_at = len(records)
    meta = read_meta(stem)
    assert (meta.save_reason, meta.coverage.epoch) == ("graceful_shutdown", resume_at)
    # cpu_async's bundle may hold some of the next epoch, listing the rest
    lacks = {(p, i) for p, start, end in meta.coverage.uncovered for i in range(start, end)}
    held = {(resume_at, i) for i in range(NUM_SAMPLES)} - lacks if lacks else set()
    seen = group.consensus()
    assert set(seen.values()) == {1}
    assert set(seen) == {(e, i) for e in range(resume_at) for i in range(NUM_SAMPLES)} | held


@pytest.mark.apart  # the hang is found at 4x the measured batch time: a loaded core moves it
@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_a_stop_while_a_rank_hangs_in_its_batch_saves_what_the_other_holds(tmp_path, mode):
    """Pins, for a rank stuck in its train_step: the stop waited for the progress
    rule (max(20 x its batch, 300 s)) before it could save. While the run stops, a batch may
    take 4 x the rank's batch time (at least the grace): past it the rank is declared hung, its
    work since the last reduce goes back, and the survivor saves its consensus with exactly
    the rest of the epoch listed uncovered, within seconds."""
    stem = str(tmp_path / "ck")
    elche = replace(ElCheConfig.preset(mode), sync_average=SyncAverage.params)
    run = ExperimentConfig(elche=elche, num_epochs=2, batch_size=8, save_path=stem)
    coord, fakes, group = cohort(run, [3.0, 3.0], faults=[Fault(rank=1, kind="hang", at=3)])
    summary = _sigint_when_rank_1_sticks(coord, fakes)
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert summary.dead_ranks == [1]
    meta = read_meta(stem)
    lacks = {(p, i) for p, start, end in meta.coverage.uncovered for i in range(start, end)}
    epoch = meta.coverage.epoch
    seen = group.consensus()
    assert lacks and set(seen.values()) == {1}
    assert set(seen) == ({(e, i) for e in range(epoch) for i in range(NUM_SAMPLES)}
                         | {(epoch, i) for i in range(NUM_SAMPLES)} - lacks)



def _sigint_when_rank_1_sticks(coord, fakes):
    """Run the cohort with a 1 s stop grace, SIGINT (a stop request) the moment rank 1 is stuck,
    and expect the run to end within 15 s, not after the progress rule's 300 s: its summary."""
    coord.stop.grace_s = 1.0
    fakes[1].on_stuck = lambda fake: coord.request_stop("interrupted by SIGINT")
    for fake in fakes:
        fake.start()
    thread, box = _run_in_thread(coord)
    thread.join(timeout=15.0)
    assert not thread.is_alive(), "the stop waited for the progress rule's 300 s"
    return box[0]


class _Noted(Observer):
    """Keeps each event's message in a list."""

    def __init__(self, into: list) -> None:
        self.into = into

    def on_event(self, kind: str, message: str) -> None:
        self.into.append(message)


@pytest.mark.apart  # the hang is found at 4x the batch time seen: a loaded core moves it
@pytest.mark.coordinator
def test_a_stop_in_the_first_window_lets_a_rank_hung_in_its_batch_go(tmp_path):
    """Pins the stop before ElChe knows any batch time (the first window, where a slow run's
    Ctrl-C lands): a rank stuck in its train_step held the stop for the progress rule's
    300 s, so the user's second Ctrl-C stopped it unsaved. The batch time its heartbeats show
    (batches finished between two beats) stands in: past 4 x it (at least the grace) the rank
    is let go and the survivor saves."""
    stem = str(tmp_path / "ck")
    elche = replace(ElCheConfig.preset("nccl_cadence"), sync_average=SyncAverage.params, anchor=100,
                    min_anchor=100, max_anchor=100)
    run = ExperimentConfig(elche=elche, num_epochs=2, batch_size=8, save_path=stem)
    events = []
    hang = Fault(rank=1, kind="hang", at=10, point="batch")  # the 10th of a 100-batch window
    coord, fakes, group = cohort(run, [20.0, 20.0], faults=[hang], beat_s=0.1, observer=_Noted(events))
    summary = _sigint_when_rank_1_sticks(coord, fakes)
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert summary.dead_ranks == [1] and "during a stop; last at batch 10" in str(events)
    coverage = read_meta(stem).coverage
    assert coverage.epoch == 0 and coverage.uncovered  # rank 1's 10 batches go back, with the rest

@pytest.mark.coordinator
def test_a_stop_while_the_final_eval_hangs_saves_the_run_as_interrupted(tmp_path):
    """Pins the final eval's case: rank 1 hung in the run's final eval (the last
    epoch scored none) and a stop came. The stop lets the rank go once its grace runs out, and
    the run ends interrupted with a graceful_shutdown bundle past the last epoch (not
    `completed`, as if the eval the user cut had been scored). The rank let go does not count
    against max_failure (one dead rank here would otherwise end the run shutdown_with_save)."""
    stem = str(tmp_path / "ck")
    run = ExperimentConfig(elche=ElCheConfig.preset("nccl_cadence"), num_epochs=3, batch_size=8,
                           save_path=stem, epoch_callback_policy="rank:1", eval_every_epochs=2,
                           max_failure=MaxFailureConfig(absolute=1))
    hang = Fault(rank=1, kind="hang", at=2, point="evaluate")  # epoch 1's eval, then the final one
    coord, fakes, _ = cohort(run, [3.0, 3.0], faults=[hang])
    coord.stop.grace_s = 1.0
    fakes[1].on_stuck = lambda fake: coord.request_stop("interrupted by SIGINT")
    summary, _ = drive(coord, fakes)
    assert (summary.status, summary.message) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert summary.dead_ranks == [1] and summary.final_eval is None
    assert [(e.epoch, e.eval) for e in summary.epochs] == [(0, None), (1, 0.5), (2, None)]
    meta = read_meta(stem)
    assert (meta.save_reason, meta.coverage.epoch, meta.coverage.uncovered) == ("graceful_shutdown", 3, [])


def _run_in_thread(coord):
    """The coordinator's run on a thread of its own (as the launcher runs it): (thread, box)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(coord.run()), daemon=True)
    thread.start()
    return thread, box


@pytest.mark.coordinator
@pytest.mark.parametrize("earlier", [False, True], ids=["first-save", "after-a-checkpoint"])
def test_a_second_signal_after_the_grace_ends_a_run_whose_final_save_hangs(tmp_path, earlier):
    """Pins: with the writer hung in checkpoint_fn during the final save, SIGTERM,
    then SIGINT after the grace, each said `at once (a save under way still finishes)` and
    the run went on waiting for the save's limit (20 x 300 s): only SIGKILL ended it, with no
    summary. Now the second signal cuts the save and the run ends interrupted, saying the
    save was not written and what the save path still holds (nothing, or the checkpoint
    written after epoch 0)."""
    stem = str(tmp_path / "ck")
    run = ExperimentConfig(elche=ElCheConfig.preset("nccl_cadence"), num_epochs=2, batch_size=8,
                           save_path=stem, epoch_callback_policy="rank:0",
                           checkpoint_every=1 if earlier else None)
    hang = Fault(rank=0, kind="hang", at=2 if earlier else 1, point="save")  # the final save's
    coord, fakes, _ = cohort(run, [3.0, 3.0], faults=[hang])
    coord.stop.grace_s = 0.5
    second = threading.Timer(1.0, coord.request_stop, ["interrupted by SIGINT"])  # past the grace

    def first(fake) -> None:
        coord.request_stop("interrupted by SIGTERM")
        second.start()

    fakes[0].on_stuck = first
    for fake in fakes:
        fake.start()
    thread, box = _run_in_thread(coord)
    thread.join(timeout=15.0)
    for fake in fakes:  # what the launcher's stop does to a rank that does not leave
        fake.kill()
    assert not thread.is_alive(), "the run did not end after the second signal"
    summary = box[0]
    stays = (f"{stem} still holds the bundle of generation 1 (checkpoint, resume at epoch 2)"
             if earlier else f"no bundle at {stem}")
    assert summary.status == "interrupted"
    assert summary.message == ("interrupted by SIGTERM; then SIGINT (stopped at once, cutting the "
                               f"checkpoint save of {stem}: not saved); {stays}")
    assert [e.epoch for e in summary.epochs] == [0, 1]


@pytest.mark.coordinator
def test_the_launcher_leaves_a_coordinator_stuck_past_a_second_signal():
    """Pins the rule that a second signal after the grace wins over anything: a coordinator
    stuck in the launcher's own process (a recipe's metrics_fn that never returns) never came
    back to look at the stop, so the launcher watched it forever. It now stops waiting
    LEAVE_S after the cut was due, and the summary says where the coordinator was stuck."""
    from flodl_run.launch.supervisor import LEAVE_S, _watch

    release = threading.Event()

    def metrics_fn() -> None:  # as a recipe's callback blocks the coordinator's thread
        release.wait(10.0)

    stuck = threading.Thread(target=metrics_fn, daemon=True)
    stuck.start()
    coord = Coordinator(ExperimentConfig(), 2, new_secret())
    try:
        coord.request_stop("interrupted by SIGTERM")
        coord.request_stop("interrupted by SIGINT")
        coord.stop.cut_at = time.monotonic() - LEAVE_S  # the grace and LEAVE_S passed, unnoticed
        _watch(coord, stuck, [], Console(file=io.StringIO()))
        assert stuck.is_alive(), "the launcher waited for the stuck coordinator"
    finally:
        release.set()
        coord.channel.socket.close()
    line = metrics_fn.__code__.co_firstlineno + 1
    assert coord.summary.status == "interrupted"
    assert coord.summary.message == (
        "interrupted by SIGTERM; then SIGINT (stopped at once, leaving the coordinator stuck in "
        f"metrics_fn (test_ctrl_c.py:{line}) {LEAVE_S:g}s past the stop: not saved)")


class _Progress(Observer):
    """What the progress bar is told: the resume point and each batch count."""

    def __init__(self) -> None:
        self.resumed = None
        self.batches: list = []

    def on_resume(self, epoch: int, batches_done: int) -> None:
        self.resumed = (epoch, batches_done)

    def on_batch(self, epoch: int, batches_done: int, loss: float) -> None:
        self.batches.append((epoch, batches_done))


@pytest.mark.coordinator
def test_a_resumed_partial_epochs_progress_counts_on_from_the_bundle(tmp_path):
    """Pins: a resumed partial epoch's progress started at epoch 1, 0 batches,
    and ended short (74/128) while training epoch 2: the observers were told neither where the
    run resumed nor the batches the bundle held. Now they are told both (on_resume), and the
    resumed epoch's count goes on from there to the epoch's batches."""
    stem = str(tmp_path / "ck")
    _stopped_mid_epoch("nccl_cadence", stem, stop_at=EPOCH_BATCHES // 2 + 5)
    uncovered = read_meta(stem).coverage.uncovered
    left = sum(-(-(end - start) // 8) for _, start, end in uncovered)
    assert 0 < left < EPOCH_BATCHES
    progress = _Progress()
    run = ExperimentConfig(elche=replace(ElCheConfig.preset("nccl_cadence"), sync_average=SyncAverage.params),
                           num_epochs=2, batch_size=8, resume_from=stem)
    coord, fakes, _ = cohort(run, [3.0, 3.0], observer=progress)
    summary, _ = drive(coord, fakes)
    assert summary.status == "completed", summary.message
    assert progress.resumed == (1, EPOCH_BATCHES - left)
    assert progress.batches[0][1] > EPOCH_BATCHES - left
    assert progress.batches[-1] == (1, EPOCH_BATCHES)


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


HANGING_EPOCH_FN = """
import os, time
from pathlib import Path
from recipes.synthetic_mlp import (build_model, build_optimizer, eval_dataset, eval_step,
                                    train_dataset, train_step)

def epoch_fn(epoch, model, marker):
    if os.environ["RANK"] == "1" and epoch >= 1:  # rank 1's epoch_fn never returns from epoch 1 on
        Path(marker).write_text(str(epoch))
        while True:
            time.sleep(1)
"""


@pytest.mark.e2e
@pytest.mark.waits  # the stop's 8 s grace runs out on the hung rank
def test_sigint_while_a_ranks_epoch_fn_hangs_saves_the_finished_epochs(tmp_path):
    """Pins on real ranks: Ctrl-C while the callback rank's epoch_fn hung at epoch
    1's close ended `no save within 8s of the ranks' last batch: not saved`, exit 130, no
    bundle (nccl_cadence, cpu_cadence and nccl_sync alike). Now, once the grace runs out, the
    hung rank is declared hung and killed, and rank 0 saves the consensus: epochs 0 and 1 in
    the summary (1 without its eval), a graceful_shutdown bundle resuming at epoch 2, no rank
    process left."""
    run_dir, out, summary = _sigint_once_it_hangs(tmp_path, "hanging_epoch_fn", HANGING_EPOCH_FN, *PAIR,
                                                  "elche=nccl_cadence", "epoch_callback_policy=rank:1")
    stem = str(run_dir / "checkpoint")
    assert (summary["status"], summary["message"]) == ("interrupted", f"interrupted by SIGINT; saved {stem}")
    assert summary["dead_ranks"] == [1] and "rank 1 lost: hung: its eval ran for" in out, out
    assert [(e["epoch"], e["eval"] is None) for e in summary["epochs"]] == [(0, False), (1, True)]
    meta = read_meta(stem)
    assert (meta.save_reason, meta.coverage.epoch, meta.coverage.uncovered) == ("graceful_shutdown", 2, [])
    assert _live_ranks(run_dir) == []


class _StopAfterFirstRead(Observer):
    """Requests the in-process trainer's stop when it first reads the losses (50 batches)."""

    trainer = None

    def on_batch(self, epoch: int, batches_done: int, loss: float) -> None:
        self.trainer.request_stop("interrupted by SIGINT")


def test_an_in_process_stop_saves_the_batches_trained_and_the_resume_trains_the_rest(tmp_path):
    """Pins the in-process run (`cluster=solo`): a Ctrl-C raised KeyboardInterrupt wherever the
    trainer was and saved nothing. A stop request now ends it after the batch in hand, saves
    the replica with the rest of the epoch listed uncovered, and a resume trains exactly those
    positions of the pass's permutation, then the epochs after it; its progress counts on from
    the batches the bundle holds (it started again at 0)."""
    from flodl_run.contracts.recipe import import_recipe as load_recipe
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
    progress = _Progress()
    resumed = SoloTrainer(replace(config, resume_from=stem, save_path=None), recipe, progress)
    summary = resumed.run().summary
    assert summary.status == "completed"
    assert [(e.epoch, e.samples) for e in summary.epochs] == [(0, train - 400), (1, train)]
    # its progress goes on from the 50 batches the bundle holds, to the epoch's end
    assert progress.resumed == (0, 50)
    assert [n for e, n in progress.batches if e == 0][-1] == -(-train // 8)
    order = permutation(train, 0, 0) % train
    assert resumed._epoch_indices(0).tolist() == order[400:].tolist()


def test_an_in_process_stop_at_once_in_an_eval_saves_the_epochs_trained(tmp_path):
    """Pins the in-process run's stop at once while its eval hangs: a second signal (or the
    grace running out) in epoch 2's eval raised KeyboardInterrupt and saved nothing, with one
    epoch finished and a second trained. The replica holds both whole there: they are saved
    (resume at epoch 3, nothing uncovered) and epoch 2 is recorded without its eval; in a
    batch, nothing is (a step cannot be saved halfway)."""
    from flodl_run.contracts.recipe import import_recipe as load_recipe
    from flodl_run.rank.solo import SoloTrainer

    recipe = load_recipe("recipes.synthetic_mlp", {"num_samples": 200, "hidden": 16, "depth": 1})

    def eval_step(model, batch):  # as the launcher's handler does, in the eval of epoch 2
        if trainer.closing == "the eval of epoch 2":
            trainer.request_stop("interrupted by SIGINT")
            trainer.stop_reason += "; then SIGINT"
            trainer.stop_at_once()
            raise KeyboardInterrupt
        return recipe.eval_step(model, batch)

    stem = str(tmp_path / "ck")
    config = ExperimentConfig(num_epochs=3, device="cpu", batch_size=8, save_path=stem)
    trainer = SoloTrainer(config, replace(recipe, eval_step=eval_step))
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    summary = trainer.summary
    assert (summary.status, summary.message) == (
        "interrupted", f"interrupted by SIGINT; then SIGINT (stopped at once in the eval of epoch 2: "
                       f"saved {stem})")
    assert [(e.epoch, e.eval is None) for e in summary.epochs] == [(0, False), (1, True)]
    meta = read_meta(stem)
    assert (meta.save_reason, meta.coverage.epoch, meta.coverage.uncovered) == ("graceful_shutdown", 2, [])
    in_batch = SoloTrainer(config, recipe)
    in_batch.stop_at_once()  # nothing trained, no close: nothing to save
    assert in_batch.at_once is None and in_batch.summary.checkpoint is None


HANGING_SOLO_EVAL = """
import time
from pathlib import Path
from recipes.synthetic_mlp import build_model, build_optimizer, eval_dataset, train_dataset, train_step
from recipes.synthetic_mlp import eval_step as _eval_step

_closed = []

def epoch_fn(epoch, model):  # after the epoch's eval
    _closed.append(epoch)

def eval_step(model, batch, marker):
    if _closed:  # the eval of epoch 2 never returns
        Path(marker).write_text("hung")
        while True:
            time.sleep(1)
    return _eval_step(model, batch)
"""


@pytest.mark.e2e
@pytest.mark.waits  # the stop's 8 s grace runs out on the hung rank
def test_sigint_while_an_in_process_eval_hangs_saves_the_epochs_trained(tmp_path):
    """Pins the in-process run (`cluster=solo`) whose eval hangs: a Ctrl-C waited for the eval
    forever, and a second one stopped it unsaved. Now the stop's grace lets the eval go as it
    lets a rank's go: the replica, which holds epochs 1 and 2 whole, is saved (resume at
    epoch 3), epoch 2 recorded without its eval, exit 130."""
    run_dir, out, summary = _sigint_once_it_hangs(tmp_path, "hanging_solo_eval", HANGING_SOLO_EVAL,
                                                  "cluster=solo")
    stem = str(run_dir / "checkpoint")
    assert (summary["status"], summary["message"]) == (
        "interrupted", f"interrupted by SIGINT; the eval of epoch 2 outlasted the stop's "
                       f"{STOP_GRACE_S:g}s grace (stopped at once in the eval of epoch 2: saved {stem})")
    assert [(e["epoch"], e["eval"] is None) for e in summary["epochs"]] == [(0, False), (1, True)]
    meta = read_meta(stem)
    assert (meta.save_reason, meta.coverage.epoch, meta.coverage.uncovered) == ("graceful_shutdown", 2, [])


def _sigint_once_it_hangs(tmp_path, module: str, source: str, *overrides: str):
    """Run the recipe `source` (as `module`, 3 epochs of a small MLP) until it writes its marker
    (it hangs from then on), SIGINT the launcher, and expect exit 130: the run dir, what the
    launcher printed, and its summary."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / f"{module}.py").write_text(source)
    run_dir, marker = tmp_path / "run", tmp_path / "hung"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "pkg"), str(REPO)]))
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", *overrides, "num_epochs=3",
                     "recipe=custom", f"recipe.module={module}", "+recipe.params.num_samples=2000",
                     "+recipe.params.hidden=16", "+recipe.params.depth=1",
                     f"+recipe.params.marker={marker}", env=env)
    deadline = time.monotonic() + 120
    while not marker.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)  # polling the recipe's own note that it hangs, bounded
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out
    return run_dir, out, json.loads((run_dir / "summary.json").read_text())
