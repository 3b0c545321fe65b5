"""MLflow tracking from the launcher/coordinator process only.

Owns the MLflow run of one job: params (batched, short values), tags (mode, outer, devices, git
commit of the recipe's repo, the sweep parent), system figures once per node and over time
(MLflow's monitor on the launcher's node, the samples ranks send for the others), per-epoch and
per-reduce metrics (the latter buffered and sent in batches), sub-epoch reports, events, the
artifacts (run.yaml, summary.json, events.jsonl, the dashboard) and the final status. mlflow is
imported only when tracking is on, so a `tracking=off` run needs no mlflow at all.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from flodl_run.config.compose import dotted_items
from flodl_run.config.schema import ExperimentConfig, OuterKind, TrackingConfig, TrackingKind
from flodl_run.contracts.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.contracts.wire import NodeSample
from flodl_run.elche.phase import Phase
from flodl_run.hardware.hostinfo import HostInfo, metric_safe, this_host
from flodl_run.observe.observer import Observer
from flodl_run.report.sendqueue import FIRST_RETRY_S, SendQueue

log = logging.getLogger(__name__)

MAX_PARAMS_PER_BATCH = 100   # MLflow's log_batch limit on params
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit on metrics
MAX_PARAM_CHARS = 250        # keep values short: long lists belong in run.yaml
MAX_TAG_CHARS = 5000         # below every MLflow version's tag value limit
FINISH_WAIT_S = 60.0
"""How long the run's end waits for MLflow to take what is still queued (a store locked a
minute, or a server restarting); past it, what is left is named on the end line."""
STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED",
          "shutdown_with_save": "FAILED"}
# Events that end a run or shrink it; the last one is also a tag (the rest: events.jsonl).
STOP_EVENT_KINDS = ("rank_lost", "rank_forgotten", "shutdown", "shutdown_with_save",
                    "interrupted", "failed")
PHASE_NUMBER = {p.name.lower(): float(p.value) for p in Phase}
VERDICT_NUMBER = {"stable": 0.0, "suppressgrowth": 1.0, "nudgedown": 2.0}
OWN_EPOCH_KEYS = ("loss", "eval", "epoch_ms")
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""The experiment tag MLflow 3's UI reads to choose its layout: runs first, not a GenAI overview."""


def _git(path: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def recipe_git(module: str) -> Dict[str, str]:
    """Commit (and dirtiness) of the git repo holding the recipe module's file; {} outside one.

    The module's own directory decides, not the current directory: a recipe from another
    checkout is versioned by that checkout.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return {}
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None or not origin.is_file():
        return {}
    commit = _git(origin.parent, "rev-parse", "HEAD")
    if not commit:
        return {}
    dirty = _git(origin.parent, "status", "--porcelain", "--untracked-files=no")
    tags = {"git_commit": commit, "mlflow.source.git.commit": commit}
    if dirty is not None:
        tags["git_dirty"] = str(bool(dirty)).lower()
    return tags


def _run_name(config: ExperimentConfig, mode: Optional[str], outer: Optional[str]) -> Optional[str]:
    """The run's name; a default name says what actually trained (`solo-...` in-process)."""
    from flodl_run.config.validate import default_run_name

    if mode is None or config.run_name != default_run_name(config, config.elche.mode.value,
                                                           config.outer.kind.value):
        return config.run_name
    return default_run_name(config, mode, outer or OuterKind.none.value)


def _params(config: ExperimentConfig) -> Dict[str, str]:
    items = dotted_items(config)
    return {k: str(v)[:MAX_PARAM_CHARS] for k, v in items.items()}


def _verdict_number(verdict: str) -> Optional[float]:
    """`Stable()` / `SuppressGrowth()` / `NudgeDown(factor=..)` (or their labels) as 0 / 1 / 2."""
    key = "".join(ch for ch in verdict.split("(")[0].lower() if ch.isalpha())
    return VERDICT_NUMBER.get(key)


def reduce_values(record: ReduceRecord) -> Dict[str, float]:
    """The numbers of one reduce, keyed as logged (`reduce/...`, step = reduce round)."""
    values = {"reduce/anchor": float(record.anchor), "reduce/sync_ms": record.sync_ms,
              "reduce/epoch": float(record.epoch)}
    optional = {"reduce/divergence": record.divergence, "reduce/overhead": record.overhead,
                "reduce/phase": PHASE_NUMBER.get(record.phase),
                "reduce/verdict": _verdict_number(record.verdict),
                "reduce/anchor_rank": record.anchor_rank, "reduce/nudge_factor": record.nudge_factor}
    values.update({k: float(v) for k, v in optional.items() if v is not None})
    for rank, count in enumerate(record.batch_counts):
        values[f"reduce/batches/rank{rank}"] = float(count)
    for name, per_rank in (("cosine", record.cosine), ("magnitude", record.magnitude)):
        values.update({f"reduce/{name}/rank{rank}": float(v) for rank, v in enumerate(per_rank)
                       if v is not None})
    return values


def epoch_values(record: EpochRecord) -> Dict[str, float]:
    """The numbers of one epoch (step = epoch); user scalars under their own name."""
    values = {"loss": record.avg_loss, "epoch_ms": record.epoch_ms}
    if record.eval is not None:
        values["eval"] = record.eval
    for r, (rate, share) in enumerate(zip(record.per_rank_throughput, record.per_rank_batch_share)):
        values[f"throughput/rank{r}"] = rate
        values[f"batch_share/rank{r}"] = share
    for r, starve_ms in enumerate(record.per_rank_data_starve_ms):
        values[f"data_starve_ms/rank{r}"] = starve_ms
    for r, delivery in enumerate(record.per_rank_delivery):
        values[f"data_resident/rank{r}"] = float(delivery == "resident")
    for r, rates in enumerate(record.per_rank_cache_hit_rate):
        values.update({f"cache_hit/{tier}/rank{r}": rate for tier, rate in rates.items()})
    for name, value in record.scalars.items():
        key = metric_safe(name)
        values[f"user/{key}" if key in OWN_EPOCH_KEYS or key in values else key] = value
    return values


def _resumed_run_id(resume_from: Optional[str]) -> Optional[str]:
    if not resume_from:
        return None
    from flodl_run.contracts.checkpoint import BundleError, read_meta

    try:
        return read_meta(resume_from).mlflow_run_id
    except BundleError:
        return None


class NullTracker(Observer):
    """tracking=off: observes nothing, logs nothing."""

    run_id: Optional[str] = None

    def start(self, config: ExperimentConfig, run_dir: Path, mode: Optional[str] = None,
              outer: Optional[str] = None) -> None:
        pass

    def finish(self, summary: Summary, run_dir: Path) -> None:
        pass

    def unwritten(self) -> Optional[str]:
        """What of the run never reached the tracking store; None when everything did."""
        return None


def quiet_mlflow_info() -> None:
    """MLflow's own INFO lines (`Creating initial MLflow database tables...` on a new store, the
    system-metrics monitor's start and stop) stay off the terminal: the run's last line says
    where its MLflow run is. Its warnings and errors still show. MLFLOW_LOGGING_LEVEL, when the
    user sets it, wins."""
    if not os.environ.get("MLFLOW_LOGGING_LEVEL"):
        logging.getLogger("mlflow").setLevel(logging.WARNING)


class MlflowTracker(NullTracker):
    """One MLflow run per job, in the store `tracking.uri` names.

    Hooks run on the coordinator's thread during training and only queue what they log: a
    sender thread (SendQueue) writes it, in order, and keeps it through an outage of the store
    (a lock, a server gone), trying again until it goes. At the end the tracker waits up to
    `finish_wait_s` for the queue; what never went is named by `unwritten()` (for the run's end
    line) and, when the outcome itself did, in the run's `tracking_incomplete` tag. The run is
    set FINISHED (or KILLED, FAILED) only after its outcome tags went. Errors in `start` do
    propagate: a store that cannot be reached is reported before any work is done.
    """

    output = "the MLflow run"

    def __init__(self, tracking: TrackingConfig, artifacts: Sequence[str] = (),
                 parent_of: Callable[[Any, str], Optional[str]] = lambda client, experiment_id: None,
                 finish_wait_s: float = FINISH_WAIT_S, first_retry_s: float = FIRST_RETRY_S):
        """`artifacts`: files of the run dir (the dashboard, the timeline) uploaded at the end
        when the run wrote them; `parent_of(client, experiment id)`: the run's parent (a sweep's);
        `finish_wait_s`: how long the end waits for what is still queued; `first_retry_s`: the
        first wait before a failed send is tried again (doubling from there)."""
        import mlflow  # lazy: only tracked runs pay for it

        quiet_mlflow_info()
        self.tracking, self.artifacts, self.parent_of = tracking, tuple(artifacts), parent_of
        self.client = mlflow.MlflowClient(tracking_uri=tracking.uri)
        self.run_id: Optional[str] = None
        self.finish_wait_s = finish_wait_s
        self.queue = SendQueue("mlflow", first_retry_s=first_retry_s)
        self._pending: List[Any] = []  # per-reduce Metric objects not queued yet
        self._events: List[Dict[str, Any]] = []
        self._nodes_logged: Set[str] = set()
        self._monitor: Optional[Any] = None  # MLflow's system-metrics monitor of this host
        self._busy_steps: Dict[int, int] = {}  # per rank: its busy samples so far
        self._node_samples = NodeSamples()  # the other nodes' system metrics over time

    # ---- start ------------------------------------------------------------------------------

    def experiment_id(self) -> str:
        """The experiment's id, created when new; either way it is marked a model-training one
        (unless it says otherwise), so MLflow 3's UI opens it on its runs, not on GenAI traces."""
        name = self.tracking.experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if EXPERIMENT_KIND[0] not in found.tags:
                self.client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
            return found.experiment_id
        uri = self.tracking.uri or ""
        location = None
        if uri.startswith("sqlite:///"):  # artifacts beside the local store
            location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location,
                                             tags=dict([EXPERIMENT_KIND]))

    def _start_tags(self, config: ExperimentConfig, run_dir: Path, mode: Optional[str],
                    outer: Optional[str]) -> Dict[str, str]:
        tags = {"mode": mode or config.elche.mode.value, "outer": outer or config.outer.kind.value,
                "emulate_slowdown": str(config.cluster.emulate_slowdown),
                "emulate_jitter": str(config.cluster.emulate_jitter),
                "run_dir": str(run_dir)}
        tags.update(recipe_git(config.recipe.module))
        return tags

    def start(self, config: ExperimentConfig, run_dir: Path, mode: Optional[str] = None,
              outer: Optional[str] = None) -> None:
        """Create the run; `mode`/`outer` are what actually trains when that is not the config's
        (an in-process run is `solo`/`none`, as summary.json says)."""
        from mlflow.entities import Param

        experiment_id = self.experiment_id()
        tags = self._start_tags(config, run_dir, mode, outer)
        parent = self.parent_of(self.client, experiment_id)
        if parent is not None:
            tags["mlflow.parentRunId"] = parent
        resumed = _resumed_run_id(config.resume_from)
        if resumed:
            tags["resumed_from_run_id"] = resumed  # a resume is a new run linked to the old one
        run = self.client.create_run(experiment_id, run_name=_run_name(config, mode, outer), tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in _params(config).items()]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_PER_BATCH])
        self.client.log_artifact(self.run_id, str(run_dir / "run.yaml"))
        if config.tracking.system_metrics:
            self._log_system()
            self._monitor = start_monitor(self.run_id, self.tracking)

    def _log_system(self, host: Optional[HostInfo] = None) -> None:
        """Once per node: the launcher's at start, the ranks' nodes when they have joined."""
        from mlflow.entities import RunTag

        host = host or this_host()
        if host.host in self._nodes_logged:
            return
        self._send(host.metrics(), step=0)
        if host.tags():
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in host.tags().items()])
        self._nodes_logged.add(host.host)  # after the sends: a failed one is sent again

    # ---- during training (coordinator thread) -----------------------------------------------

    def _guarded(self, what: str, fn: Callable[[], None], size: int = 1) -> None:
        """Queue `fn` for the sender thread (`size`: the metrics it sends)."""
        if self.run_id is not None:
            self.queue.put(what, fn, size)

    def _metrics(self, values: Dict[str, float], step: int) -> List[Any]:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        return [Metric(k, float(v), now, step) for k, v in values.items()]

    def _send(self, values: Dict[str, float], step: int) -> None:
        self._send_metrics(self._metrics(values, step))

    def _send_metrics(self, metrics: List[Any]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def _flush(self) -> None:
        """Queue the reduce metrics gathered so far as one send."""
        pending, self._pending = self._pending, []
        if pending:
            self._guarded("logging reduce metrics", lambda: self._send_metrics(pending), len(pending))

    def on_reduce(self, record: ReduceRecord) -> None:
        """Buffered: one log_batch per MAX_METRICS_PER_BATCH metrics (and at each epoch end)."""
        self._pending.extend(self._metrics(reduce_values(record), record.round))
        if len(self._pending) >= MAX_METRICS_PER_BATCH:
            self._flush()

    def on_busy(self, rank: int, busy_percent: float) -> None:
        """`utilization/rank<k>` over time (step = the rank's sample, one per heartbeat),
        buffered with the reduce metrics."""
        step = self._busy_steps.get(rank, 0)
        self._busy_steps[rank] = step + 1
        self._pending.extend(self._metrics({f"utilization/rank{rank}": busy_percent}, step))

    def on_node_sample(self, rank: int, sample: NodeSample) -> None:
        """`system/<node>/<metric>` over time for a node the launcher does not run on, as
        MLflow's monitor logs the launcher's node (buffered with the reduce metrics)."""
        if self.tracking.system_metrics:
            own = self._monitor.node_id if self._monitor is not None else None
            values = self._node_samples.keyed(rank, sample, own)
            if values is not None:
                self._pending.extend(self._metrics(*values))

    def on_report(self, record: ReportRecord) -> None:
        values = {"report/loss": record.avg_loss, "report/epoch": record.epoch + record.fraction}
        values.update({f"report/{metric_safe(k)}": v for k, v in record.scalars.items()})
        metrics = self._metrics(values, record.global_step)
        self._guarded("logging a report", lambda: self._send_metrics(metrics), len(metrics))

    def on_epoch(self, record: EpochRecord) -> None:
        pending, self._pending = self._pending, []
        metrics = pending + self._metrics(epoch_values(record), record.epoch)
        self._guarded("logging epoch metrics", lambda: self._send_metrics(metrics), len(metrics))

    def on_event(self, kind: str, message: str) -> None:
        self._events.append({"time": time.time(), "kind": kind, "message": message})

    def on_nodes(self, nodes: List[HostInfo]) -> None:
        def log() -> None:
            for node in nodes:
                self._log_system(node)

        if self.tracking.system_metrics:
            self._guarded("logging system metrics", log)

    # ---- teardown ---------------------------------------------------------------------------

    def finish(self, summary: Summary, run_dir: Path) -> None:
        """Queue what is left, the outcome and the end status (in that order: the run is never
        ended without its outcome), then wait up to `finish_wait_s` for all of it to go."""
        if self.run_id is None:
            return
        if summary.status != "completed":
            self.on_event(summary.status, summary.message or summary.status)
        self._flush()
        if self._monitor is not None:  # its last samples go in before the run ends
            self._guarded("ending the system-metrics monitor", self._monitor.finish)
        self._guarded("logging the run's outcome", lambda: self._log_outcome(summary, run_dir))
        status = STATUS.get(summary.status, "FAILED")
        self._guarded("ending the run", lambda: self.client.set_terminated(self.run_id, status))
        if not self.queue.drain(self.finish_wait_s):
            log.warning("mlflow: the store did not take what was left within %.0f s; run %s is "
                        "incomplete there (summary.json has the outcome)", self.finish_wait_s, self.run_id)
        self.queue.close()

    def unwritten(self) -> Optional[str]:
        """What of the run never reached MLflow (None: everything did), for the end line."""
        lost = self.queue.lost()
        if not lost:
            return None
        said = "; ".join(f"{what} x{count}" if count > 1 else what for what, count in lost.items())
        if "ending the run" in lost:
            said += " (MLflow shows the run RUNNING: its outcome is in summary.json)"
        return f"run {self.run_id} did not get: {said}"

    def _log_outcome(self, summary: Summary, run_dir: Path) -> None:
        from mlflow.entities import RunTag

        tags = {"devices": ", ".join(summary.devices), "world_size": str(summary.world_size),
                "status": summary.status}
        if summary.compiled_graphs:  # recipe.compile: how many graphs, and any eager fallback
            tags["compiled_graphs"] = " ".join(str(n) for n in summary.compiled_graphs)
            tags["eager_frames"] = " ".join(str(n) for n in summary.eager_frames)
        lost = self.queue.lost()
        if lost:  # dropped for room during a long outage: the run says it is not whole
            tags["tracking_incomplete"] = ", ".join(f"{what} x{count}" for what, count in lost.items())
        stops = [e for e in self._events if e["kind"] in STOP_EVENT_KINDS]
        if stops:
            tags["last_event"] = f"{stops[-1]['kind']}: {stops[-1]['message']}"[:MAX_TAG_CHARS]
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        if self._events:
            self.client.log_text(self.run_id, "".join(json.dumps(e) + "\n" for e in self._events),
                                 "events.jsonl")
        self.client.log_artifact(self.run_id, str(run_dir / "summary.json"))
        for name in self.artifacts:
            if (run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(run_dir / name))


class NodeSamples:
    """Steps and keys of the node samples ranks send: `system/<node id>/<metric>` with MLflow's
    metric names and node id the node's name made metric-safe, step 0, 1, 2, ... per node as
    MLflow's monitor counts its logging steps. The first rank heard for a node speaks for it
    (two workers of one host must not interleave steps of one key); the launcher's own node id is
    its monitor's alone."""

    def __init__(self) -> None:
        self._speaker: Dict[str, int] = {}
        self._steps: Dict[str, int] = {}

    def keyed(self, rank: int, sample: NodeSample,
              own: Optional[str]) -> Optional[Tuple[Dict[str, float], int]]:
        """(values by key, step) of one sample; None when it is not this rank's to log."""
        node = metric_safe(sample.node)
        if node == own or self._speaker.setdefault(node, rank) != rank:
            return None
        step = self._steps.get(node, 0)
        self._steps[node] = step + 1
        return {f"system/{node}/{metric_safe(k)}": v for k, v in sample.metrics.items()}, step


def start_monitor(run_id: str, tracking: TrackingConfig) -> Optional[Any]:
    """MLflow's system-metrics monitor for this host, logging `system/<host>/...` (the node id
    the once-per-node figures use) every `tracking.system_metrics_interval_s` into the run; None
    (said once) where it cannot run."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=tracking.system_metrics_interval_s,
                                       node_id=metric_safe(this_host().host), tracking_uri=tracking.uri)
        monitor.start()
    except Exception as exc:  # psutil missing, an MLflow without the monitor: the run goes on
        log.warning("mlflow: no system metrics over time (%s: %s)", type(exc).__name__, exc)
        return None
    return monitor


def make_tracker(tracking: TrackingConfig, artifacts: Sequence[str] = (),
                 parent_of: Optional[Callable[[Any, str], Optional[str]]] = None) -> NullTracker:
    """The run's tracker: nothing for `tracking=off`, else MLflow uploading `artifacts` (files
    of the run dir) at the end when they exist, its run the child of `parent_of(client,
    experiment id)` when that names one (a sweep's parent, `report.sweep.parent_run_id`)."""
    if tracking.kind is TrackingKind.off:
        return NullTracker()
    if parent_of is None:
        return MlflowTracker(tracking, artifacts)
    return MlflowTracker(tracking, artifacts, parent_of=parent_of)


SERVER_PROBE_S = 3.0
"""How long the start waits for a tracking server's answer: MLflow's own client retries a
refused connection for minutes before it fails."""


def unreachable_server(tracking: TrackingConfig) -> Optional[str]:
    """Why the tracking server at an http(s) `tracking.uri` cannot be reached, or None (also for
    local stores and `tracking=off`). Any HTTP answer counts as reached, an error status too."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    uri = tracking.uri or ""
    if tracking.kind is TrackingKind.off or not uri.startswith(("http://", "https://")):
        return None
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=SERVER_PROBE_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        where = urlsplit(uri)
        return (f"must reach an MLflow tracking server ({where.netloc}: {reason}): start one "
                f"(mlflow server --host {where.hostname} --port {where.port or 5000}), or log "
                f"to the local store with tracking=mlflow, or not at all with tracking=off")
    return None
