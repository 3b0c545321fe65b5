"""MLflow for the benchmark: one parent run per bench, one child per entry.

Owns what the bench logs: the parent's params (the bench config), tags and artifacts
(bench.json, bench.md, the plot); each child's per-epoch metrics from its summary.json and its
bench figures (samples/s, ratios, time-to-target, ...). The runs themselves train with
tracking=off, so only this process talks to MLflow. `tracking=off` logs nothing.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from flodl_run.config.schema import TrackingConfig, TrackingKind
from flodl_run.contracts.summary import EpochRecord
from flodl_run.report.tracking import MAX_PARAM_CHARS, MAX_TAG_CHARS, MlflowTracker, epoch_values

FIGURES = ("samples_per_s", "ratio_to_ideal", "ratio_to_torch_ddp", "ratio_to_torch_localsgd",
           "final_loss", "final_eval", "time_to_ddp_quality_s", "x_ddp_to_quality",
           "time_to_target_s",
           "wall_s", "train_s", "loss_drop_per_s", "syncs", "avg_sync_ms")


class BenchTracker:
    """tracking=off: logs nothing."""

    run_id: Optional[str] = None

    def start(self, params: Dict[str, Any], tags: Dict[str, str]) -> None:
        pass

    def log_entries(self, entries: Sequence[Dict[str, Any]],
                    summaries: Sequence[Dict[str, Any]]) -> None:
        pass

    def finish(self, files: Sequence[Path], status: str) -> None:
        pass


class MlflowBenchTracker(BenchTracker):
    """Parent and children in the store and experiment `tracking` names (as the runner's)."""

    def __init__(self, tracking: TrackingConfig):
        # The runner's tracker finds or creates the experiment (artifacts beside a local store).
        self._runner = MlflowTracker(tracking)
        self.client = self._runner.client
        self.experiment_id = ""

    def start(self, params: Dict[str, Any], tags: Dict[str, str]) -> None:
        from mlflow.entities import Param

        self.experiment_id = self._runner.experiment_id()
        run = self.client.create_run(self.experiment_id, run_name=tags.get("name", "bench"),
                                     tags={"mode": "bench", **_short(tags)})
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:MAX_PARAM_CHARS])
                                                   for k, v in list(params.items())[:100]])

    def log_entries(self, entries: Sequence[Dict[str, Any]],
                    summaries: Sequence[Dict[str, Any]]) -> None:
        """One child per entry: its epochs as metrics (step = epoch) and its bench figures."""
        for entry, summary in zip(entries, summaries):
            self._child(entry, summary)

    def _child(self, entry: Dict[str, Any], summary: Dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        tags = {"mlflow.parentRunId": self.run_id, "entry": entry["name"], "kind": entry["kind"],
                "mode": entry["mode"], "outer": entry["outer"], "recipe": entry["recipe"],
                "status": entry["status"], "run_dir": entry["run_dir"]}
        run = self.client.create_run(self.experiment_id, tags=_short(tags),
                                     run_name=f"{entry['recipe']}/{entry['name']}")
        run_id, now = run.info.run_id, int(time.time() * 1000)
        metrics: List[Metric] = []
        known = {f.name for f in dataclasses.fields(EpochRecord)}
        for record in summary.get("epochs", []):
            values = epoch_values(EpochRecord(**{k: v for k, v in record.items() if k in known}))
            metrics += [Metric(k, float(v), now, record["epoch"]) for k, v in values.items()]
        # a time or ratio that is "not reached" is no metric: the params below say so
        figures = {k: entry[k] for k in FIGURES if isinstance(entry[k], (int, float))}
        for rank, idle in enumerate(entry["idle_fraction"]):
            figures[f"idle_fraction/rank{rank}"] = idle
        metrics += [Metric(k, float(v), now, 0) for k, v in figures.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i:i + 1000])
        self.client.log_batch(run_id, params=[
            Param("command", entry["command"][:MAX_PARAM_CHARS]),
            Param("time_to_target", str(entry["time_to_target_s"])),
            Param("time_to_ddp_quality", str(entry["time_to_ddp_quality_s"]))])
        summary_file = Path(entry["run_dir"]) / "summary.json"
        if summary_file.is_file():
            self.client.log_artifact(run_id, str(summary_file))
        status = "FINISHED" if entry["status"] == "completed" else "FAILED"
        self.client.set_terminated(run_id, status)

    def finish(self, files: Sequence[Path], status: str) -> None:
        if self.run_id is None:
            return
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status)


def _short(tags: Dict[str, str]) -> Dict[str, str]:
    return {k: str(v)[:MAX_TAG_CHARS] for k, v in tags.items()}


def make_bench_tracker(tracking: TrackingConfig) -> BenchTracker:
    if tracking.kind is TrackingKind.off:
        return BenchTracker()
    return MlflowBenchTracker(tracking)
