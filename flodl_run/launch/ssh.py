"""Both ends of a rank started over OpenSSH.

Launcher side: the `ssh` command line for a worker (BatchMode, its user/port/key/options) and
the one-line handshake written to the session's stdin. Remote side: `python -m flodl_run.launch.ssh`
reads the handshake (rank environment with the run secret, and run.yaml), starts
`flodl_run.rank` as its child and stops it when the session's stdin closes, so a dead launcher
or a dropped connection leaves no rank behind. Standard library only (starts before torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

from flodl_run.contracts.rankenv import RankEnvironment
from flodl_run.contracts.signals import KILL_GRACE_S

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.config.schema import SshConfig

HANDSHAKE_VERSION = 1
# Our defaults come after the worker's own options: ssh keeps the first value it reads.
CLIENT_OPTIONS = (
    "BatchMode=yes",          # never prompt: a missing key is an error, not a hung launcher
    "ConnectTimeout=10",
    "ServerAliveInterval=5",  # a vanished host ends its ssh processes within ~15 s
    "ServerAliveCountMax=3",
)


def ssh_argv(host: str, ssh: "SshConfig", command: str) -> List[str]:
    """`ssh ... host command` for one worker; no tty, so the remote stdin is our pipe."""
    argv = ["ssh", "-T"]
    for option in (*ssh.options, *CLIENT_OPTIONS):
        argv += ["-o", option]
    if ssh.port != 22:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    if ssh.identity_file:
        argv += ["-i", os.path.expanduser(ssh.identity_file), "-o", "IdentitiesOnly=yes"]
    return argv + ["--", host, command]


def remote_command(path: str, python: str, args: Sequence[str], check: str = "") -> str:
    """`cd <path> && exec <python> <args>` for the remote login shell, every word quoted;
    `check` (shell text) runs between the two and must exit 0 for the exec to happen."""
    if path == "~" or path.startswith("~/"):  # let the remote shell expand the home directory
        where = "~/" + shlex.quote(path[2:]) if len(path) > 2 else "~"
    else:
        where = shlex.quote(path)
    words = " ".join(shlex.quote(a) for a in (python, *args))
    if check:
        return f"cd {where} && {{ {check}; }} && exec {words}"
    return f"cd {where} && exec {words}"


def encode_handshake(env: Dict[str, str], run_yaml: str) -> str:
    """The single stdin line of a remote rank: its environment (secret included) and run.yaml."""
    return json.dumps({"version": HANDSHAKE_VERSION, "env": env, "run_yaml": run_yaml}) + "\n"


def decode_handshake(line: bytes) -> tuple[Dict[str, str], str]:
    if not line.strip():
        raise ValueError("no handshake on stdin (start ranks through the launcher)")
    data = json.loads(line)
    if data.get("version") != HANDSHAKE_VERSION:
        raise ValueError(f"handshake version {data.get('version')} != {HANDSHAKE_VERSION} "
                         "(flodl_run differs between the launcher and this host)")
    return {str(k): str(v) for k, v in data["env"].items()}, str(data["run_yaml"])


# ---- remote side -------------------------------------------------------------------------


def _rank_environ(base: Dict[str, str], env: Dict[str, str], run_file: Path) -> Dict[str, str]:
    """The launcher's `env` over this host's `base`, with what only this end knows: the run
    file, our pid (the rank's own orphan check watches us) and the project path first on
    PYTHONPATH, before the worker's env block's (or the login shell's when the block sets none)."""
    merged = dict(base)
    merged.update(env)
    return RankEnvironment(run_file=run_file, parent_pid=os.getpid(), project=os.getcwd()).over(merged)


def _await_eof(fd: int, closed: threading.Event) -> None:
    # The raw fd, not sys.stdin: a thread parked in a buffered read blocks interpreter exit.
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    closed.set()


def _stop(child: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=KILL_GRACE_S)  # SIGTERM -> SIGKILL, as the supervisor does
            return
        except subprocess.TimeoutExpired:
            continue


def _supervise(child: subprocess.Popen, rank: str) -> int:
    """Wait for the rank; stop it when the session's stdin closes or we are signalled."""
    closed = threading.Event()
    threading.Thread(target=_await_eof, args=(sys.stdin.fileno(), closed), daemon=True).start()
    threading.Thread(target=_stop_when, args=(closed, child, rank), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: closed.set())
    code = child.wait()  # returns as soon as the rank ends, however it ends
    return 128 - code if code < 0 else code  # killed by signal n -> 128 + n, as a shell reports


def _stop_when(closed: threading.Event, child: subprocess.Popen, rank: str) -> None:
    closed.wait()
    if child.poll() is None:
        print(f"rank {rank}: ssh session closed; stopping the rank", file=sys.stderr, flush=True)
        _stop(child)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodl_run.launch.ssh",
                                     description="remote end of a rank started by the launcher")
    parser.add_argument("--rank", default="?", help="global rank (a label for process listings)")
    parser.add_argument("--run", default="", help="the launcher's run dir name (a label)")
    args = parser.parse_args(argv)
    try:
        env, run_yaml = decode_handshake(sys.stdin.buffer.readline())
    except ValueError as exc:
        print(f"flodl_run.launch.ssh: rank {args.rank}: {exc}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="flodl_run-")  # 0700: run.yaml is private to this user
    try:
        run_file = Path(workdir) / "run.yaml"
        run_file.write_text(run_yaml)
        child = subprocess.Popen(
            [sys.executable, "-m", "flodl_run.rank"],
            env=_rank_environ(dict(os.environ), env, run_file),
            stdin=subprocess.DEVNULL, start_new_session=True)
        return _supervise(child, args.rank)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
