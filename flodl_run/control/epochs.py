"""Epochs on the coordinator: a finished epoch's record (work-weighted loss, per-rank
throughput and share, scalars, data-plane metrics), the eval and the recipe's epoch callbacks
on the callback rank, the publication of the record, and checkpoint_every. What each epoch
trains is the windows' part (or the async loop's).
"""

from __future__ import annotations

import time
from typing import List, Optional, Set

from flodl_run.averaging.central import CentralAverager
from flodl_run.averaging.frames import as_frame, dtype_names
from flodl_run.contracts.recipe import CallbackFailed, Recipe
from flodl_run.contracts.scalars import roll_up
from flodl_run.contracts.summary import EpochRecord
from flodl_run.contracts.wire import Evaluate, Evaluated
from flodl_run.control.context import Bundles, Members, RunContext
from flodl_run.control.modes import easgd_center
from flodl_run.control.tallies import EpochTally


class Epochs:
    """Closes epochs in order and runs the evals.

    Owns: each rank's compute time over the run (`compute_ms`, for its idle fraction), the
    data-plane metrics per epoch and rank (`data`, fed every WindowDone), and the recipe whose
    callbacks run in this process.
    Given: the run context; the recipe; the membership (who is alive, the callback rank, the
    eval's deadline); the central averager (the EASGD center is what an eval scores in
    cpu_async); and the bundles (`save_bundle` for checkpoint_every, `fail_callback` for a
    callback that raised)."""

    def __init__(self, ctx: RunContext, *, recipe: Optional[Recipe], members: Members,
                 averager: CentralAverager, bundles: Bundles):
        self.ctx, self.recipe, self.members = ctx, recipe, members
        self.averager, self.bundles = averager, bundles
        self.config, self.world_size = ctx.config, ctx.world_size
        self.summary, self.observer = ctx.summary, ctx.observer
        self.compute_ms = [0.0] * self.world_size
        self.data = ctx.data  # per-rank data-plane metrics, per epoch (the pump feeds it)

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def close(self, epoch: int, tally: EpochTally) -> None:
        """Aggregate a finished epoch (callbacks included), publish it, and checkpoint_every.
        A recipe callback that raises fails the run, saving the epoch's consensus first."""
        for rank, ms in enumerate(tally.wall_ms):
            self.compute_ms[rank] += ms
        try:
            record = self._epoch_record(epoch, tally)
            self.summary.epochs.append(record)
            self.observer.on_epoch(record)
            if self.recipe is not None:
                self.recipe.report_epoch(record)  # eval_result_fn, metrics_fn: in this process
        except CallbackFailed as failure:
            self.bundles.fail_callback(failure, epoch + 1, [])
        every = self.config.checkpoint_every
        total = self.config.num_epochs * self.config.data.epoch_splits
        stopping = self.ctx.stop.is_set()  # the stop's own save comes next
        if every and (epoch + 1) % every == 0 and epoch + 1 < total and not stopping:
            self.bundles.save_bundle("checkpoint", epoch + 1, [])

    def final_eval(self, total: int) -> None:
        """The run's final eval: the last epoch's, or (when that epoch scored none) one more
        on the callback rank, with its eval_result_fn."""
        last = self.summary.epochs[-1] if self.summary.epochs else None
        if last is not None and last.eval is None and self.config.recipe is not None:
            try:
                last_eval = self.evaluate(total - 1)
                if last_eval is not None:
                    self.recipe.run_callback("eval_result_fn", total - 1, last_eval)
            except CallbackFailed as failure:
                self.bundles.fail_callback(failure, total, [])
            self.summary.final_eval = last_eval
        elif last is not None:
            self.summary.final_eval = last.eval

    def _epoch_record(self, epoch: int, tally: EpochTally) -> EpochRecord:
        every = self.config.eval_every_epochs
        eval_began = time.perf_counter()
        due = bool(every) and (epoch + 1) % every == 0
        epoch_fn = self.recipe is not None and self.recipe.epoch_fn is not None
        score = self.evaluate(epoch, due, epoch_fn) if due or epoch_fn else None
        eval_ms = (time.perf_counter() - eval_began) * 1000.0
        return EpochRecord(
            epoch=epoch,
            avg_loss=tally.mean_loss() or 0.0,  # work-weighted: per batch that gave a loss, all ranks
            eval=score,
            epoch_ms=(time.perf_counter() - tally.started) * 1000.0,
            eval_ms=eval_ms,
            per_rank_throughput=[s / (w / 1000.0) if w > 0 else 0.0
                                 for s, w in zip(tally.samples, tally.wall_ms)],
            per_rank_batch_share=self._shares(tally),
            scalars=roll_up(tally.scalars, self.config.scalar_reductions),
            samples=sum(tally.samples),
            **self.data.epoch_fields(epoch),
        )

    def _shares(self, tally: EpochTally) -> List[float]:
        """Each rank's share of the epoch's work: of its batches, or under nccl_sync's exact
        path (every rank runs every step, each its share of the step's samples) of its samples."""
        counts = tally.samples if self.config.elche.averages_gradients else tally.batches
        total = max(sum(counts), 1)
        return [c / total for c in counts]

    def callback_rank(self) -> int:
        return self.members.callback_rank()

    def evaluate(self, epoch: int, score: bool = True, epoch_fn: bool = False) -> Optional[float]:
        """The eval on the callback rank (`score`), then the recipe's epoch_fn there (`epoch_fn`).
        A callback rank lost meanwhile (dead, or hung: past the eval's limit, or past a stop's
        grace) hands the eval to another, unless the run is stopping: then no eval (None)."""
        rank = self.callback_rank()
        center = easgd_center(self.averager)
        if center is not None:  # under EASGD, eval scores the center, not a replica
            self.ctx.send(rank, Evaluate(epoch, dtype_names(center), score, epoch_fn),
                       [as_frame(p) for p in center])
        else:
            self.ctx.send(rank, Evaluate(epoch, score=score, epoch_fn=epoch_fn))
        began = self.members.orders.sent("eval", rank)
        deadline = began + self.members.orders.limit_s("eval")
        result = self.ctx.next(expect=Evaluated, deadline=deadline)
        while result is None or result.rank not in self.alive:
            if rank not in self.alive and self.ctx.stop.is_set():
                return None  # a stop let it go: the others save, no eval starts again
            if rank not in self.alive:  # the callback rank died or hung: ask another
                return self.evaluate(epoch, score, epoch_fn)
            self.members.overdue("eval", {rank}, began)  # past its limit: declared hung
            result = self.ctx.next(expect=Evaluated, deadline=deadline)
        self.members.orders.answered(rank)
        self.members.orders.took("eval", time.monotonic() - began)
        return result.score if score and result.score == result.score else None  # NaN: no eval set
