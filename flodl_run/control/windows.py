"""Windows of the sync and cadence modes: equal-split sync epochs (fast ranks keep stepping
until the gate opens), progressive cadence epochs (throughput-sized chunks), and nccl_sync's
orders sent ahead of the reduce they follow. The windows of the collective modes reduce with
`control.collective`'s round, those of the coordinator backend with `control.central`'s (the
`rounds` given); which samples go where is `control.dispatch`'s.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Protocol, Set, Tuple

from flodl_run.contracts.wire import SyncNow, Train, WindowDone
from flodl_run.control.context import Bundles, Closes, Members, RunContext
from flodl_run.control.dispatch import (
    Course,
    EpochPool,
    as_range,
    equal_split,
    window_samples,
)
from flodl_run.control.modes import WindowRules
from flodl_run.control.orders import Orders, take_back
from flodl_run.control.rounds import Closing
from flodl_run.control.tallies import EpochTally, WindowTally

FOLD_SPREAD = 1.3
"""nccl_sync folds SyncNow into the Train orders while the ranks' ms/batch stay within this ratio."""


class Rounds(Protocol):
    """What a reduce round offers the windows (control.collective's CollectiveRound or
    control.central's CentralRound, with the round book's counters and the ledger's news):
    `reduce` returns the round closing (with whether the survivors regrouped), `release`
    sends the next orders the caller planned from it."""

    round: int
    global_step: int

    def sync_now(self, round_: int, global_step: int) -> SyncNow: ...

    def nonfinite_pending(self) -> bool: ...

    def reduce(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, *,
               ahead: Dict[int, Train], sync_sent: bool = False, final: bool = False,
               fill: bool = False) -> Closing: ...

    def release(self, closing: Closing, trains: Dict[int, Train],
                uncovered: Optional[List[List[int]]] = None) -> None: ...


class Windows:
    """Hands out data and collects windows until the reduce gate opens (sync and cadence).

    Owns: the epoch's pools (where a dead rank's work goes back, `give_back`, and what a
    deadline window left untrained goes back), its Train orders and their window numbers
    (`orders`), and nccl_sync's orders sent ahead of the reduce they follow
    (`orders_ahead`; `cancel_ahead` voids them after a regroup and gives their batches back).
    Given: the run context (its balance: plan, smoothed batch times; its stop request; its
    holdings; the observer: progress); the membership (who is alive, whether a regroup is
    due); the `rounds` (the reduce, its counters and orders, whether a non-finite rank waits);
    the bundles (the checkpoints taken between windows); the epochs (`close`); and the
    `rules` of the mode's windows (control.modes)."""

    cuts_windows = True
    """A stop cuts the ranks' windows after the batch in hand."""
    times_reduce = True
    """ElChe starts from the reduce the ranks timed before training (collective modes)."""
    seeds_center = False
    """No center to seed before training: the ranks start from their own weights."""

    def __init__(self, ctx: RunContext, *, members: Members, rounds: Rounds, bundles: Bundles,
                 epochs: Closes, rules: WindowRules):
        self.ctx, self.members, self.rounds, self.bundles = ctx, members, rounds, bundles
        self.epochs, self.rules = epochs, rules
        self.world_size, self.config = ctx.world_size, ctx.config
        self.balance, self.stop = ctx.balance, ctx.stop
        self.holdings, self.observer = ctx.holdings, ctx.observer
        headroom = ctx.config.elche.deadline_headroom if rules.deadline_windows else None
        self.orders = Orders(ctx.config.batch_size, ctx.recorder, ctx.balance, headroom)
        self.pools: List[EpochPool] = []  # where work of a dead rank goes back
        self.pool_epoch = 0
        # nccl_sync on an even rig: each rank's next order, sent ahead of the reduce it follows
        # (rank -> (when sent, the pool it came from, the order))
        self._ahead: Dict[int, Tuple[float, EpochPool, Train]] = {}

    @property
    def window(self) -> int:
        return self.orders.window

    def train(self, course: Course) -> None:
        """Every epoch of the course, each closed once its last window is reduced."""
        self.orders.batches_before = course.batches_before
        for epoch in course.epochs():
            if self.stop.is_set():  # asked while the epoch before closed, or at its last reduce
                self.bundles.graceful_stop(epoch, course.left_before(epoch))
            self.epochs.close(epoch, self.run_epoch(epoch, course.pools[epoch]))

    def give_back(self, epoch: int, slices: list) -> bool:
        """A dead rank's chunk of the epoch under way goes back to the pool with the least
        left; False when `epoch` is not that epoch (nothing taken)."""
        if epoch != self.pool_epoch or not self.pools:
            return False
        target = min((p for p in self.pools if p is not None), key=lambda p: p.remaining)
        target.give_back(slices)
        return True

    def uncovered(self) -> List[List[int]]:
        """What of the epoch under way is not handed out yet."""
        return [r for p in self.pools if p is not None for r in p.uncovered()]

    def uncovered_now(self) -> List[List[int]]:
        """What of the epoch under way the survivors' weights may not include."""
        return self.uncovered() + self.holdings.uncovered(self.pool_epoch)

    def save_point(self) -> Tuple[int, List[List[int]]]:
        """Where a bundle saved now resumes, and what of that epoch the weights lack."""
        return self.resume_point(self.pool_epoch, self.uncovered_now())

    def orders_ahead(self) -> Dict[int, Train]:
        """The orders sent ahead, by rank: they belong to the next window."""
        return {rank: order for rank, (_, _, order) in self._ahead.items()}

    def run_epoch(self, epoch: int, pool: EpochPool) -> EpochTally:
        epoch_tally = EpochTally.empty(self.world_size)
        if self.rules.sync_epochs:
            self._run_sync_epoch(epoch, pool, epoch_tally)
        else:
            self._run_cadence_epoch(epoch, pool, epoch_tally)
        return epoch_tally

    def _reduce(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, *,
                sync_sent: bool, final: bool, parts: Optional[List[EpochPool]] = None) -> Dict[int, Train]:
        """The window's reduce, then (given the `parts` to cut them from, and unless the
        round must stop the run) the next window's orders, sent on the reduce. A regroup
        during the round voids the orders sent ahead."""
        self.orders.next_window()
        closing = self.rounds.reduce(window, epoch_tally, epoch, ahead=self.orders_ahead(),
                                     sync_sent=sync_sent, final=final, fill=not self.rules.sync_epochs)
        if closing.regrouped:
            self.cancel_ahead()
        trains = self._plan_window(epoch, parts) if parts is not None and not closing.stop else {}
        self.rounds.release(closing, trains, self.uncovered_now() if closing.stop else None)
        return trains

    def _sync_after(self, rounds: int, steps: int = 0) -> SyncNow:
        """The reduce order `rounds` past the last one, `steps` past the global step."""
        return self.rounds.sync_now(self.rounds.round + rounds, self.rounds.global_step + steps)

    def _run_cadence_epoch(self, epoch: int, pool: EpochPool, epoch_tally: EpochTally) -> None:
        """Each window hands every rank its planned count of batches; the next window's orders
        ride on the reduce (folded into the update on the coordinator backend). Progressive
        dispatch (the default) cuts them from the whole epoch, so the fast rank never idles;
        with progressive_dispatch off every rank's share is fixed up front (equal, or by
        partition_ratios) and a rank whose share ran out sits the rest of the epoch out."""
        shared = self.rules.progressive
        parts = [pool] * self.world_size if shared else partition(
            pool, self.world_size, self.config.elche.partition_ratios, self.config.batch_size)
        self.pools, self.pool_epoch = ([pool] if shared else parts), epoch
        trains = self._plan_window(epoch, parts)
        for rank, order in trains.items():
            self.ctx.send(rank, order)
        reduces = 0
        while trains or self._pools_remaining():  # work given back by a dead rank is redone
            if not trains:
                trains = self._plan_window(epoch, parts)
                for rank, order in trains.items():
                    self.ctx.send(rank, order)
            window = WindowTally.empty(self.world_size)
            self._collect_windows(trains, window, epoch, epoch_tally, parts)
            folded = all(order.then_sync is not None for order in trains.values())
            more = self._pools_remaining() and not self.stop.is_set()
            trains = self._reduce(window, epoch_tally, epoch, final=self._is_last_round(epoch),
                                  sync_sent=folded and self.members.alive <= set(trains),
                                  parts=parts if more else None)
            reduces += 1
            in_flight = [s for order in trains.values() for s in order.slices]
            if not trains:  # orders sent on the reduce (a stop asked meanwhile) are cut and reduced first
                self.stop_if_asked(epoch)
            if reduces == 1 and epoch == self.config.checkpoint_at_epoch:
                # a first window that took the whole epoch makes this the epoch's end save
                self.bundles.save_bundle("checkpoint", *self.resume_point(
                    epoch, self.uncovered() + [as_range(s) for s in in_flight]))

    def _plan_window(self, epoch: int, parts: List[EpochPool]) -> Dict[int, Train]:
        """A cadence window's orders: each live rank's planned count (a deadline window lends
        past it), cut from the whole epoch (progressive) or from the rank's own share."""
        window_ms = self.orders.deadline_ms()
        counts = [self.orders.deadlines.loan(c, window_ms) if r in self.members.alive else 0
                  for r, c in enumerate(self.balance.plan.batch_counts)]
        if self.rules.progressive:
            pool = parts[0]
            sizes = window_samples(pool.remaining, counts, self.config.batch_size)
            cut = [pool.take(size) if rank in self.members.alive else [] for rank, size in enumerate(sizes)]
        else:
            rehome_parts(parts, self.members.alive, self.config.batch_size)
            cut = [parts[r].take(c * self.config.batch_size) for r, c in enumerate(counts)]
        # Collective cadence: when every live rank has work, each order carries its reduce,
        # so a rank enters the collective the moment its count is done (no coordinator
        # round trip between the window and the reduce; the collective waits for the last).
        fold = self.rules.folds_sync and all(cut[r] for r in self.members.alive)
        then_sync = self._sync_after(1) if fold else None
        at = None if window_ms is None else self.orders.deadlines.window_ns(self.orders.window, window_ms)
        return {rank: self.orders.train_order(epoch, slices, then_sync=then_sync, deadline_ns=at)
                for rank, slices in enumerate(cut) if slices}

    def _is_last_round(self, epoch: int) -> bool:
        """The reduce about to run is the run's last: the last epoch has nothing left to hand out."""
        last = self.config.num_epochs * self.config.data.epoch_splits - 1
        return epoch == last and not self._pools_remaining()

    def _pools_remaining(self) -> int:
        return sum(part.remaining for part in self.pools)

    def _run_sync_epoch(self, epoch: int, pool: EpochPool, epoch_tally: EpochTally) -> None:
        """A reduce fires once every rank with data has stepped since the last one, and ranks
        that are ahead keep stepping meanwhile (sync is not lockstep). Each rank steps through
        its own share, fixed up front (equal, or by partition_ratios); with progressive_dispatch
        on, every rank takes its next batch from the whole epoch instead, so a fast rank does
        more of it."""
        shared = self.rules.progressive
        parts = [pool] * self.world_size if shared else partition(
            pool, self.world_size, self.config.elche.partition_ratios, self.config.batch_size)
        self.pools, self.pool_epoch = ([pool] if shared else parts), epoch
        while any(part.remaining for part in parts) or self._ahead:
            if not shared and not self._ahead:
                rehome_parts(parts, self.members.alive, self.config.batch_size)
            window = WindowTally.empty(self.world_size)
            folded = self._sync_window(epoch, parts, window, epoch_tally)
            final = self._is_last_round(epoch) and not self._ahead
            self._reduce(window, epoch_tally, epoch, sync_sent=folded, final=final)
            if not self._ahead:  # orders sent ahead run to their reduce first
                self.stop_if_asked(epoch)

    def stop_if_asked(self, epoch: int) -> None:
        """A stop was asked for: save what the consensus holds and stop (after a reduce, with no
        order out). Uncovered: what of the epoch is not handed out (a cut window's untrained
        batches went back there) or is held by a rank left out of the round. An epoch the
        consensus holds whole is not saved here: it closes first (its record, eval and
        epoch_fn, within the stop's grace), and the next epoch's start saves, so the bundle
        and the summary name the same epochs."""
        if not self.stop.is_set():
            return
        uncovered = self.uncovered() + self.holdings.uncovered(epoch)
        if uncovered:
            self.bundles.graceful_stop(epoch, uncovered)

    def resume_point(self, epoch: int, uncovered: List[List[int]]) -> Tuple[int, List[List[int]]]:
        """Where a bundle saved now resumes, and what of that epoch the weights lack. An empty
        list means all of the named epoch is still to train, so an epoch whose pools are drawn
        and reduced whole names the next one; before any pool exists, `epoch` stays."""
        return (epoch + 1 if not uncovered and self.pools else epoch), uncovered

    def _sync_window(self, epoch: int, parts: List[EpochPool], window: WindowTally,
                     epoch_tally: EpochTally) -> bool:
        """One sync window; True when its SyncNow rode on the Train orders (see folds). On an
        even rig each rank's next order goes out as soon as it reports this window's batch
        (`_queue_ahead`), so it finds that order waiting when its reduce completes."""
        ahead, self._ahead = self._ahead, {}
        in_flight = {rank: sent for rank, (sent, _, _) in ahead.items()}  # rank -> when sent
        fold = bool(ahead) or (self.rules.folds_sync and self._folds(parts))
        then_sync = self._sync_after(1) if fold else None
        for rank in sorted(self.members.alive) if not ahead else ():
            if parts[rank].remaining:
                self._give(epoch, parts[rank], rank, then_sync, in_flight)
        given, queue = len(in_flight), None
        while True:
            for rank in [r for r in in_flight if r not in self.members.alive]:
                del in_flight[rank]
            if not in_flight:
                break
            done = self.ctx.next(expect=WindowDone, accept=lambda m: m.window <= self.orders.window)
            if done is None or done.window < self.orders.window:  # a cancelled order's report
                continue
            del in_flight[done.rank]
            window.add(done)
            self.orders.progress(self.observer, epoch, epoch_tally, window, done)
            if fold:
                queue = self._queue_ahead(parts) if queue is None else queue
                if queue and not self.members.regroup_needed:
                    self._send_ahead(epoch, parts[done.rank], done.rank, given)
            elif parts[done.rank].remaining and keeps_stepping(
                    done.rank, window, in_flight, self.balance.smoothed_ms(),
                    self.config.elche.max_batch_diff):
                self._give(epoch, parts[done.rank], done.rank, then_sync, in_flight)
        return fold

    def _give(self, epoch: int, part: EpochPool, rank: int, then_sync: Optional[SyncNow],
              in_flight: Dict[int, float]) -> None:
        """The rank's next batch of a sync window, from `part`."""
        self.ctx.send(rank, self.orders.train_order(epoch, part.take(self.config.batch_size),
                                                    then_sync=then_sync))
        in_flight[rank] = time.perf_counter()

    def _queue_ahead(self, parts: List[EpochPool]) -> bool:
        """nccl_sync sends the next window's orders ahead when that window folds too (every live
        rank has a batch, speeds even) and nothing is to happen between the two windows: no
        stop asked for, no regroup pending, no non-finite rank to act on. The coordinator's
        bookkeeping of a reduce then overlaps the ranks' next step instead of delaying it."""
        return (self.rules.sends_ahead and not self.stop.is_set()
                and not self.rounds.nonfinite_pending() and not self.members.regroup_needed
                and self._folds(parts))

    def _send_ahead(self, epoch: int, part: EpochPool, rank: int, given: int) -> None:
        """The rank's order of the next window (window and round one past this one's), to be
        trained once its reduce of this window completed (`after_round`)."""
        then_sync = self._sync_after(2, given)
        order = self.orders.train_order(epoch, part.take(self.config.batch_size), then_sync=then_sync,
                                         ahead_of=self.rounds.round + 1)
        self.ctx.send(rank, order)
        self._ahead[rank] = (time.perf_counter(), part, order)

    def _folds(self, parts: List[EpochPool]) -> bool:
        return folds(parts, self.members.alive, self.balance.smoothed_ms(), self.config.batch_size)

    def cancel_ahead(self) -> None:
        """A regroup voids the orders sent ahead (the ranks drop those whose reduce failed, and
        undo the step of any they trained when the round is retried): their batches go back
        to the pool and the next window takes a fresh number, so a late report of a
        cancelled order is recognised and ignored."""
        if not self._ahead:
            return
        for rank, (_, part, order) in self._ahead.items():
            if rank in self.members.alive:  # a dead rank's share went back with its death
                part.give_back(order.slices)
                self.holdings.forget(rank, order.epoch, order.slices)
        self._ahead = {}
        self.orders.next_window()

    def _collect_windows(self, trains: Dict[int, Train], window: WindowTally, epoch: int,
                         epoch_tally: EpochTally, parts: List[EpochPool]) -> None:
        """Every live rank's report of its order; what a deadline window left untrained goes
        back to the rank's pool (`parts`: each rank's) before the reduce."""
        waiting = set(trains)
        while True:
            waiting &= self.members.alive
            if not waiting:
                break
            done = self.ctx.next(expect=WindowDone)
            if done is None:
                continue
            waiting.discard(done.rank)
            self.orders.deadlines.began(done)
            take_back(done, trains[done.rank].slices, parts[done.rank], self.members.alive, self.holdings,
                      self.config.batch_size)
            window.add(done)
            self.orders.progress(self.observer, epoch, epoch_tally, window, done)


def partition(pool: EpochPool, world_size: int, ratios: Optional[List[float]],
              batch_size: int) -> List[EpochPool]:
    """Per-rank shares of the epoch, fixed up front: equal, or by partition_ratios."""
    return pool.split(equal_split(pool.remaining, world_size, ratios, batch_size))


def rehome_parts(parts: List[EpochPool], alive: Set[int], batch_size: int) -> None:
    """A dead rank's share of a sync epoch is split evenly among the survivors, so the
    epoch still ends with every survivor stepping (not one rank finishing alone)."""
    for rank in range(len(parts)):
        if rank in alive or not parts[rank].remaining or not alive:
            continue
        survivors = sorted(alive)
        pieces = parts[rank].split(equal_split(parts[rank].remaining, len(survivors), batch_size=batch_size))
        for target, piece in zip(survivors, pieces):
            parts[target].give_back([(piece.pass_index, s, e - s) for s, e in piece.ranges])
        parts[rank].ranges = []


def folds(parts: List[EpochPool], alive: Set[int], smoothed_ms: List[Optional[float]],
          batch_size: int) -> bool:
    """nccl_sync sends the reduce order with the batch when the window is one batch per rank
    for sure: every live rank has data, and no rank would keep stepping (speeds unknown, or
    within 1.3x of each other, where a rank would need a laggard 1.5x slower). The ranks
    then reduce as soon as they stepped, without a coordinator round trip in between."""
    if any(not parts[r].remaining for r in alive):
        return False
    shared = len({id(parts[r]) for r in alive}) < len(alive)
    if shared and parts[min(alive)].remaining <= (len(alive) - 1) * batch_size:
        return False  # progressive sync: not every rank would get a batch of its own
    ms = [m for r, m in enumerate(smoothed_ms) if r in alive]
    if all(m is None for m in ms):
        return True
    return None not in ms and max(ms) <= FOLD_SPREAD * min(ms)


def keeps_stepping(rank: int, window: WindowTally, in_flight: Dict[int, float],
                   ms: List[Optional[float]], max_batch_diff: Optional[int]) -> bool:
    """Sync modes: a rank that moved goes on stepping while a rank that has not moved yet
    still needs more than half of this rank's step (so a homogeneous rig reduces once per
    step), unless max_batch_diff caps its lead (`ms`: the ranks' smoothed ms per batch)."""
    laggards = [r for r in in_flight if window.batches[r] == 0]
    if not laggards:
        return False
    if ms[rank] is None:
        return False
    now = time.perf_counter()
    remaining = [ms[r] - (now - in_flight[r]) * 1000.0 for r in laggards if ms[r] is not None]
    if not remaining or max(remaining) <= 0.5 * ms[rank]:
        return False
    return max_batch_diff is None or window.batches[rank] < max_batch_diff + min(window.batches)
