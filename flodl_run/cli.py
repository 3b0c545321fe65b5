"""`python -m flodl_run`: compose with Hydra, materialize once, train, write the run dir.

The only place that turns errors into exit codes and prints: 0 done, 2 bad config (no
traceback; FLODL_RUN_TRACEBACK=1 shows one), 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from flodl_run.config.app import fail_config, run_hydra_app
from flodl_run.config.compose import experiment_to_yaml
from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.report.rerun import RUN_FILE, Step, next_step, read_earlier
from flodl_run.report.rundir import release_dirs, remove_startup_files
from flodl_run.report.say import outlive_the_terminal, say_labelled

EXIT_INTERRUPTED = 130


class JobFailed(Exception):
    """A sweep job ended failed: raised (not exited) so Hydra records it and runs the next job."""


def run_job(cfg: Any) -> None:
    """The body of one Hydra job (also one job of a multirun sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    err = Console(stderr=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    outputs = Path.cwd() / "outputs"
    sweep_job = HydraConfig.get().mode == RunMode.MULTIRUN
    step = _rerun_step(cfg, run_dir) if sweep_job else Step("fresh")
    if step.action == "skip":
        return
    try:
        materialized = materialize(cfg, run_dir=str(run_dir), outputs_dir=str(outputs))
        for warning in materialized.warnings:
            say_labelled(err, "warning", warning, "yellow")
        (run_dir / RUN_FILE).write_text(experiment_to_yaml(materialized.config))
        from flodl_run.launch.launcher import launch  # torch and the rest: only for a valid config

        status = launch(materialized.config, run_dir, Console())
    except ConfigError as exc:  # also what only the hardware or the hosts can tell: exit 2
        if step.action == "fresh":  # an earlier attempt's files stay
            remove_startup_files(run_dir, outputs)  # a run that never started leaves no folder
        fail_config(str(exc), err)
    if status == "interrupted":
        sys.exit(EXIT_INTERRUPTED)
    if status not in ("completed",):
        if sweep_job:
            raise JobFailed(f"job ended {status}: {run_dir}")
        sys.exit(1)


def _rerun_step(cfg: Any, run_dir: Path) -> Step:
    """A sweep job in a directory an earlier attempt left (a sweep rerun into its
    hydra.sweep.dir): say what it does; a resume sets `cfg.resume_from`, a refusal exits 2."""
    from hydra.core.hydra_config import HydraConfig

    from flodl_run.report.sweep import earlier_overrides

    job = HydraConfig.get().job
    overrides = [str(o) for o in HydraConfig.get().overrides.task]
    earlier = read_earlier(run_dir, cfg.get("save_path"), earlier_overrides(run_dir))
    step = next_step(earlier, overrides, run_dir)
    if step.action == "fresh":
        return step
    where = f"job {job.num} ({' '.join(overrides) or 'no overrides'}): {run_dir}"
    if step.action == "refuse":
        fail_config(f"hydra.sweep.dir: {where} {step.why}", Console(stderr=True))
    say_labelled(Console(), "sweep", f"{where} {step.why}", "cyan")
    if step.action == "resume":
        cfg.resume_from = step.bundle
    return step


def main() -> None:
    """Entry point; Hydra's flags (-m, --cfg, --info, --help) work as usual."""
    from flodl_run.config.sweep import job_problems
    from flodl_run.report.sweep import end_active

    outlive_the_terminal()  # before Hydra's log handlers take sys.stdout
    try:
        run_hydra_app("config", run_job, check_jobs=job_problems)
    except ConfigError as exc:  # pragma: no cover - raised inside jobs is handled there
        fail_config(str(exc), Console(stderr=True))
    except KeyboardInterrupt:  # a Ctrl-C after the run wrote its records: still our exit code
        sys.exit(EXIT_INTERRUPTED)
    finally:
        # Hydra's on_multirun_end is skipped when a job failed or Ctrl-C stopped the sweep:
        # the jobs that ran still get their comparison and the parent run its status.
        end_active()
        release_dirs()  # the run's (or sweep's) directory is another run's to take now

