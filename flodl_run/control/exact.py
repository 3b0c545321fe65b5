"""nccl_sync's exact windows: a window is a run of global steps of world_size x batch_size
samples, each split between the ranks by their measured step times; the ranks step on their own (the
all-reduce inside backward synchronises them) and report once per window.

Owns the cut of a window into steps and shares, the collection of a window's answers, and what
a death inside a window means: the survivors regroup, adopt the state of the one that completed
the most steps, and the rest of the window is re-planned among them (the dead rank's samples of
the steps not completed included). The round's counters, ElChe's report and the observers
are the round book's; the skipped steps the non-finite ledger's.
"""

from __future__ import annotations

import time
from typing import Dict, List, Set, Tuple

from flodl_run.contracts.wire import Train, WindowDone, WindowFailed
from flodl_run.control.context import Bundles, Closes, Members, RunContext
from flodl_run.control.dispatch import Course, EpochPool, SliceT, cut_step
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.orders import Orders
from flodl_run.control.rounds import RoundBook
from flodl_run.control.tallies import EpochTally, WindowTally
from flodl_run.elche.shares import SharePlanner, window_steps

Step = List[SliceT]  # the samples of one global step


class ExactSteps:
    """Trains the epochs of nccl_sync's exact path.

    Owns: the epoch's pool, the window numbers (`orders`), the share planner fitted to each
    rank's step times, and the window boundary's clock. Given: the run context (link, stop
    request, holdings, balance: ElChe's plan and speeds); the membership (who is alive, a
    regroup due, the regroup itself: the survivors adopt member `source`'s state); the round
    book (counters, ElChe's report, the observers); the non-finite ledger (skipped steps);
    the bundles (a stop's save); and the epochs (`close`)."""

    cuts_windows = False
    """A stop does not cut the windows: the steps are collective, and the windows short."""
    times_reduce = False
    """The window boundary is no all-reduce: the ranks time none before training."""
    seeds_center = False
    """No center to seed before training: the ranks start from their own weights."""

    def __init__(self, ctx: RunContext, *, members: Members, book: RoundBook, ledger: NonfiniteLedger,
                 bundles: Bundles, epochs: Closes):
        self.ctx, self.members, self.book, self.ledger = ctx, members, book, ledger
        self.bundles, self.epochs = bundles, epochs
        self.config, self.world_size = ctx.config, ctx.world_size
        self.orders = Orders(ctx.config.batch_size, ctx.recorder, ctx.balance, deadline_headroom=None)
        self.pool = EpochPool(0, [])
        self.pool_epoch = 0
        self._began = False  # an epoch began: a save with nothing uncovered names the next one
        # the global batch DDP would use, fixed for the run: a death moves the dead rank's
        # samples of each step to the survivors, so the trajectory (and the LR) stay the same
        self.global_batch = ctx.world_size * ctx.config.batch_size
        self._boundary = time.perf_counter()
        self._walls: Dict[int, float] = {}  # each rank's window wall (steps, all-reduces included)
        self.shares = ctx.balance.shares = SharePlanner(ctx.config.elche.partition_ratios)  # saved
        self._timed: Set[int] = set()  # ranks whose first window (one-time costs) is behind them

    def train(self, course: Course) -> None:
        """Every epoch of the course, each closed once its last window is in."""
        self.orders.batches_before = course.batches_before
        for epoch in course.epochs():
            if self.ctx.stop.is_set():  # asked while the epoch before closed, or at its last window
                self.bundles.graceful_stop(epoch, course.left_before(epoch))
            self.epochs.close(epoch, self.run_epoch(epoch, course.pools[epoch]))

    def give_back(self, epoch: int, slices: list) -> bool:
        """A dead rank's work: the windows re-plan a broken window's steps themselves."""
        return True

    def save_point(self) -> Tuple[int, List[List[int]]]:
        """Where a bundle saved now resumes, and what of that epoch the weights lack."""
        uncovered = self.uncovered_now()
        return (self.pool_epoch + 1 if not uncovered and self._began else self.pool_epoch), uncovered

    def uncovered(self) -> List[List[int]]:
        """What of the epoch under way is not handed out yet."""
        return self.pool.uncovered()

    def uncovered_now(self) -> List[List[int]]:
        """What of the epoch under way the survivors' weights may not include."""
        return self.uncovered() + self.ctx.holdings.uncovered(self.pool_epoch)

    def run_epoch(self, epoch: int, pool: EpochPool) -> EpochTally:
        epoch_tally = EpochTally.empty(self.world_size)
        self.pool, self.pool_epoch, self._began = pool, epoch, True
        self._boundary = time.perf_counter()
        while pool.remaining:
            steps = self._cut_window(pool)
            window = self._train_window(epoch, steps, epoch_tally)
            self._close_window(epoch, len(steps), window, epoch_tally)
            self._stop_if_asked(epoch)
        self._say_costs(epoch)
        return epoch_tally

    def _stop_if_asked(self, epoch: int) -> None:
        """A stop was asked for: save what the consensus holds and stop, unless the epoch is
        held whole (it closes first; the next epoch's start saves)."""
        if not self.ctx.stop.is_set():
            return
        uncovered = self.uncovered() + self.ctx.holdings.uncovered(epoch)
        if uncovered:
            self.bundles.graceful_stop(epoch, uncovered)

    def _say_costs(self, epoch: int) -> None:
        """Once an epoch, what the shares come from: each rank's fitted step (fixed cost plus a
        cost per sample) and the split of a full step planned from them (events.jsonl, the
        record log, MLflow). A small share for a slow rank reads as its fixed cost here."""
        members = sorted(self.members.alive)
        costs = self.shares.costs(members)
        if costs is None:
            return
        split = self.shares.last_split()
        steps = ", ".join(f"rank {r} {c.fixed_ms:.3f} ms + {c.per_sample_ms:.4f} ms a sample"
                          for r, c in zip(members, costs))
        shares = " / ".join(f"{split.get(r, 0.0) * self.global_batch:.0f}" for r in members)
        self.ctx.observer.on_event(
            "step_costs", f"epoch {epoch + 1}: {steps}; a step of {self.global_batch} split {shares}")

    def _cut_window(self, pool: EpochPool) -> List[Step]:
        """ElChe's anchor of global steps, at most WINDOW_CAP_MS of compute (fewer at the epoch's
        end; a lone member's run to the cap); a last step too small to give every member a
        sample joins the one before it."""
        balance = self.ctx.balance
        count = window_steps(balance.plan.anchor, balance.smoothed_ms(), self.members.alive)
        steps = [pool.take(self.global_batch) for _ in range(count) if pool.remaining]
        if len(steps) > 1 and sum(s[2] for s in steps[-1]) < len(self.members.alive):
            steps[-2] = steps[-2] + steps.pop()
        return steps

    def _train_window(self, epoch: int, steps: List[Step], epoch_tally: EpochTally) -> WindowTally:
        """Until every step of the window is done: orders to the members alive, their answers,
        and after a death the regroup (and a re-plan of the steps not completed)."""
        window = WindowTally.empty(self.world_size)
        done = 0
        while done < len(steps):
            if self.members.regroup_needed:
                self._regroup(-1)
            asked = set(self.members.alive)
            self.orders.next_window()
            orders = self._orders(epoch, steps[done:], sorted(asked))
            for rank, order in orders.items():
                self.ctx.send(rank, order)
            completed = self._collect(asked, len(steps) - done, window, epoch, epoch_tally)
            broke = self.members.regroup_needed or any(n < len(steps) - done for n in completed.values())
            if not broke:
                break
            most = max(completed.values(), default=0)
            leader = min((r for r, n in completed.items() if n == most), default=-1)
            behind = any(n < most for n in completed.values())
            self._regroup(leader if behind else -1)
            _credit(epoch_tally, orders, completed, most, len(steps) - done)
            done += most
        return window

    def _orders(self, epoch: int, steps: List[Step], members: List[int]) -> Dict[int, Train]:
        """Each member's share of every step, planned from the ranks' fitted step times (by
        the speeds ElChe has smoothed until each has one; by partition_ratios when stated),
        cut from the step's samples in rank order."""
        totals = [sum(s[2] for s in step) for step in steps]
        splits = self.shares.plan(totals, members, self.ctx.balance.smoothed_ms())
        slices: Dict[int, List[SliceT]] = {r: [] for r in members}
        shares: Dict[int, List[int]] = {r: [] for r in members}
        for step, split in zip(steps, splits):
            for rank, piece in zip(members, cut_step(step, [split[r] for r in members])):
                slices[rank] += piece
                shares[rank].append(split[rank])
        window = self.orders.window
        return {rank: Train(window, epoch, slices[rank], len(steps), shares=shares[rank], totals=totals)
                for rank in members}

    def _collect(self, asked: Set[int], steps: int, window: WindowTally, epoch: int,
                 epoch_tally: EpochTally) -> Dict[int, int]:
        """Each asked member's answer to this attempt: the steps it completed (all of them on
        WindowDone). A member that died meanwhile gives none."""
        completed: Dict[int, int] = {}
        number = self.orders.window
        while asked & self.members.alive - set(completed):
            answer = self.ctx.next(expect=(WindowDone, WindowFailed), accept=lambda m: m.window == number)
            if answer is None or answer.window != number:
                continue
            if isinstance(answer, WindowFailed):
                completed[answer.rank] = answer.steps
                self.members.regroup_needed = True
                continue
            completed[answer.rank] = steps
            window.add(answer)
            self._observe(answer)
            self._walls[answer.rank] = answer.window_wall_ms
            self.ledger.note_skipped(answer.rank, answer.skipped)
            self.orders.progress(self.ctx.observer, epoch, epoch_tally, window, answer)
        return {r: n for r, n in completed.items() if r in self.members.alive}

    def _observe(self, answer: WindowDone) -> None:
        """The window's point of the rank's step time (its first window carries the process's
        one-time costs: left out)."""
        if answer.rank in self._timed:
            self.shares.observe(answer.rank, answer.batches, answer.samples, answer.wall_ms)
        self._timed.add(answer.rank)

    def _close_window(self, epoch: int, steps: int, window: WindowTally, epoch_tally: EpochTally) -> None:
        """The window's steps are in every survivor's state: the reduce bookkeeping, with each
        rank's compute expressed per batch of batch_size samples (ElChe's unit) and the window
        boundary's cost (the control round trip: the time between windows that no rank spent
        in its steps, all-reduces included) as the sync time."""
        now = time.perf_counter()
        elapsed_ms, self._boundary = (now - self._boundary) * 1000.0, now
        compute_ms = max(self._walls.values(), default=0.0)
        self._walls = {}
        self._fold(window, epoch_tally, epoch, steps, max(0.0, elapsed_ms - compute_ms))

    def _fold(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, steps: int,
              sync_ms: float) -> None:
        """A window of `steps` global steps is in every survivor's state. One round of
        bookkeeping: the counters, the holdings folded, ElChe's report (the timing in its
        unit), the skipped steps and the observers."""
        book = self.book
        book.begin_round()
        self.ctx.holdings.reset({rank: [] for rank in self.members.alive})
        book.add_steps(steps)
        epoch_tally.add(window)
        book.report(window, sync_ms, None, per_batch=per_batch(window, self.config.batch_size))
        stop = self.ledger.tally_skipped()
        book.observe(epoch, sync_ms, None)
        book.maybe_report(epoch, epoch_tally)
        if stop:
            self.ledger.fail(epoch, self.uncovered_now())

    def _regroup(self, source: int) -> None:
        """Rebuild the survivors' group, member `source`'s state adopted by all (-1: none),
        then drop the answers the old group sent."""
        self.members.regroup(source)
        self.ctx.link.drop_reduce_answers()


def _credit(epoch_tally: EpochTally, orders: Dict[int, Train], completed: Dict[int, int], most: int,
            steps: int) -> None:
    """The samples of a broken attempt's completed steps are in the survivors' state: counted
    for every rank that did not report the whole attempt (the dead included, whose shares of
    those steps went into every all-reduce)."""
    for rank, order in orders.items():
        if completed.get(rank) != steps:
            epoch_tally.samples[rank] += sum(order.shares[:most])


def per_batch(window: WindowTally, batch_size: int) -> Tuple[List[float], List[int]]:
    """(wall, batches) per rank such that wall / batches is the rank's ms per batch of
    `batch_size` samples: its shares vary from step to step, its speed per sample does not."""
    walls, batches = [], []
    for wall, count, samples in zip(window.wall_ms, window.batches, window.samples):
        walls.append(wall * count * batch_size / samples if samples else 0.0)
        batches.append(count if samples else 0)
    return walls, batches
