"""The stop signal a batch scheduler sends ahead of a job's end (submitit's preemption signal,
SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise), as the processes of a run agree on it.

A sweep launcher that requeues its jobs names the signal in FLODL_RUN_STOP_SIGNAL. The launcher
then treats it as it treats SIGTERM (stop at the next reduce boundary, save the bundle); the
ranks ignore it, since Slurm signals every process of the job and a rank's default action on
SIGUSR2 is to die. Also the grace a process given SIGTERM has before SIGKILL (`KILL_GRACE_S`),
the same for the launcher's ranks and a remote rank's ssh end. Standard library only: the Slurm
task entry reads it before torch loads.
"""

from __future__ import annotations

import signal
from typing import Mapping, Optional

STOP_SIGNAL_ENV = "FLODL_RUN_STOP_SIGNAL"
KILL_GRACE_S = 4.0
"""Stop order -> SIGTERM -> SIGKILL, each after this long: a rank is gone in under 10 s."""


def stop_signal(environ: Mapping[str, str]) -> Optional[signal.Signals]:
    """The signal FLODL_RUN_STOP_SIGNAL names (`SIGUSR2` or `USR2`), or None (unset, unknown)."""
    name = environ.get(STOP_SIGNAL_ENV, "").strip().upper()
    if not name:
        return None
    name = name if name.startswith("SIG") else f"SIG{name}"
    return signal.Signals.__members__.get(name)


def ignore_stop_signal(environ: Mapping[str, str]) -> None:
    """In a rank: the stop signal does nothing (an ignored signal stays ignored across exec)."""
    sig = stop_signal(environ)
    if sig is not None:
        signal.signal(sig, signal.SIG_IGN)
