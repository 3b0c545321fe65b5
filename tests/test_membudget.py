"""Budget arithmetic of the data plane against simulated device and host sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_run.hardware import membudget as mb
from tests.support import FORBIDDEN_ROOTS, _imports

GB = 10**9


def test_membudget_imports_no_shell() -> None:
    """Pins the functional core: the budget rules take sizes and return sizes, so they can be
    tested without a GPU; a torch, os or clock import creeping in fails here."""
    imported = _imports(Path(mb.__file__))
    assert not [n for n in imported if n.split(".")[0] in FORBIDDEN_ROOTS]
    assert not [n for n in imported if n.startswith("flodl_run")]


def test_budget_is_the_share_less_what_others_use_and_never_more_than_free() -> None:
    """Pins data_budget: 0.9 of a 16 GB device with 4 GB taken by the model is 10.4 GB; with
    15 GB taken, 0.99 leaves 0.84 GB (below the 1 GB free); a full device leaves nothing."""
    assert mb.data_budget(mb.DeviceMemory(16 * GB, 12 * GB), 0.90) == int(14.4 * GB) - 4 * GB
    assert mb.data_budget(mb.DeviceMemory(16 * GB, 1 * GB), 0.99) == int(0.84 * GB)
    assert mb.data_budget(mb.DeviceMemory(16 * GB, 0), 0.90) == 0


def test_budget_is_the_same_before_and_after_the_plane_takes_its_share() -> None:
    """Pins `own_bytes`: once the pool holds 6 GB it counts as used; passing it back in gives the
    re-probe the same budget, so a re-probe never shrinks the pool the first probe sized."""
    before = mb.data_budget(mb.DeviceMemory(16 * GB, 12 * GB), 0.90)
    after = mb.data_budget(mb.DeviceMemory(16 * GB, 6 * GB), 0.90, own_bytes=6 * GB)
    assert before == after


@pytest.mark.parametrize("share,expected", [(0.3, 0.50), (1.0, 0.99)])
def test_vram_max_usage_is_clamped_at_the_sizing_site(share: float, expected: float) -> None:
    """Pins the [0.50, 0.99] clamp even for values validation would refuse (Python API)."""
    mem = mb.DeviceMemory(10 * GB, 10 * GB)
    assert mb.data_budget(mem, share) == int(10 * GB * expected)


def test_a_16gb_gpu_goes_resident_while_a_6gb_gpu_streams_the_same_set() -> None:
    """Pins the per-rank choice: an 8 GB set fits 0.9 of a 16 GB device after a 2 GB model, not
    0.9 of a 6 GB one; each rank decides on its own figures."""
    dataset, batch = 8 * GB, 64 * 2**20
    big = mb.data_budget(mb.DeviceMemory(16 * GB, 14 * GB), 0.90)
    small = mb.data_budget(mb.DeviceMemory(6 * GB, 4 * GB), 0.90)
    assert mb.choose_delivery(dataset, batch, big) is mb.Delivery.resident
    assert mb.choose_delivery(dataset, batch, small) is mb.Delivery.streaming


def test_resident_needs_room_for_two_batches_beside_the_set() -> None:
    """Pins the slack: a set that fills the budget exactly would leave no room to gather."""
    assert not mb.fits_resident(1000, 10, 1000)
    assert mb.fits_resident(980, 10, 1000)


def test_a_resident_gather_takes_whole_batches_within_its_cap_and_the_room_left() -> None:
    """Pins the gather ahead's size: whole batches within GATHER_AHEAD_BYTES and the device
    room beside the set, never fewer than one (nor for a batch of unknown size)."""
    assert mb.batches_per_gather(100, 350) == 3
    assert mb.batches_per_gather(100, 10**12) == mb.GATHER_AHEAD_BYTES // 100
    assert mb.batches_per_gather(100, 50) == 1 and mb.batches_per_gather(0, 10**6) == 1


@pytest.mark.parametrize("budget,batch,override,depth", [
    (100 * GB, 1 * 2**20, None, 16),   # plenty of room: the ceiling
    (10 * 2**20, 8 * 2**20, None, 2),  # barely anything: the floor
    (64 * 2**20, 2 * 2**20, None, 8),  # 64 MiB x 0.25 / 2 MiB
    (100 * GB, 1 * 2**20, 3, 3),       # data.prefetch overrides the measurement
])
def test_prefetch_depth(budget: int, batch: int, override, depth: int) -> None:
    """Pins depth = clamp(budget x 0.25 / batch_bytes, 2, 16) and the data.prefetch override."""
    assert mb.prefetch_depth(budget, batch, override) == depth


def test_bootstrap_depth_is_four() -> None:
    """Pins the depth used before the model exists."""
    assert mb.BOOTSTRAP_DEPTH == 4


def test_pool_takes_what_the_ring_leaves_and_no_more_than_the_set() -> None:
    """Pins pool_capacity: budget minus (depth + 1) batches, in samples, capped at N."""
    assert mb.pool_capacity(1000, 3, 100, 10, 10**6) == (1000 - 400) // 10
    assert mb.pool_capacity(10**9, 3, 100, 10, 50) == 50
    assert mb.pool_capacity(300, 3, 100, 10, 50) == 0


def test_ram_budget_share_split_among_co_located_ranks() -> None:
    """Pins ram_budget: ram_max_usage of available RAM over LOCAL_WORLD_SIZE; 0.0 and
    sample_cache=false disable it; the cache's own bytes count as ours; an integrated GPU's
    reservation is priced once."""
    assert mb.ram_budget(40 * GB, 0.5, 4, True) == 5 * GB
    assert mb.ram_budget(40 * GB, 0.0, 1, True) == 0
    assert mb.ram_budget(40 * GB, 0.5, 1, False) == 0
    assert mb.ram_budget(30 * GB, 0.5, 1, True, own_bytes=10 * GB) == 20 * GB
    assert mb.ram_budget(40 * GB, 0.5, 1, True, reserved_bytes=20 * GB) == 10 * GB


def test_disk_stage_holds_only_the_overflow_and_a_full_disk_gives_none() -> None:
    """Pins disk_stage: sized to what the RAM cache cannot hold (within disk_stage_gb), and no
    stage, with a reason to warn about, when the disk lacks the room plus its margin."""
    assert mb.disk_stage(1.0, 100 * GB, 1000, 5000).capacity == 5000
    assert mb.disk_stage(1e-6, 100 * GB, 100, 5000).capacity == 10
    full = mb.disk_stage(1.0, 10 * 2**20, 1000, 5000)
    assert full.capacity == 0 and "free" in full.reason
    assert mb.disk_stage(0, 100 * GB, 1000, 5000) == mb.StagePlan(0)


def test_integrated_gpu_takes_its_share_of_host_ram_and_discrete_ignores_it() -> None:
    """Pins gpu_ram_share: on an APU the device gets the share of MemTotal and the host tiers
    lose it; a discrete GPU keeps what it reports and reserves nothing on the host."""
    apu = mb.integrated_split(8 * GB, 32 * GB, True, 0.5)
    assert apu == mb.HostSplit(16 * GB, 16 * GB)
    assert mb.integrated_split(8 * GB, 32 * GB, True, None) == mb.HostSplit(8 * GB, 8 * GB)
    assert mb.integrated_split(80 * GB, 32 * GB, False, 0.5) == mb.HostSplit(80 * GB, 0)
