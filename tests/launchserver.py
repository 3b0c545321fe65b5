"""A parent that has imported what `python -m flodl_run` imports (MLflow too, which a tracked
run's launcher imports), and forks the tests' CLI runs
from that state (`support._run` uses it; not a test module).

Why: most end-to-end tests run the CLI, and a fresh interpreter spends about two CPU-seconds
importing torch, Hydra and the runner before it reads its first override. Measured over the whole
suite on the 2-core machine: 93 launcher processes used 228 CPU-seconds of the suite's 810, almost
all of it in those imports. Forked from here, a launcher starts with them done.

What a forked launcher sees is what `python -m flodl_run` would have given it: the request's
working directory, environment and arguments, `sys.path` built from that directory and the
request's PYTHONPATH as the interpreter builds it, standard input from /dev/null, its output on
the request's pipes (buffered as an interpreter buffers pipes, PYTHONUNBUFFERED included), fresh
random generators, Python's default signal handlers (the server's own), and the module run
through `runpy` as `-m` runs it, and its exit as the interpreter's (threads joined, atexit
handlers run, output flushed) less the teardown, which in a fork only copies pages. What
it cannot see differently is only what an interpreter reads when it starts (PYTHON* variables
other than PYTHONPATH and PYTHONUNBUFFERED, `-X` options): those are this server's. Tests about
the interpreter's own start (the README's commands, a user's module found from another
directory) start a real `python -m flodl_run` instead. `LaunchServer.start` gives a running
launcher as a Popen-like handle, for tests that read its output as it comes or signal it.

Protocol (one server per pytest worker, started by `support.LaunchServer`): each request is one
SOCK_SEQPACKET message, JSON {"argv", "cwd", "env"} and optionally "module" (another entry
point of the package, e.g. flodl_run.review; default flodl_run), with the write ends of the stdout and stderr
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
    import mlflow  # noqa: F401  (a tracked run's launcher imports it: most of the suite's runs)
    from matplotlib.figure import Figure  # noqa: F401  (a sweep's comparison, the bench's plot)

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
    """Take the request's directory, environment, path and arguments, then run the request's
    module (default flodl_run) as `python -m <module>` does. Raises SystemExit with the CLI's exit code."""
    from flodl_run.launch.zygote import fresh_random_state, fresh_stdio

    cwd, env = request["cwd"], request["env"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fresh_stdio(bool(env.get("PYTHONUNBUFFERED")))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *base_path]
    sys.argv = ["-m", *request["argv"]]
    fresh_random_state()  # as the rank zygote does for the ranks it forks
    runpy.run_module(request.get("module", "flodl_run"), run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def main(argv: List[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    base_path = sys.path[1:]  # what the interpreter adds after the working directory
    _preload()
    request = _serve(sock)
    if request is None:
        return 0
    from flodl_run.launch.zygote import run_forked

    run_forked(lambda: _become_launcher(request, base_path))  # as a forked rank leaves


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

    def run(self, argv: List[str], cwd: str, env: Dict[str, str], timeout: float,
            module: str = "flodl_run"):
        """(pid, returncode, stdout, stderr) of `python -m <module> *argv`; on timeout the run
        is killed and subprocess.TimeoutExpired raised, as `communicate` would."""
        launched = self.start(argv, cwd, env, merge_stderr=False, module=module)
        out, err = launched.communicate(timeout=timeout)
        return launched.pid, launched.returncode, out, err

    def start(self, argv: List[str], cwd: str, env: Dict[str, str],
              merge_stderr: bool = True, module: str = "flodl_run") -> "Launched":
        """`python -m <module> *argv` forked and running: a handle that behaves like the
        `subprocess.Popen(..., stdout=PIPE, stderr=STDOUT or PIPE, text=True)` of it."""
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merge_stderr else os.pipe()
        try:
            request = {"argv": argv, "cwd": cwd, "env": env, "module": module}
            socket.send_fds(self.sock, [json.dumps(request).encode()], [out_w, err_w])
        finally:
            os.close(out_w)
            if err_r is not None:
                os.close(err_w)
        pid = None
        while pid is None:
            pid = self._message().get("started")
        return Launched(self, pid, [module, *argv], out_r, err_r)

    def _message(self, timeout: Optional[float] = None) -> dict:
        """The server's next message ({} when none came within `timeout`)."""
        if timeout is not None and not select.select([self.sock], [], [], max(timeout, 0))[0]:
            return {}
        data = self.sock.recv(MAX_MESSAGE)
        if not data:
            raise RuntimeError(f"the launch server (pid {self.process.pid}) exited with code "
                               f"{self.process.wait()}")
        message = json.loads(data)
        if "code" in message:
            self.exits[message["pid"]] = message["code"]
        return message


class Launched:
    """A launcher forked by the server, as the part of `subprocess.Popen` tests use: `pid`,
    `stdout` (and `stderr` unless merged) as text files, `poll`, `wait`, `communicate`,
    `send_signal`, `terminate`, `kill`, `returncode`. It is the server's child, not ours: its
    exit code comes from the server."""

    def __init__(self, server: LaunchServer, pid: int, argv: List[str], out_fd: int,
                 err_fd: Optional[int]):
        """`argv`: the module, then its arguments."""
        self.server, self.pid, self.args = server, pid, ["python", "-m", *argv]
        self.stdout = open(out_fd, "r", buffering=1)
        self.stderr = None if err_fd is None else open(err_fd, "r", buffering=1)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            while self.pid not in self.server.exits and self.server._message(timeout=0):
                pass
            self.returncode = self.server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server._message(timeout=left)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        """Read the streams to their end and wait. On timeout the launcher is killed (Popen's
        leaves it running; a test has no use for it) and subprocess.TimeoutExpired raised."""
        import subprocess
        import threading
        import time

        streams = [f for f in (self.stdout, self.stderr) if f is not None]
        read: Dict[int, str] = {}
        readers = [threading.Thread(target=lambda i=i, f=f: read.__setitem__(i, f.read()), daemon=True)
                   for i, f in enumerate(streams)]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        if any(reader.is_alive() for reader in readers):
            self.kill()
            self.wait()
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait()
        for f in streams:
            f.close()
        return read.get(0), (read.get(1) if self.stderr is not None else None)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc) -> None:
        if self.poll() is None:
            self.kill()
        self.wait()
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
