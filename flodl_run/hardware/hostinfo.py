"""Facts about this node for tracking and the record log: host name, CPUs, RAM, GPUs.

Owns reading them once, cheaply: in the launcher for its own node, in each rank for the node
it runs on (sent with RankJoined, merged per node by the coordinator). GPUs come through NVML
(`devices`), never through torch.cuda, so no CUDA context is created. It does not sample
anything over time.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from flodl_run.contracts.wire import NodeFacts
from flodl_run.hardware.devices import GpuInfo, visible_gpus

GIB = 2**30


@dataclass(frozen=True)
class HostInfo:
    host: str
    cpu_count: int
    ram_bytes: Optional[int]
    """Physical memory; None where the OS does not say."""
    gpus: List[GpuInfo] = field(default_factory=list)

    def metrics(self) -> Dict[str, float]:
        """Numeric figures keyed for MLflow (`system/<host>/...`)."""
        prefix = f"system/{metric_safe(self.host)}"
        values = {f"{prefix}/cpu_count": float(self.cpu_count),
                  f"{prefix}/num_gpus": float(len(self.gpus))}
        if self.ram_bytes is not None:
            values[f"{prefix}/ram_gib"] = self.ram_bytes / GIB
        for gpu in self.gpus:
            values[f"{prefix}/gpu{gpu.index}_memory_gib"] = gpu.memory_bytes / GIB
        return values

    def tags(self) -> Dict[str, str]:
        """The GPU names (text, so tags rather than metrics)."""
        prefix = f"system/{metric_safe(self.host)}"
        return {f"{prefix}/gpu{gpu.index}": gpu.name for gpu in self.gpus}

    def record(self) -> Dict[str, object]:
        """A JSON-ready dict for the record log."""
        return {"host": self.host, "cpu_count": self.cpu_count, "ram_bytes": self.ram_bytes,
                "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes}
                         for g in self.gpus]}


def metric_safe(text: str) -> str:
    """MLflow keys allow letters, digits, `_ - . / ` and space; anything else becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", text)


def _ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown here
        return None


def this_host(with_gpus: bool = True) -> HostInfo:
    """The launcher's node. `with_gpus=False` skips NVML (CPU-only topologies)."""
    return HostInfo(socket.gethostname(), os.cpu_count() or 1, _ram_bytes(),
                    visible_gpus() if with_gpus else [])


def node_facts(with_gpus: bool) -> NodeFacts:
    """What a rank says of its node. The launcher names SSH-started ranks' nodes as the cluster
    config does (FLODL_RUN_NODE), so metrics, record log and config agree on host names."""
    host = this_host(with_gpus)
    return NodeFacts(os.environ.get("FLODL_RUN_NODE") or host.host, host.cpu_count,
                     host.ram_bytes, [(g.index, g.uuid, g.name, g.memory_bytes) for g in host.gpus])


def merge_nodes(facts: Iterable[NodeFacts]) -> List[HostInfo]:
    """One HostInfo per node, in first-seen order; a node's GPUs are the union of what its
    ranks saw (each rank pinned to one GPU sees only that one)."""
    nodes: Dict[str, HostInfo] = {}
    for f in facts:
        node = nodes.setdefault(f.name, HostInfo(f.name, f.cpu_count, f.ram_bytes, []))
        known = {g.uuid for g in node.gpus}
        node.gpus.extend(GpuInfo(i, uuid, name, mem) for i, uuid, name, mem in f.gpus if uuid not in known)
        node.gpus.sort(key=lambda g: g.index)
    return list(nodes.values())
