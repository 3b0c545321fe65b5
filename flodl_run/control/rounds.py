"""The book of reduce rounds: the round and global-step counters, the reduce orders, ElChe's
report after each round, the reduce's record and the sub-epoch reports. How a round collects
and spreads the consensus is the collective round's (`control.collective`) or the central
round's (`control.central`); what the ranks train between rounds is the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from flodl_run.averaging.central import CentralResult
from flodl_run.config.schema import lr_factor
from flodl_run.contracts.scalars import roll_up
from flodl_run.contracts.summary import ReduceRecord, ReportRecord
from flodl_run.contracts.wire import SyncNow, Train
from flodl_run.control.context import Members, RunContext
from flodl_run.control.tallies import EpochTally, WindowTally
from flodl_run.elche.balancer import ReduceReport


@dataclass
class Closing:
    """A round whose consensus is in (what `reduce` returns): what its caller needs to plan
    the next orders and to `release` the round. `regrouped`: the survivors rebuilt their
    group meanwhile (the caller voids the orders it sent ahead); `stop`: non-finite values
    reached max_nonfinite (release saves and ends the run)."""

    epoch: int
    window: WindowTally
    epoch_tally: EpochTally
    sync_ms: float
    divergence: Optional[float]
    stop: bool = False
    regrouped: bool = False
    result: Optional[CentralResult] = None


class RoundBook:
    """Owns the round and global-step counters, the reduce times (`sync_ms`) and each rank's
    alignment to the consensus of the round just closed. Given: the run context (its balance:
    ElChe's report and plan; its holdings, reset after each round; the observer) and the
    membership (who is alive); `divergence_every`: a round in this many measures the
    divergence (control.modes)."""

    def __init__(self, ctx: RunContext, *, members: Members, divergence_every: int):
        self.ctx, self.members, self.divergence_every = ctx, members, divergence_every
        self.config, self.world_size = ctx.config, ctx.world_size
        self.balance, self.holdings = ctx.balance, ctx.holdings
        self.recorder, self.summary, self.observer = ctx.recorder, ctx.summary, ctx.observer
        self.round = 0
        self.global_step = 0
        self.sync_ms: List[float] = []
        # rank -> (cosine, magnitude) of its window update against the consensus, this reduce
        self.alignment: Dict[int, Tuple[Optional[float], Optional[float]]] = {}

    def resume(self, global_step: int, round_: int) -> None:
        """Continue a bundle's counters."""
        self.global_step, self.round = global_step, round_

    def trajectory(self) -> Tuple[int, int]:
        """(global step, round): where the run stands, as a bundle records it."""
        return self.global_step, self.round

    def begin_round(self) -> int:
        """A reduce begins: its round number."""
        self.round += 1
        return self.round

    def add_steps(self, steps: int) -> None:
        """Steps that just went into the consensus."""
        self.global_step += steps

    def sync_now(self, round_: int, global_step: int) -> SyncNow:
        """The reduce order of `round_`, measuring the divergence at one round in
        `divergence_every` (the others report None): on nccl_sync's short steps the extra pass
        and device read would cost a tenth of one."""
        measure = self.divergence_every == 1 or round_ % self.divergence_every == 1
        return SyncNow(round_, global_step, lr_factor(len(self.members.alive), self.config.lr_scale_ratio),
                       measure)

    def stall_ceiling_s(self) -> float:
        """A reduce stuck past max(10 x heartbeat timeout, 300 s) saves and stops."""
        return max(10 * self.config.heartbeat_timeout_secs, 300.0)

    def fold(self, window: WindowTally, epoch_tally: EpochTally, late: Set[int],
             ahead: Dict[int, Train]) -> None:
        """The round's consensus holds the window: the dead's work is redone, the holdings
        start over (a rank left out still owes what it trained since its last fold; orders
        sent `ahead` belong to the next window) and the window's steps count."""
        alive = self.members.alive
        window.drop(set(range(self.world_size)) - alive)
        self.holdings.reset({r: self.holdings.of(r) if r in late else [] for r in alive})
        for rank, order in ahead.items():
            if rank in alive:
                self.holdings.note(rank, order.epoch, order.slices)
        self.add_steps(sum(window.batches))
        epoch_tally.add(window)

    def report(self, window: WindowTally, sync_ms: float, divergence: Optional[float],
               fill_ms: Optional[List[float]] = None,
               per_batch: Optional[Tuple[List[float], List[int]]] = None) -> None:
        """Feed ElChe one ReduceReport (`per_batch`: the (wall, batches) of nccl_sync's exact
        path in ElChe's unit; `fill_ms`: the progressive modes' window fill); the caller
        publishes what it decided (`observe`) once the next orders are out."""
        self.sync_ms.append(sync_ms)
        lr = next((x for x in window.lr if x is not None), None)
        walls, batches = per_batch if per_batch is not None else (window.wall_ms, window.batches)
        if per_batch is not None:
            report = ReduceReport(wall_ms=walls, batches=batches, sync_ms=sync_ms, lr=lr)
        else:
            report = ReduceReport(wall_ms=walls, batches=batches, sync_ms=sync_ms, fill_ms=fill_ms,
                                  divergence=divergence, lr=lr)
        plan = self.balance.on_reduce(report)
        self.summary.anchor_trajectory.append(plan.anchor)

    def observe(self, epoch: int, sync_ms: float, divergence: Optional[float],
                window: Optional[WindowTally] = None) -> None:
        """The reduce's record (ElChe's plan for the next window, the alignment, what the
        window's deadlines left), then ElChe's events."""
        plan = self.balance.plan
        parts = [self.alignment.get(r, (None, None)) for r in range(self.world_size)]
        self.alignment = {}
        self.observer.on_reduce(ReduceRecord(
            self.round, epoch, sync_ms, divergence, plan.anchor, plan.anchor_rank,
            list(plan.batch_counts), plan.overhead, str(plan.verdict), plan.phase.name.lower(),
            plan.nudge_factor, [c for c, _ in parts], [m for _, m in parts],
            list(window.left) if window is not None else []))
        for event in plan.events:
            self.observer.on_event(event.kind, event.message)

    def maybe_report(self, epoch: int, tally: EpochTally) -> None:
        """reports_per_epoch: one sub-epoch report each time the epoch passes another 1/n of its
        samples (in samples, not batches: nccl_sync's ranks each count a batch of every step, and
        a step's last one is short, so batches overran the epoch's, 102% and more)."""
        n = self.config.reports_per_epoch
        if not n:
            return
        fraction = sum(tally.samples) / max(self.ctx.epoch_span(epoch).size, 1)
        if tally.reports >= n or fraction < (tally.reports + 1) / n:
            return
        tally.reports = min(n, int(fraction * n + 1e-9))
        counted = sum(tally.loss_batches) - tally.reported_loss_batches  # the batches that gave a loss
        loss = sum(tally.loss_sum) - tally.reported_loss
        tally.reported_loss, tally.reported_loss_batches = sum(tally.loss_sum), sum(tally.loss_batches)
        self.observer.on_report(ReportRecord(
            epoch, tally.reports, fraction, self.global_step, loss / max(counted, 1),
            roll_up(tally.scalars, self.config.scalar_reductions)))


class BookedRound:
    """What a reduce round (collective or central) answers from its round book and non-finite
    ledger, the `Rounds` protocol's counters and news: a subclass sets `book` (a RoundBook) and
    `ledger` (the run's NonfiniteLedger, which imports this module)."""

    book: RoundBook

    @property
    def round(self) -> int:
        return self.book.round

    @property
    def global_step(self) -> int:
        return self.book.global_step

    def sync_now(self, round_: int, global_step: int) -> SyncNow:
        """The reduce order of `round_` (the round book's)."""
        return self.book.sync_now(round_, global_step)

    def nonfinite_pending(self) -> bool:
        """A rank was found non-finite since the last reduce (the ledger's news)."""
        return self.ledger.nonfinite_pending()
