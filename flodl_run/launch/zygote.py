"""The rank zygote: one process per run that has imported torch, zmq and the rank's modules
once, and forks each local rank from that state instead of starting a fresh interpreter.

A fresh `python -m flodl_run.rank` spends about two CPU-seconds importing before it does
anything; eight of them starting together on one node contend for the same cores and disk.
Forked from the zygote, a rank starts with everything imported and pays only for the pages it
writes.

Entry point `python -m flodl_run.launch.zygote FD`: FD is this end of a SOCK_SEQPACKET socket pair
whose other end the supervisor holds (`Zygote`). Each request is one message: the rank's
environment as JSON, with the write end of its output pipe attached (SCM_RIGHTS). The zygote
forks; the child starts its own session, takes the pipe as stdout and stderr, takes the
environment, and runs `flodl_run.rank.process.main` as `python -m flodl_run.rank` would; it leaves
as the interpreter's exit does, less the teardown (`exit_forked`). The zygote answers each
request with the child's pid and reports each child's exit status (as `Popen.returncode`
states it: negative for a signal).

Lifetime: the zygote never touches CUDA (each rank picks its devices after the fork). It exits
when the supervisor's end closes (a launcher killed by SIGKILL included) or when it has been
told that no more ranks come and the last child was reaped. A child watches the launcher, as a
plain rank does (FLODL_RUN_PARENT_PID names the launcher, not the zygote): a zygote lost by
itself leaves the ranks training, and the supervisor says it is gone (the ranks' exit codes
went with it).

In `ps`, a forked rank shows the zygote's command line (`-m flodl_run.launch.zygote`) and the name
`flodl_rankN`; the zygote is named `flodl_zygote`. Their /proc/PID/environ is the zygote's
(the rank-independent part of the ranks' environment); `os.environ` inside is the rank's own.

The spare: `python -m flodl_run` forks a zygote from itself before it does anything else
(`prefork`), while it is one thread that has imported next to nothing, so the state it copies is
a new interpreter's. The first run of local ranks takes that spare instead of starting an
interpreter: the launcher hands it the run's log as soon as the plan says ranks will fork here
(`ready_spare`), and it imports torch and the rank while the launcher starts the tracker, the
dashboard and the coordinator. A run that forks no ranks here dismisses it. A rank forked
from the spare shows the launcher's command line and /proc environ instead.

Kept for the next run: once a run's ranks have all exited, its zygote (the spare, or one
started as a new interpreter) becomes the process's spare again (`park`), already imported,
and the next run of the same process (a multirun sweep's next job, `flodl_run.train` called
again from a script) sends it its own log and forks from it. A sweep's later jobs used to
start a new interpreter each: about 4 CPU-seconds and 2 s before the first batch.

`FLODL_RUN_RANK_START=spawn` in the launcher's environment turns this off (one interpreter per
rank, as on platforms without fork and SCM_RIGHTS). Ranks on GPUs spawn unless
`FLODL_RUN_RANK_START=zygote` is set, until the forked path is measured on GPU machines.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional

from flodl_run.contracts.rankenv import RankEnvironment

START_ENV = "FLODL_RUN_RANK_START"
ZYGOTE_NAME = "flodl_zygote"
MAX_MESSAGE = 1 << 20  # an environment is a few kB; a seqpacket message is read whole or not at all
PER_RANK_KEYS = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
"""What differs between the ranks of one host: left out of the zygote's own environment, so
that its /proc/PID/environ (which forked ranks keep showing) names no rank in particular."""


def fork_ranks(environ: Dict[str, str], on_gpus: bool = False) -> bool:
    """Fork from a zygote unless the user asked for one interpreter per rank, or the platform
    lacks fork or descriptor passing. Ranks on GPUs spawn unless `FLODL_RUN_RANK_START=zygote`
    asks for it: the forked path has not been measured on a GPU machine yet."""
    wanted = environ.get(START_ENV, "spawn" if on_gpus else "zygote")
    if wanted not in ("zygote", "spawn"):
        raise SystemExit(f"{START_ENV}={wanted!r}: expected 'zygote' or 'spawn'")
    return wanted == "zygote" and sys.platform == "linux" and hasattr(socket, "send_fds")


# ---------------------------------------------------------------- the supervisor's side


class Zygote:
    """The supervisor's handle on one zygote process. Thread-safe: the supervisor's watch loop,
    the coordinator's killer and the forwarders may call `ForkedRank.poll` concurrently."""

    def __init__(self, sock: socket.socket, process):
        self.sock, self.process = sock, process  # process: a Popen, or the spare's `ForkedChild`
        self.lock = threading.Lock()
        self.started: List[int] = []
        self.exits: Dict[int, int] = {}
        self.closed = False
        self.log_path: Optional[Path] = None  # where its output goes now (None: the spare, unwarmed)
        self.forked: List[int] = []  # every rank it forked, for `park`

    @classmethod
    def start(cls, env: Dict[str, str], log_path: Path) -> "Zygote":
        """The zygote for one run's ranks on this host: this process's spare when it has one
        (`prefork`), a new interpreter with `env` (less the per-rank keys) otherwise."""
        spare = _take_spare()
        if spare is not None and spare.warm(log_path):
            return spare
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "flodl_run.launch.zygote", str(theirs.fileno())],
                env={k: v for k, v in env.items() if k not in PER_RANK_KEYS},
                pass_fds=(theirs.fileno(),), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # Ctrl-C reaches the launcher only, as for ranks
        theirs.close()
        zygote = cls(ours, process)
        zygote.log_path = log_path
        return zygote

    def warm(self, log_path: Path) -> bool:
        """The spare: send it the run's log (its stdout and stderr from now on). The first time,
        it then imports torch and the rank; a zygote kept from an earlier run just takes the
        new log. False when it is gone (killed from outside): the caller starts an interpreter."""
        if self.log_path == log_path:
            return True
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with self.lock:
                socket.send_fds(self.sock, [b'{"log": true}'], [fd])
        except OSError:
            self.dismiss()
            return False
        finally:
            os.close(fd)
        self.log_path = log_path
        return True

    def dismiss(self) -> None:
        """The spare, unused: close our end; it exits, and we reap it."""
        self.sock.close()
        self.closed = True
        self.process.wait()

    def park(self) -> None:
        """The run is over and its ranks were reaped: keep this zygote as the process's spare
        for its next run when it is whole (every rank it forked reported, nothing else kept);
        otherwise seal it, and it exits once its last child is reaped."""
        global _spare
        with self.lock:
            while not self.closed and self._take(block=False):
                pass
            whole = not self.closed and all(pid in self.exits for pid in self.forked)
        if whole and _spare is None:
            self.forked, self.exits = [], {}
            _spare = self
        else:
            self.seal()

    def spawn(self, env: Dict[str, str]) -> "ForkedRank":
        """Fork one rank with `env`; its stdout and stderr go to the returned handle's pipe."""
        read_end, write_end = os.pipe()
        try:
            with self.lock:
                request = {"env": env, "cwd": os.getcwd()}  # where a spawned rank would start
                socket.send_fds(self.sock, [json.dumps(request).encode()], [write_end])
                while not self.started and not self.closed:
                    self._take(block=True)
                if not self.started:
                    raise RuntimeError(f"the rank zygote (pid {self.process.pid}) exited with "
                                       f"code {self.process.wait()}: see ranks/zygote.log")
                pid = self.started.pop(0)
                self.forked.append(pid)
        finally:
            os.close(write_end)  # the child holds it now: EOF on read_end when it exits
        return ForkedRank(self, pid, open(read_end, "r", buffering=1))

    def seal(self) -> None:
        """No more ranks: the zygote exits once its last child is reaped."""
        with self.lock:
            if not self.closed:
                self.sock.send(b'{"seal": true}')

    def lost(self) -> Optional[int]:
        """The zygote's exit code when it ended other than as told (killed from outside: it
        exits 0 once sealed and its last child is reaped), else None. Its ranks live on,
        watching the launcher."""
        with self.lock:
            while not self.closed and self._take(block=False):
                pass
            code = self.process.returncode if self.closed else None
        return code if code else None

    def returncode(self, pid: int) -> Optional[int]:
        with self.lock:
            while not self.closed and self._take(block=False):
                pass
            return self.exits.get(pid)

    def _take(self, block: bool) -> bool:
        """Read one message if there is one (or wait for it); False when none came."""
        if not block and not select.select([self.sock], [], [], 0)[0]:
            return False
        data = self.sock.recv(MAX_MESSAGE)
        if not data:  # the zygote exited: it reported every child it reaped before that
            self.closed = True
            self.sock.close()
            self.process.wait()
            return False
        message = json.loads(data)
        if "started" in message:
            self.started.append(message["started"])
        else:
            self.exits[message["pid"]] = message["code"]
        return True


class ForkedRank:
    """The part of `subprocess.Popen` the supervisor uses, for a rank forked by a zygote."""

    def __init__(self, zygote: Zygote, pid: int, stdout):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            from flodl_run.contracts.checkpoint import pid_alive  # here: `prefork` runs before torch loads

            self.returncode = self.zygote.returncode(self.pid)
            if self.returncode is None and self.zygote.closed and not pid_alive(self.pid):
                self.returncode = 1  # the zygote died first; the rank left as an orphan
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# ---------------------------------------------------------------- the spare


_spare: Optional[Zygote] = None
"""The zygote `prefork` forked from this process, until a run takes it or dismisses it."""


class ForkedChild:
    """A child this process forked, watched through the part of `subprocess.Popen` a caller
    uses (the spare's `Zygote`, the bench peers' forked ranks)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if timeout is None and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def terminate(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGTERM)


def prefork() -> None:
    """Fork the spare zygote from this process, now. `python -m flodl_run` calls this before
    anything else: the process is then one thread (a fork copies only the calling one) with
    next to nothing imported, so the spare starts from a new interpreter's state. Does nothing
    when ranks are asked to spawn, off Linux, or when another thread already runs. In the
    spare, this call does not return: the process leaves through `run_forked` when it is done."""
    global _spare
    if _spare is not None or os.environ.get(START_ENV) == "spawn" or not fork_ranks({}) \
            or thread_count() != 1:
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        _spare = Zygote(ours, ForkedChild(pid))
        return
    ours.close()
    _note_base_path()
    run_forked(lambda: _spare_main(theirs))  # the launcher's copy, whose teardown would copy its pages


def ready_spare(log_path: Optional[Path]) -> None:
    """The launcher, once its plan is known: with the path of the run's zygote log when its
    ranks fork on this host (the spare starts importing now, while the launcher sets up the
    rest), with None when they do not (the spare exits)."""
    if _spare is None:
        return
    if log_path is None:
        _take_spare().dismiss()
    elif not _spare.warm(log_path):
        _take_spare()


def _take_spare() -> Optional[Zygote]:
    global _spare
    spare, _spare = _spare, None
    return spare


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # unknown: do not fork


def _spare_main(sock: socket.socket) -> int:
    """The spare, from its fork: out of the launcher's session and off its output, wait for
    a run's log (or for the launcher to go), then be that run's zygote."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    _name(ZYGOTE_NAME)
    launcher = os.getppid()
    while not select.select([sock], [], [], 1.0)[0]:
        if os.getppid() != launcher:
            return 0
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    if not data:
        return 0  # dismissed, or the launcher exited
    _take_output(fds[0])
    fresh_stdio(unbuffered=True)  # ranks run with PYTHONUNBUFFERED: output forwarded as it comes
    return _zygote(sock)


def _take_output(fd: int) -> None:
    """Make `fd` (a run's zygote log) this process's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def fresh_stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr over file descriptors 1 and 2 as an interpreter starting on
    pipes makes them (a forked process's were made for its parent's streams): stdout
    block-buffered and stderr line-buffered, both unbuffered and writing through under
    PYTHONUNBUFFERED."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding,
                                  errors=old.errors, line_buffering=name == "stderr" and not unbuffered,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


# ---------------------------------------------------------------- the zygote's side


def preload() -> None:
    """Import what every rank imports, and make sure none of it initialized CUDA: a CUDA
    context does not survive fork, and each rank must choose its own devices."""
    import torch
    import torch._dynamo  # noqa: F401  (every optimizer imports it when built: 1.6 CPU-s a rank)

    import flodl_run.rank.process  # noqa: F401  (torch.distributed, zmq, the rank's modules)

    if torch.cuda.is_initialized():
        raise RuntimeError("importing the rank initialized CUDA; ranks cannot be forked")
    # Out of the collector's reach: a child's collections and its exit then leave these objects
    # (and the pages they share with us) alone, instead of copying each page they touch.
    # Measured: a forked rank's exit went from 1.2 to 0.4 CPU-seconds.
    gc.freeze()


def _serve(sock: socket.socket) -> Optional[dict]:
    """Fork ranks on request and report their exits. Returns, in a forked child, the request
    (the rank's environment and working directory: the child then runs the rank); in the
    zygote, None when it is done."""
    launcher = os.getppid()
    children: Dict[int, Optional[int]] = {}  # pid -> pidfd (None where pidfds are unsupported)
    sealed = False
    while not (sealed and not children):
        fds = [sock] + [fd for fd in children.values() if fd is not None]
        timeout = 1.0 if all(fd is not None for fd in children.values()) else 0.1
        ready = select.select(fds, [], [], timeout)[0]
        if os.getppid() != launcher:
            return None  # the launcher is gone even if our socket's end somehow is not
        if sock in ready:
            data, fds_in, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
            if not data:
                return None  # the supervisor closed its end or its process died
            request = json.loads(data)
            if request.get("seal"):
                sealed = True
                continue
            if request.get("log"):  # kept for another run: its output goes to that run's log
                _take_output(fds_in[0])
                continue
            pid = os.fork()
            if pid == 0:
                _become_rank(sock, fds_in[0], children)
                return {**request, "launcher": launcher}
            os.close(fds_in[0])
            children[pid] = _pidfd(pid)
            sock.send(json.dumps({"started": pid}).encode())
        _reap(sock, children)
    return None


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # older kernel: poll with a short timeout instead


def _reap(sock: socket.socket, children: Dict[int, Optional[int]]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            fd = children.pop(pid)
            if fd is not None:
                os.close(fd)
            sock.send(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_rank(sock: socket.socket, output: int, children: Dict[int, Optional[int]]) -> None:
    """In the forked child: what `Popen(..., stdout=pipe, stderr=STDOUT,
    start_new_session=True)` would have set up, minus the new interpreter."""
    os.setsid()  # the supervisor stops a rank by signalling its process group
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    sock.close()
    for fd in children.values():
        if fd is not None:
            os.close(fd)


def _name(name: str) -> None:
    """Set this process's name (/proc/PID/comm, what `ps` and `top` show): forked ranks share
    the zygote's command line, so the name is what tells them apart."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _run_rank(request: dict) -> int:
    env: Dict[str, str] = request["env"]
    _name(f"flodl_rank{env.get('RANK', '')}")
    if request.get("cwd"):  # the launcher's now (Hydra's job.chdir may have moved it since the fork)
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    if _base_path is not None:  # sys.path as `python -m` builds it here: cwd, PYTHONPATH, the rest
        sys.path[:] = [os.getcwd(), *_entries(env.get("PYTHONPATH", "")), *_base_path]
    # the rank's orphan check watches the launcher, not its parent (the zygote)
    os.environ.update(RankEnvironment(parent_pid=request["launcher"]).to_environ())
    fresh_random_state()
    intra_op_threads(env)
    from flodl_run.rank import process as rank

    sys.argv = [str(Path(rank.__file__).with_name("__main__.py"))]  # as `-m flodl_run.rank` sets it
    return rank.main()


def intra_op_threads(env: Dict[str, str]) -> None:
    """torch sized its thread pool from OMP_NUM_THREADS when the zygote imported it, under the
    zygote's environment (the spare's is the launcher's): size it from the rank's, as a new
    interpreter would have."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def fresh_random_state() -> None:
    """Seed torch's and numpy's global generators from the OS, as a new interpreter does:
    forked ranks would otherwise share the zygote's state (Python's `random` reseeds itself
    after a fork). What a rank seeds explicitly (its model, its data order) is unaffected."""
    import torch

    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


_base_path: Optional[List[str]] = None
"""sys.path past the entries an interpreter's start put first (its directory, PYTHONPATH), noted
when this process began to be a zygote: a rank's own go in front of it."""


def _entries(pythonpath: str) -> List[str]:
    return [p for p in pythonpath.split(os.pathsep) if p]


def _note_base_path() -> None:
    global _base_path
    _base_path = sys.path[1 + len(_entries(os.environ.get("PYTHONPATH", ""))):]


def _zygote(sock: socket.socket) -> int:
    """Import, then fork ranks until done; in a forked child, run the rank and leave."""
    preload()
    request = _serve(sock)
    if request is None:
        return 0
    run_forked(lambda: _run_rank(request))


def run_forked(main: Callable[[], Optional[int]]) -> NoReturn:
    """Run `main` in a forked child and leave with the status the interpreter would give it:
    its return value (None: 0), an uncaught SystemExit's code (a message printed, status 1),
    death by SIGINT for a KeyboardInterrupt, or 1 for any other exception (the traceback
    printed for both); then `exit_forked`. It never returns into the forking code."""
    by_signal = None
    try:
        code = main() or 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code, by_signal = 130, signal.SIGINT
    except BaseException:  # noqa: BLE001  (as the interpreter reports an uncaught exception)
        traceback.print_exc()
        code = 1
    exit_forked(code, by_signal)


def exit_forked(code: int, by_signal: Optional[int] = None) -> NoReturn:
    """Leave a forked child as the interpreter's exit would (non-daemon threads joined, atexit
    handlers run, output flushed), less its teardown: freeing every object the zygote made
    writes to pages the child shares with it, copying each one. Measured on a forked CPU
    rank: 0.6 CPU-seconds a rank with the teardown, 0.3 without. What a rank sends the
    coordinator is delivered before (RankRunner.close), not by the teardown. `by_signal`:
    die by that signal instead (code is then the status should it be caught)."""
    # CPython's own exit, in its order: threading's exit hooks (an executor tells its threads
    # to stop), non-daemon threads joined, then atexit handlers; os._exit would skip them all
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            pass
    if by_signal is not None:  # as the interpreter leaves after a KeyboardInterrupt
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code)


def main(argv: List[str]) -> int:
    _note_base_path()
    sock = socket.socket(fileno=int(argv[0]))
    _name(ZYGOTE_NAME)
    return _zygote(sock)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
