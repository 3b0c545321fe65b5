"""What a run tells the outside while it trains: the observer interface and its fan-out.

Trainers (solo, coordinator) call these hooks; the progress bar, the MLflow tracker and tests
implement them. Observers never change the run: an output that cannot be written (a full disk,
no file descriptors left) is said once (`OutputErrors`) and the run goes on without it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

from flodl_run.contracts.summary import CHECKPOINT_FAILED, EpochRecord, ReduceRecord, ReportRecord
from flodl_run.contracts.wire import NodeSample
from flodl_run.hardware.hostinfo import HostInfo

log = logging.getLogger(__name__)


class Observer:
    """No-op base: override the hooks you need."""

    output = ""
    """What it writes, as a user names it (`events.jsonl`); empty: the class name says it."""

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        """Once, before the first batch."""

    def on_resume(self, epoch: int, batches_done: int) -> None:
        """Once, right after on_start, when the run resumes a bundle: training starts in
        `epoch`, of which `batches_done` batches were trained before (the bundle holds them)."""

    def on_batch(self, epoch: int, batches_done: int, loss: Optional[float]) -> None:
        """After a batch (solo) or a rank's window (distributed); `batches_done` in this epoch
        (a resumed epoch's count includes the batches trained before the resume); `loss` None
        while no batch of the epoch gave one (a rank given no sample of a step)."""

    def on_window(self, rank: int, samples: int, wall_ms: float, device_bytes: int) -> None:
        """A rank finished a window: `samples` trained in `wall_ms` of compute; `device_bytes`
        its GPU allocator holds (0 on CPU). Distributed runs only."""

    def on_reduce(self, record: ReduceRecord) -> None:
        """After each reduce, with ElChe's plan for the next window."""

    def on_report(self, record: ReportRecord) -> None:
        """A sub-epoch report (reports_per_epoch), at a reduce boundary."""

    def on_epoch(self, record: EpochRecord) -> None:
        """When an epoch is aggregated (in ascending order)."""

    def on_event(self, kind: str, message: str) -> None:
        """Something worth a line in the log: rank lost, nudge, shutdown, ..."""

    def on_nodes(self, nodes: List[HostInfo]) -> None:
        """Once, when every rank has joined: the static facts of each node they run on."""

    def on_busy(self, rank: int, busy_percent: float) -> None:
        """A rank's heartbeat said how busy its device was since the last one, in percent (its
        GPU's utilisation, or its CPU time per thread). Distributed runs, system_metrics on."""

    def on_node_sample(self, rank: int, sample: NodeSample) -> None:
        """The lowest rank of a node the launcher does not run on read the node's system
        metrics (MLflow's collectors, every tracking.system_metrics_interval_s)."""


class Observers(Observer):
    """Fans every hook out to several observers, in order; one that cannot write is said once
    (`errors`) and neither stops the run nor the others."""

    def __init__(self, *observers: Observer):
        self.observers: Sequence[Observer] = observers
        self.errors = OutputErrors()

    def _fan(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            self.errors.attempt(o.output or type(o).__name__, getattr(o, hook), *args)

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        self._fan("on_start", total_epochs, batches_per_epoch, world_size)

    def on_resume(self, epoch: int, batches_done: int) -> None:
        self._fan("on_resume", epoch, batches_done)

    def on_batch(self, epoch: int, batches_done: int, loss: Optional[float]) -> None:
        self._fan("on_batch", epoch, batches_done, loss)

    def on_window(self, rank: int, samples: int, wall_ms: float, device_bytes: int) -> None:
        self._fan("on_window", rank, samples, wall_ms, device_bytes)

    def on_reduce(self, record: ReduceRecord) -> None:
        self._fan("on_reduce", record)

    def on_report(self, record: ReportRecord) -> None:
        self._fan("on_report", record)

    def on_epoch(self, record: EpochRecord) -> None:
        self._fan("on_epoch", record)

    def on_event(self, kind: str, message: str) -> None:
        if kind == CHECKPOINT_FAILED:  # an output too: the run's last lines say it
            self.errors.note("a checkpoint", message)
        self._fan("on_event", kind, message)

    def on_nodes(self, nodes: List[HostInfo]) -> None:
        self._fan("on_nodes", nodes)

    def on_busy(self, rank: int, busy_percent: float) -> None:
        self._fan("on_busy", rank, busy_percent)

    def on_node_sample(self, rank: int, sample: NodeSample) -> None:
        self._fan("on_node_sample", rank, sample)


class OutputErrors:
    """What a run could not write (a full disk, no file descriptors left), each said once as a
    warning and kept for the run's last lines. An output error is never a reason for the run
    to fail: it used to end runs `failed` (`coordinator error: OSError: ... events.jsonl`) and
    kill the launcher before its summary."""

    def __init__(self) -> None:
        self.failed: Dict[str, str] = {}

    def note(self, what: str, why: str) -> None:
        """An output its owner found unwritten (and said itself); the latest `why` stands."""
        self.failed[what] = why

    def attempt(self, what: str, write: Callable[..., object], *args: Any) -> bool:
        """`write(*args)`; False, said once for `what`, when it raised OSError."""
        try:
            write(*args)
            return True
        except OSError as exc:
            if what not in self.failed:
                self.failed[what] = str(exc)
                log.warning("could not write %s (%s); the run goes on without it", what, exc)
            return False
