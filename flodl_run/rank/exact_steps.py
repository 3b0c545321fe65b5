"""nccl_sync's exact path as a rank's mode: each window is a run of global steps, this rank's
share of each cut into micro-batches, the gradient averaged inside backward (rank.exact's
ExactSync), so there is nothing to average after a window.

Owns what differs from a collective window: the step the loop runs, the window's counts from
the step's own timing, a window broken inside a step (WindowFailed), and after a regroup the
DDP wrapper rebuilt over the new group and the state adopted from the member that got furthest.
A recipe with its own loop steps its optimizers itself, so it averages parameters instead
(rank.collective_windows).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from flodl_run.contracts.wire import Regroup, Regrouped, WindowFailed
from flodl_run.rank.collective_windows import CollectiveWindows
from flodl_run.rank.exact import ExactSync
from flodl_run.rank.jobs import Job
from flodl_run.rank.part import RankParts, WindowCounts
from flodl_run.rank.reduce import ReduceOptions


class ExactSteps(CollectiveWindows):
    """Windows of exact steps; every job is a window of micro-batches (Job.micro)."""

    emulates_slowdown = False  # the step sleeps itself, before its gradient goes out
    cuts_windows = False  # its steps are collective: a window is never cut short
    times_fill = False  # no fill: the first step is a step (window_counts)

    def __init__(self, parts: RankParts):
        super().__init__(parts)
        self.sync = ExactSync(parts.replica, parts.flat, parts.group, parts.slowdown,
                               parts.find_unused_parameters, parts.optimize_ddp)

    def _options(self) -> ReduceOptions:
        """One optimizer steps on the same gradient everywhere: no moments to average."""
        return ReduceOptions(self.parts.elche.gamma)

    def join(self) -> None:
        super().join()
        self.sync.rebuild()

    def worker_step(self) -> Optional[Callable[[Any], torch.Tensor]]:
        return self.sync.step

    # ---- batches and windows -------------------------------------------------------------

    def before_batch(self, job: Job) -> None:
        if job.done == 0:
            self.sync.reset_window()
        self.sync.begin(job.micro[job.done])

    def batch_failed(self, job: Job) -> Optional[WindowFailed]:
        """The window broke inside a step: say after how many steps (the runner drops the rest
        of it and waits for the Regroup; its steps are re-planned among the survivors)."""
        if not self.sync.failed:
            return None
        return WindowFailed(self.rank, job.order.window, self.sync.steps, self.sync.failed)

    def window_counts(self, job: Job) -> WindowCounts:
        """The optimizer steps taken, and the step's own compute (waits at the all-reduce left
        out) where it timed one, else the steps' wall; no fill (its first step is a step)."""
        timed = self.sync.window_compute_ms()
        return WindowCounts(self.sync.steps, timed if timed is not None else sum(job.step_ms), 0.0,
                            self.sync.window_skipped())

    # ---- regroup -------------------------------------------------------------------------

    def regroup(self, order: Regroup, jobs: Deque[Job]) -> Tuple[Deque[Job], Regrouped]:
        """What is left of an exact window is void too (the coordinator re-plans its steps)."""
        kept, regrouped = super().regroup(order, jobs)
        return deque(job for job in kept if not job.micro), regrouped

    def _rebuild(self, generation: int, members: List[int], source: int) -> None:
        self.sync.ddp = None  # its reducer holds the old group
        super()._rebuild(generation, members, source)
        if source >= 0:
            self.sync.adopt_from(members.index(source))
        self.sync.rebuild()
