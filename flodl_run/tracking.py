"""MLflow tracking from the launcher/coordinator process only (DESIGN §11.4).

Owns the MLflow run of one job: params (batched, short values), tags, per-epoch metrics,
the resolved run.yaml and summary.json as artifacts, and the final status. mlflow is imported
only when tracking is on, so a `tracking=off` run needs no mlflow at all.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

from flodl_run.config.compose import dotted_items
from flodl_run.config.schema import ExperimentConfig, TrackingKind
from flodl_run.observe import Observer
from flodl_run.summary import EpochRecord, Summary

MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
MAX_PARAM_CHARS = 250       # keep values short: long lists belong in run.yaml
STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED",
          "shutdown_with_save": "FAILED"}


def _git_commit(path: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _params(config: ExperimentConfig) -> Dict[str, str]:
    items = dotted_items(config)
    return {k: str(v)[:MAX_PARAM_CHARS] for k, v in items.items()}


class NullTracker(Observer):
    """tracking=off: observes nothing, logs nothing."""

    run_id: Optional[str] = None

    def start(self, config: ExperimentConfig, run_dir: Path) -> None:
        pass

    def finish(self, summary: Summary, run_dir: Path) -> None:
        pass


class MlflowTracker(NullTracker):
    """One MLflow run per job, in the store `tracking.uri` names."""

    def __init__(self, config: ExperimentConfig):
        import mlflow  # lazy: only tracked runs pay for it

        self.mlflow = mlflow
        self.config = config
        self.client = mlflow.MlflowClient(tracking_uri=config.tracking.uri)
        self.run_id: Optional[str] = None

    def _experiment_id(self, run_dir: Path) -> str:
        name = self.config.tracking.experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        uri = self.config.tracking.uri or ""
        location = None
        if uri.startswith("sqlite:///"):  # artifacts beside the local store
            location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def start(self, config: ExperimentConfig, run_dir: Path) -> None:
        from mlflow.entities import Param, RunTag

        run = self.client.create_run(self._experiment_id(run_dir), run_name=config.run_name)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in _params(config).items()]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_PER_BATCH])
        tags = {"mode": config.elche.mode.value, "outer": config.outer.kind.value,
                "emulate_slowdown": str(config.cluster.emulate_slowdown),
                "run_dir": str(run_dir)}
        commit = _git_commit(Path.cwd())
        if commit:
            tags["git_commit"] = commit
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        self.client.log_artifact(self.run_id, str(run_dir / "run.yaml"))

    def on_epoch(self, record: EpochRecord) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {"loss": record.avg_loss, "epoch_ms": record.epoch_ms}
        if record.eval is not None:
            values["eval"] = record.eval
        for r, (rate, share) in enumerate(zip(record.per_rank_throughput, record.per_rank_batch_share)):
            values[f"throughput/rank{r}"] = rate
            values[f"batch_share/rank{r}"] = share
        metrics = [Metric(k, float(v), now, record.epoch) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: Summary, run_dir: Path) -> None:
        if self.run_id is None:
            return
        self.client.set_tag(self.run_id, "devices", ", ".join(summary.devices))
        self.client.set_tag(self.run_id, "world_size", str(summary.world_size))
        self.client.log_artifact(self.run_id, str(run_dir / "summary.json"))
        self.client.set_terminated(self.run_id, STATUS.get(summary.status, "FAILED"))


def make_tracker(config: ExperimentConfig) -> NullTracker:
    if config.tracking.kind is TrackingKind.off:
        return NullTracker()
    return MlflowTracker(config)
