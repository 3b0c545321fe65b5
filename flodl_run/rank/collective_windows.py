"""The collective modes' windows (nccl_cadence, and nccl_sync averaging parameters): whole
batches trained on the rank's own, then a weighted average with the cohort through
torch.distributed when the coordinator says SyncNow.

Owns the process group's lifetime over the run (first join, regroups, leave), the listener
thread that aborts a group stuck on a dead peer, and the round up to which orders sent ahead
may train. The reduce itself is rank.reduce's; when to reduce is the coordinator's.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Tuple

from flodl_run.averaging.moments import FlatMoments
from flodl_run.contracts.wire import Message, Reduced, Regroup, Regrouped, SyncNow, Train
from flodl_run.rank.channels import ListenerThread
from flodl_run.rank.group import timed_reduce_ms
from flodl_run.rank.jobs import Job
from flodl_run.rank.part import RankMode, RankParts
from flodl_run.rank.reduce import CollectiveReduce, ReduceOptions


class CollectiveWindows(RankMode):
    """Windows reduced among the ranks. `tracks_start`: keep each window's starting parameters
    for the divergence's cosine and magnitude (nccl_cadence; nccl_sync reduces after every
    step, where the extra passes over the parameters would cost a good part of a short step)."""

    holds_outer_state = True
    tracks_start = False

    def __init__(self, parts: RankParts):
        super().__init__(parts)
        self.group = parts.group
        self.reducer = CollectiveReduce(self.rank, parts.replica, parts.flat, parts.outer, parts.group,
                                        parts.recorder, self._options())
        self.reduced_round = 0  # the last round whose reduce completed here (orders sent ahead)
        self._listener: Optional[ListenerThread] = None

    def _options(self) -> ReduceOptions:
        elche, replica = self.parts.elche, self.parts.replica
        moments = FlatMoments(replica.model, replica.optimizer) if elche.reduce_optimizer_state else None
        return ReduceOptions(elche.gamma, track_start=self.tracks_start, moments=moments)

    # ---- lifecycle -----------------------------------------------------------------------

    def join(self) -> None:
        self.group.join(0, list(range(self.parts.env.world_size)))

    def start(self) -> Optional[float]:
        """The listener (AbortGroup lands while the main thread is inside a collective), then
        one timed all-reduce; a cohort of one (a run started on one rank) has no group to time."""
        listener = ListenerThread(self.parts.ctx, self.parts.env, self.group.abort, self.group.watch)
        listener.start()
        self._listener = listener
        return None if self.group.alone else timed_reduce_ms(self.parts.flat.buffers)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stopped.set()
        self.group.leave()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stopped.set()
            self._listener.join(timeout=2.0)

    # ---- orders --------------------------------------------------------------------------

    def train_ordered(self, order: Train) -> None:
        if not order.after_round:  # training moved on: that reduce will not be retried
            self.reducer.forget()  # (sent ahead: a failed round may still be, and undone)

    def may_train(self, job: Job) -> bool:
        """Not an order sent ahead of a reduce that has not completed here (nccl_sync)."""
        return job.order.after_round <= self.reduced_round

    def reduce(self, order: SyncNow, steps: int) -> Tuple[Optional[Message], int]:
        fact, steps = self.reducer.run(order, steps)
        if isinstance(fact, Reduced):
            self.reduced_round = order.round
        return fact, steps

    def regroup(self, order: Regroup, jobs: Deque[Job]) -> Tuple[Deque[Job], Regrouped]:
        """Orders sent ahead of a reduce that failed here are void (the coordinator redoes
        them); the survivors' group of the new generation is built."""
        kept = deque(job for job in jobs if job.order.after_round <= self.reduced_round)
        self._rebuild(order.generation, order.members, order.source)
        return kept, Regrouped(self.rank, order.generation)

    def _rebuild(self, generation: int, members: List[int], source: int) -> None:
        self.group.join(generation, members)


class CadenceWindows(CollectiveWindows):
    """nccl_cadence: collective windows that track where each began."""

    tracks_start = True
