"""The rank's process edge: what it reads from its environment, and where it runs.

RankEnv is what a rank needs of the environment contract (flodl_run.contracts.rankenv, which
every launcher writes): the torchrun variables plus the coordinator's address and key, the run
file and the fault plan, read once at start. The orphan check ends a rank whose launcher died.
Nothing here trains or talks to the coordinator.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from flodl_run.averaging.shm import PREFIX_ENV, remove_run
from flodl_run.contracts.checkpoint import pid_alive
from flodl_run.contracts.rankenv import RankEnvironment, missing
from flodl_run.rank.faults import FaultPlan, FaultSpecError


@dataclass(frozen=True)
class RankEnv:
    """The torchrun environment contract plus the coordinator's address, key and run file."""

    rank: int
    local_rank: int
    world_size: int
    coord: str
    secret: bytes
    run_file: Path
    device: Optional[str]
    parent_pid: Optional[int]
    faults: FaultPlan = field(default_factory=FaultPlan)
    """FLODL_RUN_FAULT, parsed here so a malformed spec stops the rank before it starts."""

    @classmethod
    def from_environ(cls, env: Dict[str, str]) -> "RankEnv":
        """The contract as the launcher wrote it; SystemExit naming what is missing or malformed."""
        absent = missing(env)
        if absent:
            raise SystemExit(f"flodl_run.rank: missing environment: {', '.join(absent)}")
        try:
            faults = FaultPlan.from_environ(env)
        except FaultSpecError as exc:
            raise SystemExit(f"flodl_run.rank: {exc}") from None
        given = RankEnvironment.from_environ(env)
        return cls(given.rank, given.local_rank, given.world_size, given.coord, given.secret,
                   given.run_file, given.device, given.parent_pid, faults)


def pick_device(env: RankEnv) -> torch.device:
    """FLODL_RUN_DEVICE when the launcher named one, else GPU LOCAL_RANK (modulo the GPUs this
    process sees), else the CPU."""
    if env.device:
        return torch.device(env.device)
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def is_orphaned(env: RankEnv) -> bool:
    """The launcher that started this rank is gone. A rank the launcher spawned is its child
    until then; one a zygote forked is the zygote's, and watches the launcher's pid instead (it
    used to watch the zygote, and took a zygote killed alone for the end of the run)."""
    if env.parent_pid is None or os.getppid() == env.parent_pid:
        return False
    return not pid_alive(env.parent_pid)


def leave_orphaned(env: RankEnv) -> None:
    """Exit at once, from any thread, leaving nothing in /dev/shm and nothing the recipe
    started: the launcher that would have removed the run's slabs (ours and the coordinator's)
    and ended our process group was killed."""
    remove_run(os.environ.get(PREFIX_ENV))
    end_own_group()
    try:  # our output went to the launcher: the pipe is most likely broken
        print(f"rank {env.rank}: the launcher is gone; exiting", file=sys.stderr, flush=True)
    except OSError:
        pass
    os._exit(1)


ORPHAN_CHECK_S = 0.5


def watch_orphaned(env: RankEnv) -> None:
    """From the rank's first moment to its last: a thread that leaves as soon as the launcher is
    gone, whatever the main thread is doing (importing the recipe, building the model, joining
    the process group, a collective with a peer that will never come)."""
    def watch() -> None:
        while True:
            time.sleep(ORPHAN_CHECK_S)
            if is_orphaned(env):
                leave_orphaned(env)

    threading.Thread(target=watch, daemon=True, name="orphan-watch").start()


ORPHAN_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long: a launcher killed leaves no wait


def end_own_group(grace_s: float = ORPHAN_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to the other processes of this rank's process
    group: what the recipe started (a `sleep 3600`, an os.fork child). Only when this rank leads
    its group (the launcher and its zygote start each rank in a session of its own); a rank that
    torchrun or srun started shares its group with others that are not ours to end."""
    group = os.getpgrp()
    if group != os.getpid():
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        members = _other_members(group)
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while members and time.monotonic() < deadline:
            time.sleep(0.02)
            members = _other_members(group)
        if not members:
            return


def _other_members(group: int) -> List[int]:
    """Live processes (not zombies) of process group `group` other than this one, from /proc;
    [] when /proc cannot be read (no file descriptor left)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:  # state, ppid, pgrp, ...
            found.append(int(name))
    return found
