"""cpu_async's windows (EASGD): the rank keeps training while its snapshot makes the round trip
to the coordinator's center, up to the order's overshoot of batches past a window's end.

Owns the overshoot count between a window's end and its SyncNow; the snapshot and the update
are the coordinator-averaged windows' (rank.central_windows), the center the coordinator's.
"""

from __future__ import annotations

from flodl_run.rank.central_windows import CentralWindows
from flodl_run.rank.jobs import Job
from flodl_run.rank.part import RankParts


class AsyncWindows(CentralWindows):
    """Windows against an EASGD center: no wait for the update."""

    def __init__(self, parts: RankParts):
        super().__init__(parts)
        self._sync_pending = False  # the window is done, its SyncNow not yet received
        self._overshoot_used = 0  # batches trained since

    def joined(self) -> None:
        """The EASGD center starts at the initial weights: rank 0's, sent before any order."""
        if self.rank == 0:
            self.send_snapshot(0, 0)

    def send_snapshot(self, round_: int, steps: int) -> None:
        """The snapshot out; training goes on while the round trip is in flight."""
        self.exchange.send(round_, steps)
        self._sync_pending = False

    def may_train(self, job: Job) -> bool:
        """Within the order's overshoot past a window whose SyncNow has not come."""
        return super().may_train(job) and not (self._sync_pending and
                                               self._overshoot_used >= job.order.overshoot)

    def after_batch(self) -> None:
        if self._sync_pending:
            self._overshoot_used += 1

    def window_ended(self) -> None:
        if not self._sync_pending:
            self._sync_pending, self._overshoot_used = True, 0
