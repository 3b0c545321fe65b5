"""Windows of the sync and cadence modes: equal-split sync epochs (fast ranks keep stepping
until the gate opens), progressive cadence epochs (throughput-sized chunks), and nccl_sync's
orders sent ahead of the reduce they follow. Which samples go where is `flodl_run.control.dispatch`'s;
the reduce itself is the reduces' part.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from flodl_run.config.schema import Mode, WindowEnd
from flodl_run.contracts.wire import SyncNow, Train, WindowDone
from flodl_run.control.context import Bundles, Members, RunContext
from flodl_run.control.deadlines import Deadlines
from flodl_run.control.dispatch import (
    EpochPool,
    SliceT,
    as_range,
    equal_split,
    split_trained,
    window_samples,
)
from flodl_run.control.reduces import Reduces
from flodl_run.control.tallies import EpochTally, WindowTally

FOLD_SPREAD = 1.3
"""nccl_sync folds SyncNow into the Train orders while the ranks' ms/batch stay within this ratio."""
log = logging.getLogger(__name__)


class Windows:
    """Hands out data and collects windows until the reduce gate opens (sync and cadence).

    Owns: the epoch's pools (where a dead rank's work goes back, `give_back`, and what a
    deadline window left untrained, `take_back`), the window number and deadline Train orders
    carry, and nccl_sync's orders sent ahead of the reduce they follow
    (`orders_ahead`; `cancel_ahead` voids them on a regroup and gives their batches back).
    Given: the run context (its balance: plan, smoothed batch times; its stop request; its
    holdings: a voided order is forgotten there; the observer: progress); the membership (who
    is alive, whether a regroup is due); the reduces (`reduce`, `sync_now`, the round and step
    counters, whether a non-finite rank waits); and the bundles (`save_bundle` /
    `graceful_stop` for the checkpoints taken between windows)."""

    def __init__(self, ctx: RunContext, *, members: Members, reduces: Reduces, bundles: Bundles):
        self.ctx, self.members, self.reduces, self.bundles = ctx, members, reduces, bundles
        self.world_size, self.mode, self.config = ctx.world_size, ctx.mode, ctx.config
        self.balance, self.stop = ctx.balance, ctx.stop
        self.holdings, self.observer = ctx.holdings, ctx.observer
        self.pools: List[EpochPool] = []  # where work of a dead rank goes back
        self.pool_epoch = 0
        self.window = 0
        # nccl_sync on an even rig: each rank's next order, sent ahead of the reduce it follows
        # (rank -> (when sent, the pool it came from, the order))
        self._ahead: Dict[int, Tuple[float, EpochPool, Train]] = {}
        self.exact = None  # nccl_sync's exact windows (control.exact), when gradients are averaged
        self.batches_before: Dict[int, int] = {}  # a resumed epoch's batches the bundle holds
        self.deadlines = Deadlines(ctx.recorder, ctx.config.elche.deadline_headroom)

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def give_back(self, epoch: int, slices: list) -> bool:
        """A dead rank's chunk of the epoch under way goes back to the pool with the least
        left; False when `epoch` is not that epoch (nothing taken)."""
        if self.exact is not None:  # the exact windows re-plan a broken window's steps themselves
            return True
        if epoch != self.pool_epoch or not self.pools:
            return False
        target = min((p for p in self.pools if p is not None), key=lambda p: p.remaining)
        target.give_back(slices)
        return True

    def uncovered(self) -> List[List[int]]:
        """What of the epoch under way is not handed out yet."""
        return [r for p in self.pools if p is not None for r in p.uncovered()]

    def orders_ahead(self) -> Dict[int, Train]:
        """The orders sent ahead, by rank: they belong to the next window."""
        return {rank: order for rank, (_, _, order) in self._ahead.items()}

    def next_window(self) -> None:
        """A reduce begins: orders from now on belong to the next window."""
        self.window += 1

    def _reduce(self, *args, **kwargs) -> Dict[int, Train]:
        self.next_window()
        return self.reduces.reduce(*args, ahead=self.orders_ahead, **kwargs)

    def _sync_after(self, rounds: int, steps: int = 0) -> SyncNow:
        """The reduce order `rounds` past the last one, `steps` past the global step."""
        return self.reduces.sync_now(self.reduces.round + rounds, self.reduces.global_step + steps)

    def run_epoch(self, epoch: int, pool: EpochPool) -> EpochTally:
        epoch_tally = EpochTally.empty(self.world_size)
        if self.exact is not None:
            self.exact.run_epoch(epoch, pool, epoch_tally)
        elif self.mode.is_sync:
            self._run_sync_epoch(epoch, pool, epoch_tally)
        else:
            self._run_cadence_epoch(epoch, pool, epoch_tally)
        return epoch_tally

    def _run_cadence_epoch(self, epoch: int, pool: EpochPool, epoch_tally: EpochTally) -> None:
        """Each window hands every rank its planned count of batches; the next window's orders
        ride on the reduce (folded into the update on the coordinator backend). Progressive
        dispatch (the default) cuts them from the whole epoch, so the fast rank never idles;
        with progressive_dispatch off every rank's share is fixed up front (equal, or by
        partition_ratios) and a rank whose share ran out sits the rest of the epoch out."""
        parts = None if self._progressive else self._partition(pool)
        self.pools, self.pool_epoch = ([pool] if parts is None else parts), epoch

        def plan_window() -> Dict[int, Train]:
            window_ms = self.deadline_ms()  # a deadline window lends past the counts
            counts = [self.deadlines.loan(c, window_ms) if r in self.alive else 0
                      for r, c in enumerate(self.balance.plan.batch_counts)]
            if parts is None:
                sizes = window_samples(pool.remaining, counts, self.config.batch_size)
                cut = [pool.take(size) if rank in self.alive else [] for rank, size in enumerate(sizes)]
            else:
                self._rehome_parts(parts)
                cut = [parts[r].take(c * self.config.batch_size) for r, c in enumerate(counts)]
            # Collective cadence: when every live rank has work, each order carries its reduce,
            # so a rank enters the collective the moment its count is done (no coordinator
            # round trip between the window and the reduce; the collective waits for the last).
            fold = self.mode.is_collective and all(cut[r] for r in self.alive)
            then_sync = self._sync_after(1) if fold else None
            at = None if window_ms is None else self.deadlines.window_ns(self.window, window_ms)
            return {rank: self.train_order(epoch, slices, then_sync=then_sync, deadline_ns=at)
                    for rank, slices in enumerate(cut) if slices}

        trains = plan_window()
        for rank, order in trains.items():
            self.ctx.send(rank, order)
        reduces = 0
        while trains or self._pools_remaining():  # work given back by a dead rank is redone
            if not trains:
                trains = plan_window()
                for rank, order in trains.items():
                    self.ctx.send(rank, order)
            window = WindowTally.empty(self.world_size)
            self._collect_windows(trains, window, epoch, epoch_tally,
                                  pool_of=lambda rank: pool if parts is None else parts[rank])
            folded = all(order.then_sync is not None for order in trains.values())
            more = self._pools_remaining() and not self.stop.is_set()
            trains = self._reduce(window, epoch_tally, epoch, plan_window if more else None,
                                  final=self._is_last_round(epoch),
                                  sync_sent=folded and self.alive <= set(trains))
            reduces += 1
            in_flight = [s for order in trains.values() for s in order.slices]
            if not trains:  # orders sent on the reduce (a stop asked meanwhile) are cut and reduced first
                self.stop_if_asked(epoch)
            if reduces == 1 and epoch == self.config.checkpoint_at_epoch:
                # a first window that took the whole epoch makes this the epoch's end save
                self.bundles.save_bundle("checkpoint", *self.resume_point(
                    epoch, self.uncovered() + [as_range(s) for s in in_flight]))

    @property
    def _progressive(self) -> bool:
        """progressive_dispatch, its auto default (None) resolved by mode: on for cadence and
        async, off for sync."""
        chosen = self.config.progressive_dispatch
        return self.mode.is_progressive if chosen is None else bool(chosen)

    def _is_last_round(self, epoch: int) -> bool:
        """The reduce about to run is the run's last: the last epoch has nothing left to hand out."""
        last = self.config.num_epochs * self.config.data.epoch_splits - 1
        return epoch == last and not self._pools_remaining()

    def _pools_remaining(self) -> int:
        return sum(part.remaining for part in self.pools)

    def _partition(self, pool: EpochPool) -> List[EpochPool]:
        """Per-rank shares of the epoch, fixed up front: equal, or by partition_ratios."""
        return pool.split(equal_split(pool.remaining, self.world_size,
                                      self.config.elche.partition_ratios, self.config.batch_size))

    def _run_sync_epoch(self, epoch: int, pool: EpochPool, epoch_tally: EpochTally) -> None:
        """A reduce fires once every rank with data has stepped since the last one, and ranks
        that are ahead keep stepping meanwhile (sync is not lockstep). Each rank steps through
        its own share, fixed up front (equal, or by partition_ratios); with progressive_dispatch
        on, every rank takes its next batch from the whole epoch instead, so a fast rank does
        more of it."""
        shared = self._progressive
        parts = [pool] * self.world_size if shared else self._partition(pool)
        self.pools, self.pool_epoch = ([pool] if shared else parts), epoch
        while any(part.remaining for part in parts) or self._ahead:
            if not shared and not self._ahead:
                self._rehome_parts(parts)
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

    def _rehome_parts(self, parts: List[EpochPool]) -> None:
        """A dead rank's share of a sync epoch is split evenly among the survivors, so the
        epoch still ends with every survivor stepping (not one rank finishing alone)."""
        for rank in range(len(parts)):
            if rank in self.alive or not parts[rank].remaining or not self.alive:
                continue
            survivors = sorted(self.alive)
            pieces = parts[rank].split(equal_split(parts[rank].remaining, len(survivors),
                                                   batch_size=self.config.batch_size))
            for target, piece in zip(survivors, pieces):
                parts[target].give_back([(piece.pass_index, s, e - s) for s, e in piece.ranges])
            parts[rank].ranges = []

    def _sync_window(self, epoch: int, parts: List[EpochPool], window: WindowTally,
                     epoch_tally: EpochTally) -> bool:
        """One sync window; True when its SyncNow rode on the Train orders (see _folds). On an
        even rig each rank's next order goes out as soon as it reports this window's batch
        (`_queue_ahead`), so it finds that order waiting when its reduce completes."""
        ahead, self._ahead = self._ahead, {}
        in_flight = {rank: sent for rank, (sent, _, _) in ahead.items()}  # rank -> when sent
        fold = bool(ahead) or (self.mode.is_collective and self._folds(parts))
        then_sync = self._sync_after(1) if fold else None

        def give(rank: int) -> None:
            self.ctx.send(rank, self.train_order(epoch, parts[rank].take(self.config.batch_size),
                                               then_sync=then_sync))
            in_flight[rank] = time.perf_counter()

        for rank in sorted(self.alive) if not ahead else ():
            if parts[rank].remaining:
                give(rank)
        given, queue = len(in_flight), None
        while True:
            for rank in [r for r in in_flight if r not in self.alive]:
                del in_flight[rank]
            if not in_flight:
                break
            done = self.ctx.next(expect=WindowDone, accept=lambda m: m.window <= self.window)
            if done is None or done.window < self.window:  # a cancelled order's report
                continue
            del in_flight[done.rank]
            window.add(done)
            self.progress(epoch, epoch_tally, window, done)
            if fold:
                queue = self._queue_ahead(parts) if queue is None else queue
                if queue and not self.members.regroup_needed:
                    self._send_ahead(epoch, parts[done.rank], done.rank, given)
            elif parts[done.rank].remaining and self._keeps_stepping(done.rank, window, in_flight):
                give(done.rank)
        return fold

    def _queue_ahead(self, parts: List[EpochPool]) -> bool:
        """nccl_sync sends the next window's orders ahead when that window folds too (every live
        rank has a batch, speeds even) and nothing is to happen between the two windows: no
        stop asked for, no regroup pending, no non-finite rank to act on. The coordinator's
        bookkeeping of a reduce then overlaps the ranks' next step instead of delaying it."""
        return (self.mode is Mode.nccl_sync and not self.stop.is_set()
                and not self.reduces.nonfinite_pending() and not self.members.regroup_needed
                and self._folds(parts))

    def _send_ahead(self, epoch: int, part: EpochPool, rank: int, given: int) -> None:
        """The rank's order of the next window (window and round one past this one's), to be
        trained once its reduce of this window completed (`after_round`)."""
        then_sync = self._sync_after(2, given)
        order = self.train_order(epoch, part.take(self.config.batch_size), then_sync=then_sync,
                                  ahead_of=self.reduces.round + 1)
        self.ctx.send(rank, order)
        self._ahead[rank] = (time.perf_counter(), part, order)

    def cancel_ahead(self) -> None:
        """A regroup voids the orders sent ahead (the ranks drop those whose reduce failed, and
        undo the step of any they trained when the round is retried): their batches go back
        to the pool and the next window takes a fresh number, so a late report of a
        cancelled order is recognised and ignored."""
        if not self._ahead:
            return
        for rank, (_, part, order) in self._ahead.items():
            if rank in self.alive:  # a dead rank's share went back with its death
                part.give_back(order.slices)
                self.holdings.forget(rank, order.epoch, order.slices)
        self._ahead = {}
        self.window += 1

    def _folds(self, parts: List[EpochPool]) -> bool:
        """nccl_sync sends the reduce order with the batch when the window is one batch per rank
        for sure: every live rank has data, and no rank would keep stepping (speeds unknown, or
        within 1.3x of each other, where a rank would need a laggard 1.5x slower). The ranks
        then reduce as soon as they stepped, without a coordinator round trip in between."""
        if any(not parts[r].remaining for r in self.alive):
            return False
        shared = len({id(parts[r]) for r in self.alive}) < len(self.alive)
        if shared and parts[min(self.alive)].remaining <= (len(self.alive) - 1) * self.config.batch_size:
            return False  # progressive sync: not every rank would get a batch of its own
        ms = [m for r, m in enumerate(self.balance.smoothed_ms()) if r in self.alive]
        if all(m is None for m in ms):
            return True
        return None not in ms and max(ms) <= FOLD_SPREAD * min(ms)

    def _keeps_stepping(self, rank: int, window: WindowTally, in_flight: Dict[int, float]) -> bool:
        """Sync modes: a rank that moved goes on stepping while a rank that has not moved yet
        still needs more than half of this rank's step (so a homogeneous rig reduces once per
        step), unless max_batch_diff caps its lead."""
        laggards = [r for r in in_flight if window.batches[r] == 0]
        if not laggards:
            return False
        ms = self.balance.smoothed_ms()
        if ms[rank] is None:
            return False
        now = time.perf_counter()
        remaining = [ms[r] - (now - in_flight[r]) * 1000.0 for r in laggards if ms[r] is not None]
        if not remaining or max(remaining) <= 0.5 * ms[rank]:
            return False
        limit = self.config.elche.max_batch_diff
        return limit is None or window.batches[rank] < limit + min(window.batches)

    def train_order(self, epoch: int, slices: list, overshoot: int = 0,
                     then_sync: Optional[SyncNow] = None, ahead_of: int = 0,
                     deadline_ns: Optional[int] = None) -> Train:
        """`ahead_of`: an order of the next window, sent before the reduce of round `ahead_of`.
        With elche.window_end=deadline a cadence or async order carries the plan's duration
        and its end on the coordinator's clock: `deadline_ns` (a cadence window's, shared by
        its orders), else the duration from now (an async chunk)."""
        batches = sum(-(-s[2] // self.config.batch_size) for s in slices)
        deadline_ms = self.deadline_ms()
        if deadline_ms is not None and deadline_ns is None:
            deadline_ns = self.deadlines.chunk_ns(deadline_ms)
        return Train(self.window + (1 if ahead_of else 0), epoch, slices, batches, overshoot, then_sync,
                     after_round=ahead_of, deadline_ms=deadline_ms,
                     deadline_ns=None if deadline_ms is None else deadline_ns)

    def deadline_ms(self) -> Optional[float]:
        """The window's deadline: deadline windows in the cadence and async modes, once ElChe
        timed the anchor rank; None ends the window on its counts."""
        if self.config.elche.window_end is not WindowEnd.deadline or self.mode.is_sync:
            return None
        return self.balance.window_ms()

    def take_back(self, done: WindowDone, slices: List[SliceT], pool: EpochPool) -> List[SliceT]:
        """What the rank trained of the order of `slices` it reports on; the batches it left
        (its deadline passed first) go back to `pool` and out of its holdings, so each sample
        is still trained once in the epoch. A dead rank's report changes nothing (all it held
        went back already)."""
        if not done.left:
            return slices
        trained, left = split_trained(slices, done.batches, self.config.batch_size)
        if done.rank in self.alive:
            pool.give_back(left)
            self.holdings.trim(done.rank, done.epoch, slices, trained)
        return trained

    def _collect_windows(self, trains: Dict[int, Train], window: WindowTally, epoch: int,
                         epoch_tally: EpochTally, pool_of: Callable[[int], EpochPool]) -> None:
        """Every live rank's report of its order; what a deadline window left untrained goes
        back to the rank's pool (`pool_of`) before the reduce."""
        waiting = set(trains)
        while True:
            waiting &= self.alive
            if not waiting:
                break
            done = self.ctx.next(expect=WindowDone)
            if done is None:
                continue
            waiting.discard(done.rank)
            self.deadlines.began(done)
            self.take_back(done, trains[done.rank].slices, pool_of(done.rank))
            window.add(done)
            self.progress(epoch, epoch_tally, window, done)

    def progress(self, epoch: int, epoch_tally: EpochTally, window: WindowTally,
                  done: WindowDone) -> None:
        batches = self.batches_before.get(epoch, 0) + sum(epoch_tally.batches) + sum(window.batches)
        # the rank's window loss; a rank given no sample has none: the window's, else the epoch's
        loss = done.loss_sum / done.loss_count if done.loss_count else window.mean_loss()
        self.observer.on_batch(epoch, batches, loss if loss is not None else epoch_tally.mean_loss())
