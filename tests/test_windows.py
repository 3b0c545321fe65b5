"""The windows part of the coordinator driven alone: scripted ranks answer its Train orders,
a stand-in reduce counts rounds, and no Coordinator or socket is involved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flodl_run.config.schema import ElCheConfig, ExperimentConfig
from flodl_run.contracts.wire import SyncNow, Train, WindowDone
from flodl_run.control.context import RunContext
from flodl_run.control.dispatch import EpochPool
from flodl_run.control.modes import WindowRules
from flodl_run.control.rounds import Closing
from flodl_run.control.runstate import Holdings
from flodl_run.control.windows import Windows
from flodl_run.observe.timeline import Recorder

BATCH = 4


class _Ranks:
    """Two ranks that finish each order at once, except orders sent ahead, which they hold
    until the reduce of the round they follow (and drop when that round is regrouped)."""

    def __init__(self, holdings: Holdings):
        self.holdings, self.answers, self.held = holdings, [], []
        self.sent = []

    def send(self, rank, order, payloads=()):
        if isinstance(order, Train):  # what the coordinator's send notes too
            self.holdings.note(rank, order.epoch, order.slices)
            self.sent.append((rank, order))
            (self.held if order.after_round else self.answers).append((rank, order))

    def next(self, expect, deadline=None, accept=None):
        for i, (rank, order) in enumerate(self.answers):
            samples = sum(s[2] for s in order.slices)
            done = WindowDone(rank, order.window, order.epoch, order.num_batches, samples, 1.0, 0.0,
                              0.5 * order.num_batches, 0.1)
            if isinstance(done, expect) and (accept is None or accept(done)):
                del self.answers[i]
                return done
        raise AssertionError(f"the windows wait for {expect} but no rank has anything to say")


class _Reduces:
    """Counts rounds and tallies windows like the real reduces; its first round fails on a
    death that does not shrink the cohort, so the coordinator regroups: `regroup` runs."""

    recorder = Recorder()

    def __init__(self, ranks: _Ranks):
        self.round, self.global_step, self.ranks = 0, 0, ranks
        self.regroup = self.after_regroup = None
        self.before_regroup = self.seen_after_regroup = None

    def sync_now(self, round_, global_step):
        return SyncNow(round_, global_step, 1.0, True)

    def nonfinite_pending(self):
        return False

    def reduce(self, window, epoch_tally, epoch, *, ahead, sync_sent=False, final=False, fill=False):
        self.round += 1
        regrouped = self.round == 1
        if regrouped:
            self.ranks.held = []  # their reduce failed: the ranks drop the orders sent ahead
            self.before_regroup = self.regroup()
        else:  # the reduce completed: the orders sent ahead are trained now
            self.ranks.answers += self.ranks.held
            self.ranks.held = []
        self.global_step += sum(window.batches)
        epoch_tally.add(window)
        return Closing(epoch, window, epoch_tally, 0.0, None, regrouped=regrouped)

    def release(self, closing, trains, uncovered=None):
        if closing.regrouped:  # the windows acted on the regroup the round returned
            self.seen_after_regroup = self.after_regroup(self.before_regroup)


@pytest.mark.parametrize("samples", [32, 30])
def test_a_regroup_voids_the_orders_sent_ahead_and_their_batches_are_trained_once(samples):
    """Pins the rule windows own for nccl_sync's orders sent ahead: when a regroup voids them
    (`cancel_ahead`), their batches go back to the pool and leave the ranks' holdings, the
    window number moves on (a late report of a voided order is told apart), and the epoch
    still trains every sample exactly once (not lost, not twice) with each rank's share."""
    config = ExperimentConfig(batch_size=BATCH, num_epochs=1, elche=ElCheConfig.preset("nccl_sync"))
    holdings = Holdings(2)
    ranks, members = _Ranks(holdings), SimpleNamespace(alive={0, 1}, regroup_needed=False)
    reduces = _Reduces(ranks)
    ctx = RunContext(config, 2, link=ranks, holdings=holdings)
    windows = Windows(ctx, members=members, rounds=reduces, bundles=None, epochs=None,
                      rules=WindowRules.of(config.elche, config.progressive_dispatch))

    def regroup():  # the round regroups: what the windows hold before they act on it
        return windows.orders_ahead(), windows.window, sum(p.remaining for p in windows.pools)

    def after_regroup(before):  # once the windows voided the orders sent ahead
        voided, window, left = before
        back = sum(s[2] for order in voided.values() for s in order.slices)
        held = [s for chunks in holdings.chunks.values() for _, slices in chunks for s in slices]
        return (sorted(voided), windows.orders_ahead(), windows.window - window,
                sum(p.remaining for p in windows.pools) - left, back,
                [s for o in voided.values() for s in o.slices if s in held])

    reduces.regroup, reduces.after_regroup = regroup, after_regroup
    tally = windows.run_epoch(0, EpochPool(0, [(0, samples)]))
    voided, after, window_step, returned, back, still_held = reduces.seen_after_regroup
    assert voided == [0, 1] and after == {}
    assert window_step == 1 and returned == back == 2 * BATCH and still_held == []
    assert sum(tally.samples) == samples
    assert tally.samples == [16, samples - 16]
    trained = sorted(s for rank, order in ranks.sent for s in order.slices if not order.after_round
                     or order.after_round > 1)
    assert sum(s[2] for s in trained) == samples  # every sample handed out once, after the void
