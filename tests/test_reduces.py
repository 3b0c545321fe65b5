"""The reduces part of the coordinator driven alone: snapshots handed in as messages with
their frames, no Coordinator, socket or averaging involved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flodl_run.averaging.frames import as_frame
from flodl_run.config.schema import ElCheConfig, ExperimentConfig
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import Received, SnapshotTaken, WindowDone
from flodl_run.control.central import CentralRound
from flodl_run.control.context import RunContext
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.rounds import RoundBook
from flodl_run.control.runstate import RunAborted
from flodl_run.observe.observer import Observer


class _Events(Observer):
    def __init__(self):
        self.events = []

    def on_event(self, kind, message):
        self.events.append(kind)


class _Reduces:
    """The central round of a cpu_cadence pair with its round book and non-finite ledger,
    asked as one (each name from the part that holds it)."""

    def __init__(self, *parts):
        self._parts = parts

    def __getattr__(self, name):
        return getattr(next(p for p in self._parts if hasattr(p, name)), name)


def _reduces(**config):
    """The reduce parts of a cpu_cadence pair."""
    observer = _Events()
    ctx = RunContext(ExperimentConfig(elche=ElCheConfig.preset("cpu_cadence"), **config), 2,
                     observer=observer, summary=Summary())
    members = SimpleNamespace(alive={0, 1}, regroup_needed=False)
    book = RoundBook(ctx, members=members, divergence_every=1)
    ledger = NonfiniteLedger(ctx, members=members, book=book, bundles=None)
    central = CentralRound(ctx, members=members, averager=None, book=book, ledger=ledger, shm_prefix=None)
    return _Reduces(central, book, ledger), observer


def _taken(rank, round_, steps):
    """A snapshot with the frames of one small one (parameters, float buffers)."""
    frames = [as_frame(torch.ones(3)), as_frame(torch.zeros(1))]
    return Received(SnapshotTaken(rank, round_, steps, ["torch.float32"]), frames)


def test_a_rank_left_out_of_a_round_folds_its_late_steps_into_its_next_snapshot():
    """Pins the snapshot-timeout rule reduces own: a rank left out of round 3 has its late
    round-3 snapshot set aside (not averaged), its 5 steps owed, and its round-4 snapshot
    carries them (2 + 5 = 7 steps of weight); the budget check applies to what it trained in
    its window (2 steps), and a snapshot past its window plus allowance aborts the run."""
    reduces, observer = _reduces()
    reduces.resume(global_step=40, round_=3)
    reduces.leave_out({1})
    assert reduces.late == {1} and observer.events == ["snapshot_late"]
    assert reduces.begin_round() == 4
    assert reduces.take_snapshot(_taken(1, 3, 5), window_batches=2, allowance=0) is None
    folded = reduces.take_snapshot(_taken(1, 4, 2), window_batches=2, allowance=0)
    assert (folded.rank, folded.steps) == (1, 7) and observer.events[-1] == "snapshot_folded"
    on_time = reduces.take_snapshot(_taken(0, 4, 2), window_batches=2, allowance=0)
    assert on_time.steps == 2 and torch.equal(on_time.params[0], torch.ones(3))
    with pytest.raises(RunAborted, match="rank 0 round 4: 4 steps since the last reduce, budget 2 \\+ 1"):
        reduces.take_snapshot(_taken(0, 4, 4), window_batches=2, allowance=1)


def test_non_finite_reduces_in_a_row_stop_the_run_at_max_nonfinite():
    """Pins the non-finite rule reduces own: a NaN window loss marks its rank for the next
    reduce (logged in the summary with the round, weight 0); max_nonfinite reduces in a row
    with such a rank ask the run to stop, and a clean reduce between them restarts the count."""
    reduces, observer = _reduces(max_nonfinite=2)

    def reduce_with(loss):
        reduces.begin_round()
        reduces.note_window(WindowDone(1, reduces.round, 0, 1, 8, 1.0, 0.0, loss, 0.1))
        return reduces.tally_nonfinite()

    assert reduce_with(float("nan")) is False
    assert reduce_with(0.5) is False  # a clean reduce: the streak starts over
    assert reduce_with(float("inf")) is False
    assert reduce_with(float("nan")) is True
    assert reduces.summary.nonfinite == [{"round": r, "rank": 1, "what": "loss"} for r in (1, 3, 4)]
    assert observer.events.count("rank_nonfinite") == 3


def test_a_window_of_no_sample_adds_no_loss_to_the_epochs_mean():
    """Pins the tallies of nccl_sync with fewer samples than ranks: a rank whose steps had no
    sample reports its batches with `loss_batches=0`, and the window's and epoch's mean loss
    (and the summary's avg_loss) are those of the batches that gave one, not halved by its
    empty steps; a report without the count (cadence modes) counts every batch."""
    from flodl_run.control.tallies import EpochTally, WindowTally

    window, epoch = WindowTally.empty(2), EpochTally.empty(2)
    window.add(WindowDone(1, 0, 0, 3, 0, 1.0, 0.0, 0.0, 0.1, loss_batches=0))
    assert window.mean_loss() is None
    window.add(WindowDone(0, 0, 0, 3, 3, 1.0, 0.0, 6.0, 0.1))
    epoch.add(window)
    assert window.mean_loss() == epoch.mean_loss() == 2.0
    epoch.add_done(WindowDone(1, 1, 0, 2, 2, 1.0, 0.0, 2.0, 0.1, loss_batches=1))
    assert epoch.mean_loss() == 2.0 and epoch.loss_batches == [3, 1]
