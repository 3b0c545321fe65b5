"""Memory budgets of one rank's data plane: pure arithmetic over measured sizes.

Owns the rules: how many bytes of device memory the data may take once the model exists,
whether the train set goes resident, how deep the streaming prefetch runs, how many samples the
device pool, the host-RAM cache and the disk stage hold, and the integrated-GPU split. Values
in, values out: `dataplane` measures (torch, /proc, the disk) and acts on the answers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

BOOTSTRAP_DEPTH = 4
"""Prefetch depth before the first step, when nothing about the model's memory is known yet."""
MIN_DEPTH = 2
"""One batch being copied while one is consumed: fewer cannot overlap anything."""
MAX_DEPTH = 16
"""Past ~16 batches ahead a prefetcher only hides jitter it already hides, and holds memory."""
PREFETCH_HEADROOM = 0.25
"""Share of the data budget the prefetch ring may take; the rest is for the device pool."""
RESIDENT_SLACK_BATCHES = 2
"""A resident rank still materializes the gathered batch and the one in use beside the set."""
GATHER_AHEAD_BYTES = 8 * 2**20
"""Most bytes of an epoch's next batches a resident plane gathers in one go (one index_select a
field), then hands out as views: a gather a batch is a launch and its bookkeeping per field and
step, host time a small model's step feels."""
DISK_MARGIN_BYTES = 256 * 2**20
"""Free space a disk stage leaves on its file system (logs, checkpoints, other jobs' temp files)."""


class Delivery(str, enum.Enum):
    """How a rank's samples reach its device."""

    resident = "resident"
    """The whole train set lives on the device; batches are gathered there."""
    streaming = "streaming"
    """Batches are assembled on the host and copied ahead of the step by a prefetcher."""


@dataclass(frozen=True)
class DeviceMemory:
    """Device memory as measured (or simulated) at one moment, in bytes."""

    total_bytes: int
    free_bytes: int
    """Free after the model, the optimizer state and the last step's activations."""

    @property
    def used_bytes(self) -> int:
        return max(0, self.total_bytes - self.free_bytes)


def clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def data_budget(mem: DeviceMemory, vram_max_usage: float, own_bytes: int = 0) -> int:
    """Bytes the data plane may hold on the device: the share `vram_max_usage` (clamped to
    [0.50, 0.99]) of the device, less everything else in use, never more than is free.

    `own_bytes` is what the data plane already holds (it is inside `used`), so a re-probe gives
    the same answer before and after the plane allocates its share.
    """
    share = int(mem.total_bytes * clamp(vram_max_usage, 0.50, 0.99))
    others = max(0, mem.used_bytes - own_bytes)
    return max(0, min(mem.free_bytes + own_bytes, share - others))


def fits_resident(dataset_bytes: int, batch_bytes: int, budget: int) -> bool:
    """The whole set fits with room for the gathered batch and the one in use."""
    return dataset_bytes + RESIDENT_SLACK_BATCHES * batch_bytes <= budget


def batches_per_gather(batch_bytes: int, headroom: int) -> int:
    """Whole batches a resident plane gathers at once: as many as GATHER_AHEAD_BYTES and the
    `headroom` beside the resident set allow, at least one."""
    if batch_bytes <= 0:
        return 1
    return max(1, min(GATHER_AHEAD_BYTES, headroom) // batch_bytes)


def choose_delivery(dataset_bytes: int, batch_bytes: int, budget: int) -> Delivery:
    if fits_resident(dataset_bytes, batch_bytes, budget):
        return Delivery.resident
    return Delivery.streaming


def prefetch_depth(budget: int, batch_bytes: int, override: Optional[int] = None) -> int:
    """clamp(budget x headroom / batch_bytes, 2, 16); `data.prefetch` overrides it."""
    if override is not None:
        return override
    if batch_bytes <= 0:
        return MAX_DEPTH
    return int(clamp(budget * PREFETCH_HEADROOM // batch_bytes, MIN_DEPTH, MAX_DEPTH))


def pool_capacity(budget: int, depth: int, batch_bytes: int, sample_bytes: int,
                  num_samples: int) -> int:
    """Samples the device pool may keep: the budget left after the prefetch ring (depth batches
    in flight plus the one in use), capped at the set's size."""
    if sample_bytes <= 0:
        return 0
    room = budget - (depth + 1) * batch_bytes
    return int(max(0, min(num_samples, room // sample_bytes)))


def ram_budget(available_bytes: int, ram_max_usage: float, local_world_size: int,
               sample_cache: bool, own_bytes: int = 0, reserved_bytes: int = 0) -> int:
    """Host-RAM bytes for this rank's sample cache: `ram_max_usage` of the available RAM,
    split evenly among the ranks of this host; 0 when `sample_cache` is off or the share is 0.

    `own_bytes` is what the cache already holds (no longer available, but ours);
    `reserved_bytes` is RAM an integrated GPU was handed (`gpu_ram_share`), priced once only.
    """
    if not sample_cache or ram_max_usage <= 0:
        return 0
    pool = max(0, available_bytes + own_bytes - reserved_bytes)
    return int(pool * clamp(ram_max_usage, 0.0, 0.90) // max(1, local_world_size))


def cache_capacity(budget: int, sample_bytes: int, num_samples: int) -> int:
    if sample_bytes <= 0:
        return 0
    return int(max(0, min(num_samples, budget // sample_bytes)))


@dataclass(frozen=True)
class StagePlan:
    """What the disk stage should be: `capacity` samples, or none and why."""

    capacity: int
    reason: Optional[str] = None
    """Set when a stage was asked for and cannot be had (the caller warns once)."""


def disk_stage(requested_gb: float, free_disk_bytes: int, sample_bytes: int,
               overflow_samples: int) -> StagePlan:
    """Size the on-disk overflow tier: at most `requested_gb`, at most the samples the RAM
    cache cannot hold. A disk without room for the request (plus a margin) gives no stage."""
    requested = int(requested_gb * 1e9)
    if requested <= 0 or overflow_samples <= 0 or sample_bytes <= 0:
        return StagePlan(0)
    capacity = min(overflow_samples, requested // sample_bytes)
    need = capacity * sample_bytes
    if need + DISK_MARGIN_BYTES > free_disk_bytes:
        return StagePlan(0, f"needs {need / 1e9:.2f} GB plus a {DISK_MARGIN_BYTES >> 20} MiB "
                            f"margin, {free_disk_bytes / 1e9:.2f} GB free")
    return StagePlan(int(capacity))


@dataclass(frozen=True)
class HostSplit:
    """Device and host RAM figures once an integrated GPU's share is taken out of host RAM."""

    device_total_bytes: int
    reserved_host_bytes: int


def integrated_split(reported_total_bytes: int, mem_total_bytes: int, is_integrated: bool,
                     gpu_ram_share: Optional[float]) -> HostSplit:
    """On an integrated GPU device memory is host RAM: the device gets `gpu_ram_share` of
    MemTotal (or what it reports), and the host tiers must not price those bytes again.
    Discrete GPUs ignore `gpu_ram_share`."""
    if not is_integrated:
        return HostSplit(reported_total_bytes, 0)
    total = int(gpu_ram_share * mem_total_bytes) if gpu_ram_share else reported_total_bytes
    return HostSplit(total, total)
