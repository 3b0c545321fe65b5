"""The coordinator: the control plane of a distributed run.

Owns the window loop: hands out data (equal split for sync, throughput-sized chunks for
cadence), opens the reduce gate, orders reduces, feeds ElChe, aggregates epochs in order and
runs the eval callback. It never touches a device; ranks do the training and the averaging.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import zmq

from flodl_run.averaging.central import CentralAverager
from flodl_run.averaging.frames import as_frame, dtype_names
from flodl_run.averaging.shm import Mapper, Slab
from flodl_run.config.schema import ExperimentConfig, Mode
from flodl_run.datametrics import DataTally
from flodl_run.dispatch import EpochPool, EpochSpan, epoch_span
from flodl_run.elche import ElChe, Plan
from flodl_run.hostinfo import merge_nodes
from flodl_run.membership import Membership, RunAborted, ShutdownWithSave
from flodl_run.observe import Observer
from flodl_run.outer import OuterOptimizer
from flodl_run.recipe import CallbackFailed, Recipe, load_recipe
from flodl_run.reduces import Reduces
from flodl_run.saving import Saving
from flodl_run.scalars import roll_up
from flodl_run.summary import EpochRecord, Summary
from flodl_run.timeline import Timeline
from flodl_run.windows import EpochTally, Windows
from flodl_run.wire import (
    Channel,
    CheckpointSaved,
    ClockPing,
    Evaluate,
    Evaluated,
    Heartbeat,
    Listening,
    Message,
    RankFailed,
    RankJoined,
    Received,
    Reduced,
    ReduceFailed,
    Regrouped,
    SnapshotTaken,
    Stop,
    TimelineEvents,
    Train,
    Update,
    WindowDone,
    bind_router,
)

POLL_MS = 200
STOP_GRACE_S = 8.0  # SIGINT -> save at a reduce boundary; ranks are gone within 15 s either way
log = logging.getLogger(__name__)

class Coordinator(Membership, Saving, Windows, Reduces):
    """Runs on a thread of the launcher; `run()` returns the Summary of the whole run."""

    def __init__(self, config: ExperimentConfig, world_size: int, secret: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 observer: Optional[Observer] = None, shm_prefix: Optional[str] = None,
                 max_frame_bytes: int = -1, timeline: Optional[Timeline] = None):
        self.config, self.world_size = config, world_size
        self.timeline = timeline or Timeline()
        self.recorder = self.timeline.recorder  # the coordinator's own spans
        self.mode = config.elche.mode
        self.observer = observer or Observer()
        self.recipe: Optional[Recipe] = None
        """The recipe as the launcher imports it, for its callbacks (metrics_fn, eval_result_fn)."""
        if config.recipe is not None:
            self.recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform,
                                      config.recipe.loop)
        self.mlflow_run_id: Optional[str] = None
        """The tracked run, recorded in bundles so a resume can link to it."""
        self.ctx = zmq.Context()  # its own: the handshake gate is one per context
        sock, self.address, self._gate = bind_router(self.ctx, bind_host, port, max_frame_bytes, secret)
        self.channel = Channel(sock, secret)
        self.identities: Dict[int, bytes] = {}
        self.listeners: Dict[int, bytes] = {}
        """Each collective rank's listener socket (AbortGroup goes there, see Membership)."""
        self.last_seen: Dict[int, float] = {}
        self.joined: Dict[int, RankJoined] = {}
        self.num_samples = 0
        self.summary = Summary(mode=self.mode.value, outer=config.outer.kind.value,
                               world_size=world_size)
        self.averager = CentralAverager(OuterOptimizer(config.outer), config.elche.gamma,
                                        config.elche.easgd_alpha if self.mode is Mode.cpu_async else None)
        self._payloads: List[memoryview] = []
        self._shm_prefix = shm_prefix
        """Where this run's shared-memory slabs live (ranks on the launcher's host), or None."""
        self._shm = Mapper(shm_prefix)
        self._shm_ranks: Set[int] = set()  # ranks whose last snapshot came through shared memory
        self._update_slab: Optional[Slab] = None
        self._deferred: List[Received] = []
        self.elche: Optional[ElChe] = None
        self.plan: Optional[Plan] = None
        self._stop = threading.Event()
        self._stop_reason = ""
        self._stop_deadline = float("inf")
        self._failure: Optional[RunAborted] = None
        self._saving = False  # a bundle is being written: a stop deadline waits for it
        self._raised: Dict[int, str] = {}  # rank -> the exception it reported (RankFailed)
        self._nonfinite: Dict[int, str] = {}  # rank -> "loss" | "parameters", since the last reduce
        # rank -> (cosine, magnitude) of its window update against the consensus, this reduce
        self._alignment: Dict[int, Tuple[Optional[float], Optional[float]]] = {}
        self._pending_events: List[Tuple[str, str]] = []
        self._nonfinite_streak = 0  # reduces in a row with a non-finite rank
        self._reset_next: Set[int] = set()  # non-finite ranks the next update replaces
        self._resetting: Set[int] = set()  # ... until their next snapshot (NaN windows in flight)
        self._window = 0
        self._round = 0
        self._global_step = 0
        self._sync_ms: List[float] = []
        self._compute_ms = [0.0] * world_size
        self._data = DataTally(world_size)  # per-rank data-plane metrics, per epoch
        self.alive: Set[int] = set(range(world_size))
        self._deaths: "queue.Queue[tuple]" = queue.Queue()
        self._batch_clock: Dict[int, tuple] = {}  # rank -> (batches finished, since when), from heartbeats
        self._liveness_checked = 0.0
        self._stopped: Set[int] = set()
        self.on_rank_dead: Optional[Callable[[int], None]] = None
        self._since_reduce: Dict[int, List[tuple]] = {r: [] for r in range(world_size)}
        self._pools: List[EpochPool] = []  # where work of a dead rank goes back
        self._pool_epoch = 0
        self._generation = 0
        self._regroup_needed = False
        # nccl_sync on an even rig: each rank's next order, sent ahead of the reduce it follows
        # (rank -> (when sent, the pool it came from, the order))
        self._ahead: Dict[int, Tuple[float, EpochPool, Train]] = {}
        self._start_epoch = 0
        self._resume_uncovered: List[List[int]] = []
        self._train_started: Optional[float] = None
        # snapshot_timeout_secs: ranks left out of a round's average (rank -> that round), the
        # steps their late snapshots carried (folded into their next snapshot), and the ranks
        # left out of the round just finished (they get a no-op update).
        self._left_out: Dict[int, int] = {}
        self._owed: Dict[int, int] = {}
        self._late: Set[int] = set()

    # ---- thread-safe controls ---------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop at the next reduce boundary and save (SIGINT/SIGTERM); a second request, or no
        boundary within STOP_GRACE_S, stops at once without saving."""
        now = time.monotonic()
        self._stop_deadline = now if self._stop.is_set() else now + STOP_GRACE_S
        self._stop_reason = reason
        self._stop.set()

    def report_failure(self, status: str, reason: str) -> None:
        """Something the run cannot survive (not a rank death): abort."""
        self._failure = RunAborted(status, reason)

    def report_death(self, rank: int, reason: str) -> None:
        """A rank process ended without being told to (seen by the launcher)."""
        self._deaths.put((rank, reason))

    def stopped(self, rank: int) -> bool:
        """The rank was sent Stop: its exit is clean, never a death."""
        return rank in self._stopped

    # ---- the run ----------------------------------------------------------------------------

    def run(self) -> Summary:
        started = time.perf_counter()
        try:
            self._await_ranks()
            self._train_all_epochs()
            self.summary.status = "completed"
        except ShutdownWithSave as exc:
            if self.elche is None:  # lost before training began: nothing to save
                self.summary.status, self.summary.message = "failed", self._failed_ranks(exc.detail)
            else:
                self._shutdown_with_save(exc.reason, exc.detail)
                if self._raised:  # the cohort shrank because ranks raised: a failure
                    self.summary.status = "failed"
                    self.summary.message = f"{self._failed_ranks('')}; {self.summary.message}"
        except RunAborted as exc:
            self.summary.status, self.summary.message = exc.status, exc.reason
        except Exception as exc:  # a bug of ours: fail the run loudly, never report success
            log.exception("coordinator failed")
            self.summary.status = "failed"
            self.summary.message = f"coordinator error: {type(exc).__name__}: {exc}"
        finally:
            self._finish(time.perf_counter() - started)
        return self.summary

    def _await_ranks(self) -> None:
        deadline = time.monotonic() + max(300.0, self.config.heartbeat_timeout_secs)
        seeded = self.mode is not Mode.cpu_async
        while len(self.joined) < self.world_size or not seeded:
            if time.monotonic() > deadline:
                raise RunAborted("failed", f"only {len(self.joined)} of {self.world_size} ranks joined")
            message = self._next(expect=(RankJoined, SnapshotTaken))
            if message is None:
                raise RunAborted("failed", self._failed_ranks(f"a rank died before all {self.world_size} "
                                                              f"joined"))
            if isinstance(message, SnapshotTaken):  # cpu_async: rank 0's initial weights
                self.averager.seed_center(self._snapshot(message).params)
                seeded = True
        sizes = {j.num_samples for j in self.joined.values()}
        if len(sizes) != 1:
            raise RunAborted("failed", f"ranks see different train set sizes: {sorted(sizes)}")
        self.num_samples = sizes.pop()
        self.summary.devices = [self.joined[r].device_name for r in range(self.world_size)]
        nodes = merge_nodes(self.joined[r].node for r in range(self.world_size) if self.joined[r].node)
        self.summary.nodes = [node.record() for node in nodes]
        self.observer.on_nodes(nodes)
        self.elche = ElChe(self.config.elche, self.world_size, epoch_batches=self._epoch_batches(0),
                           reduce_ms=self._reduce_ms())
        if self.config.resume_from:
            self._restore(self.config.resume_from)
        self.plan = self.elche.plan()

    def _reduce_ms(self) -> Optional[float]:
        """The slowest rank's view of one reduce timed before training (collective modes)."""
        timed = [j.reduce_ms for j in self.joined.values() if j.reduce_ms is not None]
        if not timed:
            return None
        self._pending_events.append(("reduce_timed", f"one reduce before training: {max(timed):.1f} ms"))
        return max(timed)

    def _epoch_batches(self, epoch: int) -> int:
        span = self._span(epoch)
        return -(-span.size // self.config.batch_size)

    def _span(self, epoch: int) -> EpochSpan:
        data = self.config.data
        return epoch_span(epoch, self.num_samples, data.augment, data.epoch_splits)

    def _train_all_epochs(self) -> None:
        total = self.config.num_epochs * self.config.data.epoch_splits
        self.observer.on_start(total, self._epoch_batches(0), self.world_size)
        for kind, message in self._pending_events:  # noted while the ranks joined: after the start
            self.observer.on_event(kind, message)
        self._train_started = time.perf_counter()
        if self.mode is Mode.cpu_async:
            from flodl_run.overlap import AsyncLoop

            AsyncLoop(self, total, self._start_epoch).run()
        else:
            for epoch in range(self._start_epoch, total):
                self.close_epoch(epoch, self._run_epoch(epoch, self._epoch_pool(epoch)))
        last = self.summary.epochs[-1] if self.summary.epochs else None
        if last is not None and last.eval is None and self.config.recipe is not None:
            try:
                last_eval = self._evaluate(total - 1)
                if last_eval is not None:
                    self.recipe.run_callback("eval_result_fn", total - 1, last_eval)
            except CallbackFailed as failure:
                self.fail_callback(failure, total, [])
            self.summary.final_eval = last_eval
        elif last is not None:
            self.summary.final_eval = last.eval
        self.save_bundle("checkpoint", total, [])

    def _epoch_pool(self, epoch: int) -> EpochPool:
        """The whole epoch, or only what a resumed mid-epoch bundle left uncovered."""
        span = self._span(epoch)
        if epoch == self._start_epoch and self._resume_uncovered:
            return EpochPool(span.pass_index, [(s, e) for _, s, e in self._resume_uncovered])
        return EpochPool.whole(span)

    def close_epoch(self, epoch: int, tally: "EpochTally") -> None:
        """Aggregate a finished epoch (callbacks included), publish it, and checkpoint_every.
        A recipe callback that raises fails the run, saving the epoch's consensus first."""
        for rank, ms in enumerate(tally.wall_ms):
            self._compute_ms[rank] += ms
        try:
            record = self._epoch_record(epoch, tally)
            self.summary.epochs.append(record)
            self.observer.on_epoch(record)
            if self.recipe is not None:
                self.recipe.report_epoch(record)  # eval_result_fn, metrics_fn: in this process
        except CallbackFailed as failure:
            self.fail_callback(failure, epoch + 1, [])
        every = self.config.checkpoint_every
        total = self.config.num_epochs * self.config.data.epoch_splits
        if every and (epoch + 1) % every == 0 and epoch + 1 < total:
            self.save_bundle("checkpoint", epoch + 1, [])

    # ---- epoch records and callbacks --------------------------------------------------------

    def _epoch_record(self, epoch: int, tally: EpochTally) -> EpochRecord:
        total_batches = max(sum(tally.batches), 1)
        every = self.config.eval_every_epochs
        eval_began = time.perf_counter()
        due = bool(every) and (epoch + 1) % every == 0
        epoch_fn = self.recipe is not None and self.recipe.epoch_fn is not None
        score = self._evaluate(epoch, due, epoch_fn) if due or epoch_fn else None
        eval_ms = (time.perf_counter() - eval_began) * 1000.0
        return EpochRecord(
            epoch=epoch,
            avg_loss=sum(tally.loss_sum) / total_batches,  # work-weighted: per batch, all ranks
            eval=score,
            epoch_ms=(time.perf_counter() - tally.started) * 1000.0,
            eval_ms=eval_ms,
            per_rank_throughput=[s / (w / 1000.0) if w > 0 else 0.0
                                 for s, w in zip(tally.samples, tally.wall_ms)],
            per_rank_batch_share=[b / total_batches for b in tally.batches],
            scalars=roll_up(tally.scalars, self.config.scalar_reductions),
            samples=sum(tally.samples),
            **self._data.epoch_fields(epoch),
        )

    def _callback_rank(self) -> int:
        policy = self.config.epoch_callback_policy
        if policy.startswith("rank:") and int(policy.split(":", 1)[1]) in self.alive:
            return int(policy.split(":", 1)[1])
        known = [(ms, rank) for rank, ms in enumerate(self.elche.smoothed_ms() if self.elche else [])
                 if ms is not None and rank in self.alive]
        return min(known)[1] if known else min(self.alive)

    def _evaluate(self, epoch: int, score: bool = True, epoch_fn: bool = False) -> Optional[float]:
        """The eval on the callback rank (`score`), then the recipe's epoch_fn there (`epoch_fn`)."""
        rank = self._callback_rank()
        center = self.averager.center if self.mode is Mode.cpu_async else None
        if center is not None:  # under EASGD, eval scores the center, not a replica
            self._send(rank, Evaluate(epoch, dtype_names(center), score, epoch_fn),
                       [as_frame(p) for p in center])
        else:
            self._send(rank, Evaluate(epoch, score=score, epoch_fn=epoch_fn))
        result = self._next(expect=Evaluated)
        while result is None or result.rank not in self.alive:
            if rank not in self.alive:  # the callback rank died: ask another
                return self._evaluate(epoch, score, epoch_fn)
            result = self._next(expect=Evaluated)
        return result.score if score and result.score == result.score else None  # NaN: no eval set

    # ---- messaging --------------------------------------------------------------------------

    def _send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        order = message.train if isinstance(message, Update) else message
        if isinstance(order, Train) and order.slices:
            self._since_reduce.setdefault(rank, []).append((order.epoch, list(order.slices)))
        self.channel.send(message, payloads, identity=self.identities[rank])

    def _next(self, expect: type | tuple, deadline: Optional[float] = None,
              accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]:
        """The next message of type `expect` (and, given `accept`, one it accepts), or None when
        a rank died meanwhile or the `deadline` (time.monotonic) passed (callers then re-check
        what they wait for); heartbeats and failures are handled on the way.
        Other orders' answers (e.g. WindowDone while waiting for Evaluated in cpu_async, or the
        answers to orders sent ahead) are kept, in order, for the call that expects them."""
        if self._absorb_deaths():
            return None
        for i, waiting in enumerate(self._deferred):
            if getattr(waiting.message, "rank", None) not in self.alive and \
                    not isinstance(waiting.message, RankJoined):
                continue
            if isinstance(waiting.message, expect) and (accept is None or accept(waiting.message)):
                del self._deferred[i]
                self._payloads = waiting.payloads
                return waiting.message
        while True:
            if self._failure is not None:
                raise self._failure
            if self._stop.is_set() and not self._saving and time.monotonic() > self._stop_deadline:
                raise RunAborted("interrupted", f"{self._stop_reason or 'stopped'} (no reduce "
                                                f"boundary within {STOP_GRACE_S:.0f}s: not saved)")
            self._check_liveness()  # also while messages flow: a busy socket must not hide a hang
            if not self._deaths.empty() and self._absorb_deaths():
                return None
            received = self.channel.recv(timeout_ms=POLL_MS)
            if received is None:
                if self._absorb_deaths():
                    return None  # membership changed: the caller re-plans what it waits for
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            message = received.message
            rank = getattr(message, "rank", None)
            if rank is not None and rank not in self.alive:
                if isinstance(message, RankFailed):  # why it died (its exit may be seen first)
                    self._raised.setdefault(rank, message.error)
                continue  # a rank declared dead does not speak for the run any more
            if rank is not None:
                self.last_seen[rank] = time.monotonic()
            if isinstance(message, Heartbeat):
                self._note_progress(message, self.last_seen[rank])
            if isinstance(message, (ClockPing, TimelineEvents)):
                self.timeline.receive(message, received.identity, self.channel)
                continue
            if isinstance(message, WindowDone):
                self._data.add(message)  # each WindowDone passes here once, deferred or not
                self.observer.on_window(message.rank, message.samples, message.wall_ms,
                                        message.device_bytes)
                if not math.isfinite(message.loss_sum) and message.rank not in self._resetting:
                    self._nonfinite.setdefault(message.rank, "loss")
            if isinstance(message, RankJoined):
                self.identities[message.rank] = received.identity
                self.joined[message.rank] = message
            elif isinstance(message, Listening):
                self.listeners[message.rank] = received.identity
            elif isinstance(message, RankFailed) and message.callback:  # the rank lives on
                raise CallbackFailed(message.callback, message.error, message.rank)
            elif isinstance(message, RankFailed):
                self._raised.setdefault(message.rank, message.error)
                self.report_death(message.rank, f"failed: {message.error}")
                self._absorb_deaths()
                return None
            if isinstance(message, expect) and (accept is None or accept(message)):
                self._payloads = received.payloads
                return message
            if isinstance(message, (WindowDone, SnapshotTaken, Evaluated, Reduced, ReduceFailed,
                                    CheckpointSaved, Regrouped)):
                self._deferred.append(received)
            elif not isinstance(message, (Heartbeat, RankJoined, Listening)):
                raise RunAborted("failed", f"unexpected {type(message).__name__} from rank {rank}")

    def _failed_ranks(self, fallback: str) -> str:
        """`rank k failed: <its exception>` for the ranks that raised (their RankFailed may
        trail their exit: wait for it briefly), else `fallback`."""
        deadline = time.monotonic() + 1.0
        while len(self._raised) < self.world_size - len(self.alive) and time.monotonic() < deadline:
            received = self.channel.recv(timeout_ms=100)
            if received is not None and isinstance(received.message, RankFailed):
                self._raised.setdefault(received.message.rank, received.message.error)
        if not self._raised:
            return fallback
        first = min(self._raised)
        others = sorted(r for r, e in self._raised.items() if r != first and e == self._raised[first])
        also = f" (also rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" \
            if others else ""
        return f"rank {first} failed: {self._raised[first]}{also}"

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout_secs
        for rank, seen in self.last_seen.items():
            if rank in self.alive and now - seen > timeout:
                self.report_death(rank, f"silent for {now - seen:.1f}s (heartbeat timeout {timeout:g}s)")

    def _finish(self, wall_s: float) -> None:
        for rank in list(self.identities):
            self._stopped.add(rank)
            try:
                self._send(rank, Stop(self.summary.status))
            except zmq.ZMQError:
                pass
        self.timeline.await_final(self.channel, sorted(self.alive & set(self.identities)))
        self._close_socket()
        self.summary.wall_s = wall_s
        self.summary.syncs = len(self._sync_ms)
        self.summary.avg_sync_ms = sum(self._sync_ms) / len(self._sync_ms) if self._sync_ms else 0.0
        if self.plan is not None:
            self.summary.phase = self.plan.phase.name.lower()
        self.summary.samples_per_s = self._samples_per_s()
        if not self.mode.is_collective:
            self.summary.param_transport = ["shm" if r in self._shm_ranks else "frames"
                                            for r in range(self.world_size)]
        if self._train_started is not None:
            train_ms = (time.perf_counter() - self._train_started) * 1000.0
            self.summary.idle_fraction = [max(0.0, 1.0 - ms / train_ms) for ms in self._compute_ms]

    def _close_socket(self) -> None:
        """Close the control plane now (the Stop orders still go out, within LINGER), not when
        the garbage collector finds the context: nobody joins or speaks to a finished run."""
        self.channel.socket.close(linger=1000)
        self._gate.stop()
        self.ctx.term()

    def _samples_per_s(self) -> float:
        """Samples trained per second of epoch time (eval callbacks included, startup not)."""
        trained = sum(self._span(e.epoch).size for e in self.summary.epochs) if self.num_samples else 0
        train_s = sum(e.epoch_ms for e in self.summary.epochs) / 1000.0
        return trained / train_s if train_s > 0 else 0.0

