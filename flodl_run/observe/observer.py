"""What a run tells the outside while it trains: the observer interface and its fan-out.

Trainers (solo, coordinator) call these hooks; the progress bar, the MLflow tracker and tests
implement them. Observers never change the run.
"""

from __future__ import annotations

from typing import List, Sequence

from flodl_run.contracts.summary import EpochRecord, ReduceRecord, ReportRecord
from flodl_run.hardware.hostinfo import HostInfo


class Observer:
    """No-op base: override the hooks you need."""

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        """Once, before the first batch."""

    def on_batch(self, epoch: int, batches_done: int, loss: float) -> None:
        """After a batch (solo) or a rank's window (distributed); `batches_done` in this epoch."""

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


class Observers(Observer):
    """Fans every hook out to several observers, in order."""

    def __init__(self, *observers: Observer):
        self.observers: Sequence[Observer] = observers

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        for o in self.observers:
            o.on_start(total_epochs, batches_per_epoch, world_size)

    def on_batch(self, epoch: int, batches_done: int, loss: float) -> None:
        for o in self.observers:
            o.on_batch(epoch, batches_done, loss)

    def on_window(self, rank: int, samples: int, wall_ms: float, device_bytes: int) -> None:
        for o in self.observers:
            o.on_window(rank, samples, wall_ms, device_bytes)

    def on_reduce(self, record: ReduceRecord) -> None:
        for o in self.observers:
            o.on_reduce(record)

    def on_report(self, record: ReportRecord) -> None:
        for o in self.observers:
            o.on_report(record)

    def on_epoch(self, record: EpochRecord) -> None:
        for o in self.observers:
            o.on_epoch(record)

    def on_event(self, kind: str, message: str) -> None:
        for o in self.observers:
            o.on_event(kind, message)

    def on_nodes(self, nodes: List[HostInfo]) -> None:
        for o in self.observers:
            o.on_nodes(nodes)
