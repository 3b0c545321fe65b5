"""A connection flood without the run's secret against the launcher's two listeners (the
coordinator's control port and the rendezvous store) while a real run trains, with the launcher
held to 1,024 open files. Each idle connection used to take one of the launcher's descriptors:
about 1,100 on the control port (for up to its handshake deadline, and re-opened at once) and
1,000 on the store (for good) left none for events.jsonl, and the run failed."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Dict, Set

import pytest

from tests.support import _free_port, start_cli

pytestmark = pytest.mark.e2e

NUM_TRAIN = 1437  # digits train split
FILES = 1024  # the common soft limit, here the hard one too: the launcher cannot raise it
CONTROL_FLOOD, STORE_FLOOD = 1100, 1000
EPOCHS = 8
REOPEN = 20  # connections re-opened a port every 10 ms (2,000 a second)


class Flood:
    """Keeps `count` idle TCP connections open to each port of `targets` from a thread of its
    own, re-opening each one the far side closes (`dropped` counts those). `stop()` closes them
    all."""

    def __init__(self) -> None:
        self.targets: Dict[int, int] = {}
        self.live: Dict[int, int] = {}
        self.dropped: Dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def aim(self, port: int, count: int) -> None:
        with self._lock:
            self.targets[port] = count
            self.live.setdefault(port, 0)
            self.dropped.setdefault(port, 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _open(self, port: int) -> bool:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            sock.close()
            return False
        self._selector.register(sock, selectors.EVENT_READ, port)
        self.live[port] += 1
        return True

    def _run(self) -> None:
        """Open each port's connections at once, then re-open what was closed, at most
        REOPEN a port every 10 ms: a flood kept up, not a busy loop on two cores."""
        full: Set[int] = set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    targets = dict(self.targets)
                for port, count in targets.items():
                    missing = count - self.live[port]
                    for _ in range(min(REOPEN, missing) if port in full else missing):
                        if not self._open(port):
                            break
                    full.add(port)
                began = time.monotonic()
                while time.monotonic() - began < 0.01:
                    for key, _ in self._selector.select(0.01 - (time.monotonic() - began)):
                        self._read(key)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        try:
            if key.fileobj.recv(4096):
                return  # a greeting: the connection stays idle from our side
        except BlockingIOError:
            return
        except OSError:
            pass
        self._selector.unregister(key.fileobj)
        key.fileobj.close()
        self.live[key.data] -= 1
        self.dropped[key.data] += 1


def _listening_ports(pid: int) -> Set[int]:
    """TCP ports the process `pid` listens on (its own descriptors), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _await(what: str, found, proc, timeout_s: float = 120.0):
    """Poll `found()` until it is truthy; fail naming `what` when the run ends or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        value = found()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"no {what} (launcher exit code {proc.poll()})")


def _started(events: Path) -> bool:
    return events.exists() and any(json.loads(line)["kind"] == "start"
                                   for line in events.read_text().splitlines())


def _rank_pid(run_dir: Path, rank: int) -> int:
    """The pid the supervisor wrote first into the rank's log."""
    return int(re.search(r"pid (\d+)", (run_dir / "ranks" / f"rank{rank}.log").read_text())[1])


def test_a_connection_flood_without_the_secret_does_not_end_the_run(tmp_path):
    """Pins: 1,100 idle connections kept open against the control port (from before the ranks
    join) and 1,000 against the rendezvous store (once they have) ended a 1,024-file launcher's
    run `failed` on its next file (`coordinator error: OSError: [Errno 24] Too many open
    files`, in events.jsonl or in the next checkpoint generation). Now the control plane closes
    what is past its cap of connections still in their handshake and the store's connections
    are another process's files: the run completes, its two survivors regrouped on the flooded
    store after rank 2 is killed, every sample of every epoch trained, every checkpoint and
    output written, and the flood named in events.jsonl."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < CONTROL_FLOOD + STORE_FLOOD + 200:
        pytest.skip(f"the flood needs {CONTROL_FLOOD + STORE_FLOOD + 200} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    run_dir, store_port = tmp_path / "run", _free_port()
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "cluster=cpu", "cluster.num_ranks=3",
                     "cluster.threads_per_rank=1", f"cluster.master_port={store_port}",
                     f"num_epochs={EPOCHS}", "checkpoint_every=1", f"save_path={tmp_path / 'bundle'}")
    flood = Flood()
    try:
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FILES, FILES))
        (control_port,) = _await("control port", lambda: _listening_ports(proc.pid) - {store_port}, proc)
        flood.aim(control_port, CONTROL_FLOOD)
        _await("start event", lambda: _started(run_dir / "events.jsonl"), proc)
        flood.aim(store_port, STORE_FLOOD)
        _await("store flood", lambda: flood.live[store_port] >= STORE_FLOOD, proc)
        os.kill(_rank_pid(run_dir, 2), signal.SIGKILL)  # the survivors regroup on the store
        out, _ = proc.communicate(timeout=180)
    finally:
        flood.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["dead_ranks"] == [2], summary.get("message")
    assert [e["samples"] for e in summary["epochs"]] == [NUM_TRAIN] * EPOCHS
    assert proc.returncode == 0 and "not written" not in out, out[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("checkpoint") == EPOCHS and kinds[-1] == "end", kinds
    floods = [e["message"] for e in events if e["kind"] == "connection_flood"]
    assert len(floods) == 1 and "closed" in floods[0], kinds
    assert flood.dropped[control_port] > 0  # the flood was kept up: what was closed came back
