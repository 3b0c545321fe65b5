"""The coordinator-averaged modes' windows (cpu_sync, cpu_cadence): whole batches trained on the
rank's own, then a snapshot to the coordinator at SyncNow and no training until its Update
brings the average back.

Owns the snapshot exchange (rank.snapshot: shared-memory slab or frames) and the wait for the
update; the averaging and the outer step are the coordinator's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from flodl_run.contracts.wire import Message, SyncNow, Train, Update
from flodl_run.rank.jobs import Job
from flodl_run.rank.part import RankMode, RankParts
from flodl_run.rank.reduce import after_outer_step
from flodl_run.rank.snapshot import SnapshotExchange


class CentralWindows(RankMode):
    """Windows reduced by the coordinator: snapshot out, update in."""

    def __init__(self, parts: RankParts):
        super().__init__(parts)
        self.replica, self.outer = parts.replica, parts.outer
        self.exchange = SnapshotExchange(self.rank, parts.flat, parts.channel, parts.shm_prefix)
        self._awaiting_update = False

    def stop(self) -> None:
        self.exchange.close()

    @property
    def awaiting_update(self) -> bool:
        return self._awaiting_update

    def may_train(self, job: Job) -> bool:
        """No update awaited (cpu_sync, cpu_cadence block until it lands)."""
        return not self._awaiting_update

    def reduce(self, order: SyncNow, steps: int) -> Tuple[Optional[Message], int]:
        """The snapshot out (it is the fact: the exchange sent it); the count starts over."""
        recorder = self.parts.recorder
        began_ns = recorder.now()
        self.send_snapshot(order.round, steps)
        recorder.span("reduce.snapshot", began_ns, order.round)
        return None, 0

    def send_snapshot(self, round_: int, steps: int) -> None:
        """The snapshot out, then block until the update lands."""
        self.exchange.send(round_, steps)
        self._awaiting_update = True

    def apply_update(self, update: Update, payloads: List[memoryview]) -> Optional[Train]:
        """The coordinator's parameters in, then what they mean for the optimizer and schedule;
        returns the Train order folded into the update (None: none was)."""
        self.exchange.apply_(update, payloads)
        if update.outer_stepped:
            after_outer_step(self.replica, self.outer.config)
        if update.reset:  # we were non-finite: so are the optimizer's moments
            self.replica.optimizer.state.clear()
        self.replica.seek_schedule(update.global_step)
        self._awaiting_update = False
        return update.train
