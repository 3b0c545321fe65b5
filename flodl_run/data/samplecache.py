"""Sample tiers of one rank's data plane: fixed-size slot stores and the on-disk pack file.

A tier keeps raw samples (never transformed ones) in preallocated per-field tensors, found
through a slot map over sample ids: the device pool (VRAM), the pinned host-RAM cache and the
disk stage (one memory-mapped pack file). Admission fills free slots and never replaces a
sample; shrinking evicts. Sizes are `membudget`'s decision; moving batches is `dataplane`'s.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset, TensorDataset

log = logging.getLogger(__name__)

Rows = Tuple[torch.Tensor, ...]
_ALIGN = 64  # field regions in the pack file start on cache-line boundaries (and any dtype's)
FILL_CHUNK = 4096
"""Samples per copy when a generic data set is copied whole to the device (going resident)."""


class LayoutMismatch(ValueError):
    """A sample does not have the shape or fields sample 0 had."""


@dataclass(frozen=True)
class Layout:
    """Per-sample fields of a data set: shapes and dtypes, and how a batch is packed
    (`kind`: tensor, tuple, list or dict with `keys`), as torch's default collate packs it."""

    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[torch.dtype, ...]
    kind: str = "tuple"
    keys: Tuple[str, ...] = ()

    @property
    def sample_bytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            count = 1
            for d in shape:
                count *= d
            total += count * torch.empty((), dtype=dtype).element_size()
        return total

    @classmethod
    def of(cls, dataset: Dataset) -> Optional["Layout"]:
        """The layout of a TensorDataset, or of sample 0 when every field is a tensor or a
        number; None for anything else (strings, nested structures): no tiers then."""
        if isinstance(dataset, TensorDataset):
            return cls(tuple(tuple(t.shape[1:]) for t in dataset.tensors),
                       tuple(t.dtype for t in dataset.tensors))
        if len(dataset) == 0:
            return None
        sample = dataset[0]
        kind, keys, fields = _split(sample)
        if fields is None:
            return None
        tensors = [_as_tensor(f) for f in fields]
        if any(t is None for t in tensors):
            return None
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors),
                   kind, keys)

    def fields_of(self, sample: Any, index: int) -> List[torch.Tensor]:
        """The fields of one sample, checked against this layout."""
        _, _, fields = _split(sample)
        tensors = [_as_tensor(f) for f in fields] if fields is not None else []
        if len(tensors) != len(self.shapes) or any(
                t is None or tuple(t.shape) != s for t, s in zip(tensors, self.shapes)):
            raise LayoutMismatch(f"sample {index} does not match sample 0's fields {self.shapes}")
        return tensors

    def pack(self, rows: Sequence[torch.Tensor]) -> Any:
        """Rows as the recipe's train_step expects them (default collate's structure)."""
        if self.kind == "tensor":
            return rows[0]
        if self.kind == "dict":
            return dict(zip(self.keys, rows))
        return list(rows) if self.kind == "list" else tuple(rows)


def _split(sample: Any) -> Tuple[str, Tuple[str, ...], Optional[List[Any]]]:
    if isinstance(sample, torch.Tensor):
        return "tensor", (), [sample]
    if isinstance(sample, (tuple, list)):
        return ("list" if isinstance(sample, list) else "tuple"), (), list(sample)
    if isinstance(sample, dict) and all(isinstance(k, str) for k in sample):
        return "dict", tuple(sample), list(sample.values())
    return "tuple", (), None


def _as_tensor(value: Any) -> Optional[torch.Tensor]:
    """Tensors as they are; Python numbers as default collate turns them (int64, float64)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


class SlotStore:
    """Up to `capacity` samples in per-field tensors on one device.

    `slot_of[sample]` is the sample's slot or -1; slots fill in order and a stored sample stays
    until a shrink evicts it. Not thread-safe: one owner thread per store.
    """

    def __init__(self, layout: Layout, num_samples: int, capacity: int, device: torch.device,
                 pin: bool = False, storage: Optional[List[torch.Tensor]] = None):
        self.layout, self.device, self.pin = layout, device, pin
        self.capacity = capacity
        self.fields = storage if storage is not None else [
            torch.empty((capacity, *shape), dtype=dtype, device=device, pin_memory=pin)
            for shape, dtype in zip(layout.shapes, layout.dtypes)]
        self.slot_of = torch.full((num_samples,), -1, dtype=torch.int64)
        self.sample_at = torch.full((capacity,), -1, dtype=torch.int64)
        self.count = 0

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.fields)

    def lookup(self, samples: torch.Tensor) -> torch.Tensor:
        """Slots of `samples` (CPU int64), -1 where absent."""
        return self.slot_of[samples]

    def read(self, slots: torch.Tensor) -> Rows:
        index = slots.to(self.device) if self.device.type != "cpu" else slots
        return tuple(f.index_select(0, index) for f in self.fields)

    def admit(self, samples: torch.Tensor, rows: Sequence[torch.Tensor]) -> int:
        """Store the absent samples of `samples` (rows in the same order) while slots are free;
        returns how many were stored. A full store admits nothing (see the module docstring)."""
        free = self.capacity - self.count
        if free <= 0 or len(samples) == 0:
            return 0
        absent = self.slot_of[samples] < 0
        positions = absent.nonzero().flatten()
        # A batch may hold one sample twice (augment): store the first occurrence only.
        new, first = _first_occurrences(samples[positions])
        positions = positions[first][:free]
        new = new[:free]
        if len(new) == 0:
            return 0
        slots = torch.arange(self.count, self.count + len(new))
        dev_slots = slots.to(self.device) if self.device.type != "cpu" else slots
        dev_pos = positions.to(rows[0].device) if rows[0].device.type != "cpu" else positions
        for field, row in zip(self.fields, rows):
            field.index_copy_(0, dev_slots, row.index_select(0, dev_pos).to(field.device))
        self.slot_of[new] = slots
        self.sample_at[slots] = new
        self.count += len(new)
        return len(new)

    def shrink(self, capacity: int) -> Tuple[torch.Tensor, Rows]:
        """Keep slots [0, capacity); returns the evicted samples and their rows (copies), so a
        lower tier may take them. The storage is reallocated to release the memory."""
        capacity = max(0, min(capacity, self.capacity))
        evicted = self.sample_at[capacity:self.count].clone()
        rows = tuple(f[capacity:self.count].clone() for f in self.fields)
        self.slot_of[evicted] = -1
        self.fields = [f[:capacity].clone() if not self.pin else
                       torch.empty_like(f[:capacity], pin_memory=True).copy_(f[:capacity])
                       for f in self.fields]
        self.sample_at = self.sample_at[:capacity].clone()
        self.count = min(self.count, capacity)
        self.capacity = capacity
        return evicted, rows


def _first_occurrences(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct values in first-seen order, and the positions of their first occurrence."""
    if len(values) == 0:
        return values, values
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(uniq),), len(values), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(values)), reduce="amin")
    order = first.sort().values
    return values[order], order


class PackFile:
    """One memory-mapped file that backs a disk stage's fields. The file is unlinked as soon as
    it is mapped, so no stage file outlives the process, even after a crash."""

    def __init__(self, directory: str, layout: Layout, capacity: int):
        sizes = [capacity * _field_bytes(s, d) for s, d in zip(layout.shapes, layout.dtypes)]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        fd, path = tempfile.mkstemp(prefix="flodl_run-stage-", suffix=".pack", dir=directory)
        try:
            # Reserve the blocks now: writing into a sparse mapping on a full disk is SIGBUS.
            os.posix_fallocate(fd, 0, max(total, 1))
            self._map = mmap.mmap(fd, max(total, 1))
        finally:
            os.close(fd)
            os.unlink(path)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.fields = [raw[o:o + n].view(d).view(capacity, *s)
                       for o, n, s, d in zip(offsets, sizes, layout.shapes, layout.dtypes)]
        self.nbytes = total


def _field_bytes(shape: Tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def open_disk_stage(directory: Optional[str], layout: Layout, num_samples: int,
                    capacity: int) -> Optional[SlotStore]:
    """A SlotStore over a pack file in `directory` (default: the system temp dir), or None
    with one warning when the file cannot be made (no room, not writable, not a directory)."""
    directory = directory or tempfile.gettempdir()
    try:
        pack = PackFile(directory, layout, capacity)
    except (OSError, ValueError) as exc:
        log.warning("data.disk_stage_gb: disk stage off, cannot create its pack file in %s (%s)",
                    directory, exc)
        return None
    store = SlotStore(layout, num_samples, capacity, torch.device("cpu"), storage=pack.fields)
    store.pack = pack  # keeps the mapping alive as long as the store
    return store


class HostTiers:
    """Rows of samples on the host: the RAM cache, then the disk stage, then the data set.

    Misses are read from the data set and admitted to the RAM cache while it has room, else to
    the disk stage. `hits` counts rows by where they came from (ram, disk, source). Owned by one
    thread (the prefetcher's).
    """

    def __init__(self, dataset: Dataset, layout: Layout, ram: Optional[SlotStore],
                 stage: Optional[SlotStore], pin: bool = False):
        self.dataset, self.layout = dataset, layout
        self.ram, self.stage, self.pin = ram, stage, pin
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) else None
        self.hits: Dict[str, int] = {"ram": 0, "disk": 0, "source": 0}

    def read(self, samples: torch.Tensor) -> Rows:
        """Rows of `samples` (CPU int64), in order, in fresh (pinned when `pin`) host tensors."""
        out = tuple(torch.empty((len(samples), *s), dtype=d, pin_memory=self.pin)
                    for s, d in zip(self.layout.shapes, self.layout.dtypes))
        if self._tensors is not None and self.ram is None and self.stage is None:
            for source, target in zip(self._tensors, out):  # one copy, straight into `out`
                torch.index_select(source, 0, samples, out=target)
            self.hits["source"] += len(samples)
            return out
        todo = torch.arange(len(samples))
        for name, store in (("ram", self.ram), ("disk", self.stage)):
            if store is None or store.count == 0 or len(todo) == 0:
                continue
            slots = store.lookup(samples[todo])
            hit = slots >= 0
            if hit.any():
                _scatter(out, todo[hit], store.read(slots[hit]))
                self.hits[name] += int(hit.sum())
                todo = todo[~hit]
        if len(todo):
            missing = samples[todo]
            rows = self._from_source(missing)
            _scatter(out, todo, rows)
            self.hits["source"] += len(todo)
            self._admit(missing, rows)
        return out

    def _from_source(self, samples: torch.Tensor) -> Rows:
        if self._tensors is not None:
            return tuple(t.index_select(0, samples) for t in self._tensors)
        fields = [self.layout.fields_of(self.dataset[i], i) for i in samples.tolist()]
        return tuple(torch.stack([f[k] for f in fields]) for k in range(len(self.layout.shapes)))

    def _admit(self, samples: torch.Tensor, rows: Rows) -> None:
        if self.ram is not None:
            self.ram.admit(samples, rows)
            left = (self.ram.lookup(samples) < 0).nonzero().flatten()
            samples, rows = samples[left], tuple(r.index_select(0, left) for r in rows)
        if self.stage is not None and len(samples):
            self.stage.admit(samples, rows)

    def shrink_ram(self, capacity: int) -> int:
        """Evict RAM-cache samples past `capacity`, demoting them to the disk stage while it has
        room; returns how many left the RAM cache."""
        if self.ram is None or capacity >= self.ram.capacity:
            return 0
        evicted, rows = self.ram.shrink(capacity)
        if self.stage is not None and len(evicted):
            self.stage.admit(evicted, rows)
        return len(evicted)

    @property
    def ram_bytes(self) -> int:
        return self.ram.nbytes if self.ram is not None else 0


def _scatter(out: Rows, positions: torch.Tensor, rows: Rows) -> None:
    for target, row in zip(out, rows):
        target.index_copy_(0, positions, row)


def fill_device(dataset: Dataset, layout: Layout, device: torch.device,
                         stream: Optional[torch.cuda.Stream] = None) -> Rows:
    """Every sample of `dataset` in per-field tensors on `device` (on `stream`, synchronized)."""
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with context:
        if isinstance(dataset, TensorDataset):
            rows = tuple(t.to(device) for t in dataset.tensors)
        else:
            rows = tuple(torch.empty((len(dataset), *s), dtype=d, device=device)
                         for s, d in zip(layout.shapes, layout.dtypes))
            for start in range(0, len(dataset), FILL_CHUNK):
                chunk = range(start, min(len(dataset), start + FILL_CHUNK))
                samples = [layout.fields_of(dataset[i], i) for i in chunk]
                for k, field in enumerate(rows):
                    field[start:start + len(chunk)].copy_(torch.stack([s[k] for s in samples]))
    if stream is not None:
        stream.synchronize()
    return rows


def run_into(future: Future, fn: Callable[[], Any]) -> None:
    """Run `fn` and put its result (or exception) into `future` (threads without an executor)."""
    future.set_running_or_notify_cancel()
    try:
        future.set_result(fn())
    except BaseException as exc:  # the consumer re-raises it (or falls back on OOM)
        future.set_exception(exc)
