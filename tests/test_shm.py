"""Shared-memory slabs for the coordinator backend: the pieces, then real runs that must train
exactly as the frame path does and leave nothing in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from flodl_run.averaging import shm
from flodl_run.averaging.shm import Mapper, Slab, remove_run, run_prefix
from flodl_run.contracts.checkpoint import load_model
from tests.support import _run


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
    remove_run(prefix)


@pytest.mark.e2e
def test_shared_memory_trains_exactly_as_frames_and_cleans_up(tmp_path):
    """Pins the shm path end to end: a homogeneous cpu_sync pair (lockstep, deterministic)
    ends on the same weights through shared memory as through frames (FLODL_RUN_SHM=off), the
    summary says which path each rank took, and no slab is left in /dev/shm (looked up by the
    launchers' pids: other runs may be under way beside this one)."""
    common = ("cluster=cpu", "cluster.num_ranks=2", "cluster.threads_per_rank=1", "elche=cpu_sync",
              "elche.max_batch_diff=0", "batch_size=64", "num_epochs=1")
    runs = {}
    for name, env in (("shm", dict(os.environ)), ("frames", dict(os.environ, FLODL_RUN_SHM="off"))):
        proc, summary = _run(tmp_path / name, *common, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert summary["param_transport"] == [name, name]
        runs[name] = load_model(tmp_path / name / "run" / "checkpoint")
        assert glob.glob(f"/dev/shm/flodl_run-{proc.pid}-*") == []
    for key, value in runs["shm"].items():
        assert torch.equal(value, runs["frames"][key]), key
    assert json.loads((tmp_path / "shm" / "run" / "summary.json").read_text())["syncs"] > 0


def test_a_run_keeps_its_slabs_in_a_private_unguessable_directory(tmp_path):
    """Pins the fix for a planted file: slabs live in a 0700 directory named with 128 random
    bits, so no other user can list it or put a file where cleanup would trip on it."""
    prefix = run_prefix(str(tmp_path))
    assert prefix.endswith(os.sep) and os.stat(prefix).st_mode & 0o777 == 0o700
    assert len(os.path.basename(prefix[:-1]).rsplit("-", 1)[1]) == 32
    assert Slab.create(prefix, "rank0", [torch.zeros(4)]) is not None
    remove_run(prefix)
    assert list(tmp_path.iterdir()) == []


def test_cleanup_trouble_is_a_warning_and_a_failed_slab_is_warned_once(tmp_path, caplog, monkeypatch):
    """Pins 'a cleanup error never fails a run' and 'no warning storm': a slab file that cannot
    be removed is one warning (remove_run returns), and a prefix where a slab could not be made
    is not tried again (one warning for any number of rounds)."""
    prefix = run_prefix(str(tmp_path))
    Slab.create(prefix, "rank0", [torch.zeros(4)])
    real_unlink = os.unlink

    def refuse(path, *a, **k):
        if path.endswith("rank0.0"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(shm.os, "unlink", refuse)
    remove_run(prefix)
    assert "could not remove" in caplog.text and "Operation not permitted" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    missing = str(tmp_path / "gone") + os.sep
    assert all(Slab.create(missing, "update", [torch.zeros(4)]) is None for _ in range(50))
    assert caplog.text.count("parameters travel as frames") == 1


def test_directories_of_dead_launchers_are_swept_at_start(tmp_path):
    """Pins the sweep: a run directory whose launcher pid is gone (a SIGKILLed launcher) is
    removed when the next run starts; one whose launcher lives is left alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"flodl_run-{dead.pid}-{'a' * 32}"
    live = tmp_path / f"flodl_run-{os.getpid()}-{'b' * 32}"
    for d in (stale, live):
        d.mkdir(mode=0o700)
        (d / "update.0").write_bytes(b"x")
    prefix = run_prefix(str(tmp_path))
    assert not stale.exists() and (live / "update.0").exists()
    remove_run(prefix)
