"""What a rank's mode part offers the runner, and the collaborators every part is built from.

A rank runs one part per mode family (exact steps, collective windows, coordinator-averaged
windows, async windows), picked once by rank.modes. The runner asks its part what differs
between modes (may the next batch train, what a reduce does, what a window reports) and never
looks at the mode itself. The defaults here are a window of whole batches with no group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch
import zmq

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import ElCheConfig
from flodl_run.contracts.wire import (
    Channel,
    Message,
    Regroup,
    Regrouped,
    SyncNow,
    Train,
    Update,
    WindowFailed,
)
from flodl_run.hardware.slowdown import Slowdown
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.env import RankEnv
from flodl_run.rank.group import RankGroup
from flodl_run.rank.jobs import Job, fill_ms
from flodl_run.rank.replica import Replica


@dataclass(frozen=True)
class RankParts:
    """The rank's collaborators a mode's part may use; the runner builds them once."""

    env: RankEnv
    ctx: zmq.Context
    """The rank's zmq context (the listener thread opens its own socket on it)."""
    channel: Channel
    """The main channel: orders in, facts out (main thread only)."""
    replica: Replica
    flat: FlatParams
    outer: OuterOptimizer
    group: RankGroup
    """The rank's process group; only the collective modes' parts join it."""
    recorder: Recorder
    slowdown: Slowdown
    elche: ElCheConfig
    find_unused_parameters: bool
    """recipe.find_unused_parameters (DDP's flag, for the exact step)."""
    optimize_ddp: bool
    """recipe.optimize_ddp (a compiled graph split at DDP's buckets, for the exact step)."""
    shm_prefix: Optional[str]
    """The launcher's shared-memory prefix when it runs on this host (snapshots through slabs)."""


@dataclass(frozen=True)
class WindowCounts:
    """What a finished window reports of its steps (WindowDone's counts and times)."""

    steps: int
    compute_ms: float
    fill_ms: float
    skipped: int


class RankMode:
    """One mode family's part of a rank. The runner calls, in a run's order: `join` (before the
    heartbeat starts), `start` (returns the reduce's timed cost for RankJoined, or None),
    `joined`; per order, `train_ordered` / `reduce` / `apply_update` / `regroup`; per batch,
    `may_train`, `before_batch`, `batch_failed`, `after_batch`; per window, `window_counts` and
    `window_ended`; at the end `stop` (the run is over) and `close` (the process is)."""

    holds_outer_state = False
    """The rank steps the outer optimizer itself, so its share of a bundle holds the outer state
    and a resume loads it (the collective modes; otherwise the coordinator does)."""
    emulates_slowdown = True
    """The runner sleeps an emulated slower rank after each batch (an exact step does so itself,
    before its gradient goes out)."""
    cuts_windows = True
    """A CutWindow ends the window in hand after its batch (an exact window's steps are
    collective: the coordinator sends no cut on that path)."""
    times_fill = True
    """A window's first batch is timed on its own (the host waits for the device after it):
    its fill cost, the one-time work after a reduce. An exact window has none (its first step
    is a step like the others), so the host queues on past it."""

    def __init__(self, parts: RankParts):
        self.parts = parts
        self.rank = parts.env.rank

    # ---- lifecycle -----------------------------------------------------------------------

    def join(self) -> None:
        """Before the heartbeat starts: the first generation's group, where the mode has one."""

    def start(self) -> Optional[float]:
        """After the heartbeat started: the side channels the mode needs; returns what one
        reduce costs on this backend (RankJoined's reduce_ms), None where the rank times none."""
        return None

    def joined(self) -> None:
        """RankJoined went out: what the mode sends before the first order."""

    def stop(self) -> None:
        """The run is over for this rank (the Stop, or a failure): release what the mode holds."""

    def close(self) -> None:
        """The process ends: wait for the mode's threads."""

    def worker_step(self) -> Optional[Callable[[Any], torch.Tensor]]:
        """What `worker.step` runs instead of the replica's own step (None: the replica's)."""
        return None

    # ---- orders --------------------------------------------------------------------------

    def train_ordered(self, order: Train) -> None:
        """A Train order arrived (its job is queued by the runner)."""

    def reduce(self, order: SyncNow, steps: int) -> Tuple[Optional[Message], int]:
        """This rank's part of a reduce, `steps` batches since the last one. Returns the fact
        to send (None: the mode sent what it had to) and the batch count now in effect."""
        raise NotImplementedError

    def apply_update(self, update: Update, payloads: List[memoryview]) -> Optional[Train]:
        """The coordinator's parameters in; returns the Train order folded into the update."""
        raise RuntimeError(f"rank {self.rank}: an Update arrived, but this mode's reduce is collective")

    def regroup(self, order: Regroup, jobs: Deque[Job]) -> Tuple[Deque[Job], Regrouped]:
        """Rebuild the group of `order`'s generation; returns the jobs still valid and the fact."""
        raise RuntimeError(f"rank {self.rank}: a Regroup arrived, but this mode has no process group")

    # ---- batches and windows -------------------------------------------------------------

    def may_train(self, job: Job) -> bool:
        """The next batch of `job` (the first queued) may train now."""
        return True

    @property
    def awaiting_update(self) -> bool:
        """Blocked until the coordinator's Update lands (an idle wait, not a throttle)."""
        return False

    def before_batch(self, job: Job) -> None:
        """The batch `job.done` of `job` is about to be handed to the loop."""

    def batch_failed(self, job: Job) -> Optional[WindowFailed]:
        """The batch just trained broke the window (the fact to send), or None."""
        return None

    def after_batch(self) -> None:
        """A batch was trained and counted."""

    def window_counts(self, job: Job) -> WindowCounts:
        """The finished window's steps, compute, fill and skipped steps."""
        return WindowCounts(job.done, sum(job.step_ms), fill_ms(job.step_ms), 0)

    def window_ended(self) -> None:
        """WindowDone went out (before any SyncNow folded into the order is served)."""

