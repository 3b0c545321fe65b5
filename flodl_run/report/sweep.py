"""Hydra multirun sweeps: one MLflow parent run per sweep, each job a child of it, and the
comparison (table and plot) in the parent and the multirun directory when the sweep ends.

Owns the sweep's lifetime in this process. Hydra's basic launcher runs the jobs one after
another in the process that started the sweep, so the parent is created once (by the first
job's tracker) and every job sees it. `SweepCallback` is named in conf/config.yaml; Hydra calls
its methods by name, so this module does not import Hydra and the tracker can ask it for the
parent without Hydra. Outside a sweep every function here is a no-op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rich.console import Console

from flodl_run.report.compare import JobOutcome, plot, to_csv, to_markdown

log = logging.getLogger(__name__)

TABLE_MD, TABLE_CSV, PLOT_PNG = "comparison.md", "comparison.csv", "comparison.png"
MAX_NAME_CHARS = 250


@dataclass
class Sweep:
    """One multirun: its directory, its jobs, and its parent run in each MLflow store used."""

    dir: Path
    overrides: List[str]
    jobs: List[Tuple[int, List[str], Path]] = field(default_factory=list)
    parents: Dict[Tuple[str, str], Tuple[Any, str]] = field(default_factory=dict)
    """(tracking uri, experiment id) -> (client, parent run id)."""

    def parent_run_id(self, client: Any, experiment_id: str) -> str:
        """The parent run in this store and experiment, created on the first call."""
        key = (client.tracking_uri, experiment_id)
        if key not in self.parents:
            name = ("sweep " + " ".join(self.overrides))[:MAX_NAME_CHARS]
            run = client.create_run(experiment_id, run_name=name, tags={
                "sweep_dir": str(self.dir), "sweep_overrides": " ".join(self.overrides)[:5000],
                "mode": "sweep"})
            self.parents[key] = (client, run.info.run_id)
        return self.parents[key][1]

    def outcomes(self) -> List[JobOutcome]:
        return [JobOutcome.read(num, overrides, run_dir) for num, overrides, run_dir in self.jobs]

    def finish(self) -> None:
        """Write the comparison into the sweep dir and each parent; close the parents."""
        jobs = self.outcomes()
        self.dir.mkdir(parents=True, exist_ok=True)
        files = [self.dir / TABLE_MD, self.dir / TABLE_CSV]
        files[0].write_text(to_markdown(jobs))
        files[1].write_text(to_csv(jobs))
        png = plot(jobs, self.dir / PLOT_PNG)
        if png is not None:
            files.append(png)
        status = _parent_status([j.status for j in jobs])
        for client, run_id in self.parents.values():
            for path in files:
                client.log_artifact(run_id, str(path))
            client.set_tag(run_id, "num_jobs", str(len(jobs)))
            client.set_terminated(run_id, status)
        # printed, not logged: after the jobs, Hydra's own log handler would print it again
        Console().print(self.written(files), markup=False, highlight=False, soft_wrap=True)

    def written(self, files: List[Path]) -> str:
        """The sweep's last line: its comparison files and its MLflow parent run(s)."""
        parents = [f"mlflow parent run {run_id} in {client.tracking_uri}"
                   for client, run_id in self.parents.values()]
        return " | ".join([f"sweep: wrote {self.dir}/: {', '.join(p.name for p in files)}", *parents])


def _parent_status(statuses: List[str]) -> str:
    """KILLED if a job was interrupted, FAILED if one failed, else FINISHED."""
    if "interrupted" in statuses:
        return "KILLED"
    if any(s != "completed" for s in statuses) or not statuses:
        return "FAILED"
    return "FINISHED"


_active: Optional[Sweep] = None


def active() -> Optional[Sweep]:
    return _active


def parent_run_id(client: Any, experiment_id: str) -> Optional[str]:
    """The sweep's parent run for a job's tracker; None outside a sweep."""
    return _active.parent_run_id(client, experiment_id) if _active is not None else None


def end_active() -> None:
    """Finish the running sweep, if any (also after a job stopped it early); idempotent."""
    global _active
    sweep, _active = _active, None
    if sweep is None:
        return
    try:
        sweep.finish()
    except Exception as exc:  # a comparison that cannot be written must not hide the jobs' results
        log.warning("sweep %s: comparison not written (%s: %s)", sweep.dir, type(exc).__name__, exc)


def job_entry(config: Any) -> Tuple[int, List[str], Path]:
    """A sweep's job as Hydra's on_job_start describes it: (number, overrides, run dir)."""
    return (int(config.hydra.job.num), [str(o) for o in config.hydra.overrides.task],
            Path(str(config.hydra.runtime.output_dir)))


class UnusedHooks:
    """Hydra's callback hooks a sweep callback does not use (Hydra calls each by name)."""

    def on_run_start(self, config: Any, **_: Any) -> None:
        pass

    def on_run_end(self, config: Any, **_: Any) -> None:
        pass

    def on_job_end(self, config: Any, **_: Any) -> None:
        pass


class SweepCallback(UnusedHooks):
    """Hydra callback (`hydra.callbacks.sweep` in conf/config.yaml). Hydra calls the on_* methods
    by name; in single runs (no multirun) it does nothing."""

    def on_multirun_start(self, config: Any, **_: Any) -> None:
        global _active
        launcher = str(config.hydra.launcher.get("_target_", ""))
        if not launcher.endswith("BasicLauncher"):
            log.warning("sweep: launcher %s may run jobs in parallel or elsewhere; flodl_run "
                        "sweeps expect Hydra's basic launcher (jobs one after another)", launcher)
        _active = Sweep(Path(str(config.hydra.sweep.dir)).resolve(),
                        [str(o) for o in config.hydra.overrides.task])

    def on_job_start(self, config: Any, **_: Any) -> None:
        if _active is not None:
            _active.jobs.append(job_entry(config))

    def on_multirun_end(self, config: Any, **_: Any) -> None:
        end_active()
