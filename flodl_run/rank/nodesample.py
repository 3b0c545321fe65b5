"""The system metrics over time of a node the launcher does not run on, read by one of its ranks.

The launcher's own node is sampled by MLflow's monitor in the launcher. Every other node (an
SSH worker, a Slurm node) has no MLflow run to log into, so its lowest rank reads MLflow's own
collectors (CPU, memory, disk, network, and each GPU through NVML) every
`tracking.system_metrics_interval_s`, and its heartbeat carries the reading to the coordinator,
which logs it under MLflow's keys. Never raises: a collector that fails is said once and the
rank goes on without node samples.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from flodl_run.contracts.rankenv import LAUNCHER_NODE_ENV, NODE_ENV
from flodl_run.contracts.wire import NodeSample
from flodl_run.hardware.hostinfo import metric_safe

log = logging.getLogger(__name__)

# NODE_ENV: the rank's node as the cluster config (SSH) or Slurm names it, unset for local
# ranks; LAUNCHER_NODE_ENV: the launcher's node under the same naming, the node its MLflow
# monitor already samples. The rank environment's contract names both.


def sampled_node(environ: Mapping[str, str], local_rank: int) -> Optional[str]:
    """The node this rank samples, or None: only the lowest rank (local rank 0) of a node that
    is named (started over SSH or by Slurm) and is not the launcher's samples it, so each node
    is sampled once and none twice. Names compare as MLflow keys do (metric_safe)."""
    node = environ.get(NODE_ENV, "")
    launcher = environ.get(LAUNCHER_NODE_ENV, "")
    if local_rank != 0 or not node or metric_safe(node) == metric_safe(launcher):
        return None
    return node


def mlflow_collectors() -> List[Any]:
    """MLflow's collectors as its SystemMetricsMonitor builds them: CPU and memory, disk,
    network, then NVIDIA GPUs, else AMD ones, else none."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
    from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

    collectors: List[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for gpu in (GPUMonitor, ROCMMonitor):
        try:
            collectors.append(gpu())
            break
        except Exception:  # no pynvml / no NVIDIA driver: try the next kind, as MLflow does
            continue
    return collectors


class NodeSampler:
    """`sample()` once per heartbeat: a NodeSample when `interval_s` has passed since the last
    one, else None. A heartbeat is at most one a second, so an interval below that samples
    once a beat. `start()` builds the collectors on a thread of their own (importing MLflow
    takes seconds: neither the rank's start nor a heartbeat may wait for it); until they are
    built there is nothing to sample."""

    def __init__(self, node: str, interval_s: float,
                 collectors: Callable[[], List[Any]] = mlflow_collectors,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.interval_s = node, interval_s
        self._make, self._clock = collectors, clock
        self._collectors: Optional[List[Any]] = None
        self._last_s: Optional[float] = None
        self._broken = False

    def start(self) -> "NodeSampler":
        threading.Thread(target=self._attempt, args=(self._build,), daemon=True,
                         name="node-sampler").start()
        return self

    def sample(self) -> Optional[NodeSample]:
        if self._broken or self._collectors is None:
            return None
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            return None
        self._last_s = now
        metrics = self._attempt(lambda: self._read(self._collectors or ()))
        return NodeSample(self.node, metrics) if metrics is not None else None

    def _build(self) -> List[Any]:
        collectors = self._make()
        # a first reading only primes psutil's CPU counter (its first percent is always 0.0)
        self._read(collectors)
        self._collectors = collectors
        return collectors

    def _attempt(self, what: Callable[[], Any]) -> Any:
        """`what()`, or None: the first failure (psutil or NVML) is said once and ends the
        node samples; the rank goes on."""
        try:
            return what()
        except Exception as exc:
            self._broken = True
            log.warning("node %s: no system metrics over time (%s: %s)", self.node,
                        type(exc).__name__, exc)
            return None

    def _read(self, collectors: Sequence[Any]) -> Dict[str, float]:
        """One collection, aggregated and cleared, as MLflow's monitor does with one sample
        per logging step."""
        metrics: Dict[str, float] = {}
        for collector in collectors:
            collector.collect_metrics()
            metrics.update(collector.aggregate_metrics())
            collector.clear_metrics()
        return {str(k): float(v) for k, v in metrics.items()}


def node_sampler(environ: Mapping[str, str], local_rank: int, system_metrics: bool,
                 interval_s: float) -> Callable[[], Optional[NodeSample]]:
    """What the heartbeat calls: this rank's node sampler, or nothing when it samples no node
    (another rank of its node does, the launcher's monitor does, or system metrics are off)."""
    node = sampled_node(environ, local_rank) if system_metrics else None
    if node is None:
        return lambda: None
    return NodeSampler(node, interval_s).start().sample
