"""`hydra/launcher=gpu_groups`: Hydra's joblib launcher, a sweep's jobs side by side on one
host, each on its own group of GPUs and cores.

Owns the groups: `n_jobs` disjoint shares of the GPUs and of this process's cores, and the
slot a running job holds (a lock the kernel frees with the process). A job runs as
cluster=local_gpus on its GPUs, and on its cores through the CPU affinity its ranks inherit.
Named by `_target_` in conf/hydra/launcher/ (Hydra instantiates only launchers of the
hydra_plugins package).
"""

# (no `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules,
# where a dataclass cannot resolve string annotations)

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Sequence

try:
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
except ImportError as missing:  # a minimal environment: this module still imports (see _absent)
    from hydra_plugins.flodl_run_launchers._absent import absent_launcher

    JoblibLauncher = absent_launcher("hydra-joblib-launcher", "gpu_groups", missing)

GROUPS_DIR = ".groups"


@dataclass(frozen=True)
class Group:
    """One job slot: the GPUs (indices or UUIDs; none on a CPU host) and cores it owns."""

    devices: List[str]
    cores: List[int]


def plan_groups(num_jobs: int, devices: Sequence[str], cores: Sequence[int]) -> List[Group]:
    """`num_jobs` groups with disjoint devices and cores, each an equal share (what does not
    divide evenly is left unused); ConfigError naming the key when a share would be empty."""
    from flodl_run.config.materialize import ConfigError
    from flodl_run.config.validate import Problem

    problems = []
    if num_jobs < 1:
        problems.append(Problem("hydra.launcher.n_jobs", num_jobs, "must be >= 1"))
    elif devices and len(devices) < num_jobs:
        problems.append(Problem("hydra.launcher.n_jobs", num_jobs,
                                f"must be <= the GPUs to share ({len(devices)}: {','.join(devices)})"))
    elif len(cores) < num_jobs:
        problems.append(Problem("hydra.launcher.n_jobs", num_jobs,
                                f"must be <= the cores this process may use ({len(cores)})"))
    if problems:
        raise ConfigError(problems)
    per_gpu, per_core = len(devices) // num_jobs, len(cores) // num_jobs
    return [Group(list(devices[k * per_gpu:(k + 1) * per_gpu]), list(cores[k * per_core:(k + 1) * per_core]))
            for k in range(num_jobs)]


def take_slot(folder: Path, num_slots: int) -> tuple:
    """(slot, its lock file): a group no running job of the sweep holds. The lock is the
    kernel's (flock) and goes with the process, so a job that dies frees its group. joblib runs
    at most n_jobs jobs at once, one group each, so a slot is free; were none, the job waits for
    slot 0."""
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(num_slots):
        handle = open(folder / f"{slot}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot, handle
        except BlockingIOError:
            handle.close()
    handle = open(folder / "0.lock", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return 0, handle


class InGroup:
    """The task function of a group sweep's job: take a group, run the job on its cores (the
    process's CPU affinity, which its ranks inherit) and, for a GPU run, its devices."""

    def __init__(self, task: Callable[[Any], Any], groups: List[Group], folder: Path):
        self.task, self.groups, self.folder = task, groups, folder

    def __call__(self, cfg: Any) -> Any:
        slot, lock = take_slot(self.folder, len(self.groups))
        group, before = self.groups[slot], os.sched_getaffinity(0)
        topology = getattr(cfg.cluster.topology, "value", cfg.cluster.topology)  # an enum node
        if group.devices and str(topology) in ("auto", "local_gpus"):
            cfg.cluster.topology = "local_gpus"
            cfg.cluster.devices = list(group.devices)
        os.sched_setaffinity(0, group.cores)
        try:
            return self.task(cfg)
        finally:
            os.sched_setaffinity(0, before)
            lock.close()


def visible_devices() -> List[str]:
    """This host's GPUs by UUID (NVML, no CUDA context); none on a CPU host."""
    from flodl_run.hardware.devices import visible_gpus

    return [g.uuid for g in visible_gpus()]


class GroupSweepLauncher(JoblibLauncher):
    """Hydra's joblib launcher, each job on its own group: `n_jobs` jobs side by side, the GPUs
    in `devices` (none given: every visible one) and this process's cores split among them."""

    def __init__(self, devices: Sequence[Any] = (), **joblib: Any) -> None:
        super().__init__(**joblib)
        self.devices = [str(d) for d in devices]

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        assert self.config is not None and self.task_function is not None
        from rich.console import Console

        from flodl_run.config.app import fail_config
        from flodl_run.config.materialize import ConfigError

        try:
            groups = plan_groups(int(self.joblib.get("n_jobs", 1)), self.devices or visible_devices(),
                                 sorted(os.sched_getaffinity(0)))
        except ConfigError as exc:  # before any job: exit 2, no traceback (Hydra would print one)
            fail_config(str(exc), Console(stderr=True))
        folder = Path(str(self.config.hydra.sweep.dir)) / GROUPS_DIR
        if not isinstance(self.task_function, InGroup):
            self.task_function = InGroup(self.task_function, groups, folder)
        return super().launch(job_overrides, initial_job_idx)
