"""nccl_sync's exact windows: a window is a run of global steps of world_size x batch_size
samples, each split between the ranks by their measured step times; the ranks step on their own (the
all-reduce inside backward synchronises them) and report once per window.

Owns the cut of a window into steps and shares, the collection of a window's answers, and what
a death inside a window means: the survivors regroup, adopt the state of the one that completed
the most steps, and the rest of the window is re-planned among them (the dead rank's samples of
the steps not completed included). The reduce bookkeeping (round, steps, ElChe's report, the
observers) is the reduces' part; the pool and the window numbers are the windows'.
"""

from __future__ import annotations

import time
from typing import Dict, List, Set, Tuple

from flodl_run.contracts.wire import Train, WindowDone, WindowFailed
from flodl_run.control.context import Group, RunContext
from flodl_run.control.dispatch import EpochPool, SliceT, cut_step
from flodl_run.control.reduces import Reduces
from flodl_run.control.tallies import EpochTally, WindowTally
from flodl_run.control.windows import Windows
from flodl_run.elche.shares import SharePlanner, window_steps

Step = List[SliceT]  # the samples of one global step


class ExactWindows:
    """Trains the epochs of nccl_sync's exact path. Given: the run context (`send`/`next`),
    the windows (the pool, window numbers, the stop request, progress), the reduces (round and
    step counters, ElChe's report, the non-finite streak, the observers), and the `group`,
    whose `regroup(source)` rebuilds the survivors' group and has them adopt member `source`'s
    state (-1: none)."""

    def __init__(self, ctx: RunContext, *, windows: Windows, reduces: Reduces, group: Group):
        self.ctx, self.windows, self.reduces, self.group = ctx, windows, reduces, group
        # the global batch DDP would use, fixed for the run: a death moves the dead rank's
        # samples of each step to the survivors, so the trajectory (and the LR) stay the same
        self.global_batch = ctx.world_size * ctx.config.batch_size
        self._boundary = time.perf_counter()
        self._walls: Dict[int, float] = {}  # each rank's window wall (steps, all-reduces included)
        self.shares = SharePlanner(self.windows.config.elche.partition_ratios)
        self._timed: Set[int] = set()  # ranks whose first window (one-time costs) is behind them

    @property
    def members(self):
        return self.windows.members

    def run_epoch(self, epoch: int, pool: EpochPool, epoch_tally: EpochTally) -> None:
        windows = self.windows
        windows.pools, windows.pool_epoch = [pool], epoch
        self._boundary = time.perf_counter()
        while pool.remaining:
            steps = self._cut_window(pool)
            window = self._train_window(epoch, steps, epoch_tally)
            self._close_window(epoch, len(steps), window, epoch_tally)
            windows.stop_if_asked(epoch)
        self._say_costs(epoch)

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
        self.reduces.observer.on_event(
            "step_costs", f"epoch {epoch + 1}: {steps}; a step of {self.global_batch} split {shares}")

    def _cut_window(self, pool: EpochPool) -> List[Step]:
        """ElChe's anchor of global steps, at most WINDOW_CAP_MS of compute (fewer at the epoch's
        end); a last step too small to give every member a sample joins the one before it."""
        balance = self.reduces.balance
        count = window_steps(balance.plan.anchor, balance.smoothed_ms(), self.members.alive)
        steps = [pool.take(self.global_batch) for _ in range(count) if pool.remaining]
        if len(steps) > 1 and sum(s[2] for s in steps[-1]) < len(self.members.alive):
            steps[-2] = steps[-2] + steps.pop()
        return steps

    def _train_window(self, epoch: int, steps: List[Step], epoch_tally: EpochTally) -> WindowTally:
        """Until every step of the window is done: orders to the members alive, their answers,
        and after a death the regroup (and a re-plan of the steps not completed)."""
        window = WindowTally.empty(self.windows.world_size)
        done = 0
        while done < len(steps):
            if self.members.regroup_needed:
                self.group.regroup(-1)
            asked = set(self.members.alive)
            self.windows.next_window()
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
            self.group.regroup(leader if behind else -1)
            _credit(epoch_tally, orders, completed, most, len(steps) - done)
            done += most
        return window

    def _orders(self, epoch: int, steps: List[Step], members: List[int]) -> Dict[int, Train]:
        """Each member's share of every step, planned from the ranks' fitted step times (by
        the speeds ElChe has smoothed until each has one; by partition_ratios when stated),
        cut from the step's samples in rank order."""
        totals = [sum(s[2] for s in step) for step in steps]
        splits = self.shares.plan(totals, members, self.reduces.balance.smoothed_ms())
        slices: Dict[int, List[SliceT]] = {r: [] for r in members}
        shares: Dict[int, List[int]] = {r: [] for r in members}
        for step, split in zip(steps, splits):
            for rank, piece in zip(members, cut_step(step, [split[r] for r in members])):
                slices[rank] += piece
                shares[rank].append(split[rank])
        window = self.windows.window
        return {rank: Train(window, epoch, slices[rank], len(steps), shares=shares[rank], totals=totals)
                for rank in members}

    def _collect(self, asked: Set[int], steps: int, window: WindowTally, epoch: int,
                 epoch_tally: EpochTally) -> Dict[int, int]:
        """Each asked member's answer to this attempt: the steps it completed (all of them on
        WindowDone). A member that died meanwhile gives none."""
        completed: Dict[int, int] = {}
        number = self.windows.window
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
            self.reduces.note_skipped(answer.rank, answer.skipped)
            self.windows.progress(epoch, epoch_tally, window, answer)
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
        self.reduces.close_exact_window(window, epoch_tally, epoch, steps,
                                        per_batch(window, self.windows.config.batch_size),
                                        max(0.0, elapsed_ms - compute_ms))


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
