"""The rank process: one replica on one device, driven by the coordinator's orders.

Entry point `python -m flodl_run.rank`, torchrun-compatible: reads RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, plus FLODL_RUN_COORD (coordinator address),
FLODL_RUN_SECRET (hex key) and FLODL_RUN_FILE (the resolved run.yaml). It trains what it is
told, reduces when told, and reports facts; it decides nothing about cadence.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import zmq

from flodl_run import checkpoint, scalars
from flodl_run.averaging.central import blend_
from flodl_run.averaging.collective import (
    CollectiveError,
    ReduceOutcome,
    all_finite,
    consensus_weight,
    weighted_reduce_,
)
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.frames import HostStaging, as_frame, dtype_names, from_frames
from flodl_run.averaging.shm import PREFIX_ENV, Mapper, Slab, remove_run
from flodl_run.config.compose import experiment_from_yaml
from flodl_run.config.schema import ExperimentConfig, Mode, OuterKind, lr_factor
from flodl_run.data import permutation
from flodl_run.dataplane import DataPlane
from flodl_run.hostinfo import node_facts
from flodl_run.outer import OuterOptimizer
from flodl_run.recipe import CallbackFailed, load_recipe, user_traceback
from flodl_run.replica import Replica
from flodl_run.slowdown import Slowdown, factor_for
from flodl_run.timeline import RankTimeline
from flodl_run.wire import (
    AbortGroup,
    Channel,
    CheckpointSaved,
    Evaluate,
    Evaluated,
    Heartbeat,
    Listening,
    RankFailed,
    RankJoined,
    Reduced,
    ReduceFailed,
    Regroup,
    Regrouped,
    SaveCheckpoint,
    SnapshotTaken,
    Stop,
    SyncNow,
    Train,
    Update,
    WindowDone,
    connect_dealer,
)
from flodl_run.worker import Loss, Worker, run_loop

HEARTBEAT_PERIOD_S = 1.0
LISTEN_POLL_MS = 200
NCCL_ABORTABLE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
"""NCCL settings under which a communicator can be aborted from another thread: torch's
watchdog leaves errors to us (it would otherwise tear the process down on a timeout), and a
non-blocking communicator's abort returns without waiting on a dead peer. Set before the first
process group unless the environment already names them."""


@dataclass(frozen=True)
class RankEnv:
    """The torchrun environment contract plus the coordinator's address, key and run file."""

    rank: int
    local_rank: int
    world_size: int
    coord: str
    secret: bytes
    run_file: Path
    device: Optional[str]
    parent_pid: Optional[int]

    @classmethod
    def from_environ(cls, env: Dict[str, str]) -> "RankEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                               "FLODL_RUN_COORD", "FLODL_RUN_SECRET", "FLODL_RUN_FILE")
                   if k not in env]
        if missing:
            raise SystemExit(f"flodl_run.rank: missing environment: {', '.join(missing)}")
        parent = env.get("FLODL_RUN_PARENT_PID")
        return cls(int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])),
                   int(env["WORLD_SIZE"]), env["FLODL_RUN_COORD"],
                   bytes.fromhex(env["FLODL_RUN_SECRET"]), Path(env["FLODL_RUN_FILE"]),
                   env.get("FLODL_RUN_DEVICE"), int(parent) if parent else None)


def _pick_device(env: RankEnv) -> torch.device:
    if env.device:
        return torch.device(env.device)
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class _Heartbeat(threading.Thread):
    """Sends a Heartbeat every second on its own socket (zmq sockets are single-thread),
    carrying the rank's progress (`progress()`: batches finished, working on a Train order).
    Being a thread, it also notices a dead launcher while the main thread is busy in a step:
    then it removes the run's slabs and ends the process, so no orphan rank stays behind."""

    def __init__(self, ctx: zmq.Context, env: RankEnv, progress: Callable[[], Tuple[int, bool]],
                 on_beat: Callable[[Channel], None] = lambda channel: None):
        super().__init__(daemon=True, name=f"heartbeat-{env.rank}")
        self.ctx, self.env, self.progress, self.on_beat = ctx, env, progress, on_beat
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = connect_dealer(self.ctx, self.env.coord, self.env.secret, linger_ms=0)
        channel = Channel(sock, self.env.secret)
        self.on_beat(channel)
        while not self.stopped.wait(HEARTBEAT_PERIOD_S):
            if _orphaned(self.env):
                _leave_orphaned(self.env)
            channel.send(Heartbeat(self.env.rank, *self.progress()))
            self.on_beat(channel)  # the timeline's clock pings, counters and shipment
        sock.close()


class _Listener(threading.Thread):
    """Receives the coordinator's notices on its own socket, so they land while the main thread
    is blocked inside a collective with a dead peer: AbortGroup aborts the group from here.
    `on_idle` runs every LISTEN_POLL_MS when nothing arrived."""

    def __init__(self, ctx: zmq.Context, env: RankEnv, on_abort: Callable[[AbortGroup], None],
                 on_idle: Callable[[], None]):
        super().__init__(daemon=True, name=f"listener-{env.rank}")
        self.ctx, self.env, self.on_abort, self.on_idle = ctx, env, on_abort, on_idle
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = connect_dealer(self.ctx, self.env.coord, self.env.secret, linger_ms=0)
        channel = Channel(sock, self.env.secret)
        channel.send(Listening(self.env.rank))
        while not self.stopped.is_set():
            received = channel.recv(timeout_ms=LISTEN_POLL_MS)
            if received is None:
                self.on_idle()
            elif isinstance(received.message, AbortGroup):
                self.on_abort(received.message)
        sock.close()


def _orphaned(env: RankEnv) -> bool:
    """The launcher that started this rank is gone (the rank was re-parented)."""
    return env.parent_pid is not None and os.getppid() != env.parent_pid


def _leave_orphaned(env: RankEnv) -> None:
    """Exit at once, from any thread, leaving nothing in /dev/shm: the launcher that would
    have removed the run's slabs (ours and the coordinator's) was killed."""
    remove_run(os.environ.get(PREFIX_ENV))
    try:  # our output went to the launcher: the pipe is most likely broken
        print(f"rank {env.rank}: the launcher is gone; exiting", file=sys.stderr, flush=True)
    except OSError:
        pass
    os._exit(1)


class RankWorker:
    """Follows orders: Train, SyncNow, Evaluate, Stop."""

    def __init__(self, env: RankEnv, config: ExperimentConfig):
        self.env, self.config = env, config
        self.device = _pick_device(env)
        if self.device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        self.recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform,
                                  config.recipe.loop)
        self.replica = Replica(self.recipe, self.device, config.seed,
                               lr_scale=lr_factor(env.world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm)
        self.flat = FlatParams(self.replica.model)
        self.outer = OuterOptimizer(config.outer)
        self.source = DataPlane(self.recipe.call("train_dataset"), self.device, config,
                                self.recipe.transform, rank=env.rank)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None
        self.slowdown = Slowdown(factor_for(config.cluster.emulate_slowdown, env.rank))
        self.mode = config.elche.mode
        self._perms: Dict[int, torch.Tensor] = {}
        self._steps_since_reduce = 0
        self.jobs: Deque[_Job] = deque()
        self._awaiting_update = False
        self._sync_pending = False  # cpu_async: window done, SyncNow not yet received
        self._overshoot_used = 0
        self._reduces_seen = 0
        self._tcp_store: Optional[dist.Store] = None
        self._group_lock = threading.Lock()  # the listener thread aborts what the main thread built
        self._group: Optional[dist.ProcessGroup] = None  # the NCCL group the listener may abort
        self._alone = False  # the only member left: no group, the reduce is the identity
        self._generation = 0
        self._aborted_generation = -1  # the listener aborted this generation's group
        self._collective_began: Optional[float] = None  # the main thread is inside a reduce since
        self._collective_limit_s = max(5.0, 2 * config.heartbeat_timeout_secs)  # the group timeout
        self._batches_total = 0
        self._training = False  # inside the train loop (not idle, not serving an order)
        self._reported: Optional[Loss] = None  # what the loop reported for the batch in hand
        self._stopped = False  # the coordinator's Stop arrived: the batches have ended
        self._fault = _fault_for(env.rank, os.environ.get("FLODL_RUN_FAULT", ""))
        self.waits = _Waits(os.environ.get("FLODL_RUN_WAITS") == "1")
        self._last_reduce: Optional[tuple] = None  # (round, scratch, steps, outer state)
        self._reduced_round = 0  # the last round whose reduce completed here (orders sent ahead)
        self._staging: Optional[HostStaging] = None  # frames path (no shared memory)
        self._shm_prefix = os.environ.get(PREFIX_ENV)  # set by a launcher on this host
        self._slab: Optional[Slab] = None
        self._shm = Mapper(self._shm_prefix)
        if config.resume_from:
            self._resume(config.resume_from)
        # nccl_cadence: where this window began (the last consensus), for the divergence's
        # cosine/magnitude; a spare buffer of the same size takes the next one (no allocation).
        # nccl_sync reduces after every step, where the breakdown's extra passes over the
        # parameters would cost a good part of a short step (and sync modes take no verdicts).
        self._start = self.flat.clone() if self.mode is Mode.nccl_cadence else None
        self._spare: Optional[List[torch.Tensor]] = None
        self.timeline = RankTimeline(env.rank, config.timeline, f"{socket.gethostname()} {self.device}",
                                     self.device.index if self.device.type == "cuda" else None)
        self.recorder = self.timeline.recorder
        self.ctx = zmq.Context()
        sock = connect_dealer(self.ctx, env.coord, env.secret, linger_ms=1000)
        self.channel = Channel(sock, env.secret)

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        collective = self.mode.is_collective
        if collective:  # the coordinator backend needs no process group (and no NCCL)
            self._join_group(0, list(range(self.env.world_size)))
        heartbeat = _Heartbeat(self.ctx, self.env, lambda: (self._batches_total, self._training),
                               self.timeline.on_beat)
        heartbeat.start()
        listener = _Listener(self.ctx, self.env, self._abort_group, self._watch_collective)
        if collective:
            listener.start()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        reduce_ms = timed_reduce_ms(self.flat.buffers) if collective else None
        self.channel.send(RankJoined(self.env.rank, self.env.world_size, os.getpid(),
                                     socket.gethostname(), str(self.device), name,
                                     len(self.source), node_facts(self.device.type == "cuda"),
                                     reduce_ms=reduce_ms))
        if self.mode is Mode.cpu_async and self.env.rank == 0:
            self._send_snapshot(0, steps=0)  # the EASGD center starts at the initial weights
            self._awaiting_update = False
        try:
            self._run_loop()
        finally:
            heartbeat.stopped.set()
            listener.stopped.set()
            if self._slab is not None:
                self._slab.unlink()
            self._leave_group()
        return 0

    def _store(self) -> dist.Store:
        """The rendezvous store at MASTER_ADDR:MASTER_PORT. When the launcher (or torchrun's
        agent) hosts it, every rank is a client, so it outlives any rank."""
        if self._tcp_store is None:
            hosted = os.environ.get("FLODL_RUN_STORE_HOSTED") == "1" or \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            self._tcp_store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                is_master=not hosted and self.env.rank == 0,
                timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
        return self._tcp_store

    def _join_group(self, generation: int, members: List[int]) -> None:
        """(Re)build the process group of one membership generation. A rank left
        alone builds none: its reduce is the identity. Collectives time out after
        2 x heartbeat_timeout_secs, a backstop only: the coordinator's AbortGroup comes first."""
        self._leave_group()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            for name, value in NCCL_ABORTABLE.items():
                os.environ.setdefault(name, value)
        if len(members) > 1:
            timeout = datetime.timedelta(seconds=self._collective_limit_s)
            store = dist.PrefixStore(f"flodl_run/gen{generation}/", self._store())
            dist.init_process_group(backend, store=store, rank=members.index(self.env.rank),
                                    world_size=len(members), timeout=timeout,
                                    device_id=self.device if backend == "nccl" else None)
        with self._group_lock:
            self._generation = generation
            self._group = dist.group.WORLD if len(members) > 1 and backend == "nccl" else None
            self._alone = len(members) == 1

    def _leave_group(self) -> None:
        """Destroy this generation's group (an aborted one included); nothing when there is none."""
        with self._group_lock:
            self._group = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _abort_group(self, notice: AbortGroup) -> None:
        """Listener thread: members of this generation died. Abort the group (NCCL: the
        communicator, which ends kernels waiting on the dead) so the main thread leaves the
        collective now; its reduce then reports failure and the coordinator regroups. Gloo has
        no abort (torch's is a no-op there, and an aborted Gloo group dies badly at teardown): a
        dead peer's closed sockets end Gloo collectives at once, and the launcher kills a rank
        it declared dead, hung or not; the group timeout is the backstop."""
        with self._group_lock:
            if notice.generation != self._generation or self._aborted_generation == notice.generation:
                return
            self._aborted_generation = notice.generation
            group = self._group
        if group is not None:
            try:
                group.abort()
            except Exception as exc:  # never let the listener die: the regroup destroys it anyway
                print(f"rank {self.env.rank}: aborting generation {notice.generation}: {exc}",
                      file=sys.stderr)

    def _watch_collective(self) -> None:
        """Listener thread, our stand-in for NCCL's watchdog (whose teardown is off): a reduce
        stuck past the group timeout with no death announced (a hang, a desync) is aborted as if
        a member had died. The rank reports ReduceFailed, the coordinator regroups and retries,
        and a round that keeps failing ends in reduce_stall (save and stop)."""
        began = self._collective_began
        if began is not None and self._group is not None and \
                time.monotonic() - began > self._collective_limit_s:
            self._abort_group(AbortGroup(self._generation, []))

    def _group_broken(self) -> bool:
        """The listener aborted the group this reduce runs on: its results cannot be trusted."""
        return self._aborted_generation == self._generation

    def _regroup(self, order: Regroup) -> None:
        if self.env.rank not in order.members:
            raise SystemExit(f"rank {self.env.rank}: declared dead by the coordinator; exiting")
        # orders sent ahead of a reduce that failed here are void (the coordinator redoes them)
        self.jobs = deque(job for job in self.jobs if job.order.after_round <= self._reduced_round)
        self._join_group(order.generation, order.members)
        self.channel.send(Regrouped(self.env.rank, order.generation))

    def _run_loop(self) -> None:
        """The recipe's loop (or the built-in one) over this rank's batches, to the Stop."""
        worker = Worker(self.replica, self._serve, self._report, self.env.rank, self.env.world_size)
        run_loop(self.recipe, worker)
        if not self._stopped:  # the batches left untrained would stall the run
            raise RuntimeError("the recipe's loop returned before worker.batches() ended "
                               "(a loop must consume every batch the coordinator plans)")

    def _report(self, loss: Loss) -> None:
        self._reported = loss if self._reported is None else self._reported + loss

    def _serve(self) -> Iterator[Any]:
        """Batch-granular loop: handle every order that arrived, then hand the loop one batch to
        train if allowed; returns at the coordinator's Stop."""
        idle_since: Optional[float] = None
        throttled = False
        while True:
            can_train = self._can_train()
            if not can_train and idle_since is None:
                idle_since = time.perf_counter()
                throttled = bool(self.jobs) and not self._awaiting_update  # the overshoot cap
            received = self.channel.recv(timeout_ms=0 if can_train else 1000)
            self._training = received is None and self._can_train()  # what heartbeats report
            if received is None:
                if self._can_train():
                    yield from self._train_one()
                elif _orphaned(self.env):
                    _leave_orphaned(self.env)
                continue
            if isinstance(received.message, Stop):
                self.waits.report(self.env.rank)
                self.timeline.ship(self.channel, final=True)
                self._stopped = True
                return
            began, began_ns = time.perf_counter(), self.recorder.now()
            self.waits.waited(received.message, idle_since, began)
            if idle_since is not None:  # perf_counter and perf_counter_ns read the same clock
                self.recorder.span_between("throttled" if throttled else "wait",
                                           int(idle_since * 1e9), began_ns,
                                           type(received.message).__name__)
            idle_since = None
            self._handle(received.message, received.payloads)
            self.waits.handled(received.message, began)
            self.timeline.order_span(received.message, began_ns)

    def _handle(self, order: Any, payloads: List[memoryview]) -> None:
        if isinstance(order, Train):
            if not order.after_round:  # training moved on: that reduce will not be retried
                self._last_reduce = None  # (sent ahead: a failed round may still be, and undone)
            self.jobs.append(_Job(order, self._order_batches(order)))
        elif isinstance(order, SyncNow):
            self._reduce(order)
        elif isinstance(order, Update):
            self._apply_update(order, payloads)
        elif isinstance(order, Evaluate):
            self._evaluate(order, payloads)
        elif isinstance(order, SaveCheckpoint):
            self._save(order, payloads)
        elif isinstance(order, Regroup):
            self._regroup(order)

    # ---- training --------------------------------------------------------------------------

    def _can_train(self) -> bool:
        """Work queued, no update awaited (cpu_sync/cadence), within the async overshoot, and
        not an order sent ahead of a reduce that has not completed here (nccl_sync)."""
        if not self.jobs or self._awaiting_update or self.jobs[0].order.after_round > self._reduced_round:
            return False
        return not (self._sync_pending and self._overshoot_used >= self.jobs[0].order.overshoot)

    def _order_batches(self, order: Train) -> List[torch.Tensor]:
        batches = []
        for pass_index, offset, size in order.slices:
            indices = self._indices(pass_index, offset, size)
            batches += list(indices.split(self.config.batch_size))
        return batches

    def _indices(self, pass_index: int, offset: int, size: int) -> torch.Tensor:
        if pass_index not in self._perms:
            self._perms = {pass_index: permutation(len(self.source) * self.config.data.augment,
                                                   self.config.seed, pass_index)}
        return self._perms[pass_index][offset:offset + size] % len(self.source)

    def _train_one(self) -> Iterator[Any]:
        """Hand the loop the next batch of the window; once it comes back for another, the batch
        was trained: account for it (and end the window after its last batch)."""
        job = self.jobs[0]
        indices = job.batches[job.done]
        began, began_ns = time.perf_counter(), self.recorder.now()
        batch = self.source.gather(indices, self.jobs)
        data_ns = self.recorder.now()
        self._reported = None
        yield batch
        loss, self._reported = self._reported, None
        if loss is not None:  # read at window end
            job.loss_sum = loss if job.loss_sum is None else job.loss_sum + loss
        last = job.done + 1 == len(job.batches)
        self._settle_step(began, timed=job.done == 0 or last)
        job.step_ms.append((time.perf_counter() - began) * 1000.0)
        self.recorder.batch(began_ns, data_ns, self._batches_total)
        job.done += 1
        job.samples += len(indices)
        self._steps_since_reduce += 1
        self._batches_total += 1
        if self._fault is not None and self._batches_total == self._fault[0]:
            os.kill(os.getpid(), self._fault[1])  # fault injection for tests (FLODL_RUN_FAULT)
        if self._sync_pending:
            self._overshoot_used += 1
        if last:
            self.jobs.popleft()
            self._window_done(job)

    def _settle_step(self, began: float, timed: bool) -> None:
        """Wait for the device only where a clock reading needs it: the first batch of a window
        (its fill cost), the last (the window's compute time) and every batch of an emulated
        slower rank (its sleep is a multiple of the step time). In between the host queues
        batches ahead of the GPU, so a step's host time is its launch cost and the wait at the
        window's end carries the rest: the window's total stays exact."""
        if self.device.type == "cuda" and (timed or self.slowdown.active):
            torch.cuda.synchronize(self.device)
        self.slowdown.after_step(began)

    def _window_done(self, job: "_Job") -> None:
        order = job.order
        self.recorder.instant("window_end", order.window)
        self.waits.sent("WindowDone")
        self.channel.send(WindowDone(
            self.env.rank, order.window, order.epoch, job.done, job.samples, sum(job.step_ms),
            _fill_ms(job.step_ms), _read(job.loss_sum), self.replica.lr, scalars.drain(),
            reduces_seen=self._reduces_seen, device_bytes=_device_bytes(self.device),
            **self.source.take_stats()))
        if self.mode is Mode.cpu_async and not self._sync_pending:
            self._sync_pending, self._overshoot_used = True, 0
        if order.then_sync is not None:  # the coordinator folded the SyncNow into the order
            self._reduce(order.then_sync)

    # ---- reduces ---------------------------------------------------------------------------

    def _reduce(self, order: SyncNow) -> None:
        self._training = False  # waiting on peers in a reduce is not a hang of ours
        self._reduces_seen += 1
        self.replica.rescale_lr(order.lr_factor)
        if not self.mode.is_collective:
            began_ns = self.recorder.now()
            self._send_snapshot(order.round)
            self.recorder.span("reduce.snapshot", began_ns, order.round)
            return
        if self._last_reduce is not None and self._last_reduce[0] == order.round:
            self._undo_reduce()  # a retry after a death: start again from our own replica
        if self._group_broken():  # a member died: wait for the Regroup, touch nothing
            self.channel.send(ReduceFailed(self.env.rank, order.round, "process group aborted"))
            return
        outer_before = self.outer.state_dict() if self.outer.active and self.outer.prev is not None else None
        outer_before = {k: [t.clone() for t in v] for k, v in outer_before.items()} if outer_before else None
        began_ns = self.recorder.now()
        try:
            outcome = self._weighted_reduce(order.measure)
        except CollectiveError as exc:
            self.channel.send(ReduceFailed(self.env.rank, order.round, str(exc)))
            return
        averaged_ns = self.recorder.now()
        self._last_reduce = (order.round, outcome.scratch, self._steps_since_reduce, outer_before,
                             self._start)
        if outcome.applied and self.outer.step_(self.flat.buffers):
            self._after_outer_step()
        if self._start is not None:
            self._begin_window()
        self.replica.seek_schedule(order.global_step)
        self._steps_since_reduce = 0
        if not outcome.finite:
            self.replica.optimizer.state.clear()  # its moments are NaN too: restart them
        self._reduced_round = order.round
        self._trace_reduce(order.round, began_ns, averaged_ns)
        self.waits.sent("Reduced")
        self.channel.send(Reduced(self.env.rank, order.round, outcome.divergence, outcome.weight,
                                  outcome.finite, outcome.cosine, outcome.magnitude))

    def _trace_reduce(self, round_: int, began_ns: int, averaged_ns: int) -> None:
        """Timeline: the collective reduce's phases. wait: until the cohort's weights were
        all-reduced (every peer arrived); average: the snapshot for a retry, the parameters'
        all-reduce and the divergence (it ends reading a result back, so the device is done);
        apply: the outer step and the next window's start."""
        lined_up = self.recorder.last_lap(began_ns)
        self.recorder.span_between("reduce.wait", began_ns, lined_up, round_)
        self.recorder.span_between("reduce.average", lined_up, averaged_ns, round_)
        self.recorder.span("reduce.apply", averaged_ns, round_)

    def _begin_window(self) -> None:
        """The next window starts from the parameters now held: copy them into the spare
        buffer and make it the start (the old start stays intact for an undo)."""
        spare = self._spare if self._spare is not None else self.flat.clone()
        for dst, src in zip(spare, self.flat.buffers):
            dst.copy_(src)
        self._start, self._spare = spare, self._start

    def _weighted_reduce(self, measure: bool = True) -> ReduceOutcome:
        """The cohort's consensus; alone, the identity (this replica is the consensus)."""
        steps, gamma = self._steps_since_reduce, self.config.elche.gamma
        if self._alone:  # a non-finite lone replica has nobody to adopt: the coordinator decides
            finite = bool(all_finite(self.flat))
            weight = consensus_weight(steps, gamma) if finite else 0.0
            return ReduceOutcome(weight > 0.0, weight, weight, 0.0, None, finite)
        self._collective_began = time.monotonic()
        try:
            return weighted_reduce_(self.flat, steps, gamma, broken=self._group_broken,
                                    start=self._start, measure=measure, lined_up=self.recorder.lap)
        finally:
            self._collective_began = None

    def _undo_reduce(self) -> None:
        """Back to the pre-reduce replica (parameters, step count, outer state)."""
        _, scratch, steps, outer_before, start = self._last_reduce
        if scratch is not None:
            self.flat.copy_(scratch)
        if start is not self._start:  # the window's start goes back too; the new one is spare
            self._start, self._spare = start, self._start
        self._steps_since_reduce = steps
        if outer_before is not None:
            self.outer.load_state_dict(outer_before)
        self._last_reduce = None

    def _after_outer_step(self) -> None:
        if self.config.outer.kind is OuterKind.diloco:
            self.replica.optimizer.state.clear()  # DiLoCo: inner state restarts from the new global

    def _send_snapshot(self, round_: int, steps: Optional[int] = None) -> None:
        """Coordinator backend: parameters into this rank's shared-memory slab (launcher on this
        host) or staged on the host as frames; float buffers always as a frame."""
        buffers = as_frame(self.flat.flat_float_buffers())
        steps = self._steps_since_reduce if steps is None else steps
        finite = bool(all_finite(self.flat))  # one device-side check, read once per reduce
        slab = self._snapshot_slab()
        if slab is not None:
            slab.write(self.flat.buffers)
            params = slab.tensors
            taken = SnapshotTaken(self.env.rank, round_, steps, dtype_names(params), slab.paths,
                                  [p.numel() for p in params], finite)
            self.channel.send(taken, [buffers])
        else:
            self._staging = self._staging or HostStaging(self.flat.buffers)
            params = self._staging.stage(self.flat.buffers)
            self.channel.send(SnapshotTaken(self.env.rank, round_, steps, dtype_names(params),
                                            finite=finite),
                              [as_frame(p) for p in params] + [buffers])
        self._steps_since_reduce = 0
        if self.mode is Mode.cpu_async:
            self._sync_pending = False  # keep training while the round trip is in flight
        else:
            self._awaiting_update = True  # cpu_sync / cpu_cadence: block until the update lands

    def _snapshot_slab(self) -> Optional[Slab]:
        if self._slab is None and self._shm_prefix:
            self._slab = Slab.create(self._shm_prefix, f"rank{self.env.rank}", self.flat.buffers)
            if self._slab is None:
                self._shm_prefix = None  # no room: frames from now on
        return self._slab

    def _apply_update(self, update: Update, payloads: List[memoryview]) -> None:
        """Blend in the coordinator's parameters (1.0 = overwrite), overwrite float buffers."""
        if update.shm:
            count, params = 0, self._shm.tensors(update.shm, update.dtypes, update.numels)
        else:
            count = len(update.dtypes)
            params = from_frames(payloads[:count], update.dtypes)
        blend_(self.flat.buffers, params, update.blend)
        with torch.no_grad():
            if update.buffers:
                self.flat.load_float_buffers_(from_frames(payloads[count:], ["torch.float32"])[0])
        if update.outer_stepped:
            self._after_outer_step()
        if update.reset:  # we were non-finite: so are the optimizer's moments
            self.replica.optimizer.state.clear()
        self.replica.seek_schedule(update.global_step)
        self._awaiting_update = False
        if update.train is not None:
            self.jobs.append(_Job(update.train, self._order_batches(update.train)))

    # ---- callbacks -------------------------------------------------------------------------

    def _evaluate(self, order: Evaluate, payloads: List[memoryview]) -> None:
        """Score the consensus (this replica after a reduce) or the parameters sent along, then
        run the recipe's epoch_fn on the same parameters when told to. A callback that raises
        is reported (RankFailed naming it) instead of the score."""
        score = float("nan")
        try:
            with self._parameters(payloads, order.dtypes):
                if order.score and self.eval_data is not None:
                    score = self.replica.evaluate(self.eval_data)
                if order.epoch_fn:
                    self.recipe.run_callback("epoch_fn", order.epoch, self.replica.model)
        except CallbackFailed as failure:
            self._callback_failed(failure)
            return
        self.channel.send(Evaluated(self.env.rank, order.epoch, score))

    def _callback_failed(self, failure: CallbackFailed) -> None:
        """Print the user's exception once (this rank's log and the launcher's terminal) and
        tell the coordinator, which fails the run with a save; this rank lives on to save."""
        print(f"rank {self.env.rank}: {failure.describe()}", file=sys.stderr, end="", flush=True)
        self.channel.send(RankFailed(self.env.rank, failure.error, callback=failure.name))

    @contextlib.contextmanager
    def _parameters(self, payloads: List[memoryview], dtypes: List[str]) -> Iterator[None]:
        """Temporarily swap in parameters sent along (the EASGD center), then restore ours."""
        if not dtypes:
            yield
            return
        saved = self.flat.clone()
        with torch.no_grad():
            for local, remote in zip(self.flat.buffers, from_frames(payloads, dtypes)):
                local.copy_(remote)
        try:
            yield
        finally:
            self.flat.copy_(saved)

    def _save(self, order: SaveCheckpoint, payloads: List[memoryview]) -> None:
        """Model (or the center sent along) and optimizer; the outer state in collective modes.
        `order.stem` is the new generation's: the files become the bundle only when the
        coordinator's meta names them. Non-finite weights are refused, never written."""
        files = checkpoint.paths(order.stem)
        written: Dict[str, str] = {}
        error = ""

        def save(path: Path, state: Any) -> None:
            written[path.name] = checkpoint.save_tensors(path, state)

        try:
            optim = _cpu(self.replica.optimizer.state_dict())
            save(checkpoint.rank_optim_path(order.stem, self.env.rank), optim)
            if order.write_model:
                with self._parameters(payloads, order.dtypes):  # on CPU the state shares storage
                    model = _cpu(self.replica.model.state_dict())
                    checkpoint.require_finite(model, "the model")
                    save(files["model"], model)
                save(files["optim"], optim)
                if self.mode.is_collective and self.outer.active and self.outer.prev is not None:
                    save(files["outer"], _cpu(self.outer.state_dict()))
        except Exception as exc:  # a full disk must not kill the rank: the coordinator decides
            error = f"{type(exc).__name__}: {exc}"
        if not error and order.write_model and order.epoch is not None:
            try:  # on what was just saved (the center under EASGD)
                with self._parameters(payloads, order.dtypes):
                    self.recipe.run_callback("checkpoint_fn", order.epoch, self.replica.model)
            except CallbackFailed as failure:
                self._callback_failed(failure)
                return
        self.channel.send(CheckpointSaved(self.env.rank, order.stem, error, written))

    def _resume(self, stem: str) -> None:
        """Load a bundle's model, optimizer and (collective) outer state before training (the
        launcher verified the files against the meta's checksums)."""
        meta = checkpoint.read_meta(stem)
        files = checkpoint.bundle_files(stem, meta)
        self.replica.model.load_state_dict(checkpoint.load_tensors(files["model"]))
        optim = checkpoint.rank_optim_file(stem, meta, self.env.rank)
        self.replica.optimizer.load_state_dict(checkpoint.load_tensors(optim))
        if self.mode.is_collective and self.outer.active and files["outer"].is_file():
            state = checkpoint.load_tensors(files["outer"])
            self.outer.load_state_dict({k: [t.to(self.device) for t in v] for k, v in state.items()
                                        if v is not None})


class _Waits:
    """Where an idle rank's time goes (FLODL_RUN_WAITS=1, a diagnostic): how long it waited for
    each order after each fact it sent (e.g. Reduced -> Train), and how long it spent handling
    each order; one JSON line on stderr at Stop (the rank's log)."""

    def __init__(self, on: bool):
        self.on, self.last_sent = on, "start"
        self.totals: Dict[str, List[float]] = {}

    def sent(self, what: str) -> None:
        self.last_sent = what

    def _add(self, key: str, ms: float) -> None:
        self.totals.setdefault(key, []).append(ms)

    def waited(self, message: Any, since: Optional[float], now: float) -> None:
        if self.on and since is not None:
            self._add(f"wait {self.last_sent}->{type(message).__name__}", (now - since) * 1000.0)

    def handled(self, message: Any, began: float) -> None:
        if self.on:
            self._add(f"handle {type(message).__name__}", (time.perf_counter() - began) * 1000.0)

    def report(self, rank: int) -> None:
        if self.on:
            import json

            summary = {k: {"n": len(v), "total_ms": round(sum(v), 1),
                           "median_ms": round(sorted(v)[len(v) // 2], 2)}
                       for k, v in sorted(self.totals.items())}
            print(f"rank {rank} waits: {json.dumps(summary)}", file=sys.stderr, flush=True)


@dataclass
class _Job:
    """One Train order being worked through, batch by batch."""

    order: Train
    batches: List[torch.Tensor]
    done: int = 0
    samples: int = 0
    loss_sum: Optional[torch.Tensor] = None
    """Sum of the window's losses, on the device (read once, when the window is done)."""
    step_ms: List[float] = field(default_factory=list)


def _fault_for(rank: int, spec: str) -> Optional[tuple]:
    """FLODL_RUN_FAULT="<rank>:<after batches>:<SIGNAL>[,...]" (a test and diagnostic knob):
    the rank sends itself SIGNAL right after its Nth batch, e.g. "1:30:SIGKILL"."""
    for item in filter(None, spec.split(",")):
        who, after, sig = item.split(":")
        if int(who) == rank:
            return int(after), getattr(signal, sig)
    return None


def _cpu(state: Any) -> Any:
    """A state dict with every tensor on the CPU (bundles load anywhere)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu(v) for v in state)
    return state


def _read(total: Optional[torch.Tensor]) -> float:
    return 0.0 if total is None else float(total)


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


def _device_bytes(device: torch.device) -> int:
    """What the caching allocator holds on the rank's GPU (its share of the device's memory, as
    the live dashboard shows it); 0 on CPU. A counter read: no sync, no CUDA call that waits."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0


def _fill_ms(step_ms: List[float]) -> float:
    """Excess of the first batch over the mean of the rest (cold caches, lazy init)."""
    if len(step_ms) < 2:
        return 0.0
    rest = sum(step_ms[1:]) / (len(step_ms) - 1)
    return max(0.0, step_ms[0] - rest)


def main() -> int:
    """Run one rank; an exception (the recipe's, or ours) is reported to the coordinator and
    printed once, as the traces of the code that raised it, and the rank exits 1."""
    env = RankEnv.from_environ(dict(os.environ))
    config = experiment_from_yaml(env.run_file.read_text())
    worker: Optional[RankWorker] = None
    try:
        worker = RankWorker(env, config)
        return worker.run()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        when = "failed" if worker is not None else "failed to start"
        print(f"rank {env.rank}: {when}: {error}\n{user_traceback(exc)}", file=sys.stderr, end="")
        _report_failure(env, worker, RankFailed(env.rank, error))
        return 1
    finally:
        if _orphaned(env):  # however we got here (a broken output pipe, ...): no slab stays
            remove_run(os.environ.get(PREFIX_ENV))


def _report_failure(env: RankEnv, worker: Optional[RankWorker], failed: RankFailed) -> None:
    """Tell the coordinator (a worker that failed to start has no channel yet: open one)."""
    if worker is not None and hasattr(worker, "channel"):
        worker.channel.send(failed)
        return
    ctx = zmq.Context.instance()
    sock = connect_dealer(ctx, env.coord, env.secret, linger_ms=1000)  # delivered before exit
    Channel(sock, env.secret).send(failed)
    sock.close()


if __name__ == "__main__":
    sys.exit(main())
