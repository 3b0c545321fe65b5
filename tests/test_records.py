"""The record log: drop-oldest rings under their byte cap, the per-node tree, and I/O errors
that never reach training."""

from __future__ import annotations

import json
import logging
import os

import pytest

from flodl_run.contracts.summary import EpochRecord, ReduceRecord, Summary
from flodl_run.hardware.hostinfo import HostInfo
from flodl_run.report.records import RecordLog, RingFile

HOST = HostInfo("node-a", 4, 8 * 2**30)


def _epoch(epoch: int) -> EpochRecord:
    return EpochRecord(epoch, 1.0 / (epoch + 1), 0.5, 10.0, [300.0, 100.0], [0.75, 0.25])


def _reduce(round_: int) -> ReduceRecord:
    return ReduceRecord(round_, 0, 1.5, 0.01, 10, 1, [30, 10], 0.1, "Stable()", "warmup")


def test_ring_stays_under_its_cap_and_keeps_the_newest_records(tmp_path):
    """Pins the drop-oldest ring: 200x the cap written, the file never exceeds the cap, holds
    only whole JSON lines, in order, ending with the newest record."""
    cap = 4096
    ring = RingFile(tmp_path / "ring.log", cap)
    sizes = []
    for i in range(8000):  # ~100 bytes each: ~800 KB through a 4 KB ring
        ring.append((json.dumps({"i": i, "pad": "x" * 80}) + "\n").encode())
        sizes.append((tmp_path / "ring.log").stat().st_size)
    ring.close()
    assert max(sizes) <= cap
    lines = (tmp_path / "ring.log").read_text().splitlines()
    numbers = [json.loads(line)["i"] for line in lines]
    assert numbers[-1] == 7999 and numbers == list(range(numbers[0], 8000))
    assert len(lines) >= cap // 2 // 100 - 1  # at least the half kept at each rewrite


def test_ring_reopened_on_an_existing_file_keeps_the_cap(tmp_path):
    """Pins that a ring continuing an existing file (a reused record_log_dir) counts the bytes
    already there."""
    path = tmp_path / "ring.log"
    path.write_bytes(b'{"old": 1}\n' * 300)  # 3300 bytes
    ring = RingFile(path, 4096)
    for i in range(200):
        ring.append(b'{"new": %05d}\n' % i)
    ring.close()
    assert path.stat().st_size <= 4096
    assert path.read_bytes().endswith(b'{"new": 00199}\n')


def test_record_log_writes_root_host_and_rank_files(tmp_path):
    """Pins the record log's tree: root.log with every record, root/<host>.log with the host's
    system figures and its share, root/<host>/rank<k>.log with each rank's own numbers."""
    records = RecordLog(tmp_path / "records", 1 << 20, host=HOST)
    records.on_start(2, 40, 2)
    records.on_reduce(_reduce(1))
    records.on_event("phase", "probe -> warmup")
    records.on_epoch(_epoch(0))
    records.finish(Summary(status="completed", world_size=2), tmp_path)

    def read(name):
        return [json.loads(x) for x in (tmp_path / "records" / name).read_text().splitlines()]

    assert [r["kind"] for r in read("root.log")] == ["start", "reduce", "event", "epoch", "end"]
    host = read("root/node-a.log")
    assert host[0]["kind"] == "system" and host[0]["cpu_count"] == 4
    assert host[1]["batch_counts"] == {"0": 30, "1": 10} and host[2]["throughput"] == 400.0
    rank1 = read("root/node-a/rank1.log")
    assert rank1[0] == {**rank1[0], "kind": "reduce", "batch_count": 10, "is_anchor_rank": True}
    assert rank1[1]["throughput"] == 100.0 and rank1[1]["batch_share"] == 0.25


def test_unwritable_directory_warns_once_and_never_raises(tmp_path, caplog):
    """Pins 'an unwritable dir never fails training': the record_log_dir sits under a regular
    file (mkdir fails even for root); every hook still returns, one warning is logged."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    records = RecordLog(blocker / "records", 4096, host=HOST)
    with caplog.at_level(logging.WARNING, logger="flodl_run.report.records"):
        records.on_start(1, 10, 2)
        for i in range(5):
            records.on_reduce(_reduce(i))
            records.on_epoch(_epoch(i))
        records.finish(Summary(), tmp_path)
    assert len([r for r in caplog.records if "record log" in r.getMessage()]) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fake a full disk")
def test_full_disk_warns_once_and_stops_writing(tmp_path, caplog):
    """Pins 'a full disk never fails training': root.log is a link to /dev/full (every write
    gets ENOSPC); the hooks return, one warning, and nothing more is attempted."""
    root = tmp_path / "records"
    root.mkdir()
    (root / "root.log").symlink_to("/dev/full")
    records = RecordLog(root, 4096, host=HOST)
    with caplog.at_level(logging.WARNING, logger="flodl_run.report.records"):
        records.on_start(1, 10, 2)
        records.on_epoch(_epoch(0))
        records.finish(Summary(), tmp_path)
    warnings = [r.getMessage() for r in caplog.records if "record log" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0]
    assert not (root / "root").exists()  # stopped before the host and rank files


def test_nodes_merge_the_gpus_each_rank_saw_and_keep_first_seen_order():
    """Pins the per-node merge of RankJoined facts: ranks pinned to one GPU each add up to the
    node's GPUs (by UUID, in index order, no duplicates), nodes in first-seen order."""
    from flodl_run.contracts.wire import NodeFacts
    from flodl_run.hardware.hostinfo import merge_nodes

    gib = 2**30
    facts = [NodeFacts("b", 64, 512 * gib, [(1, "GPU-y", "NVIDIA A100", 80 * gib)]),
             NodeFacts("a", 16, 128 * gib, []),
             NodeFacts("b", 64, 512 * gib, [(0, "GPU-x", "NVIDIA H200", 141 * gib)]),
             NodeFacts("b", 64, 512 * gib, [(1, "GPU-y", "NVIDIA A100", 80 * gib)])]
    nodes = merge_nodes(facts)
    assert [n.host for n in nodes] == ["b", "a"]
    assert [(g.index, g.uuid) for g in nodes[0].gpus] == [(0, "GPU-x"), (1, "GPU-y")]
    assert nodes[0].metrics()["system/b/gpu0_memory_gib"] == 141.0
    assert nodes[1].gpus == [] and nodes[1].cpu_count == 16


def test_record_log_gets_the_system_record_of_each_other_node(tmp_path):
    """Pins system figures once per node in the record log: a node the ranks report besides the
    launcher's gets a `system` record in root/<host>.log; the launcher's node is not repeated."""
    records = RecordLog(tmp_path / "records", 1 << 20, host=HOST)
    records.on_start(1, 10, 2)
    records.on_nodes([HostInfo("node-a", 4, 8 * 2**30), HostInfo("node-b", 32, 64 * 2**30)])
    records.close()

    def kinds(host):
        lines = (tmp_path / "records" / "root" / f"{host}.log").read_text().splitlines()
        return [json.loads(line) for line in lines]

    assert [r["kind"] for r in kinds("node-a")] == ["system"]
    assert [(r["kind"], r["host"], r["cpu_count"]) for r in kinds("node-b")] == [("system", "node-b", 32)]
