"""Hydra multirun sweeps: one MLflow parent run per sweep, each job a child of it, and the
comparison (table and plot) in the parent and the multirun directory when the sweep ends.

Owns the sweep's lifetime. Hydra's basic launcher runs the jobs one after another in the
process that started the sweep: the parent is created there by the first job's tracker. Other
launchers (Slurm through submitit, side-by-side groups through joblib) run each job in another
process, maybe on another node: the parent is created before any job is submitted and left in
the sweep dir (`.parents.json`) for the jobs' trackers. Either way each job leaves its entry in
`.jobs/` of the sweep dir, and the process that started the sweep writes the comparison from
those entries once the launcher says every job has ended. `SweepCallback` is named in
conf/config.yaml; Hydra calls its methods by name, so this module does not import Hydra.
Outside a sweep every function here is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rich.console import Console

from flodl_run.config.schema import TrackingConfig, TrackingKind
from flodl_run.report.compare import JobOutcome, plot, to_csv, to_markdown
from flodl_run.report.rerun import resumes_itself

log = logging.getLogger(__name__)

TABLE_MD, TABLE_CSV, PLOT_PNG = "comparison.md", "comparison.csv", "comparison.png"
MAX_NAME_CHARS = 250
JOBS_DIR, PARENTS_FILE = ".jobs", ".parents.json"


@dataclass
class Sweep:
    """One multirun: its directory, its jobs, and its parent run in each MLflow store used."""

    dir: Path
    overrides: List[str]
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

    def open_parents(self, tracking: TrackingConfig) -> None:
        """For jobs in other processes: the parent now, before any job is submitted, written to
        the sweep dir where each job's tracker finds it (none for tracking=off). Creating the
        store here also keeps jobs starting at once from racing to create a new SQLite store."""
        if tracking.kind is TrackingKind.off:
            return
        from flodl_run.report.tracking import MlflowTracker

        tracker = MlflowTracker(tracking)
        experiment_id = tracker.experiment_id()
        run_id = self.parent_run_id(tracker.client, experiment_id)
        record = [{"uri": tracker.client.tracking_uri, "experiment_id": experiment_id,
                   "run_id": run_id}]
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.dir / PARENTS_FILE, record)

    def outcomes(self) -> List[JobOutcome]:
        return [JobOutcome.read(num, overrides, run_dir)
                for num, overrides, run_dir in read_jobs(self.dir)]

    def finish(self) -> None:
        """Write the comparison into the sweep dir and each parent; close the parents."""
        jobs = self.outcomes()
        if not jobs:  # the launcher refused before any job started: nothing to compare
            for client, run_id in self.parents.values():
                client.set_terminated(run_id, "FAILED")
            return
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
"""The sweep started in this process."""
_joined: Optional[Path] = None
"""The sweep dir of the job this process runs for a sweep started elsewhere."""
_earlier: Dict[Path, List[str]] = {}
"""Run dir -> the overrides of the entry an earlier attempt of its job left (this job's
entry replaces it before the job runs)."""


def active() -> Optional[Sweep]:
    return _active


def parent_run_id(client: Any, experiment_id: str) -> Optional[str]:
    """The sweep's parent run for a job's tracker; None outside a sweep, and for a job whose
    store is not the one its sweep made a parent in (then it says so)."""
    if _active is not None:
        return _active.parent_run_id(client, experiment_id)
    if _joined is None:
        return None
    try:
        parents = json.loads((_joined / PARENTS_FILE).read_text())
    except (OSError, ValueError):
        parents = []
    for parent in parents:
        if (parent["uri"], parent["experiment_id"]) == (client.tracking_uri, experiment_id):
            return str(parent["run_id"])
    log.warning("sweep %s: no parent run in %s (experiment %s); this job's run has none",
                _joined, client.tracking_uri, experiment_id)
    return None


def _write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a job started on another node never reads half a file."""
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def write_job(sweep_dir: Path, entry: Tuple[int, List[str], Path]) -> None:
    """Leave a job's entry for the comparison; a requeued job's replaces its first attempt's
    (and leaves out the resume_from its requeue added: the job is the same sweep point)."""
    num, overrides, run_dir = entry
    own = [o for o in overrides if not resumes_itself(o, run_dir)]
    (sweep_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
    _write_json(sweep_dir / JOBS_DIR / f"{num}.json",
                {"num": num, "overrides": own, "run_dir": str(run_dir)})


def earlier_overrides(run_dir: Path) -> Optional[List[str]]:
    """The overrides an earlier attempt of the job in `run_dir` ran with (its sweep entry, as
    found when this attempt started); None when there was none."""
    return _earlier.get(Path(run_dir))


def read_jobs(sweep_dir: Path) -> List[Tuple[int, List[str], Path]]:
    """The entries the sweep's jobs left, in job order."""
    entries = []
    for path in (sweep_dir / JOBS_DIR).glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        entries.append((int(entry["num"]), list(entry["overrides"]), Path(entry["run_dir"])))
    return sorted(entries)


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


def is_sweep_job(config: Any) -> bool:
    """Whether Hydra runs this job for a sweep (`-m`): only then has it a number. A single run
    leaves `hydra.job.num` mandatory-missing, so it is read with a default (reading it plainly
    raised, and Hydra printed that as a warning before every single run)."""
    return config.hydra.job.get("num", None) is not None


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


def sweep_tracking(tracking: Any) -> TrackingConfig:
    """The store the sweep's jobs log to, from the composed `tracking` node (its uri resolved
    as a job resolves it, against ./outputs)."""
    from flodl_run.config.validate import resolve_tracking

    kind = tracking.kind if isinstance(tracking.kind, TrackingKind) else TrackingKind(str(tracking.kind))
    typed = TrackingConfig(kind=kind, uri=tracking.uri,
                           experiment=str(tracking.experiment))
    return resolve_tracking(typed, str(Path.cwd() / "outputs"))


class SweepCallback(UnusedHooks):
    """Hydra callback (`hydra.callbacks.sweep` in conf/config.yaml). Hydra calls the on_* methods
    by name; in single runs (no multirun) it does nothing."""

    def on_multirun_start(self, config: Any, **_: Any) -> None:
        global _active
        launcher = str(config.hydra.launcher.get("_target_", ""))
        _active = Sweep(Path(str(config.hydra.sweep.dir)).resolve(),
                        [str(o) for o in config.hydra.overrides.task])
        if not launcher.endswith("BasicLauncher"):  # jobs in other processes, maybe other nodes
            if launcher.startswith("hydra_plugins.hydra_submitit_launcher"):
                log.warning("sweep: %s restarts a requeued job from scratch; hydra/launcher=slurm "
                            "resumes it from its own bundle", launcher)
            _active.open_parents(sweep_tracking(config.tracking))

    def on_job_start(self, config: Any, **_: Any) -> None:
        """In the job's own process: leave its entry; join the sweep started elsewhere. An entry
        an earlier attempt of the job left (a sweep rerun into its directory) is remembered for
        the job (`earlier_overrides`), and stays when its overrides differ: that job is refused.
        A single run (Hydra calls this hook for it too, with `hydra.job.num` unset) is no job of
        a sweep: nothing to do."""
        global _joined
        if not is_sweep_job(config):
            return
        entry = job_entry(config)
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        if _active is None:
            _joined = sweep_dir
        num, overrides, run_dir = entry
        _earlier.pop(run_dir, None)
        for earlier_num, earlier, earlier_dir in read_jobs(sweep_dir):
            if earlier_num == num and earlier_dir == run_dir:
                _earlier[run_dir] = earlier
        own = [o for o in overrides if not resumes_itself(o, run_dir)]
        if _earlier.get(run_dir, own) == own:
            write_job(sweep_dir, entry)

    def on_multirun_end(self, config: Any, **_: Any) -> None:
        end_active()
