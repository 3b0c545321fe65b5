"""One task of the srun step that `cluster=slurm` starts: the torchrun contract from Slurm's.

`python -m flodl_run.launch.slurm_task` runs once per task. It maps Slurm's numbering onto the
variables `flodl_run.rank` reads (SLURM_PROCID -> RANK, SLURM_LOCALID -> LOCAL_RANK, the step's
task count -> WORLD_SIZE, this node's share of it -> LOCAL_WORLD_SIZE), reads the run secret
from the 0600 file the launcher named in FLODL_RUN_SECRET_FILE (never argv), and replaces
itself with the rank, so the task's pid is the rank's and its exit is the rank's exit.
Standard library only (starts before torch).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from flodl_run.contracts.rankenv import SECRET_FILE_ENV, RankEnvironment
from flodl_run.contracts.signals import ignore_stop_signal

_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_counts(text: str) -> List[int]:
    """Slurm's compressed per-node counts, e.g. `2(x3),1` -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in text.split(","):
        match = _COUNT.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"not a Slurm per-node count list: {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def task_environ(environ: Mapping[str, str], secret_hex: str) -> Dict[str, str]:
    """The rank's environment: ours as the launcher set it, plus the torchrun contract."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID") if k not in environ]
    if missing:
        raise ValueError(f"not inside an srun task (missing {', '.join(missing)})")
    per_node = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE")
                             or environ.get("SLURM_TASKS_PER_NODE", "1"))
    node = int(environ["SLURM_NODEID"])
    env = RankEnvironment(
        rank=int(environ["SLURM_PROCID"]), local_rank=int(environ["SLURM_LOCALID"]),
        world_size=int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS", "1")),
        local_world_size=per_node[node] if node < len(per_node) else per_node[-1],
        node=environ.get("SLURMD_NODENAME", ""), secret=bytes.fromhex(secret_hex)).over(environ)
    env.pop(SECRET_FILE_ENV, None)  # read: the key itself replaces its file's path
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Become the rank; exit 2 (with the reason) when this is not a task the launcher started."""
    try:
        secret = Path(os.environ[SECRET_FILE_ENV]).read_text().strip()
        env = task_environ(os.environ, secret)
    except (KeyError, OSError, ValueError) as exc:
        print(f"flodl_run.launch.slurm_task: {type(exc).__name__}: {exc} (start ranks with "
              "`python -m flodl_run cluster=slurm` inside an allocation)", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "flodl_run.rank", *(argv or [])]
    ignore_stop_signal(env)  # before torch loads: Slurm signals every task of the job
    os.execve(sys.executable, argv, env)
    return 0  # pragma: no cover - execve does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
