"""Streaming delivery: a background thread builds the next batches on the host and copies them
to the device ahead of the step.

Owns the worker thread, the futures of scheduled batches, the side CUDA stream and the hand-over
(the consumer's stream waits on the copy's event). What a batch holds and where its rows come
from is the caller's (`dataplane`): it hands in a function that builds the host batch.
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from flodl_run.data.passes import to_device


@dataclass
class _Scheduled:
    indices: torch.Tensor
    """Held so its id() cannot be reused by another batch while it is scheduled."""
    future: Future
    meta: Any


def _work(tasks: "queue.SimpleQueue[Optional[Tuple[Future, Callable[[], Any]]]]") -> None:
    """The worker loop; a None task ends it. Holds no reference to its Prefetcher, so a
    forgotten Prefetcher is collected and its finalizer stops the thread."""
    while True:
        task = tasks.get()
        if task is None:
            return
        future, fn = task
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the consumer, raised in its thread
            future.set_exception(exc)


def _stop(tasks: queue.SimpleQueue, thread: threading.Thread) -> None:
    tasks.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=10.0)


class Prefetcher:
    """Runs `build()` functions in order on one background thread and moves their results to
    `device` on a side stream. One consumer thread schedules and takes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._scheduled: Dict[int, _Scheduled] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        thread = threading.Thread(target=_work, args=(self._tasks,), daemon=True,
                                  name="flodl_run-prefetch")
        thread.start()
        # Stop and join the worker when this object goes, or at exit: a daemon thread still
        # inside torch when the interpreter finalizes aborts the process.
        self._finalizer = weakref.finalize(self, _stop, self._tasks, thread)

    def run(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn` on the worker (after what is already queued)."""
        future: Future = Future()
        self._tasks.put((future, fn))
        return future

    def schedule(self, indices: torch.Tensor, build: Callable[[], Any], meta: Any = None) -> None:
        """Build and copy the batch keyed by the tensor `indices` (once; later calls no-op)."""
        if id(indices) in self._scheduled:
            return
        stream, device = self._stream, self.device
        future = self.run(lambda: _build_and_copy(build, device, stream))
        self._scheduled[id(indices)] = _Scheduled(indices, future, meta)

    def is_scheduled(self, indices: torch.Tensor) -> bool:
        entry = self._scheduled.get(id(indices))
        return entry is not None and entry.indices is indices

    def take(self, indices: torch.Tensor) -> Tuple[Any, Any, Dict[str, int]]:
        """Wait for the batch of `indices`: (device batch, its meta, the builder's extra)."""
        entry = self._scheduled.pop(id(indices))
        batch, extra, event = entry.future.result()
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            event.synchronize()  # host clock honest about the wait (ranks sync each step anyway)
            for tensor in tensors_of(batch):
                tensor.record_stream(current)  # allocated on the side stream, used on this one
        return batch, entry.meta, extra

    def retain(self, keep: Iterable[torch.Tensor]) -> int:
        """Drop scheduled batches not in `keep` (a plan changed); returns how many."""
        ids = {id(t) for t in keep}
        stale = [k for k in self._scheduled if k not in ids]
        for key in stale:
            self._scheduled.pop(key).future.cancel()
        return len(stale)

    def __len__(self) -> int:
        return len(self._scheduled)

    def close(self) -> None:
        for entry in self._scheduled.values():
            entry.future.cancel()
        self._scheduled.clear()
        self._finalizer()


def _build_and_copy(build: Callable[[], Any], device: torch.device,
                    stream: Optional[torch.cuda.Stream]) -> Tuple[Any, Any, Optional[Any]]:
    """On the worker: host batch (pinned when the builder pins it), then the copy on `stream`."""
    host, extra = build()
    if stream is None:
        return to_device(host, device), extra, None
    with torch.cuda.stream(stream):
        batch = to_device(host, device)
        event = torch.cuda.Event()
        event.record(stream)
    return batch, extra, event


def tensors_of(batch: Any) -> Iterable[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from tensors_of(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from tensors_of(item)


class IndexUpload:
    """Moves a batch's row indices to a CUDA device without stalling the host.

    A copy from pageable host memory makes CUDA wait for the stream first, which would hold the
    host at every batch until the GPU caught up. The indices are staged in a small ring of
    pinned buffers instead; a slot is reused only after its copy finished (its event), so the
    host may run up to SLOTS batches ahead of the device. Other devices get the indices as
    they are.
    """

    SLOTS = 8

    def __init__(self, device: torch.device):
        self.device = device
        self._slots: list = [None] * self.SLOTS
        self._next = 0

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return indices
        n, i = len(indices), self._next
        self._next = (i + 1) % self.SLOTS
        slot = self._slots[i]
        if slot is not None:
            slot[1].synchronize()
        if slot is None or slot[0].numel() < n:
            slot = (torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True),
                    torch.cuda.Event())
            self._slots[i] = slot
        staged = slot[0][:n]
        staged.copy_(indices)
        moved = staged.to(self.device, non_blocking=True)
        slot[1].record(torch.cuda.current_stream(self.device))
        return moved
