"""cpu_async's async chunks: training overlapped with the reduce round trip.

Owns the event loop of the async mode: each rank gets its next chunk the moment it finishes
a window (so it may run up to `max_overshoot` batches ahead, across epoch boundaries), a
reduce starts once every rank reached its count, snapshots are averaged into the EASGD center
while ranks keep training, and epochs close in ascending order once all their chunks are done.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

from flodl_run.averaging.central import Snapshot
from flodl_run.contracts.wire import Received, SnapshotTaken, WindowDone
from flodl_run.control.central import CentralRound
from flodl_run.control.context import Bundles, Closes, Members, RunContext
from flodl_run.control.dispatch import Course, EpochPool, EpochSpan
from flodl_run.control.orders import Orders, take_back
from flodl_run.control.tallies import EpochTally, WindowTally


class AsyncChunks:
    """The cpu_async event loop, from the first chunk to the last epoch closed.

    Owns: the epochs' pools and tallies, the chunks each rank has in hand, their Train orders
    and window numbers (`orders`), the window gate (this round's and the next's), the
    snapshots of the round in flight, each rank's overshoot budget, and which epochs are closed.
    Given: the run context (the balance: the plan's counts and overshoot; the holdings, reset
    after each round; the stop request); the membership (who is alive); the
    central round (its SyncNow, the snapshots, the average, its bookkeeping and the updates);
    the epochs (`close`); the bundles (`graceful_stop`); and `deadline_windows` (control.modes).
    `train` takes the epochs' spans and pools from the resume point on."""

    cuts_windows = True
    """A stop cuts the ranks' chunks after the batch in hand."""
    times_reduce = True
    """ElChe starts from the reduce the ranks timed before training, when they did."""
    seeds_center = True
    """Rank 0's initial weights seed the EASGD center before training."""

    def __init__(self, ctx: RunContext, *, members: Members, central: CentralRound, epochs: Closes,
                 bundles: Bundles, deadline_windows: bool):
        self.ctx, self.members, self.central = ctx, members, central
        self.epochs, self.bundles = epochs, bundles
        headroom = ctx.config.elche.deadline_headroom if deadline_windows else None
        self.orders = Orders(ctx.config.batch_size, ctx.recorder, ctx.balance, headroom)
        self.world, self.config = ctx.world_size, ctx.config
        self.balance, self.holdings = ctx.balance, ctx.holdings
        self.stop = ctx.stop
        # the epochs, from `run` on: their spans and pools, orders out, tallies, the oldest
        # epoch with work to hand out and the first not closed
        self.spans: List[EpochSpan] = []
        self.pools: List[EpochPool] = []
        self.outstanding: List[int] = []
        self.tallies: List[EpochTally] = []
        self.dispatch_epoch = self.closed = 0
        self.in_hand: Dict[int, List[tuple]] = {r: [] for r in range(self.world)}  # (epoch, slices)
        self.new_window = lambda: WindowTally.empty(self.world)
        self.window = self.new_window()
        self.window_done: Set[int] = set()
        # Windows that ranks finish while a round is in flight belong to the next gate.
        self.next_window = self.new_window()
        self.next_done: Set[int] = set()
        # Chunks finished after their rank's snapshot of the round in flight: not in the center
        # yet, so a death before the next round must give them back (see _maybe_finish_round).
        self.after_snapshot: Dict[int, List[tuple]] = {r: [] for r in range(self.world)}
        # The reports behind what each rank trained since its work last folded into the center
        # (all of them, and those after its snapshot of the round in flight): the epochs'
        # tallies counted them on arrival, so a death that gives their chunks back to be
        # redone takes them out again (else an epoch counts the redone samples twice).
        self.unfolded: Dict[int, List[WindowDone]] = {r: [] for r in range(self.world)}
        self.unfolded_after: Dict[int, List[WindowDone]] = {r: [] for r in range(self.world)}
        self.idle: Set[int] = set()
        self.snapshots: Optional[List[Snapshot]] = None
        self.overshoot = [0] * self.world  # budget of each rank's latest chunk
        self.rounds_started = 0
        self.round_began = 0.0  # time.monotonic() of the round in flight's SyncNow

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def give_back(self, epoch: int, slices: list) -> bool:
        """A dead rank's chunks (since its last snapshot) go back to their epoch's pool, which
        is then the first place new chunks come from."""
        self.pools[epoch].give_back(slices)
        self.dispatch_epoch = min(self.dispatch_epoch, epoch)
        return True

    def _forget_dead(self) -> None:
        for rank in [r for r in range(self.world) if r not in self.alive and self.unfolded.get(r)]:
            for done in self.unfolded.pop(rank):  # its chunks went back: they are redone
                self.tallies[done.epoch].drop_done(done)
        for rank in [r for r in range(self.world) if r not in self.alive and self.in_hand.get(r)]:
            for epoch, _ in self.in_hand[rank]:
                self.outstanding[epoch] -= 1
            self.in_hand[rank] = []
            self.window_done.discard(rank)
            self.next_done.discard(rank)
        for rank in range(self.world):  # a survivor idle for want of work gets the given-back work
            if rank in self.alive and rank in self.idle and any(p.remaining for p in self.pools):
                self.idle.discard(rank)
                self.dispatch_epoch = min(e for e, p in enumerate(self.pools) if p.remaining)
                self._give(rank)

    def train(self, course: Course) -> None:
        """Train every epoch of the course from its start on (its pools: what each hands out)."""
        self.spans, self.pools = course.spans, course.pools
        self.orders.batches_before = course.batches_before
        self.outstanding = [0] * len(self.spans)
        self.tallies = [EpochTally.empty(self.world) for _ in self.spans]
        self.dispatch_epoch = self.closed = course.start
        for rank in range(self.world):
            self._give(rank)
        while self.closed < len(self.spans):
            received = self.ctx.link.next_with_frames(expect=(WindowDone, SnapshotTaken),
                                                      deadline=self._deadline())
            self._forget_dead()
            if received is not None and isinstance(received.message, WindowDone):
                self._on_window_done(received.message)
            elif received is not None:
                self._on_snapshot(received)
            self._forget_dead()
            self._maybe_finish_round()
            self._maybe_start_round()
            self._close_epochs()

    # ---- dispatch ---------------------------------------------------------------------------

    def _give(self, rank: int) -> None:
        """Next chunk for `rank`: its planned count, from the oldest epoch with data left."""
        while self.dispatch_epoch < len(self.spans) and not self.pools[self.dispatch_epoch].remaining:
            self.dispatch_epoch += 1
        if self.dispatch_epoch >= len(self.spans) or self.stop.is_set() or rank not in self.alive:
            self.idle.add(rank)
            return
        epoch = self.dispatch_epoch
        count = max(1, self.balance.plan.batch_counts[rank])
        loan = self.orders.deadlines.loan(count, self.orders.deadline_ms())
        slices = self.pools[epoch].take(loan * self.config.batch_size)
        self.outstanding[epoch] += 1
        self.in_hand[rank].append((epoch, slices))
        if self.tallies[epoch].batches == [0] * self.world and self.outstanding[epoch] == 1:
            self.tallies[epoch].started = time.perf_counter()
        self.overshoot[rank] = self._overshoot(count)
        self.ctx.send(rank, self.orders.train_order(epoch, slices, self.overshoot[rank]))

    def _overshoot(self, count: int) -> int:
        """Batches past the window a rank may run before SyncNow; below its next count so a
        window never completes twice per reduce, and within max_batch_diff when set."""
        budget = self.balance.plan.max_overshoot or 0
        limit = self.config.elche.max_batch_diff
        if limit is not None:
            budget = min(budget, limit)
        return max(0, min(budget, count - 1))

    # ---- events -----------------------------------------------------------------------------

    def _on_window_done(self, done: WindowDone) -> None:
        self.tallies[done.epoch].add_done(done)
        self.outstanding[done.epoch] -= 1
        epoch, slices = self.in_hand[done.rank].pop(0)
        chunk = (epoch, self._take_back(done, epoch, slices))
        # A window the rank finished before it handled the in-flight SyncNow went into that
        # round's snapshot; one finished after belongs to the next gate.
        later = self.snapshots is not None and done.reduces_seen >= self.rounds_started
        (self.next_window if later else self.window).add(done)
        (self.next_done if later else self.window_done).add(done.rank)
        if later:
            self.after_snapshot[done.rank].append(chunk)
            self.unfolded_after[done.rank].append(done)
        self.unfolded.setdefault(done.rank, []).append(done)
        self.orders.progress(self.ctx.observer, done.epoch, self.tallies[done.epoch], self.new_window(), done)
        self._give(done.rank)
        self._maybe_start_round()

    def _take_back(self, done: WindowDone, epoch: int, slices: list) -> list:
        """What the rank trained of its chunk; what a deadline window left goes back to the
        epoch's pool (handed out first) and out of the rank's holdings."""
        if done.left:
            self.dispatch_epoch = min(self.dispatch_epoch, epoch)
        return take_back(done, slices, self.pools[epoch], self.alive, self.holdings, self.config.batch_size)

    def _maybe_start_round(self) -> None:
        """Reduce once every rank reached its count (ranks without data count as done)."""
        if self.snapshots is not None or not self.window_done:
            return
        if any(r not in self.window_done and r not in self.idle for r in self.alive):
            return
        self.orders.next_window()
        self.central.open_round()
        self.rounds_started += 1
        self.snapshots = []
        self.round_began = time.monotonic()

    def _deadline(self) -> Optional[float]:
        """When the round in flight stops waiting for snapshots: snapshot_timeout_secs after
        its SyncNow, once one snapshot is in; None while no round waits, or when nothing is
        left to hand out (a late rank's steps would have no later round to fold into)."""
        if not self.snapshots or not any(p.remaining for p in self.pools):
            return None
        return self.round_began + self.config.snapshot_timeout_secs

    def _on_snapshot(self, taken: Received) -> None:
        rank = taken.message.rank
        snap = self.central.take_snapshot(taken, self.window.batches[rank], self.overshoot[rank])
        if snap is not None:  # None: the late snapshot of a round that left its rank out
            self.snapshots.append(snap)

    def _maybe_finish_round(self) -> None:
        """Average once every live rank's snapshot is in (a dead rank's is dropped), or once
        the snapshot timeout passed: a rank still missing is left out of this average."""
        if self.snapshots is None:
            return
        missing = self.alive - {s.rank for s in self.snapshots}
        deadline = self._deadline()
        if missing and (deadline is None or time.monotonic() < deadline):
            return
        if missing:
            self.central.leave_out(missing)
        snapshots = sorted((s for s in self.snapshots if s.rank in self.alive), key=lambda s: s.rank)
        # What the center now holds is forgotten; what a rank trained or holds beyond its
        # snapshot (finished after it, or still in hand) stays owed if the rank dies. Resetting
        # it all here lost those chunks (an epoch short by whole chunks after a SIGKILL).
        # A rank left out keeps all it was sent since its last fold owed.
        self.holdings.reset({r: self.holdings.of(r) if r in missing else
                             self.after_snapshot[r] + list(self.in_hand[r]) for r in self.alive})
        self.after_snapshot = {r: [] for r in range(self.world)}
        self.unfolded = {r: self.unfolded.get(r, []) if r in missing else self.unfolded_after[r]
                         for r in self.alive}
        self.unfolded_after = {r: [] for r in range(self.world)}
        epoch = max(self.closed, min(self.dispatch_epoch, len(self.spans) - 1))
        closing = self.central.average_in(snapshots, self.window, epoch)
        fail_at = (self.closed, self._uncovered(self.closed)) if closing.stop else None
        self.central.release_async(closing, fail_at)
        self.window, self.window_done = self.next_window, self.next_done
        self.next_window, self.next_done, self.snapshots = self.new_window(), set(), None
        if self.stop.is_set() and not any(self.in_hand.values()):  # cut windows still out: their round first
            self._close_held_epochs()
            self.bundles.graceful_stop(*self.save_point())
        self._maybe_start_round()

    def save_point(self) -> Tuple[int, List[List[int]]]:
        """The epoch a save made now names, and what of it the center does not include yet: the
        oldest epoch not closed, or past it while the center holds that one whole (its close
        not run yet), so a resume redoes none of it."""
        epoch = self.closed
        while epoch < len(self.spans):
            uncovered = self._uncovered(epoch)
            if uncovered:
                return epoch, uncovered
            epoch += 1
        return epoch, []

    def _uncovered(self, epoch: int) -> List[List[int]]:
        """What of `epoch` the center does not include yet: undispatched work, and what the
        live ranks trained or hold since their work last folded in (a dead rank's went back to
        the pool)."""
        return self.pools[epoch].uncovered() + self.holdings.uncovered(epoch)

    def _close_held_epochs(self) -> None:
        """A stop saves next: close, in order, each epoch the center holds whole (nothing of it
        undispatched, in hand or unfolded), so the bundle, which names the first epoch the
        center does not hold whole, and the summary list the same epochs."""
        while self.closed < len(self.spans) and self.outstanding[self.closed] == 0 \
                and not self._uncovered(self.closed):
            self.epochs.close(self.closed, self.tallies[self.closed])
            self.closed += 1

    def _close_epochs(self) -> None:
        """Close finished epochs in order, only between rounds (their work is in the center)."""
        while self.closed < len(self.spans) and self.snapshots is None \
                and not self.pools[self.closed].remaining \
                and self.outstanding[self.closed] == 0 and not self.window_done:
            self.epochs.close(self.closed, self.tallies[self.closed])
            self.closed += 1
