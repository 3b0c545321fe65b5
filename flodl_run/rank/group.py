"""The rank's process group: one per membership generation, built over the rendezvous store,
aborted from the listener thread when a member dies or a reduce hangs.

Owns the group's state (generation, the group the listener may abort, the reduce in flight);
the reduce itself (what is averaged, and what a failure undoes) is the caller's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from flodl_run.contracts.wire import AbortGroup

NCCL_ABORTABLE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
"""NCCL settings under which a communicator can be aborted from another thread: torch's
watchdog leaves errors to us (it would otherwise tear the process down on a timeout), and a
non-blocking communicator's abort returns without waiting on a dead peer. Set before the first
process group unless the environment already names them."""


class RankGroup:
    """This rank's membership in the collective: `join` (re)builds the group of a generation,
    `abort`/`watch` run on the listener thread, `collective()` brackets a reduce so `watch` can
    tell a hung one. Collectives time out after `limit_s`, a backstop only: the coordinator's
    AbortGroup comes first."""

    def __init__(self, rank: int, device: torch.device, limit_s: float, backend: str = "auto"):
        self.rank, self.device, self.limit_s = rank, device, limit_s
        self._tcp_store: Optional[dist.Store] = None
        # cluster.backend: NCCL on a GPU unless Gloo is asked for (ranks sharing one GPU)
        self.backend = "nccl" if device.type == "cuda" and backend != "gloo" else "gloo"
        self._lock = threading.Lock()  # the listener thread aborts what the main thread built
        self._group: Optional[dist.ProcessGroup] = None  # the NCCL group the listener may abort
        self.alone = False  # the only member left: no group, the reduce is the identity
        self.generation = 0
        self._aborted_generation = -1  # the listener aborted this generation's group
        self._collective_began: Optional[float] = None  # the main thread is inside a reduce since

    def _store(self) -> dist.Store:
        """The rendezvous store at MASTER_ADDR:MASTER_PORT. When the launcher (or torchrun's
        agent) hosts it, every rank is a client, so it outlives any rank."""
        if self._tcp_store is None:
            hosted = os.environ.get("FLODL_RUN_STORE_HOSTED") == "1" or \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            self._tcp_store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                is_master=not hosted and self.rank == 0,
                timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
        return self._tcp_store

    def join(self, generation: int, members: List[int]) -> None:
        """(Re)build the process group of one membership generation. A rank left alone builds
        none: its reduce is the identity."""
        self.leave()
        backend = self.backend
        if backend == "nccl":
            for name, value in NCCL_ABORTABLE.items():
                os.environ.setdefault(name, value)
        if len(members) > 1:
            timeout = datetime.timedelta(seconds=self.limit_s)
            store = dist.PrefixStore(f"flodl_run/gen{generation}/", self._store())
            dist.init_process_group(backend, store=store, rank=members.index(self.rank),
                                    world_size=len(members), timeout=timeout,
                                    device_id=self.device if backend == "nccl" else None)
        with self._lock:
            self.generation = generation
            self._group = dist.group.WORLD if len(members) > 1 and backend == "nccl" else None
            self.alone = len(members) == 1

    def leave(self) -> None:
        """Destroy this generation's group (an aborted one included); nothing when there is none."""
        with self._lock:
            self._group = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self, notice: AbortGroup) -> None:
        """Listener thread: members of this generation died. Abort the group (NCCL: the
        communicator, which ends kernels waiting on the dead) so the main thread leaves the
        collective now; its reduce then reports failure and the coordinator regroups. Gloo has
        no abort (torch's is a no-op there, and an aborted Gloo group dies badly at teardown): a
        dead peer's closed sockets end Gloo collectives at once, and the launcher kills a rank
        it declared dead, hung or not; the group timeout is the backstop."""
        with self._lock:
            if notice.generation != self.generation or self._aborted_generation == notice.generation:
                return
            self._aborted_generation = notice.generation
            group = self._group
        if group is not None:
            try:
                group.abort()
            except Exception as exc:  # never let the listener die: the regroup destroys it anyway
                print(f"rank {self.rank}: aborting generation {notice.generation}: {exc}",
                      file=sys.stderr)

    def fail(self) -> None:
        """Main thread: this rank will not complete a reduce of this generation (its collective
        failed, or the group was aborted before it began). Gloo: the group is destroyed now, so
        a peer waiting on this rank inside a collective sees its connections close and fails at
        once. It would otherwise wait out the group timeout: Gloo has no abort, and the Regroup
        that destroys the group comes only once every survivor has answered the round. Until
        that Regroup, reduces here fail at once (`broken`). NCCL: nothing (every survivor's
        listener aborts its communicator)."""
        if self.backend != "gloo" or self.alone:
            return
        with self._lock:
            self._aborted_generation = self.generation
        self.leave()

    def watch(self) -> None:
        """Listener thread, our stand-in for NCCL's watchdog (whose teardown is off): a reduce
        stuck past the group timeout with no death announced (a hang, a desync) is aborted as if
        a member had died. The rank reports ReduceFailed, the coordinator regroups and retries,
        and a round that keeps failing ends in reduce_stall (save and stop)."""
        began = self._collective_began
        if began is not None and self._group is not None and time.monotonic() - began > self.limit_s:
            self.abort(AbortGroup(self.generation, []))

    def broken(self) -> bool:
        """The listener aborted the group this reduce runs on: its results cannot be trusted."""
        return self._aborted_generation == self.generation

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """The main thread is inside a collective on this group (what `watch` times)."""
        self._collective_began = time.monotonic()
        try:
            yield
        finally:
            self._collective_began = None


def timed_reduce_ms(buffers: List[torch.Tensor]) -> float:
    """Wall of one all-reduce of copies of `buffers` over the default group, in ms: what a reduce
    costs on this backend, measured once before training so ElChe can size its first anchor.
    One untimed round first (it sets the communicator up and lines the ranks up); the
    parameters themselves are never touched. Every rank of the group must call it."""
    scratch = [b.detach().clone() for b in buffers]
    elapsed = 0.0
    for timed in (False, True):
        began = time.perf_counter()
        for buf in scratch:
            dist.all_reduce(buf)
        if scratch and scratch[0].is_cuda:
            torch.cuda.synchronize(scratch[0].device)
        elapsed = (time.perf_counter() - began) * 1000.0 if timed else 0.0
    return elapsed
