"""Shared-memory slabs for the coordinator backend: the pieces, then real runs that must train
exactly as the frame path does and leave nothing in /dev/shm."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from flodl_run.averaging.shm import Mapper, Slab, remove_run, run_prefix
from flodl_run.checkpoint import load_model
from tests.test_distributed_cli import _run


def test_a_slab_written_by_one_side_is_read_by_the_other(tmp_path):
    """Pins the round trip through the files: what the writer copies in (two dtype groups, one
    of them empty) is what a Mapper of the same prefix reads, and later writes show through the
    existing mapping (the coordinator maps each slab once)."""
    prefix = str(tmp_path / "run-")
    like = [torch.randn(1000), torch.empty(0, dtype=torch.float64)]
    slab = Slab.create(prefix, "rank0", like)
    assert slab is not None and [os.stat(p).st_mode & 0o777 for p in slab.paths] == [0o600, 0o600]
    slab.write(like)
    mapper = Mapper(prefix)
    seen = mapper.tensors(slab.paths, ["torch.float32", "torch.float64"], [1000, 0])
    assert torch.equal(seen[0], like[0]) and seen[1].numel() == 0
    slab.write([like[0] * 2, like[1]])
    again = mapper.tensors(slab.paths[:1], ["torch.float32"], [1000])
    assert again[0] is seen[0] and torch.equal(seen[0], like[0] * 2)
    remove_run(prefix)
    assert not glob.glob(prefix + "*")


def test_paths_outside_the_run_are_refused(tmp_path):
    """Pins the Mapper's guard: only files under this run's prefix, no path tricks, no mapping
    at all without a prefix."""
    prefix = str(tmp_path / "run-")
    with pytest.raises(ValueError, match="outside this run"):
        Mapper(prefix).tensors(["/etc/passwd"], ["torch.float32"], [4])
    with pytest.raises(ValueError, match="outside this run"):
        Mapper(prefix).tensors([prefix + "x/../../secret"], ["torch.float32"], [4])
    with pytest.raises(ValueError, match="outside this run"):
        Mapper(None).tensors([prefix + "rank0.0"], ["torch.float32"], [4])


def test_no_room_means_frames_and_no_leftover_file(tmp_path, caplog):
    """Pins the fallback: a slab that cannot be created (here: its directory is missing; on a
    full /dev/shm: posix_fallocate's ENOSPC) is None with one warning, and leaves no file."""
    assert Slab.create(str(tmp_path / "missing" / "run-"), "rank0", [torch.zeros(8)]) is None
    assert "parameters travel as frames" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_kill_switch_turns_shared_memory_off(monkeypatch):
    monkeypatch.setenv("FLODL_RUN_SHM", "off")
    assert run_prefix() is None
    monkeypatch.delenv("FLODL_RUN_SHM")
    prefix = run_prefix()
    assert prefix is not None and prefix.startswith("/dev/shm/flodl_run-")


def test_shared_memory_trains_exactly_as_frames_and_cleans_up(tmp_path):
    """Pins the shm path end to end: a homogeneous cpu_sync pair (lockstep, deterministic)
    ends on the same weights through shared memory as through frames (FLODL_RUN_SHM=off), the
    summary says which path each rank took, and no slab is left in /dev/shm."""
    before = set(glob.glob("/dev/shm/flodl_run-*"))
    common = ("cluster=cpu", "cluster.num_ranks=2", "cluster.threads_per_rank=1", "elche=cpu_sync",
              "elche.max_batch_diff=0", "batch_size=64", "num_epochs=1")
    runs = {}
    for name, env in (("shm", dict(os.environ)), ("frames", dict(os.environ, FLODL_RUN_SHM="off"))):
        proc, summary = _run(tmp_path / name, *common, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert summary["param_transport"] == [name, name]
        runs[name] = load_model(tmp_path / name / "run" / "checkpoint")
    for key, value in runs["shm"].items():
        assert torch.equal(value, runs["frames"][key]), key
    assert set(glob.glob("/dev/shm/flodl_run-*")) == before
    assert json.loads((tmp_path / "shm" / "run" / "summary.json").read_text())["syncs"] > 0
