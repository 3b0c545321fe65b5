"""The data plane of one rank on CPU, with simulated device sizes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from flodl_run.config.schema import DataConfig, ExperimentConfig
from flodl_run.contracts.recipe import RecipeError
from flodl_run.contracts.wire import Train
from flodl_run.data import dataplane as dp
from flodl_run.data.datametrics import DataTally
from flodl_run.hardware import memprobe

N, FEATURES, BATCH = 240, 4, 16
X = torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(1))
Y = torch.arange(N)
SAMPLE_BYTES = FEATURES * 4 + 8
PARTIAL = 6000
"""A simulated device too small for the set (5760 B + 2 batches) with room for a partial pool."""
CPU = torch.device("cpu")


class Decoded(Dataset):
    """Samples built per call, like a set decoded from files."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return X[i], int(Y[i])


def _config(**data) -> ExperimentConfig:
    return ExperimentConfig(batch_size=BATCH, seed=7, data=DataConfig(**data))


def _plane(dataset=None, sim=None, env=None, transform=None, **data) -> dp.DataPlane:
    environ = dict(env or {})
    if sim is not None:
        environ["FLODL_RUN_SIM_DEVICE_BYTES"] = str(sim)
    return dp.DataPlane(dataset or TensorDataset(X, Y), CPU, _config(**data), transform,
                        environ=environ)


def _epoch(plane: dp.DataPlane, epoch: int) -> list:
    """One epoch the way solo runs it: the epoch's picks in order, with the epoch number."""
    pass_index, start, end = plane.picks.epoch_span(epoch)
    indices = plane.picks.picks(pass_index, start, end - start) % len(plane)
    return list(plane.batches(indices, BATCH, epoch=epoch))


def test_a_cpu_rank_with_a_tensor_dataset_is_resident_without_a_copy():
    """Pins the CPU decision (docs/decisions.md): a TensorDataset already lives in the rank's
    device memory (host RAM), so the plane is resident from the first batch, gathers from the
    set's own tensors and starts no thread."""
    plane = _plane()
    batches = _epoch(plane, 0)
    assert plane.delivery.value == "resident" and plane._prefetcher is None
    assert plane._resident[0].data_ptr() == X.data_ptr()
    indices = plane.picks.picks(0, 0, N)
    assert torch.equal(torch.cat([b[0] for b in batches]), X[indices])


class _Gathers:
    """Counts index_select calls on the resident set's tensors while it is on."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = torch.Tensor.index_select

        def counted(tensor, dim, index):
            self.count += 1
            return original(tensor, dim, index)
        monkeypatch.setattr(torch.Tensor, "index_select", counted)


def test_a_resident_epoch_is_gathered_in_few_calls_and_sliced_into_the_same_batches(monkeypatch):
    """Pins the gather ahead: a resident plane gathers an epoch's next batches at once
    (GATHER_AHEAD_BYTES of them) and hands each batch out as a slice, one index_select per field
    per gather instead of per batch; the rows, the short last batch and the stats are those of
    gathering each batch alone."""
    monkeypatch.setattr(dp.mb, "GATHER_AHEAD_BYTES", 4 * BATCH * SAMPLE_BYTES)
    plane = _plane()
    indices = plane.picks.picks(0, 0, N)[:N - 5]  # 15 batches, the last of 11 rows
    gathers = _Gathers(monkeypatch)
    batches = list(plane.batches(indices, BATCH, epoch=0))
    assert plane._per_gather == 4 and gathers.count == 2 * 4  # two fields, 15 batches in 4 gathers
    expected = [(X[i], Y[i]) for i in indices.split(BATCH)]
    assert [len(b[0]) for b in batches] == [BATCH] * 14 + [11]
    assert all(torch.equal(b[0], x) and torch.equal(b[1], y) for b, (x, y) in zip(batches, expected))
    assert all(b[0].is_contiguous() for b in batches)
    assert plane.take_stats()["data_hits"]["ram"] == N - 5


def test_a_batch_that_a_slice_would_misalign_is_gathered_alone():
    """Pins the alignment rule: when batch_size rows of a field are not a multiple of 16 bytes,
    a slice of a gather would start off a 16-byte boundary (inductor copies such an input), so
    the plane gathers each batch alone."""
    odd = TensorDataset(X[:, :1].contiguous(), Y)  # 4 bytes a row: 16 rows are 64 bytes, fine
    assert _plane(odd)._per_gather > 1
    config = ExperimentConfig(batch_size=BATCH + 1, seed=7, data=DataConfig())
    plane = dp.DataPlane(odd, CPU, config, None, environ={})  # 17 rows of 4 bytes: 68
    assert plane._per_gather == 1
    assert torch.equal(torch.cat([b[0] for b in plane.batches(torch.arange(N), BATCH + 1)]), X[:, :1])


def test_simulated_device_sizes_choose_the_mode_after_the_first_step():
    """Pins the choice: batch 1 streams at the bootstrap depth 4; at batch 2 (the model and a
    step exist) a device the set fits goes resident, a small one keeps streaming with a measured
    depth; both deliver the same rows as indexing the set."""
    big, small = _plane(sim=10**8), _plane(sim=12 * BATCH * SAMPLE_BYTES)
    for plane in (big, small):
        it = plane.batches(torch.arange(N), BATCH)
        next(it)
        assert plane.delivery.value == "streaming" and plane.depth == 4
        rest = list(it)
        assert torch.equal(rest[0][0], X[BATCH:2 * BATCH])
    assert big.delivery.value == "resident"
    assert small.delivery.value == "streaming" and small.depth == 2


def test_modes_and_pool_deliver_identical_epochs():
    """Pins that the mode changes where rows come from, never which rows: resident, streaming
    with a device pool and streaming without one give the same epochs."""
    planes = [_plane(), _plane(sim=10**8), _plane(sim=PARTIAL),
              _plane(sim=PARTIAL, vram_pool=False)]
    runs = [[torch.cat([b[0] for b in _epoch(p, e)]) for e in range(3)] for p in planes]
    assert planes[2]._pool is not None and planes[3]._pool is None
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_device_pool_serves_later_epochs():
    """Pins vram_pool: after the first step leftover device memory keeps samples, so the next
    epoch gathers that share on the device instead of copying it again."""
    plane = _plane(sim=PARTIAL)
    _epoch(plane, 0)
    plane.take_stats()
    _epoch(plane, 1)
    stats = plane.take_stats()
    held = plane._pool.count
    assert 0 < held < N and stats["data_hits"]["vram"] == held and stats["delivery"] == "streaming"


@pytest.mark.parametrize("env,data", [({"FLODL_RUN_VRAM_POOL": "off"}, {}),
                                      ({}, {"vram_pool": False})])
def test_pool_kill_switch_and_config_off(env, data):
    """Pins FLODL_RUN_VRAM_POOL=off and data.vram_pool=false: no pool however much room."""
    plane = _plane(sim=PARTIAL, env=env, **data)
    _epoch(plane, 0)
    assert plane._pool is None


def test_reprobe_each_epoch_shrinks_the_pool_when_the_budget_falls():
    """Pins the per-epoch re-probe: a device that lost memory between epochs gets a smaller
    pool (evicted to the new capacity), and the plane's device bytes fit the new budget."""
    plane = _plane(sim=PARTIAL)
    _epoch(plane, 0)
    before = plane._pool.capacity
    plane.probe.sim_bytes = 4000
    _epoch(plane, 1)
    assert plane._pool.capacity < before
    assert plane._pool.nbytes <= plane._budget()


def test_prefetch_override_fixes_the_depth():
    """Pins data.prefetch: the depth is the configured one after the decision and re-probes."""
    plane = _plane(sim=PARTIAL, prefetch=3)
    _epoch(plane, 0)
    _epoch(plane, 1)
    assert plane.depth == 3


def test_oom_while_going_resident_streams_and_says_so_once(monkeypatch, caplog):
    """Pins the fallback: an out-of-memory error while copying the set to the device leaves the
    rank streaming, with one warning however many epochs follow."""
    def no_room(*_args, **_kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(dp, "fill_device", no_room)
    plane = _plane(sim=10**8)
    with caplog.at_level(logging.WARNING, logger="flodl_run.data.dataplane"):
        batches = [b for e in range(3) for b in _epoch(plane, e)]
    assert plane.delivery.value == "streaming" and len(batches) == 3 * N // BATCH
    warnings = [r for r in caplog.records if "streaming instead" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0].getMessage()


def _fake_jobs(plane: dp.DataPlane, slices):
    """Jobs as RankRunner queues them: a Train order and its batches (the rank's cut)."""
    order = Train(window=0, epoch=0, slices=slices, num_batches=0)
    batches = []
    for pass_index, offset, size in slices:
        batches += list((plane.picks.picks(pass_index, offset, size) % N).split(BATCH))
    return [SimpleNamespace(order=order, batches=batches, done=0)]


def test_rank_queue_feeds_the_prefetcher_and_a_changed_plan_drops_stale_batches():
    """Pins gather(indices, jobs): the rank's queue tells the prefetcher the next batches (up to
    the depth), and batches that left the plan (work taken back) are dropped, not delivered."""
    plane = _plane(sim=PARTIAL)
    jobs = _fake_jobs(plane, [(0, 0, 160)])
    job = jobs[0]
    for _ in range(3):
        rows = plane.gather(job.batches[job.done], jobs)
        assert torch.equal(rows[0], X[job.batches[job.done]])
        job.done += 1
    assert len(plane._prefetcher) == plane.depth
    other = _fake_jobs(plane, [(0, 160, 80)])
    plane.gather(other[0].batches[0], other)
    assert all(plane._prefetcher.is_scheduled(b) for b in other[0].batches[1:1 + plane.depth])
    assert not any(plane._prefetcher.is_scheduled(b) for b in job.batches)


def test_a_resident_rank_gathers_its_planned_batches_at_once_and_a_changed_plan_still_gets_its_rows(
        monkeypatch):
    """Pins the rank's gather ahead: a resident rank gathers the batch asked for and the next
    ones its queue plans (whole batches, GATHER_AHEAD_BYTES of them) in one index_select a
    field, and hands the later ones out as views of it; a plan that changed (the batches asked
    for are not in the gather) gets its rows gathered afresh, the same rows as indexing the set."""
    monkeypatch.setattr(dp.mb, "GATHER_AHEAD_BYTES", 3 * BATCH * SAMPLE_BYTES)
    plane = _plane()
    jobs = _fake_jobs(plane, [(0, 0, 100)])  # 7 batches, the last of 4 rows
    job = jobs[0]
    gathers = _Gathers(monkeypatch)
    for _ in range(5):
        picked = job.batches[job.done]
        rows = plane.gather(picked, jobs)
        assert torch.equal(rows[0], X[picked]) and torch.equal(rows[1], Y[picked])
        job.done += 1
    assert plane._per_gather == 3 and gathers.count == 2 * 2  # batches 1-3, then 4-6
    other = _fake_jobs(plane, [(0, 160, 80)])
    rows = plane.gather(other[0].batches[0], other)
    assert torch.equal(rows[0], X[other[0].batches[0]]) and gathers.count == 2 * 3
    rows = plane.gather(job.batches[job.done], jobs)  # no longer held: gathered again
    assert torch.equal(rows[0], X[job.batches[job.done]]) and gathers.count == 2 * 4


def _jitter(rows, keys):
    """A deterministic augmentation: noise seeded by each pick's key."""
    x, y = rows
    gens = [torch.Generator().manual_seed(k.seed_value()) for k in keys]
    noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
    return x + noise, y


def test_transform_is_identical_across_runs_and_across_a_restarted_epoch():
    """Pins transform(rows, pick_keys): two runs give the same augmented epoch; a restart that
    re-trains only the second half of the epoch (a resumed, uncovered range, through the rank
    path) sees exactly the augmentation the uninterrupted run saw; the two picks of a sample
    (augment 2) are augmented differently."""
    first = torch.cat([b[0] for b in _epoch(_plane(transform=_jitter, augment=2), 1)])
    again = torch.cat([b[0] for b in _epoch(_plane(transform=_jitter, augment=2), 1)])
    assert torch.equal(first, again)
    restarted = _plane(transform=_jitter, augment=2, sim=12 * BATCH * SAMPLE_BYTES)
    pass_index, start, end = restarted.picks.epoch_span(1)
    mid = start + (end - start) // 2
    jobs = _fake_jobs(restarted, [(pass_index, mid, end - mid)])
    rows = []
    for indices in jobs[0].batches:
        rows.append(restarted.gather(indices, jobs)[0])
        jobs[0].done += 1
    assert torch.equal(torch.cat(rows), first[mid - start:])
    picks = restarted.picks.picks(pass_index, start, end - start)
    twice = (picks % N == picks[0] % N).nonzero().flatten()
    assert len(twice) == 2 and not torch.equal(first[twice[0]], first[twice[1]])


def test_generic_set_streams_through_the_ram_cache_and_a_full_disk_drops_the_stage(monkeypatch,
                                                                                    caplog):
    """Pins the host tiers in a running plane: with room for half the set in RAM (simulated
    available RAM, split by LOCAL_WORLD_SIZE) the second epoch serves half its rows from the
    cache; a disk without room for the asked stage gives no stage and one warning."""
    cache_bytes = N // 2 * SAMPLE_BYTES
    monkeypatch.setattr(memprobe, "host_memory", lambda: (10**12, 4 * cache_bytes))
    monkeypatch.setattr(dp, "disk_free_bytes", lambda _dir: 10**6)
    plane = _plane(Decoded(), sim=4 * BATCH * SAMPLE_BYTES, env={"LOCAL_WORLD_SIZE": "2"},
                   ram_max_usage=0.5, disk_stage_gb=1.0, vram_pool=False)
    with caplog.at_level(logging.WARNING, logger="flodl_run.data.dataplane"):
        first = [b for e in range(2) for b in _epoch(plane, e)]
        plane.take_stats()
        _epoch(plane, 2)
    stats = plane.take_stats()
    assert stats["data_hits"] == {"vram": 0, "ram": N // 2, "disk": 0}
    assert torch.equal(first[0][0], X[plane.picks.picks(0, 0, BATCH)])
    assert sum("disk stage off" in r.getMessage() for r in caplog.records) == 1


def test_samples_of_varying_shape_fall_back_to_plain_collation(caplog):
    """Pins the fallback: a set whose samples change shape cannot use fixed-size tiers; the plane
    says so once and delivers batches by collating samples, as before."""
    class Ragged(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.ones(1 + (i >= N // 2)), i

    plane = _plane(Ragged(), sim=10**3)
    with caplog.at_level(logging.WARNING, logger="flodl_run.data.dataplane"):
        batches = list(plane.batches(torch.arange(N // 2 - BATCH, N // 2 + BATCH), BATCH))
    assert batches[1][0].shape == (BATCH, 2) and plane.layout is None
    assert sum("differ in shape" in r.getMessage() for r in caplog.records) == 1


def test_plane_refuses_more_splits_than_a_pass_has_batches():
    """Pins the runtime guard of the Python API path (no materializer): the error names
    data.epoch_splits (a RecipeError: the rank prints it as one line, without our frames)."""
    with pytest.raises(RecipeError, match="data.epoch_splits"):
        _plane(epoch_splits=N // BATCH + 1)


def test_window_stats_roll_up_per_epoch_and_rank():
    """Pins the coordinator's tally: starve ms sum per (epoch, rank), hit rates are shares of
    the rows, the delivery is the last one reported, a silent rank reads zeros."""
    tally = DataTally(3)
    for rank, starve, hits, mode in [(0, 1.5, {"vram": 10}, "resident"),
                                     (0, 0.5, {"vram": 10}, "resident"),
                                     (1, 4.0, {"ram": 5, "disk": 5}, "streaming")]:
        tally.add(SimpleNamespace(rank=rank, epoch=0, data_starve_ms=starve, delivery=mode,
                                  data_rows=20 if rank else 10, data_hits=hits))
    fields = tally.epoch_fields(0)
    assert fields["per_rank_data_starve_ms"] == [2.0, 4.0, 0.0]
    assert fields["per_rank_delivery"] == ["resident", "streaming", ""]
    assert fields["per_rank_cache_hit_rate"][0]["vram"] == 1.0
    assert fields["per_rank_cache_hit_rate"][1] == {"vram": 0.0, "ram": 0.25, "disk": 0.25}
