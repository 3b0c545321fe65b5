"""A rank process as the launcher holds it, and the rendezvous pieces every way of starting
ranks shares (local spawn in `supervisor`, ssh in `hosts`, an srun step in `slurm`).

Owns the `RankProcess` record, forwarding a rank's output to its log and the terminal, the
rendezvous store hosted by the launcher, and the address helpers around it. Watching and
stopping ranks is `supervisor`'s; laying them out is `hosts`' and `slurm`'s.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import resource
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass
from typing import Optional, Set, TextIO

from rich.console import Console
from rich.markup import escape

from flodl_run.contracts.signals import ignore_stop_signal


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen
    log: TextIO
    forwarder: Optional[threading.Thread] = None
    host: Optional[str] = None
    """Worker host of a rank started over ssh (`hosts`); None for a local rank."""
    store: Optional["StoreHost"] = None
    """The rendezvous store these ranks share (closed once they are all gone)."""


def forward(proc: RankProcess, console: Console, label: str) -> None:
    """Copy a rank's output to its log file and to the terminal, prefixed by `label`."""
    prefix = f"[dim]\\[{escape(label)}][/] "
    for line in proc.process.stdout:
        proc.log.write(line)
        proc.log.flush()
        console.print(prefix + escape(line.rstrip()), highlight=False, soft_wrap=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StoreHost:
    """The rendezvous store's process, as the launcher holds it: `port` is where it listens;
    `close()` ends it (so does the launcher's own end, however it comes)."""

    def __init__(self, pid: int, port: int, watch_fd: int):
        self.pid, self.port, self._watch_fd = pid, port, watch_fd

    def close(self) -> None:
        if self._watch_fd < 0:
            return
        os.close(self._watch_fd)  # the store's read sees the end of the pipe and it exits
        self._watch_fd = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped elsewhere
            pass


def host_store(addr: str, port: int) -> StoreHost:
    """The rendezvous store, hosted by a child of this process (CPU only, no CUDA) so it
    outlives any rank: survivors rebuild their process group on it after a death. It listens
    on `addr` only (port 0: the kernel picks; `.port` says which): left to itself, torch's
    store listens on every interface whatever host it is given, so we bind the socket and hand
    it over. A child of its own, forked from here, so that the connections made to it (torch's
    store takes any number, and asks nothing of them) use its descriptors, never the
    launcher's: 1,000 idle ones used to take what the run's own files needed."""
    import torch.distributed  # noqa: F401  (imported before the fork: the child imports nothing)

    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen()
    except OSError:
        listener.close()
        raise
    watch_r, watch_w = os.pipe()
    ready_r, ready_w = os.pipe()
    # blocked across the fork: the child runs none of our handlers before it drops them
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover  (the child never returns)
            _serve_store(addr, listener.fileno(), watch_r, ready_w, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(watch_r)
    os.close(ready_w)
    port = listener.getsockname()[1]
    listener.close()  # the child's copy is the one that accepts
    with os.fdopen(ready_r, "rb") as ready:
        answer = ready.read().decode(errors="replace")
    if answer != "ready":
        os.close(watch_w)
        os.waitpid(pid, 0)
        raise OSError(f"the rendezvous store did not start: {answer or 'it exited'}")
    return StoreHost(pid, port, watch_w)


def _serve_store(addr: str, listen_fd: int, watch_fd: int, ready_fd: int,
                 mask: Set[signal.Signals]) -> None:
    """The store's child: torch's master store on `listen_fd` until `watch_fd` reads its end.
    Only descriptors it uses stay open (a copy of the launcher's would keep their files, pipes
    and ports alive); no collection runs (a finalizer could close a number torch reuses)."""
    import gc

    gc.disable()
    try:
        os.setsid()  # a Ctrl-C for the launcher does not end the store under the ranks
        _drop_handlers()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        keep = sorted({0, 1, 2, listen_fd, watch_fd, ready_fd})
        for low, high in zip(keep, keep[1:] + [resource.getrlimit(resource.RLIMIT_NOFILE)[0]]):
            os.closerange(low + 1, high)
        import torch.distributed as dist

        store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300), master_listen_fd=listen_fd)
        os.write(ready_fd, b"ready")
        os.close(ready_fd)
        while os.read(watch_fd, 1):
            pass
        del store
    except BaseException as exc:
        try:
            os.write(ready_fd, f"{type(exc).__name__}: {exc}".encode())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _drop_handlers() -> None:
    """In the store's child: none of the launcher's Python signal handlers, forked with it,
    runs here. A sweep job's launcher holds submitit's preemption handler, and Slurm signals
    every process of the job step: in the store, that handler requeued the job at once (every
    step cancelled, no bundle saved). The scheduler's stop signal is ignored, as in a rank."""
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
    ignore_stop_signal(os.environ)
