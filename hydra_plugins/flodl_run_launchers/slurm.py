"""`hydra/launcher=slurm` and `hydra/launcher=slurm_local`: hydra-submitit-launcher's launchers,
one Slurm allocation (or one local process) per job of a sweep, with a requeue that resumes.

Owns only what flodl_run adds to the plugin: a job stopped by the scheduler's notice before its
end (submitit's preemption signal) stops with a save, as on SIGTERM, and its requeue resumes
from that bundle through submitit's checkpoint hook. The sweep's parent run and comparison are
flodl_run.report.sweep's. Named by `_target_` in conf/hydra/launcher/ (Hydra instantiates only
launchers of the hydra_plugins package).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError as missing:  # a minimal environment: this module still imports (see _absent)
    from hydra_plugins.flodl_run_launchers._absent import absent_launcher

    SlurmLauncher = absent_launcher("hydra-submitit-launcher", "slurm", missing)
    LocalLauncher = absent_launcher("hydra-submitit-launcher", "slurm_local", missing)

from flodl_run.contracts.signals import STOP_SIGNAL_ENV

EXIT_INTERRUPTED = 130  # the CLI's exit for a run that was stopped (flodl_run.cli)


def _run_resumable(launcher: Any, call: Callable[..., Any], args: Sequence[Any]) -> Any:
    """Run one job in submitit's process. The scheduler's notice (submitit's signal) stops the
    run with a save, like SIGTERM; then submitit's own handler, called here, asks `checkpoint`
    for the resubmission (resuming from that bundle), requeues the job and exits."""
    import submitit

    name = "SIG" + submitit.JobEnvironment.USR_SIG
    os.environ[STOP_SIGNAL_ENV] = name
    launcher.resume_from = None
    try:
        return call(*args)
    except SystemExit as exc:
        job_num = args[2]
        stem = _stopped_with_save(launcher, job_num, name) if exc.code == EXIT_INTERRUPTED else None
        if stem is None:
            raise
        launcher.resume_from = stem
        sig = signal.Signals[name]
        handler = signal.getsignal(sig)
        if callable(handler):
            handler(sig, None)  # submitit: checkpoint(), requeue, exit
        raise


def _stopped_with_save(launcher: Any, job_num: int, signal_name: str) -> Optional[str]:
    """The bundle job `job_num` just saved when the scheduler's notice stopped it, else None
    (its run dir is the one its entry in the sweep dir names)."""
    from flodl_run.report.sweep import read_jobs

    sweep_dir = Path(str(launcher.config.hydra.sweep.dir)).resolve()
    run_dirs = [run_dir for num, _, run_dir in read_jobs(sweep_dir) if num == job_num]
    try:
        summary = json.loads((run_dirs[0] / "summary.json").read_text())
    except (IndexError, OSError, ValueError):
        return None
    stopped = summary.get("status") == "interrupted" and signal_name in (summary.get("message") or "")
    return summary.get("checkpoint") if stopped else None


def _resubmission(launcher: Any, args: Sequence[Any]) -> Any:
    """submitit's checkpoint hook: the same job again, resuming from its bundle when it saved
    one (else it starts afresh, as nothing was trained)."""
    import submitit

    overrides, *rest = args
    overrides = list(overrides)
    if launcher.resume_from:
        overrides = [o for o in overrides if o.partition("=")[0].lstrip("+") != "resume_from"]
        overrides.append(f"resume_from={launcher.resume_from}")
    return submitit.helpers.DelayedSubmission(launcher, overrides, *rest)


class _Resumes:
    """What both sweep launchers add to submitit's: a requeued job resumes from its bundle."""

    resume_from: Optional[str] = None

    def __call__(self, *args: Any) -> Any:
        return _run_resumable(self, super().__call__, args)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return _resubmission(self, args)


class SlurmSweepLauncher(_Resumes, SlurmLauncher):
    """hydra-submitit-launcher's Slurm launcher; a requeued job resumes from its bundle."""


class LocalSweepLauncher(_Resumes, LocalLauncher):
    """The same on submitit's local executor: each job a process of this host."""
