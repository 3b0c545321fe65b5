"""A rank process as the launcher holds it, and the rendezvous pieces every way of starting
ranks shares (local spawn in `supervisor`, ssh in `hosts`, an srun step in `slurm`).

Owns the `RankProcess` record, forwarding a rank's output to its log and the terminal, the
rendezvous store hosted by the launcher, and the address helpers around it. Watching and
stopping ranks is `supervisor`'s; laying them out is `hosts`' and `slurm`'s.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import subprocess
import threading
from dataclasses import dataclass
from typing import Any, Optional, TextIO

from rich.console import Console
from rich.markup import escape


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen
    log: TextIO
    forwarder: Optional[threading.Thread] = None
    host: Optional[str] = None
    """Worker host of a rank started over ssh (`hosts`); None for a local rank."""
    store: Any = None
    """The rendezvous store these ranks share (kept alive as long as the processes)."""


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


def host_store(addr: str, port: int) -> Any:
    """The rendezvous store, hosted here (CPU only, no CUDA) so it outlives any rank: survivors
    rebuild their process group on it after a death. It listens on `addr` only
    (port 0: the kernel picks; `.port` says which): left to itself, torch's store listens on
    every interface whatever host it is given, so we bind the socket and hand it over."""
    import torch.distributed as dist

    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen()
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(addr, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=300), master_listen_fd=listener.detach())
