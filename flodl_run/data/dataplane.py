"""One rank's data plane: delivers the batches of its plan to its device within memory budgets.

Owns the delivery mode (resident or streaming, chosen by each rank after its first step), the
device pool, the host tiers, feeding the prefetcher, the transform call and the data metrics.
It does not decide which samples a rank trains (dispatch and the coordinator do) nor the budget
arithmetic (`membudget`). On a CPU rank "device memory" is host RAM (docs/decisions.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data.dataloader import default_collate

from flodl_run.config.schema import ExperimentConfig
from flodl_run.config.validate import epoch_splits_problem
from flodl_run.contracts.recipe import RecipeError
from flodl_run.data.datametrics import DataStats
from flodl_run.data.picks import JobPlan, PickSpace, Transform, Work, apply_transform, epoch_of
from flodl_run.data.prefetch import IndexUpload, Prefetcher, tensors_of
from flodl_run.data.samplecache import (
    HostTiers,
    Layout,
    LayoutMismatch,
    Rows,
    SlotStore,
    fill_device,
    open_disk_stage,
    run_into,
)
from flodl_run.hardware import membudget as mb
from flodl_run.hardware.memprobe import DeviceProbe, disk_free_bytes, sim_device_bytes

log = logging.getLogger(__name__)

POOL_ENV = "FLODL_RUN_VRAM_POOL"
"""Kill switch of the device pool: `off` disables it whatever data.vram_pool says."""


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


class DataPlane:
    """Delivers batches of one data set to one device.

    `gather(indices, jobs)` (ranks) and `batches(indices, batch_size, epoch)` (solo) return
    batches on the device, transformed when a transform is set. The first batches stream
    (bootstrap prefetch depth 4); after the first step the plane measures the device and goes
    resident or keeps streaming, re-probing at every epoch. Called from one thread.
    """

    def __init__(self, dataset: Dataset, device: torch.device, config: ExperimentConfig,
                 transform: Optional[Transform] = None, rank: int = 0,
                 environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        problem = epoch_splits_problem(len(dataset), config)
        if problem is not None:  # the rank's first look at the set: the launcher never loads it
            raise RecipeError(problem.key, problem.value, problem.rule)
        self.dataset, self.device, self.data = dataset, device, config.data
        self.rank, self.batch_size, self.transform = rank, config.batch_size, transform
        self.num_samples = len(dataset)
        self.picks = PickSpace(self.num_samples, self.data.augment, self.data.epoch_splits,
                               config.seed)
        self.layout = Layout.of(dataset)
        self.probe = DeviceProbe(device, sim_device_bytes(env, rank), self.data.gpu_ram_share)
        # the tier rows held on the device count as: VRAM on a GPU (or a simulated device); on a
        # CPU rank the device memory is host RAM, so they count as `ram`
        self.device_tier = "ram" if device.type == "cpu" and not self.probe.is_simulated else "vram"
        self.pool_on = self.data.vram_pool and env.get(POOL_ENV, "on").lower() != "off"
        self.local_world_size = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        self.stats = DataStats()
        self.depth = self.data.prefetch or mb.BOOTSTRAP_DEPTH
        self.batch_bytes = self.batch_size * self.layout.sample_bytes if self.layout else 0
        self._resident: Optional[Rows] = None
        self._per_gather = 1  # batches of an epoch's order gathered at once, once resident
        self._gather_room = mb.GATHER_AHEAD_BYTES  # device bytes beside the set: _decide measures
        self._filling: Optional[Future] = None
        self._pool: Optional[SlotStore] = None
        self._prefetcher: Optional[Prefetcher] = None
        self._host: Optional[Future] = None
        self._delivered = 0
        self._epoch: Optional[int] = None
        self._plan = JobPlan(self.batch_size, mb.MAX_DEPTH)
        self._warned: set = set()
        self._upload = IndexUpload(device)
        self._planned = _PlannedGather(self._upload)
        if device.type == "cpu" and not self.probe.is_simulated and \
                isinstance(dataset, TensorDataset):
            self._go_resident(dataset.tensors)  # already in this device's memory: no copy

    def __len__(self) -> int:
        return self.num_samples

    @property
    def delivery(self) -> mb.Delivery:
        return mb.Delivery.resident if self._resident is not None else mb.Delivery.streaming

    # ---- what to deliver next ---------------------------------------------------------------

    def gather(self, indices: torch.Tensor, jobs: Optional[Sequence[Any]] = None) -> Any:
        """The batch of `indices` on the device. `jobs` is the rank's queue of Train orders in
        progress (each with `.order.slices`, `.batches`, `.done`, and `indices` is
        `jobs[0].batches[jobs[0].done]`): it tells the prefetcher what comes next and the
        transform which picks these rows are."""
        works = self._plan.works(indices, jobs)
        return self._deliver(works[0], works[1:])

    def batches(self, indices: torch.Tensor, batch_size: int,
                epoch: Optional[int] = None) -> Iterator[Any]:
        """Consecutive batches over `indices`; with `epoch`, `indices` are that epoch's picks in
        order (solo), which keys the transform."""
        if epoch is None:
            works = [Work(rows) for rows in indices.split(batch_size)]
        else:
            works = list(self.picks.epoch_works(epoch, indices, batch_size))
        order = _OrderOnDevice(indices, self._upload)
        for i, work in enumerate(works):
            yield self._deliver(work, works[i + 1:i + 1 + mb.MAX_DEPTH], order, i * batch_size)

    # ---- delivery ---------------------------------------------------------------------------

    def _deliver(self, work: Work, ahead: List[Work], order: Optional[_OrderOnDevice] = None,
                 offset: int = 0) -> Any:
        """The batch of `work`. With `order` (solo: the epoch's order, `work` at `offset` in
        it) resident delivery slices its rows' indices from the order on the device instead of
        uploading them for each batch."""
        began = time.perf_counter()
        self._at_step(work)
        if self._resident is not None:
            batch = self._resident_batch(work, ahead, order, offset)
        else:
            batch = self._stream(work, ahead)
        self.stats.starve_ms += (time.perf_counter() - began) * 1000.0
        self.stats.rows += work.indices.shape[0]  # len() of a tensor goes through Python
        if self.batch_bytes == 0:
            self.batch_bytes = sum(t.numel() * t.element_size() for t in tensors_of(batch))
        if self.transform is not None:
            if work.pass_index is None:
                raise ValueError(f"rank {self.rank}: data.transform needs the pass positions of "
                                 "each batch, and this one came without a plan")
            batch = apply_transform(self.transform, batch, self.picks.keys(work))
        return batch

    def _at_step(self, work: Work) -> None:
        """Decide after the first step; re-probe at each new epoch; adopt a finished fill. A
        resident plane stays so until closed: nothing is left to decide, re-probe or adopt (on
        a small model's step, the checks below cost more host time than the batch's views)."""
        self._delivered += 1
        if self._resident is not None:
            return
        epoch = None if work.pass_index is None else epoch_of(
            work.start, work.pass_index, self.picks.picks_per_pass, self.data.epoch_splits)
        if self._delivered == 2:
            self._decide()
        elif epoch is not None and self._epoch is not None and epoch != self._epoch \
                and self._delivered > 2 and self._filling is None:
            self._reprobe()
        if epoch is not None:
            self._epoch = epoch
        self._poll_fill()
        self.stats.delivery = self.delivery.value

    def _resident_batch(self, work: Work, ahead: List[Work], order: Optional[_OrderOnDevice],
                        offset: int) -> Any:
        """The rows of `work` from the resident set, views of one gather of the next batches:
        with the epoch's `order` (solo), its next rows; else (a rank) the batches its plan
        names next (`ahead`), as far as they stay whole batch_size batches."""
        count = work.indices.shape[0]
        if order is not None:
            rows = order.gathered(self._resident, offset, count, self._per_gather * self.batch_size)
        else:
            rows = self._planned.rows(self._resident, work, ahead, self._per_gather, self.batch_size)
        self.stats.add(self.device_tier, count)
        return self.layout.pack(rows) if self.layout is not None else rows

    def _stream(self, work: Work, ahead: List[Work]) -> Any:
        prefetcher = self._ensure_prefetcher()
        prefetcher.retain([work.indices, *(w.indices for w in ahead)])  # drop what left the plan
        for w in (work, *ahead[:self.depth]):
            self._schedule(w)
        try:
            moved, slots, extra = prefetcher.take(work.indices)
        except LayoutMismatch as exc:
            self._warn_once("layout", f"samples differ in shape ({exc}); delivering without "
                                      "sample tiers or a device pool")
            self.layout, self._pool = None, None
            prefetcher.retain([])
            return self._stream(work, ahead)
        for tier, count in extra.items():
            self.stats.add(tier, count)
        if self.layout is None:
            return moved
        return self.layout.pack(self._combine(work.indices, moved, slots))

    def _schedule(self, work: Work) -> None:
        if self._prefetcher.is_scheduled(work.indices):
            return
        samples = work.indices
        if self.layout is None:
            dataset = self.dataset
            self._prefetcher.schedule(
                samples, lambda: (default_collate([dataset[int(i)] for i in samples]), {}))
            return
        slots = self._pool.lookup(samples) if self._pool is not None and self._pool.count else None
        misses = samples if slots is None else samples[slots < 0]
        host = self._host

        def build() -> Tuple[Rows, Dict[str, int]]:
            tiers: HostTiers = host.result()  # built by this worker's first task
            if len(misses) == 0:
                return (), {}
            before = dict(tiers.hits)
            rows = tiers.read(misses)
            return rows, {k: tiers.hits[k] - before[k] for k in ("ram", "disk")}

        self._prefetcher.schedule(samples, build, slots)

    def _combine(self, samples: torch.Tensor, moved: Rows, slots: Optional[torch.Tensor]) -> Rows:
        """Rows from the device pool where it had them, the rest from the copy; then admit the
        copied rows to the pool while it has room."""
        rows, hit = moved, None
        if slots is not None:
            hit = slots >= 0
            count = int(hit.sum())
            if count:
                pooled = self._pool.read(slots[hit])
                rows = pooled if count == len(samples) else _merge(hit, pooled, moved, self.device)
                self.stats.add(self.device_tier, count)
        if self._pool is not None and len(moved):
            self._pool.admit(samples if hit is None else samples[~hit], moved)
        return rows

    # ---- the mode -------------------------------------------------------------------------

    def _budget(self) -> int:
        """Device bytes the data plane may hold now (its own holdings included)."""
        own = self._device_bytes()
        return mb.data_budget(self.probe.memory(own), self.data.vram_max_usage, own)

    def _device_bytes(self) -> int:
        """What this plane holds on its device (inside the probe's `used`)."""
        held = self._pool.nbytes if self._pool is not None else 0
        if self._resident is not None and (self.device.type == "cuda" or self.probe.is_simulated):
            held += sum(t.numel() * t.element_size() for t in self._resident)
        return held

    def _decide(self) -> None:
        """After the first step (model, optimizer state and activations exist): resident when
        the whole set fits the budget, else streaming with a measured depth and a pool."""
        budget = self._budget()
        dataset_bytes = self.num_samples * self.layout.sample_bytes if self.layout else None
        if dataset_bytes is not None and mb.fits_resident(dataset_bytes, self.batch_bytes, budget):
            self._gather_room = budget - dataset_bytes - self.batch_bytes
            self._start_fill()
        else:
            self._plan_streaming(budget)

    def _plan_streaming(self, budget: int) -> None:
        self.depth = mb.prefetch_depth(budget, self.batch_bytes, self.data.prefetch)
        pool_here = self.device.type == "cuda" or self.probe.is_simulated
        if not (self.pool_on and pool_here and self.layout is not None and self._pool is None):
            return
        capacity = mb.pool_capacity(budget, self.depth, self.batch_bytes, self.layout.sample_bytes,
                                    self.num_samples)
        if capacity <= 0:
            return
        try:
            self._pool = SlotStore(self.layout, self.num_samples, capacity, self.device)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            self._warn_once("pool-oom", f"no device pool: out of memory for {capacity} samples")

    def _reprobe(self) -> None:
        """Each epoch: depth from the budget now; the pool and RAM cache shrink if theirs fell."""
        budget = self._budget()
        self.depth = mb.prefetch_depth(budget, self.batch_bytes, self.data.prefetch)
        if self._pool is not None:
            keep = mb.pool_capacity(budget, self.depth, self.batch_bytes, self.layout.sample_bytes,
                                    self.num_samples)
            if keep < self._pool.capacity:
                self._pool.shrink(keep)
        if self._host is not None:
            self._prefetcher.run(self._reprobe_ram)

    def _reprobe_ram(self) -> None:
        """On the worker (it owns the host tiers)."""
        tiers: Optional[HostTiers] = self._host.result()
        if tiers is not None and tiers.ram is not None:
            tiers.shrink_ram(mb.cache_capacity(self._ram_budget(tiers.ram_bytes),
                                               self.layout.sample_bytes, self.num_samples))

    def _start_fill(self) -> None:
        """Copy the whole set to the device: inline when it costs nothing (a CPU rank's
        TensorDataset), else on a thread while streaming goes on."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        future: Future = Future()

        def fill() -> Rows:
            return fill_device(self.dataset, self.layout, self.device, stream)

        if self.device.type == "cpu" and isinstance(self.dataset, TensorDataset):
            run_into(future, fill)
        else:
            threading.Thread(target=run_into, args=(future, fill), daemon=True,
                             name="flodl_run-fill").start()
        self._filling = future
        self._poll_fill()

    def _poll_fill(self) -> None:
        if self._filling is None or not self._filling.done():
            return
        future, self._filling = self._filling, None
        try:
            rows = future.result()
        except Exception as exc:
            if not (_is_oom(exc) or isinstance(exc, LayoutMismatch)):
                raise
            self._warn_once("resident", f"going resident failed ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0]}); streaming instead")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._plan_streaming(self._budget())
            return
        if self.device.type == "cuda":
            for t in rows:
                t.record_stream(torch.cuda.current_stream(self.device))
        self._go_resident(rows)

    def _go_resident(self, rows: Rows) -> None:
        self._resident, self._pool = rows, None
        # a batch sliced from a gather starts batch_size rows on from the last: keep it 16-byte
        # aligned (inductor copies an input that is not), else gather each batch alone
        aligned = all(self.batch_size * t.element_size() * (t.numel() // max(len(t), 1)) % 16 == 0
                      for t in rows)
        self._per_gather = mb.batches_per_gather(self.batch_bytes, self._gather_room) if aligned else 1
        if self._prefetcher is not None:
            self._prefetcher.retain([])
        self.stats.delivery = mb.Delivery.resident.value

    # ---- host side ------------------------------------------------------------------------

    def _ensure_prefetcher(self) -> Prefetcher:
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.device)
            if self.layout is not None:
                self._host = self._prefetcher.run(self._make_host_tiers)
        return self._prefetcher

    def _ram_budget(self, own_bytes: int = 0) -> int:
        return self.probe.ram_budget(self.data.ram_max_usage, self.local_world_size,
                                     self.data.sample_cache, own_bytes)

    def _make_host_tiers(self) -> HostTiers:
        """RAM cache and disk stage for a data set that is not already tensors in RAM."""
        pin = self.device.type == "cuda"
        if isinstance(self.dataset, TensorDataset):  # its tensors are the RAM tier already
            return HostTiers(self.dataset, self.layout, None, None, pin)
        capacity = mb.cache_capacity(self._ram_budget(), self.layout.sample_bytes, self.num_samples)
        ram = None
        if capacity:
            ram = SlotStore(self.layout, self.num_samples, capacity, torch.device("cpu"), pin)
        stage = self._make_stage(self.num_samples - capacity)
        return HostTiers(self.dataset, self.layout, ram, stage, pin)

    def _make_stage(self, overflow: int) -> Optional[SlotStore]:
        if self.data.disk_stage_gb <= 0 or overflow <= 0:
            return None
        directory = self.data.disk_stage_dir or tempfile.gettempdir()
        plan = mb.disk_stage(self.data.disk_stage_gb, disk_free_bytes(directory),
                             self.layout.sample_bytes, overflow)
        if plan.reason is not None:
            self._warn_once("stage", f"data.disk_stage_gb: disk stage off in {directory}: "
                                     f"{plan.reason}")
            return None
        return open_disk_stage(directory, self.layout, self.num_samples, plan.capacity)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("rank %d: %s", self.rank, message)

    def settle(self) -> None:
        """Wait for a resident copy in flight and adopt it (or fall back): for benchmarks and
        tests that need the mode fixed; training never waits for it."""
        if self._filling is not None:
            self._filling.exception()  # blocks until done; _poll_fill raises what must be raised
            self._poll_fill()
            self.stats.delivery = self.delivery.value

    def take_stats(self) -> Dict[str, Any]:
        """The data fields of this rank's next WindowDone (counters since the last call)."""
        return self.stats.take()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._resident, self._pool, self._prefetcher, self._host = None, None, None, None
        self._planned = _PlannedGather(self._upload)  # it refers to the set and holds a gather


def _merge(hit: torch.Tensor, pooled: Rows, moved: Rows, device: torch.device) -> Rows:
    hit_pos = hit.nonzero().flatten().to(device)
    miss_pos = (~hit).nonzero().flatten().to(device)
    out = []
    for p, m in zip(pooled, moved):
        row = torch.empty((len(hit), *p.shape[1:]), dtype=p.dtype, device=device)
        out.append(row.index_copy_(0, hit_pos, p).index_copy_(0, miss_pos, m))
    return tuple(out)


class _OrderOnDevice:
    """An epoch's order of rows, moved to the device once (through the plane's IndexUpload), at
    its first resident batch: a batch's indices are then a slice of it, not an upload each step
    (on a GPU, a copy and its bookkeeping per step is host time a small model's step feels)."""

    def __init__(self, order: torch.Tensor, upload: IndexUpload):
        self.order, self.upload = order, upload
        self._on_device: Optional[torch.Tensor] = None
        self._held: Optional[_Gather] = None

    def rows(self, start: int, count: int) -> torch.Tensor:
        if self._on_device is None:
            self._on_device = self.upload(self.order)
        return self._on_device[start:start + count]

    def gathered(self, fields: Rows, start: int, count: int, ahead: int) -> Rows:
        """Rows `start` to `start + count` of the order, taken from `fields`: views of the
        gather that holds them, else of a new gather of `ahead` rows from `start` (fewer at the
        order's end). Each view is contiguous; a caller that keeps one keeps its gather."""
        held = self._held
        if held is None or held.fields is not fields or not held.start <= start <= held.end - count:
            end = min(self.order.shape[0], start + max(count, ahead))
            held = self._held = _Gather(fields, start, end, count, self.rows(start, end - start))
        return held.batch(start, count)


class _PlannedGather:
    """A rank's planned batches gathered from the resident set in one go: the batch asked for
    and the ones its plan names after it (up to `most`, and only while each is a whole
    batch_size batch, so every view after the first starts where a whole batch ended), their
    indices joined and uploaded once. A later batch of the gather is its views, found by its
    indices tensor (the plan hands the same tensor again); a plan that changed asks for
    indices the gather does not hold, which are gathered afresh."""

    def __init__(self, upload: IndexUpload):
        self.upload = upload
        self._fields: Optional[Rows] = None
        self._held: Dict[int, Tuple[torch.Tensor, Rows]] = {}  # id(indices): (indices, views)

    def rows(self, fields: Rows, work: Work, ahead: Sequence[Work], most: int,
             batch_size: int) -> Rows:
        hit = self._held.get(id(work.indices)) if fields is self._fields else None
        if hit is not None and hit[0] is work.indices:
            return hit[1]
        chosen = [work]
        for nxt in ahead[:most - 1]:
            if chosen[-1].indices.shape[0] != batch_size:
                break
            chosen.append(nxt)
        indices = [w.indices for w in chosen]
        index = self.upload(torch.cat(indices) if len(indices) > 1 else indices[0])
        sizes = [i.shape[0] for i in indices]
        cut = list(zip(*(f.index_select(0, index).split(sizes) for f in fields)))
        self._fields, self._held = fields, {id(i): (i, views) for i, views in zip(indices, cut)}
        return cut[0]


class _Gather:
    """Rows [start, end) of an epoch's order, gathered from the resident `fields` in one
    index_select each, and cut into batches of `size` rows up front (one split a field: a view
    each costs less there than a slice a batch does)."""

    def __init__(self, fields: Rows, start: int, end: int, size: int, index: torch.Tensor):
        self.fields, self.start, self.end, self.size = fields, start, end, size
        self.rows = tuple(field.index_select(0, index) for field in fields)
        self.cut = list(zip(*(rows.split(size) for rows in self.rows)))

    def batch(self, start: int, count: int) -> Rows:
        first = start - self.start
        k, off = divmod(first, self.size)
        if off == 0 and k < len(self.cut) and self.cut[k][0].shape[0] == count:
            return self.cut[k]
        return tuple(rows[first:first + count] for rows in self.rows)
