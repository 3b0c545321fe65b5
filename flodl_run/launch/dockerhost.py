"""Workers whose ranks run in a Docker Compose service (`cluster.workers[i].docker: SERVICE`).

Owns the remote command line for such a worker: in the worker's `path` (where its compose file
is), check that the service is running, then `docker compose exec -T SERVICE <python> ...`
inside it. Everything else is the bare-metal path's: the same `ssh`, the same remote entry
(`python -m flodl_run.launch.ssh`, here inside the container) reading the handshake (environment and
secret) on stdin, and GPU pinning by CUDA_VISIBLE_DEVICES set to the GPU's UUID (the UUID is
the same inside the container; indices may not be). `exec`, not `run`: GPUs, volumes and the
network are the service's (a running container cannot be given GPUs by `exec`), and a warm
container keeps its caches across runs. Pure: builds text, runs nothing.
"""

from __future__ import annotations

import shlex
from typing import Dict, List, Optional, Sequence

from flodl_run.launch.ssh import remote_command

MARKER = "FLODL_RUN_DOCKER "
"""Prefix of the one stderr line the service check writes when the service is not up."""
NOT_UP_EXIT = 3
# The torchrun contract, also given to `exec` with -e so the process in the container shows it;
# the handshake (stdin) carries the whole environment and the secret, as for bare metal.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


def exec_words(service: str, python: str, args: Sequence[str],
               env: Optional[Dict[str, str]] = None) -> List[str]:
    """`docker compose exec -T [-e NAME=VALUE ...] SERVICE python args`: no tty, stdin attached
    (exec's default), so the handshake reaches the container and its EOF stops the rank."""
    words = ["docker", "compose", "exec", "-T"]
    for name in TORCHRUN_VARS:
        if env and name in env:
            words += ["-e", f"{name}={env[name]}"]
    return [*words, service, python, *args]


def service_check(service: str) -> str:
    """POSIX shell text that exits NOT_UP_EXIT, with one MARKER line on stderr naming the
    service and why, unless `docker compose ps` lists the service as running."""
    name = shlex.quote(service)
    flat = "$(printf '%s' \"$up\" | tr '\\n' ' ')"  # the client's message on one line
    return (f"up=$(docker compose ps --status running --services 2>&1) || "
            f"{{ echo \"{MARKER}service {service} is not up: docker compose ps failed: {flat}\" >&2; "
            f"exit {NOT_UP_EXIT}; }}; "
            f"printf '%s\\n' \"$up\" | grep -qxF -- {name} || "
            f"{{ echo \"{MARKER}service {service} is not running (running: {flat})\" >&2; "
            f"exit {NOT_UP_EXIT}; }}")


def docker_command(path: str, service: str, python: str, args: Sequence[str],
                   env: Optional[Dict[str, str]] = None) -> str:
    """The remote shell command of a docker worker: `cd <path>`, the service check, then
    `exec docker compose exec -T ... SERVICE python args` (every word quoted)."""
    words = exec_words(service, python, args, env)
    return remote_command(path, words[0], words[1:], check=service_check(service))


def docker_reason(error: Optional[str]) -> Optional[str]:
    """The service check's reason inside a probe or launch error, or None when it passed."""
    if not error or MARKER not in error:
        return None
    return error.split(MARKER, 1)[1].split(" / ")[0].strip()
