"""The record log (`record_log_dir`): JSONL files in a tree per node.

`root.log` holds the run's records (start, epochs, reduces, reports, events, end),
`root/<host>.log` each host's share of them and its system figures, and
`root/<host>/rank<k>.log` each rank's. Every file is a drop-oldest ring of at most
`max_log_size` bytes. Written from the launcher process through the Observer hooks; an I/O
error (unwritable directory, full disk) is warned about once and ends the log, never the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any, Dict, List, Optional

from flodl_run.config.schema import ClusterConfig, Topology
from flodl_run.contracts.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.hardware.hostinfo import HostInfo, this_host
from flodl_run.observe.observer import Observer

log = logging.getLogger(__name__)


class RingFile:
    """One JSONL file kept at or under `max_bytes`: when the next line would not fit, the newest
    lines that fill half the cap are kept and the rest dropped (so rewrites are rare)."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self._file: Optional[IO[bytes]] = None
        self._size = 0

    def append(self, line: bytes) -> None:
        """Add one line (ending in a newline). A line longer than the cap is dropped. Raises OSError."""
        if len(line) > self.max_bytes:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
            self._size = self._file.tell()
        if self._size + len(line) > self.max_bytes:
            self._drop_oldest(keep=min(self.max_bytes // 2, self.max_bytes - len(line)))
        self._file.write(line)
        self._file.flush()  # a crash keeps every record written so far
        self._size += len(line)

    def _drop_oldest(self, keep: int) -> None:
        """Rewrite the file with its newest whole lines totalling <= keep bytes (atomic rename)."""
        self._file.close()
        self._file = None
        with open(self.path, "rb") as f:
            f.seek(max(0, self._size - keep))
            tail = f.read()
        if self._size > keep:  # started mid-line: drop the partial first line
            cut = tail.find(b"\n")
            tail = tail[cut + 1:] if cut >= 0 else b""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(tail)
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self._size = len(tail)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def rank_hosts(cluster: ClusterConfig, world_size: int, local_host: str) -> List[str]:
    """Host of each global rank: workers in order for multi-host clusters (explicit device lists),
    this host otherwise."""
    if cluster.topology is Topology.hosts:
        hosts = [w.host for w in cluster.workers if isinstance(w.local_devices, (list, tuple))
                 for _ in w.local_devices]
        if len(hosts) == world_size:
            return hosts
    return [local_host] * world_size


class RecordLog(Observer):
    """The Observer writing the tree; `finish(summary, run_dir)` writes the end records.

    `cluster` places each rank on its worker host in the records (None: all on this host)."""

    output = "the record log"

    def __init__(self, root: Path, max_bytes: int, cluster: Optional[ClusterConfig] = None,
                 host: Optional[HostInfo] = None):
        self.root, self.max_bytes, self.cluster = Path(root), max_bytes, cluster
        self.host = host
        self.hosts: List[str] = []
        self._files: Dict[str, RingFile] = {}
        self._broken = False

    # ---- writing ----------------------------------------------------------------------------

    def _file(self, name: str) -> RingFile:
        if name not in self._files:
            self._files[name] = RingFile(self.root / name, self.max_bytes)
        return self._files[name]

    def _write(self, name: str, kind: str, fields: Dict[str, Any]) -> None:
        if self._broken:
            return
        line = json.dumps(_finite({"time": round(time.time(), 3), "kind": kind, **fields}),
                          default=str) + "\n"
        try:
            self._file(name).append(line.encode())
        except OSError as exc:
            self._broken = True
            self.close()
            log.warning("record log %s: %s; record logging stops, training goes on",
                        self.root, exc)

    def _root(self, kind: str, fields: Dict[str, Any]) -> None:
        self._write("root.log", kind, fields)

    def _host(self, host: str, kind: str, fields: Dict[str, Any]) -> None:
        self._write(f"root/{host}.log", kind, fields)

    def _rank(self, rank: int, kind: str, fields: Dict[str, Any]) -> None:
        self._write(f"root/{self.hosts[rank]}/rank{rank}.log", kind, fields)

    def _ranks_by_host(self, n: int) -> Dict[str, List[int]]:
        if len(self.hosts) < n:  # a record wider than on_start said: put the rest on this host
            self.hosts += [self._local()] * (n - len(self.hosts))
        grouped: Dict[str, List[int]] = {}
        for rank in range(n):
            grouped.setdefault(self.hosts[rank], []).append(rank)
        return grouped

    def _local(self) -> str:
        if self.host is None:
            self.host = this_host()
        return self.host.host

    # ---- hooks ------------------------------------------------------------------------------

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        local = self._local()
        self.hosts = (rank_hosts(self.cluster, world_size, local) if self.cluster is not None
                      else [local] * world_size)
        self._root("start", {"total_epochs": total_epochs, "batches_per_epoch": batches_per_epoch,
                             "world_size": world_size, "hosts": self.hosts})
        self._host(local, "system", self.host.record())

    def on_nodes(self, nodes: List[HostInfo]) -> None:
        for node in nodes:  # the launcher's node wrote its own at start
            if node.host != self._local():
                self._host(node.host, "system", node.record())

    def on_epoch(self, record: EpochRecord) -> None:
        self._root("epoch", dataclasses.asdict(record))
        rates, shares = record.per_rank_throughput, record.per_rank_batch_share
        for host, ranks in self._ranks_by_host(len(rates)).items():
            self._host(host, "epoch", {"epoch": record.epoch, "ranks": ranks,
                                       "throughput": sum(rates[r] for r in ranks),
                                       "batch_share": sum(shares[r] for r in ranks)})
            for r in ranks:
                self._rank(r, "epoch", {"epoch": record.epoch, "throughput": rates[r],
                                        "batch_share": shares[r]})

    def on_reduce(self, record: ReduceRecord) -> None:
        self._root("reduce", dataclasses.asdict(record))
        counts = record.batch_counts
        for host, ranks in self._ranks_by_host(len(counts)).items():
            self._host(host, "reduce", {"round": record.round, "epoch": record.epoch,
                                        "batch_counts": {str(r): counts[r] for r in ranks}})
            for r in ranks:
                self._rank(r, "reduce", {"round": record.round, "epoch": record.epoch,
                                         "batch_count": counts[r],
                                         "is_anchor_rank": record.anchor_rank == r})

    def on_report(self, record: ReportRecord) -> None:
        self._root("report", dataclasses.asdict(record))

    def on_event(self, kind: str, message: str) -> None:
        self._root("event", {"event": kind, "message": message})

    def finish(self, summary: Summary, run_dir: Path) -> None:
        self._root("end", {k: v for k, v in dataclasses.asdict(summary).items() if k != "epochs"})
        self.close()

    def close(self) -> None:
        for ring in self._files.values():
            try:
                ring.close()
            except OSError:
                pass


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: such floats become null (as in summary.json)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
