"""Sample tiers: slot stores, the RAM cache over the disk stage, the pack file."""

from __future__ import annotations

import logging
import os

import torch
from torch.utils.data import Dataset, TensorDataset

from flodl_run.data.samplecache import HostTiers, Layout, SlotStore, open_disk_stage

N = 200
X = torch.arange(N * 3, dtype=torch.float32).view(N, 3)
Y = torch.arange(N)
CPU = torch.device("cpu")


class Decoded(Dataset):
    """A map-style set whose samples are built per call (like decoding files), counting reads."""

    def __init__(self):
        self.reads = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        self.reads += 1
        return X[i], int(Y[i])


def test_layout_of_tensor_and_generic_sets():
    """Pins Layout.of: TensorDataset fields, a generic sample's tensors and numbers (as default
    collate types them), dicts keep their keys, and unsupported samples give None (no tiers)."""
    assert Layout.of(TensorDataset(X, Y)) == Layout(((3,), ()), (torch.float32, torch.int64))
    generic = Layout.of(Decoded())
    assert generic.shapes == ((3,), ()) and generic.dtypes == (torch.float32, torch.int64)
    assert generic.sample_bytes == 3 * 4 + 8

    class Named(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"x": X[i], "y": 1.5}

    named = Layout.of(Named())
    assert named.kind == "dict" and named.pack([X[:2], Y[:2]])["x"].shape == (2, 3)

    class Text(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return "hello", 1

    assert Layout.of(Text()) is None


def test_slot_store_admits_until_full_and_never_replaces():
    """Pins admission: absent samples fill free slots in order, a sample twice in one batch is
    stored once, a full store admits nothing and what it holds stays (random passes make every
    sample equally likely next, so replacing one cannot raise the hit rate)."""
    layout = Layout.of(TensorDataset(X, Y))
    store = SlotStore(layout, N, 5, CPU)
    samples = torch.tensor([7, 3, 7, 9])
    assert store.admit(samples, (X[samples], Y[samples])) == 3
    more = torch.tensor([1, 2, 4, 5])
    assert store.admit(more, (X[more], Y[more])) == 2
    assert store.count == 5 and store.admit(torch.tensor([6]), (X[[6]], Y[[6]])) == 0
    slots = store.lookup(torch.tensor([7, 3, 9, 1, 2, 4, 6]))
    assert (slots[:5] >= 0).all() and slots[5:].tolist() == [-1, -1]
    rows = store.read(slots[:5])
    assert torch.equal(rows[0], X[[7, 3, 9, 1, 2]]) and torch.equal(rows[1], Y[[7, 3, 9, 1, 2]])


def test_shrink_evicts_past_the_new_capacity_and_releases_memory():
    """Pins eviction: shrinking returns the evicted samples with their rows, forgets them, and
    the store's bytes drop to the new capacity (a budget re-probe is honoured)."""
    layout = Layout.of(TensorDataset(X, Y))
    store = SlotStore(layout, N, 8, CPU)
    samples = torch.arange(10, 18)
    store.admit(samples, (X[samples], Y[samples]))
    evicted, rows = store.shrink(3)
    assert evicted.tolist() == list(range(13, 18)) and torch.equal(rows[0], X[13:18])
    assert store.nbytes == 3 * layout.sample_bytes and store.count == 3
    assert (store.lookup(evicted) == -1).all() and (store.lookup(torch.arange(10, 13)) >= 0).all()


def test_ram_cache_over_disk_stage_hits_and_stays_within_budget(tmp_path):
    """Pins the read-through tiers: pass one reads every sample from the set, the RAM cache
    keeps what fits, the disk stage the overflow it has room for, and pass two serves those
    from RAM and disk with exactly the rest read again; no tier exceeds its capacity."""
    data = Decoded()
    layout = Layout.of(data)
    ram = SlotStore(layout, N, 50, CPU)
    stage = open_disk_stage(str(tmp_path), layout, N, 80)
    tiers = HostTiers(data, layout, ram, stage)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    for batch in order.split(32):
        rows = tiers.read(batch)
        assert torch.equal(rows[0], X[batch]) and torch.equal(rows[1], Y[batch])
    assert tiers.hits == {"ram": 0, "disk": 0, "source": N}
    for batch in order.flip(0).split(32):
        assert torch.equal(tiers.read(batch)[0], X[batch])
    assert tiers.hits == {"ram": 50, "disk": 80, "source": N + 70}
    assert ram.count == 50 and stage.count == 80
    assert ram.nbytes == 50 * layout.sample_bytes


def test_shrinking_the_ram_cache_demotes_to_the_disk_stage(tmp_path):
    """Pins demotion: samples evicted from RAM by a smaller budget move to the stage while it
    has room, so they are still served from disk, not read again."""
    data = Decoded()
    layout = Layout.of(data)
    tiers = HostTiers(data, layout, SlotStore(layout, N, 40, CPU),
                      open_disk_stage(str(tmp_path), layout, N, 100))
    first = torch.arange(40)
    tiers.read(first)
    assert tiers.shrink_ram(10) == 30
    reads = data.reads
    assert torch.equal(tiers.read(first)[0], X[first])
    assert data.reads == reads and tiers.hits["ram"] == 10 and tiers.hits["disk"] == 30


def test_pack_file_is_unlinked_once_mapped(tmp_path):
    """Pins cleanup: the stage's file disappears from the directory as soon as it is mapped, so
    a crashed run leaves no multi-GB pack file behind, while the mapping keeps working."""
    layout = Layout.of(Decoded())
    stage = open_disk_stage(str(tmp_path), layout, N, 64)
    assert os.listdir(tmp_path) == []
    stage.admit(torch.arange(5), (X[:5], Y[:5]))
    assert torch.equal(stage.read(stage.lookup(torch.arange(5)))[0], X[:5])


def test_unusable_stage_directory_degrades_to_no_stage_with_a_warning(tmp_path, caplog):
    """Pins the degraded path: a stage directory that cannot hold the pack file (here a regular
    file; root ignores permission bits) gives no stage and one warning naming the key."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING):
        assert open_disk_stage(str(blocker), Layout.of(Decoded()), N, 64) is None
    assert len(caplog.records) == 1 and "data.disk_stage_gb" in caplog.text
