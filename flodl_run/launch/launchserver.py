"""The launch server: a process that has imported what `python -m flodl_run` imports (MLflow,
matplotlib's Figure and the rank's modules too), and forks launchers from that state on request.

Why: a fresh interpreter spends two to four CPU-seconds importing torch, Hydra, MLflow and the
runner before it reads its first override, and its spare zygote as much again. A bench on a
CPU rig runs one launcher after another, each for a few seconds: forked from here, each starts
with the imports done. The test suite forks its CLI runs from one server per pytest worker.

What a forked launcher sees is what `python -m <module>` would have given it: the request's
working directory, environment and arguments, `sys.path` built from that directory and the
request's PYTHONPATH as the interpreter builds it, standard input from /dev/null, its output on
the descriptors the request passed (buffered as an interpreter buffers pipes, PYTHONUNBUFFERED
included), fresh random generators, Python's default SIGINT handler, the module run through
`runpy` as `-m` runs it, and its exit as the interpreter's (threads joined, atexit handlers
run, output flushed) less the teardown (`zygote.run_forked`). What it cannot see differently is
what an interpreter reads when it starts (PYTHON* variables other than PYTHONPATH and
PYTHONUNBUFFERED, `-X` options): those are the server's.

Two ways to have one:
- `LaunchServer.spawn(cwd, modules)`: a fresh interpreter running `python -m
  flodl_run.launch.launchserver FD MODULE...`, which imports at once (the tests' per-worker
  server).
- `prefork()` then `warm(modules)`: forked from the calling process while it is one bare thread
  (the bench calls it first thing, as `python -m flodl_run` forks its spare), it waits;
  `warm` makes it import, `dismiss()` ends it (a bench on GPUs, or one that stops at a config
  error).

The caller names the modules to preload (Hydra, MLflow and the entry points live above this
layer); the rank zygote's own preload is always added.

Protocol: each request is one SOCK_SEQPACKET message, JSON {"argv", "cwd", "env"} and optionally
"module" (default flodl_run), with the stdout and stderr descriptors attached (SCM_RIGHTS). The
server answers {"started": pid}, and {"pid", "code"} when that child exits (`Popen.returncode`'s
form: negative for a signal). It exits when the client's end closes. The server ignores SIGINT
(a Ctrl-C in the terminal reaches the launchers, which stop and save, while the server stays to
report their exits); each launcher gets Python's handler back.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, List, Optional

MAX_MESSAGE = 1 << 20


def can_fork() -> bool:
    """Whether launchers may fork here: Linux with descriptor passing, and not turned off by
    `FLODL_RUN_RANK_START=spawn` (which asks for one interpreter per process)."""
    from flodl_run.launch.zygote import START_ENV

    return sys.platform == "linux" and hasattr(socket, "send_fds") \
        and os.environ.get(START_ENV) != "spawn"


def preload(modules: List[str]) -> None:
    """Import `modules` (the caller names them: what its launchers import, entry points
    included, as multiprocessing's forkserver is told what to preload; `module:function` also
    calls the function, work each launcher would do first), then what the rank
    zygote imports, for the spare each launcher forks (the CUDA check and gc.freeze included:
    a child's collections leave these objects and their pages alone). A module that does not
    import here is left out: a launcher that needs it imports it itself and says why it cannot,
    in its own output, as a fresh interpreter would."""
    import importlib

    from flodl_run.launch.zygote import preload as preload_ranks

    for name in modules:
        module, _, call = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if call:
                getattr(loaded, call)()
        except Exception:  # noqa: BLE001 - a preload is a head start, never a condition
            continue
    preload_ranks()


# ---------------------------------------------------------------- the server's side


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
                signal.signal(signal.SIGINT, signal.default_int_handler)
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
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):  # each its own descriptor,
        os.dup2(fd, target)                                           # even when sent twice
        os.close(fd)


def _become_launcher(request: dict, base_path: List[str]) -> None:
    """Take the request's directory, environment, path and arguments, then run the request's
    module (default flodl_run) as `python -m <module>` does. Raises SystemExit with its exit code."""
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


def _server_main(sock: socket.socket, base_path: List[str], modules: Optional[List[str]]) -> int:
    """Preload `modules` (None: wait for the client's `warm` to name them), then serve."""
    from flodl_run.launch.zygote import run_forked

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the launchers (see above)
    if modules is None:
        data = sock.recv(MAX_MESSAGE)
        if not data:
            return 0  # dismissed, or the client exited
        modules = json.loads(data)["warm"]
    preload(modules)
    request = _serve(sock)
    if request is None:
        return 0
    run_forked(lambda: _become_launcher(request, base_path))  # as a forked rank leaves


def main(argv: List[str]) -> int:
    """`python -m flodl_run.launch.launchserver FD [MODULE ...]`: preload the modules, then
    serve on the socket FD."""
    return _server_main(socket.socket(fileno=int(argv[0])), sys.path[1:], list(argv[1:]))


# ---------------------------------------------------------------- the client's side


class StartInterrupted(KeyboardInterrupt):
    """A Ctrl-C while the server was forking a launcher: `launched` is its handle, so the
    caller can still stop it (the terminal's SIGINT reached the launcher only if it came after
    the fork) and wait for it."""

    def __init__(self, launched: "Launched"):
        super().__init__()
        self.launched = launched


class LaunchServer:
    """The client's handle on a server. Launchers it started and left running are killed by
    `kill_running()` (a test that failed before it waited for its launcher)."""

    def __init__(self, sock: socket.socket, process):
        self.sock, self.process = sock, process
        self.exits: Dict[int, int] = {}
        self.running: Dict[int, "Launched"] = {}

    @classmethod
    def spawn(cls, cwd: str, modules: List[str]) -> "LaunchServer":
        """A server in a fresh interpreter started in `cwd`, preloading `modules` at once."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        process = subprocess.Popen(
            [sys.executable, "-m", "flodl_run.launch.launchserver", str(theirs.fileno()), *modules],
            cwd=cwd, env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        return cls(ours, process)

    def alive(self) -> bool:
        return self.process.poll() is None

    def warm(self, modules: List[str]) -> None:
        """A preforked server: preload `modules` now (a spawned one already has)."""
        self.sock.send(json.dumps({"warm": list(modules)}).encode())

    def close(self) -> None:
        """End the server (its launchers still running carry on)."""
        self.sock.close()
        self.process.wait()

    def start(self, argv: List[str], cwd: str, env: Dict[str, str], merge_stderr: bool = True,
              module: str = "flodl_run", output: Optional[int] = None) -> "Launched":
        """`python -m <module> *argv` forked and running: a handle that behaves like the
        `subprocess.Popen(..., stdout=PIPE, stderr=STDOUT or PIPE, text=True)` of it, or, with
        `output` (a descriptor), like `Popen(..., stdout=output, stderr=STDOUT)`."""
        if output is not None:
            out_r = err_r = None
            sent = [output, output]
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = (None, out_w) if merge_stderr else os.pipe()
            sent = [out_w, err_w]
        try:
            request = {"argv": argv, "cwd": cwd, "env": env, "module": module}
            socket.send_fds(self.sock, [json.dumps(request).encode()], sent)
        finally:
            if output is None:
                for fd in set(sent):
                    os.close(fd)
        pid, interrupted = None, False
        while pid is None:
            try:
                pid = self._message().get("started")
            except KeyboardInterrupt:  # the fork is under way: take its handle first
                interrupted = True
        launched = Launched(self, pid, [module, *argv], out_r, err_r)
        self.running[pid] = launched
        if interrupted:
            raise StartInterrupted(launched)
        return launched

    def run(self, argv: List[str], cwd: str, env: Dict[str, str], timeout: float,
            module: str = "flodl_run"):
        """(pid, returncode, stdout, stderr) of `python -m <module> *argv`; on timeout the run
        is killed and subprocess.TimeoutExpired raised, as `communicate` would."""
        launched = self.start(argv, cwd, env, merge_stderr=False, module=module)
        out, err = launched.communicate(timeout=timeout)
        return launched.pid, launched.returncode, out, err

    def kill_running(self, keep: Iterable[int] = ()) -> List[int]:
        """SIGKILL every launcher of ours still running (but those whose pid is in `keep`), wait
        for each; their pids."""
        kept = set(keep)
        left = [launched for launched in list(self.running.values())
                if launched.pid not in kept and launched.poll() is None]
        for launched in left:
            launched.kill()
            launched.wait()
        return [launched.pid for launched in left]

    def _message(self, timeout: Optional[float] = None) -> dict:
        """The server's next message ({} when none came within `timeout`)."""
        if timeout is not None and not select.select([self.sock], [], [], max(timeout, 0))[0]:
            return {}
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except ConnectionResetError:
            data = b""
        if not data:
            raise RuntimeError(f"the launch server (pid {self.process.pid}) exited with code "
                               f"{self.process.wait()}")
        message = json.loads(data)
        if "code" in message:
            self.exits[message["pid"]] = message["code"]
        return message


class Launched:
    """A launcher forked by the server, as the part of `subprocess.Popen` its users need:
    `pid`, `stdout` (and `stderr` unless merged, neither when the output went to a descriptor)
    as text files, `poll`, `wait`, `communicate`, `send_signal`, `terminate`, `kill`,
    `returncode`. It is the server's child, not ours: its exit code comes from the server."""

    def __init__(self, server: LaunchServer, pid: int, argv: List[str], out_fd: Optional[int],
                 err_fd: Optional[int]):
        """`argv`: the module, then its arguments."""
        self.server, self.pid, self.args = server, pid, ["python", "-m", *argv]
        self.stdout = None if out_fd is None else open(out_fd, "r", buffering=1)
        self.stderr = None if err_fd is None else open(err_fd, "r", buffering=1)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            while self.pid not in self.server.exits and self.server._message(timeout=0):
                pass
            self.returncode = self.server.exits.pop(self.pid, None)
            if self.returncode is not None:
                self.server.running.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server._message(timeout=left)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        """Read the streams to their end and wait. On timeout the launcher is killed (Popen's
        leaves it running; its callers have no use for it) and subprocess.TimeoutExpired raised."""
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


# ---------------------------------------------------------------- the preforked server

_preforked: Optional[LaunchServer] = None


def prefork() -> None:
    """Fork a server from this process, now, while it is one bare thread (as `python -m
    flodl_run` forks its spare zygote); it waits for `warm()` before it imports anything. Does
    nothing where launchers may not fork, or when another thread already runs."""
    global _preforked
    from flodl_run.launch.zygote import ForkedChild, run_forked, thread_count

    if _preforked is not None or not can_fork() or thread_count() != 1:
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    base_path = sys.path[1:]
    pid = os.fork()
    if pid:
        theirs.close()
        _preforked = LaunchServer(ours, ForkedChild(pid))
        return
    ours.close()
    run_forked(lambda: _server_main(theirs, base_path, None))


def preforked() -> Optional[LaunchServer]:
    """The server `prefork()` made, if it is still there."""
    return _preforked if _preforked is not None and _preforked.alive() else None


def dismiss() -> None:
    """End the preforked server (it imported nothing unless warmed)."""
    global _preforked
    if _preforked is not None:
        server, _preforked = _preforked, None
        server.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
