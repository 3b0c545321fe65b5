"""A parent that has imported what `python -m flodl_run` imports, and forks the tests' CLI runs
from that state (`support._run` uses it; not a test module).

Why: most end-to-end tests run the CLI, and a fresh interpreter spends about two CPU-seconds
importing torch, Hydra and the runner before it reads its first override. Measured over the whole
suite on the 2-core machine: 93 launcher processes used 228 CPU-seconds of the suite's 810, almost
all of it in those imports. Forked from here, a launcher starts with them done.

What a forked launcher sees is what `python -m flodl_run` would have given it: the request's
working directory, environment and arguments, `sys.path` built from that directory and the
request's PYTHONPATH as the interpreter builds it, standard input from /dev/null, its output on
the request's pipes, fresh random generators, and the module run through `runpy` as `-m` runs it,
through the interpreter's normal exit (atexit included). What it cannot see differently is only
what an interpreter reads when it starts (PYTHON* variables other than PYTHONPATH, `-X` options):
those are this server's. Tests about the interpreter's own start (the README's commands, signals
sent to a launcher by pid) start a real `python -m flodl_run` instead.

Protocol (one server per pytest worker, started by `support.LaunchServer`): each request is one
SOCK_SEQPACKET message, JSON {"argv", "cwd", "env"}, with the write ends of the stdout and stderr
pipes attached (SCM_RIGHTS). The server answers {"started": pid}, and {"pid", "code"} when that
child exits (`Popen.returncode`'s form: negative for a signal). It exits when the client's end
closes.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Dict, List, Optional

MAX_MESSAGE = 1 << 20


def _preload() -> None:
    import hydra  # noqa: F401

    import flodl_run.cli  # noqa: F401
    import flodl_run.launch.launcher  # noqa: F401
    import flodl_run.launch.supervisor  # noqa: F401  (the coordinator, zmq, the averaging)
    from flodl_run.launch.zygote import preload

    # What the rank zygote imports, for the spare each launcher forks (the CUDA check and
    # gc.freeze included: a child's collections leave these objects and their pages alone).
    preload()


def _serve(sock: socket.socket) -> Optional[dict]:
    """Fork on request and report exits. Returns the request in a forked child; None in the
    server when the client is gone."""
    while True:
        if select.select([sock], [], [], 0.1)[0]:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return None
            pid = os.fork()
            if pid == 0:
                sock.close()
                _take_output(*fds)
                return json.loads(data)
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"started": pid}).encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _take_output(stdout: int, stderr: int) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _become_launcher(request: dict, base_path: List[str]) -> None:
    """Take the request's directory, environment, path and arguments, then run the CLI module
    as `python -m flodl_run` does. Raises SystemExit with the CLI's exit code."""
    cwd, env = request["cwd"], request["env"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *base_path]
    sys.argv = ["-m", *request["argv"]]
    from flodl_run.launch.zygote import fresh_random_state

    fresh_random_state()  # as the rank zygote does for the ranks it forks
    runpy.run_module("flodl_run", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def main(argv: List[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    base_path = sys.path[1:]  # what the interpreter adds after the working directory
    _preload()
    request = _serve(sock)
    if request is None:
        return 0
    _become_launcher(request, base_path)
    return 0


class LaunchServer:
    """The client's handle (one per pytest worker process, started on first use)."""

    _instance: Optional["LaunchServer"] = None

    def __init__(self, repo: str):
        import subprocess

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.launchserver", str(theirs.fileno())], cwd=repo, env=env,
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.exits: Dict[int, int] = {}

    @classmethod
    def get(cls, repo: str) -> "LaunchServer":
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = cls(repo)
        return cls._instance

    def run(self, argv: List[str], cwd: str, env: Dict[str, str], timeout: float):
        """(pid, returncode, stdout, stderr) of `python -m flodl_run *argv`; on timeout the run
        is killed and subprocess.TimeoutExpired raised, as `communicate` would."""
        import subprocess
        import time

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()],
                            [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = None
        while pid is None:
            pid = self._message().get("started")
        deadline = time.monotonic() + timeout
        chunks: Dict[int, List[bytes]] = {out_r: [], err_r: []}
        open_fds = [out_r, err_r]
        while open_fds:
            left = deadline - time.monotonic()
            ready = select.select(open_fds, [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)
                for fd in (out_r, err_r):
                    os.close(fd)
                self._wait(pid)
                raise subprocess.TimeoutExpired(["python", "-m", "flodl_run", *argv], timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
        os.close(out_r)
        os.close(err_r)
        code = self._wait(pid)
        return pid, code, b"".join(chunks[out_r]).decode(), b"".join(chunks[err_r]).decode()

    def _wait(self, pid: int) -> int:
        while pid not in self.exits:
            self._message()
        return self.exits.pop(pid)

    def _message(self) -> dict:
        data = self.sock.recv(MAX_MESSAGE)
        if not data:
            raise RuntimeError(f"the launch server (pid {self.process.pid}) exited with code "
                               f"{self.process.wait()}")
        message = json.loads(data)
        if "code" in message:
            self.exits[message["pid"]] = message["code"]
        return message


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
