"""System metrics over time of the nodes the launcher does not run on: which rank samples its
node, what a sample holds (MLflow's own collectors and names), how a failing collector is
survived, and the keys and steps the tracker logs the samples under."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import msgspec

from flodl_run.contracts.wire import Heartbeat, NodeSample
from flodl_run.rank.nodesample import NodeSampler, mlflow_collectors, node_sampler, sampled_node
from flodl_run.report.tracking import NodeSamples

LAUNCHER = {"FLODL_RUN_LAUNCHER_NODE": "launcher.invalid"}


class _Collector:
    """A collector with MLflow's interface (collect, aggregate, clear) reading a counter."""

    def __init__(self, name: str):
        self.name, self.reads = name, 0
        self._metrics = defaultdict(list)

    def collect_metrics(self):
        self.reads += 1
        self._metrics[self.name].append(float(self.reads))

    def aggregate_metrics(self):
        return {k: sum(v) / len(v) for k, v in self._metrics.items()}

    def clear_metrics(self):
        self._metrics.clear()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _built(sampler: NodeSampler) -> NodeSampler:
    """`start()`, waited for: the collectors are built on a thread of their own."""
    sampler.start()
    for thread in threading.enumerate():
        if thread.name == "node-sampler":
            thread.join(timeout=30)
    return sampler


def test_only_the_lowest_rank_of_a_node_other_than_the_launchers_samples_it():
    """Pins who samples: local rank 0 of a named node (SSH worker, Slurm node); not its other
    ranks (one sampler per node), not a node named as the launcher's (its MLflow monitor
    samples that one, also when the names differ only where MLflow keys cannot), not an unnamed
    local rank."""
    worker = {**LAUNCHER, "FLODL_RUN_NODE": "127.0.0.2"}
    assert sampled_node(worker, 0) == "127.0.0.2"
    assert sampled_node(worker, 1) is None
    assert sampled_node({**LAUNCHER, "FLODL_RUN_NODE": "launcher.invalid"}, 0) is None
    assert sampled_node({"FLODL_RUN_LAUNCHER_NODE": "gpu:a", "FLODL_RUN_NODE": "gpu_a"}, 0) is None
    assert sampled_node(LAUNCHER, 0) is None
    assert sampled_node({**LAUNCHER, "FLODL_RUN_NODE": ""}, 0) is None


def test_system_metrics_off_samples_nothing():
    """Pins `tracking.system_metrics=false`: the heartbeat's node sample is always None and no
    sampler thread starts, even on the rank that would sample."""
    before = {t.name for t in threading.enumerate()}
    sample = node_sampler({**LAUNCHER, "FLODL_RUN_NODE": "127.0.0.2"}, 0, False, 0.5)
    assert sample() is None
    assert "node-sampler" not in {t.name for t in threading.enumerate()} - before


def test_samples_come_every_interval_from_the_collectors_aggregated_and_cleared():
    """Pins the sampling: nothing before the collectors are built, then one sample at the first
    beat and the next only once the interval has passed; each sample is one collection of every
    collector under MLflow's metric names, after one priming read that is not sent."""
    cpu, gpu = _Collector("cpu_utilization_percentage"), _Collector("gpu_0_utilization_percentage")
    clock = _Clock()
    sampler = NodeSampler("127.0.0.2", 10.0, collectors=lambda: [cpu, gpu], clock=clock)
    assert sampler.sample() is None  # not started: nothing to read yet
    _built(sampler)
    first = sampler.sample()
    assert first == NodeSample("127.0.0.2", {"cpu_utilization_percentage": 2.0,
                                             "gpu_0_utilization_percentage": 2.0})
    clock.now += 9.9
    assert sampler.sample() is None
    clock.now += 0.1
    assert sampler.sample().metrics == {"cpu_utilization_percentage": 3.0,
                                        "gpu_0_utilization_percentage": 3.0}
    assert cpu.reads == gpu.reads == 3


def test_a_failing_collector_is_said_once_and_never_raises(caplog):
    """Pins that the sampler never stops a rank: a collector that raises (NVML gone) gives no
    sample, one warning naming the node, and no further reads."""

    class Broken(_Collector):
        def collect_metrics(self):
            super().collect_metrics()
            if self.reads > 1:
                raise RuntimeError("NVML: GPU is lost")

    broken, clock = Broken("gpu_0_utilization_percentage"), _Clock()
    sampler = _built(NodeSampler("gpu-b.invalid", 1.0, collectors=lambda: [broken], clock=clock))
    with caplog.at_level(logging.WARNING, logger="flodl_run.rank.nodesample"):
        assert sampler.sample() is None
        clock.now += 5
        assert sampler.sample() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "gpu-b.invalid" in warnings[0] and "GPU is lost" in warnings[0]
    assert broken.reads == 2


def test_a_collector_that_cannot_be_built_is_said_once(caplog):
    """Pins a node without psutil (or an MLflow without collectors): no samples, one warning."""

    def missing():
        raise ImportError("No module named 'psutil'")

    with caplog.at_level(logging.WARNING, logger="flodl_run.rank.nodesample"):
        sampler = _built(NodeSampler("gpu-b.invalid", 1.0, collectors=missing))
        assert sampler.sample() is None
    assert [r.getMessage() for r in caplog.records] == [
        "node gpu-b.invalid: no system metrics over time (ImportError: No module named 'psutil')"]


def test_mlflows_own_collectors_give_its_metric_names():
    """Pins that the samples are MLflow's: its CPU, memory, disk and network collectors (and
    NVML's where there is a GPU), read under the names its monitor logs."""
    sampler = _built(NodeSampler("127.0.0.2", 1.0, collectors=mlflow_collectors))
    metrics = sampler.sample().metrics
    for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes",
                 "system_memory_usage_percentage", "disk_usage_percentage",
                 "network_receive_megabytes", "network_transmit_megabytes"):
        assert name in metrics, name
    assert 0.0 <= metrics["cpu_utilization_percentage"] <= 100.0
    assert metrics["system_memory_usage_megabytes"] > 0


def test_a_node_sample_travels_on_the_heartbeat():
    """Pins the wire: the sample decodes back whole on a Heartbeat; beats without one stay
    decodable (and are None)."""
    beat = Heartbeat(2, 40, True, 55.0, NodeSample("127.0.0.3", {"cpu_utilization_percentage": 12.5}))
    codec = msgspec.msgpack
    assert codec.decode(codec.encode(beat), type=Heartbeat) == beat
    assert codec.decode(codec.encode(Heartbeat(1)), type=Heartbeat).node_sample is None


def test_node_samples_are_keyed_as_mlflows_monitor_keys_them():
    """Pins the keys and steps: `system/<node id>/<metric>` with the node's name made
    metric-safe, steps 0, 1, ... per node; the first rank heard for a node is the only one
    logged for it, and the launcher's own node id is left to its monitor."""
    samples = NodeSamples()
    a = NodeSample("gpu-b:7", {"cpu_utilization_percentage": 30.0, "gpu_0_power_usage_watts": 80.0})
    assert samples.keyed(3, a, "launcher") == ({"system/gpu-b_7/cpu_utilization_percentage": 30.0,
                                                "system/gpu-b_7/gpu_0_power_usage_watts": 80.0}, 0)
    assert samples.keyed(3, a, "launcher")[1] == 1
    assert samples.keyed(4, a, "launcher") is None  # another rank of the same node
    other = NodeSample("127.0.0.3", {"cpu_utilization_percentage": 5.0})
    assert samples.keyed(4, other, "launcher") == ({"system/127.0.0.3/cpu_utilization_percentage": 5.0}, 0)
    assert samples.keyed(3, a, "launcher")[1] == 2
    assert samples.keyed(0, NodeSample("launcher", {"x": 1.0}), "launcher") is None
