"""The coordinator: the control plane of a distributed run (DESIGN §2, §5, §8).

Owns the window loop: hands out data (equal split for sync, throughput-sized chunks for
cadence), opens the reduce gate, orders reduces, feeds ElChe, aggregates epochs in order and
runs the eval callback. It never touches a device; ranks do the training and the averaging.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set

import zmq

from flodl_run import checkpoint
from flodl_run.averaging.central import CentralAverager, CentralResult, Snapshot
from flodl_run.averaging.frames import as_frame, dtype_names, from_frames
from flodl_run.checkpoint import BundleMeta, Coverage, load_tensors, read_meta, save_meta, save_tensors
from flodl_run.config.compose import dotted_items
from flodl_run.config.schema import ExperimentConfig, Mode
from flodl_run.datametrics import DataTally
from flodl_run.dispatch import EpochPool, EpochSpan, epoch_span, equal_split, window_samples
from flodl_run.elche import ElChe, Plan, ReduceReport
from flodl_run.observe import Observer
from flodl_run.outer import OuterOptimizer
from flodl_run.scalars import merge, roll_up
from flodl_run.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.wire import (
    Channel, CheckpointSaved, Evaluate, Evaluated, Heartbeat, Message, RankFailed, RankJoined,
    Reduced, ReduceFailed, Regroup, Regrouped, SaveCheckpoint,
    SnapshotTaken, Stop, SyncNow, Train, Update, WindowDone, Received,
)

POLL_MS = 200
STOP_GRACE_S = 8.0  # SIGINT -> save at a reduce boundary; ranks are gone within 15 s either way
log = logging.getLogger(__name__)


class RunAborted(Exception):
    """The run cannot go on (a rank failed or died, or a stop was requested)."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class ShutdownWithSave(Exception):
    """Membership broke the failure policy: a survivor saves, then the run stops (DESIGN §9)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class _WindowTally:
    """What each rank did since the last reduce."""

    batches: List[int]
    samples: List[int]
    wall_ms: List[float]
    fill_ms: List[float]
    loss_sum: List[float]
    lr: List[Optional[float]]
    scalars: Dict[str, List[float]] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> "_WindowTally":
        return cls([0] * n, [0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [None] * n)

    def drop(self, ranks: Set[int]) -> None:
        """Dead ranks contributed nothing that survives: their work is redone."""
        for r in ranks:
            self.batches[r], self.samples[r], self.wall_ms[r], self.loss_sum[r] = 0, 0, 0.0, 0.0

    def add(self, done: WindowDone) -> None:
        r = done.rank
        if self.batches[r] == 0:
            self.fill_ms[r] = done.fill_ms
        self.batches[r] += done.batches
        self.samples[r] += done.samples
        self.wall_ms[r] += done.wall_ms
        self.loss_sum[r] += done.loss_sum
        self.lr[r] = done.lr
        merge(self.scalars, done.scalars)


@dataclass
class _EpochTally:
    batches: List[int]
    samples: List[int]
    wall_ms: List[float]
    loss_sum: List[float]
    scalars: Dict[str, List[float]] = field(default_factory=dict)
    reported_batches: int = 0
    reported_loss: float = 0.0
    reports: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, n: int) -> "_EpochTally":
        return cls([0] * n, [0] * n, [0.0] * n, [0.0] * n)

    def add_done(self, done: WindowDone) -> None:
        """cpu_async: windows straddle epochs, so epochs count WindowDone messages directly."""
        r = done.rank
        self.batches[r] += done.batches
        self.samples[r] += done.samples
        self.wall_ms[r] += done.wall_ms
        self.loss_sum[r] += done.loss_sum
        merge(self.scalars, done.scalars)

    def add(self, window: _WindowTally) -> None:
        for r in range(len(self.batches)):
            self.batches[r] += window.batches[r]
            self.samples[r] += window.samples[r]
            self.wall_ms[r] += window.wall_ms[r]
            self.loss_sum[r] += window.loss_sum[r]
        merge(self.scalars, window.scalars)


class Coordinator:
    """Runs on a thread of the launcher; `run()` returns the Summary of the whole run."""

    def __init__(self, config: ExperimentConfig, world_size: int, secret: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 observer: Optional[Observer] = None):
        self.config, self.world_size = config, world_size
        self.mode = config.elche.mode
        self.observer = observer or Observer()
        self.mlflow_run_id: Optional[str] = None
        """The tracked run, recorded in bundles so a resume can link to it."""
        self.ctx = zmq.Context.instance()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        if port:
            sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self.channel = Channel(sock, secret)
        self.identities: Dict[int, bytes] = {}
        self.last_seen: Dict[int, float] = {}
        self.joined: Dict[int, RankJoined] = {}
        self.num_samples = 0
        self.summary = Summary(mode=self.mode.value, outer=config.outer.kind.value,
                               world_size=world_size)
        self.averager = CentralAverager(OuterOptimizer(config.outer), config.elche.gamma,
                                        config.elche.easgd_alpha if self.mode is Mode.cpu_async else None)
        self._payloads: List[memoryview] = []
        self._deferred: List[Received] = []
        self.elche: Optional[ElChe] = None
        self.plan: Optional[Plan] = None
        self._stop = threading.Event()
        self._stop_reason = ""
        self._stop_deadline = float("inf")
        self._failure: Optional[RunAborted] = None
        self._window = 0
        self._round = 0
        self._global_step = 0
        self._sync_ms: List[float] = []
        self._compute_ms = [0.0] * world_size
        self._data = DataTally(world_size)  # per-rank data-plane metrics, per epoch
        self.alive: Set[int] = set(range(world_size))
        self._deaths: "queue.Queue[tuple]" = queue.Queue()
        self._stopped: Set[int] = set()
        self.on_rank_dead: Optional[Callable[[int], None]] = None
        self._since_reduce: Dict[int, List[tuple]] = {r: [] for r in range(world_size)}
        self._pools: List[EpochPool] = []  # where work of a dead rank goes back
        self._pool_epoch = 0
        self._generation = 0
        self._regroup_needed = False
        self._start_epoch = 0
        self._resume_uncovered: List[List[int]] = []
        self._train_started: Optional[float] = None

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
            self._shutdown_with_save(exc.reason, exc.detail)
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
                raise RunAborted("failed", f"a rank died before all {self.world_size} joined")
            if isinstance(message, SnapshotTaken):  # cpu_async: rank 0's initial weights
                self.averager.seed_center(self._snapshot(message).params)
                seeded = True
        sizes = {j.num_samples for j in self.joined.values()}
        if len(sizes) != 1:
            raise RunAborted("failed", f"ranks see different train set sizes: {sorted(sizes)}")
        self.num_samples = sizes.pop()
        self.summary.devices = [self.joined[r].device_name for r in range(self.world_size)]
        self.elche = ElChe(self.config.elche, self.world_size, epoch_batches=self._epoch_batches(0))
        if self.config.resume_from:
            self._restore(self.config.resume_from)
        self.plan = self.elche.plan()

    def _epoch_batches(self, epoch: int) -> int:
        span = self._span(epoch)
        return -(-span.size // self.config.batch_size)

    def _span(self, epoch: int) -> EpochSpan:
        data = self.config.data
        return epoch_span(epoch, self.num_samples, data.augment, data.epoch_splits)

    def _train_all_epochs(self) -> None:
        total = self.config.num_epochs * self.config.data.epoch_splits
        self.observer.on_start(total, self._epoch_batches(0), self.world_size)
        self._train_started = time.perf_counter()
        if self.mode is Mode.cpu_async:
            from flodl_run.overlap import AsyncLoop

            AsyncLoop(self, total, self._start_epoch).run()
        else:
            for epoch in range(self._start_epoch, total):
                self.close_epoch(epoch, self._run_epoch(epoch, self._epoch_pool(epoch)))
        last = self.summary.epochs[-1] if self.summary.epochs else None
        if last is not None and last.eval is None and self.config.recipe is not None:
            last_eval = self._evaluate(total - 1)
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

    def close_epoch(self, epoch: int, tally: "_EpochTally") -> None:
        """Aggregate a finished epoch (callbacks included), publish it, and checkpoint_every."""
        for rank, ms in enumerate(tally.wall_ms):
            self._compute_ms[rank] += ms
        record = self._epoch_record(epoch, tally)
        self.summary.epochs.append(record)
        self.observer.on_epoch(record)
        every = self.config.checkpoint_every
        total = self.config.num_epochs * self.config.data.epoch_splits
        if every and (epoch + 1) % every == 0 and epoch + 1 < total:
            self.save_bundle("checkpoint", epoch + 1, [])

    # ---- membership (DESIGN §9) -------------------------------------------------------------

    def _absorb_deaths(self) -> bool:
        """Turn reported deaths into a smaller membership: forget the rank's timing, give its
        unfinished work back, re-plan, then apply the failure policy. True when it changed."""
        changed = False
        while not self._deaths.empty():
            rank, reason = self._deaths.get()
            if rank not in self.alive:
                continue
            self.alive.discard(rank)
            self.summary.dead_ranks.append(rank)
            self.observer.on_event("rank_lost", f"rank {rank} lost: {reason}")
            log.warning("rank %d lost: %s", rank, reason)
            if self.on_rank_dead is not None:
                self.on_rank_dead(rank)
            self._give_back(rank)
            if self.elche is not None:
                self.plan = self.elche.forget_rank(rank)
            self._regroup_needed = self.mode.is_collective
            changed = True
            self._apply_failure_policy(reason)
        return changed

    def _give_back(self, rank: int) -> None:
        """Everything the rank trained since the last reduce is lost with it: redo it."""
        for epoch, slices in self._since_reduce.pop(rank, []):
            if epoch == self._pool_epoch and self._pools:
                target = min((p for p in self._pools if p is not None), key=lambda p: p.remaining)
                target.give_back(slices)
            elif hasattr(self, "async_loop"):
                self.async_loop.give_back(epoch, slices)

    def _apply_failure_policy(self, reason: str) -> None:
        dead = self.world_size - len(self.alive)
        limit = self.config.max_failure
        if not self.alive:
            raise ShutdownWithSave("all_ranks_lost", reason)
        if (limit.absolute is not None and dead >= limit.absolute) or \
                (limit.percent is not None and dead >= math.ceil(limit.percent * self.world_size)):
            raise ShutdownWithSave("max_failure_exceeded", f"{dead} of {self.world_size} ranks dead")
        if self.mode.is_collective and len(self.alive) == 1:
            raise ShutdownWithSave("single_survivor", "one rank cannot form a collective")

    def _regroup(self) -> None:
        """Collective modes: survivors rebuild the process group (new store prefix, new ranks
        by ascending old rank) before the next reduce."""
        self._generation += 1
        members = sorted(self.alive)
        for rank in members:
            self._send(rank, Regroup(self._generation, members))
        joined: Set[int] = set()
        while joined < self.alive:
            msg = self._next(expect=Regrouped)
            if msg is None:  # another death while regrouping: start over with fewer members
                return self._regroup()
            if msg.generation == self._generation:
                joined.add(msg.rank)
        self._regroup_needed = False
        self.observer.on_event("regroup", f"generation {self._generation}: ranks {members}")

    def _shutdown_with_save(self, reason: str, detail: str) -> None:
        """Save from a survivor (when any), then stop with status shutdown_with_save."""
        self.summary.status = "shutdown_with_save"
        stem = None
        if self.alive:
            try:
                stem = self.save_bundle(reason, self._pool_epoch, self._uncovered_now())
            except (RunAborted, zmq.ZMQError) as exc:
                detail = f"{detail}; the save failed: {exc}"
        saved = f"bundle {stem}" if stem else "no bundle"
        self.summary.message = f"{reason}: {detail}; {saved}"
        self.observer.on_event("shutdown", self.summary.message)

    def _uncovered_now(self) -> List[List[int]]:
        """What of the current epoch the survivors' weights may not include."""
        ranges = [r for p in self._pools if p is not None for r in p.uncovered()]
        for chunks in self._since_reduce.values():
            ranges += [list(s) for epoch, slices in chunks if epoch == self._pool_epoch for s in slices]
        return ranges

    # ---- checkpoints ------------------------------------------------------------------------

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]:
        """The callback rank writes model and optimizer, the coordinator the rest (DESIGN §10).
        `epoch` is where a resume starts; `uncovered` what of it the weights do not include."""
        stem = self.config.save_path
        if not stem:
            return None
        writer = self._callback_rank()
        center = self.averager.center if self.mode is Mode.cpu_async else None
        for rank in sorted(self.alive):
            if rank != writer:  # the others keep their own optimizer state (momentum differs)
                self._send(rank, SaveCheckpoint(stem, write_model=False))
        if center is not None:  # under EASGD the model of record is the center
            self._send(writer, SaveCheckpoint(stem, dtype_names(center)), [as_frame(p) for p in center])
        else:
            self._send(writer, SaveCheckpoint(stem))
        answered: Set[int] = set()
        while not self.alive <= answered:
            saved = self._next(expect=CheckpointSaved)
            if saved is None:
                continue
            answered.add(saved.rank)
            if saved.error:
                raise RunAborted("failed", f"rank {saved.rank} could not save {stem}: {saved.error}")
        if not self.mode.is_collective and self.averager.outer.active or center is not None:
            state = dict(self.averager.outer.state_dict(), center=center)
            save_tensors(checkpoint.paths(stem)["outer"], state)
        save_meta(stem, self._bundle_meta(reason, epoch, uncovered))
        self.summary.checkpoint = stem
        self.observer.on_event("checkpoint", f"{reason}: {stem} (resume at epoch {epoch})")
        return stem

    def _bundle_meta(self, reason: str, epoch: int, uncovered: List[List[int]]) -> BundleMeta:
        data = self.config.data
        coverage = Coverage(self.config.seed, self.config.batch_size, data.epoch_splits, epoch,
                            [list(u) for u in uncovered])
        return BundleMeta(checkpoint.SCHEMA_VERSION, epoch, self._global_step, self._round,
                          self.world_size, reason, self.elche.export_state(), coverage,
                          json.loads(json.dumps(dotted_items(self.config), default=str)),
                          self.mlflow_run_id)

    def _restore(self, stem: str) -> None:
        """Continue a bundle's trajectory: epoch, step, round, ElChe (no warm-up re-run)."""
        meta = read_meta(stem)
        self.elche = ElChe.from_state(self.config.elche, meta.elche_state, world_size=self.world_size,
                                      epoch_batches=self._epoch_batches(0))
        self._start_epoch, self._resume_uncovered = meta.epoch, meta.coverage.uncovered
        self._global_step, self._round = meta.global_step, meta.sync_round
        outer_file = checkpoint.paths(stem)["outer"]
        if not self.mode.is_collective and outer_file.is_file():
            state = load_tensors(outer_file)
            self.averager.outer.load_state_dict(state)
            if state.get("center") is not None:
                self.averager.center = state["center"]
        self.observer.on_event("resume", f"resuming {stem} at epoch {meta.epoch} "
                                         f"({meta.elche_state.get('phase')}, step {meta.global_step})")

    def _graceful_stop(self, epoch: int, uncovered: List[List[int]]) -> None:
        """SIGINT/SIGTERM at a reduce boundary: save what the consensus holds, then stop."""
        stem = self.save_bundle("graceful_shutdown", epoch, uncovered)
        raise RunAborted("interrupted", f"{self._stop_reason}; saved {stem}" if stem else self._stop_reason)

    # ---- one epoch --------------------------------------------------------------------------

    def _run_epoch(self, epoch: int, pool: EpochPool) -> _EpochTally:
        epoch_tally = _EpochTally.empty(self.world_size)
        if self.mode.is_sync:
            self._run_sync_epoch(epoch, pool, epoch_tally)
        else:
            self._run_cadence_epoch(epoch, pool, epoch_tally)
        return epoch_tally

    def _run_cadence_epoch(self, epoch: int, pool: EpochPool, epoch_tally: _EpochTally) -> None:
        """Progressive dispatch: each window hands every rank its planned count of batches; the
        next window's orders ride on the reduce (folded into the update on the coordinator
        backend)."""
        self._pools, self._pool_epoch = [pool], epoch

        def plan_window() -> Dict[int, Train]:
            counts = [c if r in self.alive else 0 for r, c in enumerate(self.plan.batch_counts)]
            sizes = window_samples(pool.remaining, counts, self.config.batch_size)
            trains = {}
            for rank, size in enumerate(sizes):
                slices = pool.take(size) if rank in self.alive else []
                if slices:
                    trains[rank] = self._train_order(epoch, slices)
            return trains

        trains = plan_window()
        for rank, order in trains.items():
            self._send(rank, order)
        reduces = 0
        while trains or pool.remaining:  # work given back by a dead rank is redone
            if not trains:
                trains = plan_window()
                for rank, order in trains.items():
                    self._send(rank, order)
            window = _WindowTally.empty(self.world_size)
            self._collect_windows(set(trains), window, epoch, epoch_tally)
            trains = self._reduce(window, epoch_tally, epoch,
                                  plan_window if pool.remaining and not self._stop.is_set() else None)
            reduces += 1
            in_flight = [s for order in trains.values() for s in order.slices]
            if self._stop.is_set():
                self._graceful_stop(epoch, pool.uncovered())
            if reduces == 1 and epoch == self.config.checkpoint_at_epoch:
                self.save_bundle("checkpoint", epoch, pool.uncovered() + [list(s) for s in in_flight])

    def _run_sync_epoch(self, epoch: int, pool: EpochPool, epoch_tally: _EpochTally) -> None:
        """Equal split; a reduce fires once every rank with data has stepped since the last one,
        and ranks that are ahead keep stepping meanwhile (sync is not lockstep)."""
        shares = equal_split(pool.remaining, self.world_size, self.config.elche.partition_ratios)
        parts = pool.split(shares)
        self._pools, self._pool_epoch = parts, epoch
        while any(part.remaining for part in parts):
            self._rehome_parts(parts)
            window = _WindowTally.empty(self.world_size)
            self._sync_window(epoch, parts, window, epoch_tally)
            self._reduce(window, epoch_tally, epoch)
            if self._stop.is_set():
                self._graceful_stop(epoch, [r for part in parts for r in part.uncovered()])

    def _rehome_parts(self, parts: List[EpochPool]) -> None:
        """A dead rank's share of a sync epoch goes to the survivor with the least left."""
        for rank in range(len(parts)):
            if rank not in self.alive and parts[rank].remaining and self.alive:
                target = min(self.alive, key=lambda r: parts[r].remaining)
                parts[target].give_back([(parts[rank].pass_index, s, e - s) for s, e in parts[rank].ranges])
                parts[rank].ranges = []

    def _sync_window(self, epoch: int, parts: List[EpochPool], window: _WindowTally,
                     epoch_tally: _EpochTally) -> None:
        in_flight: Dict[int, float] = {}  # rank -> when its batch was sent

        def give(rank: int) -> None:
            self._send(rank, self._train_order(epoch, parts[rank].take(self.config.batch_size)))
            in_flight[rank] = time.perf_counter()

        for rank in sorted(self.alive):
            if parts[rank].remaining:
                give(rank)
        while True:
            for rank in [r for r in in_flight if r not in self.alive]:
                del in_flight[rank]
            if not in_flight:
                break
            done = self._next(expect=WindowDone)
            if done is None:
                continue
            del in_flight[done.rank]
            window.add(done)
            self._progress(epoch, epoch_tally, window, done)
            if parts[done.rank].remaining and self._keeps_stepping(done.rank, window, in_flight):
                give(done.rank)

    def _keeps_stepping(self, rank: int, window: _WindowTally, in_flight: Dict[int, float]) -> bool:
        """Sync modes: a rank that moved goes on stepping while a rank that has not moved yet
        still needs more than half of this rank's step (so a homogeneous rig reduces once per
        step), unless max_batch_diff caps its lead."""
        laggards = [r for r in in_flight if window.batches[r] == 0]
        if not laggards:
            return False
        ms = self.elche.smoothed_ms()
        if ms[rank] is None:
            return False
        now = time.perf_counter()
        remaining = [ms[r] - (now - in_flight[r]) * 1000.0 for r in laggards if ms[r] is not None]
        if not remaining or max(remaining) <= 0.5 * ms[rank]:
            return False
        limit = self.config.elche.max_batch_diff
        return limit is None or window.batches[rank] < limit + min(window.batches)

    def _train_order(self, epoch: int, slices: list, overshoot: int = 0) -> Train:
        batches = sum(-(-s[2] // self.config.batch_size) for s in slices)
        return Train(self._window, epoch, slices, batches, overshoot)

    def _collect_windows(self, waiting: Set[int], window: _WindowTally, epoch: int,
                         epoch_tally: _EpochTally) -> None:
        while True:
            waiting &= self.alive
            if not waiting:
                break
            done = self._next(expect=WindowDone)
            if done is None:
                continue
            waiting.discard(done.rank)
            window.add(done)
            self._progress(epoch, epoch_tally, window, done)

    def _progress(self, epoch: int, epoch_tally: _EpochTally, window: _WindowTally,
                  done: WindowDone) -> None:
        batches = sum(epoch_tally.batches) + sum(window.batches)
        self.observer.on_batch(epoch, batches, done.loss_sum / max(done.batches, 1))

    # ---- the reduce -------------------------------------------------------------------------

    def _reduce(self, window: _WindowTally, epoch_tally: _EpochTally, epoch: int,
                plan_next: Optional[Callable[[], Dict[int, Train]]] = None) -> Dict[int, Train]:
        """Order the consensus, wait for every rank, let ElChe plan, then send the next window
        (`plan_next`) — after the collective, or folded into the coordinator's update."""
        self._window += 1
        self._round += 1
        began = time.perf_counter()
        result = None
        if self.mode.is_collective:
            divergence = self._collective_round()
        else:
            for rank in sorted(self.alive):
                self._send(rank, SyncNow(self._round, self._global_step))
            result = self._central_round(window)
            divergence = result.divergence if result else 0.0
        sync_ms = (time.perf_counter() - began) * 1000.0
        window.drop(set(range(self.world_size)) - self.alive)  # the dead's work is redone
        self._since_reduce = {r: [] for r in self.alive}
        self._global_step += sum(window.batches)
        epoch_tally.add(window)
        self._after_reduce(window, epoch, sync_ms, divergence)
        trains = plan_next() if plan_next is not None else {}
        if result is not None or not self.mode.is_collective:
            self._send_updates(result, trains)
        else:
            for rank, order in trains.items():
                self._send(rank, order)
        self._maybe_report(epoch, epoch_tally)
        return trains

    def _collective_round(self) -> float:
        """SyncNow to the survivors until one round completes on all of them: a death during
        the reduce (ReduceFailed, or a rank lost) regroups and retries the same round; each
        rank restores its pre-reduce replica before the retry."""
        began = time.monotonic()
        while True:
            if self._regroup_needed:
                self._regroup()
            asked = set(self.alive)
            for rank in sorted(asked):
                self._send(rank, SyncNow(self._round, self._global_step))
            divergences, failed = self._collect_reduced(asked)
            if not failed and not self._regroup_needed:
                return max(divergences) if divergences else 0.0
            self._regroup_needed = True
            if time.monotonic() - began > self._stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self._round} did not complete")

    def _collect_reduced(self, asked: Set[int]) -> tuple:
        divergences: List[float] = []
        failed = False
        answered: Set[int] = set()
        while not asked & self.alive <= answered:
            msg = self._next(expect=(Reduced, ReduceFailed))
            if msg is None:
                failed = True  # the round lost a member: regroup and retry it
                continue
            if msg.round != self._round or msg.rank not in asked:
                continue
            answered.add(msg.rank)
            if isinstance(msg, ReduceFailed):
                failed = True
            else:
                divergences.append(msg.divergence)
        return divergences, failed

    def _stall_ceiling_s(self) -> float:
        """DESIGN §9: a reduce stuck past max(10 x heartbeat timeout, 300 s) saves and stops."""
        return max(10 * self.config.heartbeat_timeout_secs, 300.0)

    def _after_reduce(self, window: _WindowTally, epoch: int, sync_ms: float, divergence: float) -> None:
        """Feed ElChe one ReduceReport and publish what it decided."""
        self._sync_ms.append(sync_ms)
        lr = next((x for x in window.lr if x is not None), None)
        self.plan = self.elche.on_reduce(ReduceReport(
            wall_ms=window.wall_ms, batches=window.batches, sync_ms=sync_ms,
            fill_ms=window.fill_ms if self.mode.is_progressive else None,
            divergence=divergence, lr=lr))
        self.summary.anchor_trajectory.append(self.plan.anchor)
        self._observe_reduce(epoch, sync_ms, divergence)

    # ---- the coordinator backend (cpu_* modes) -----------------------------------------------

    def _central_round(self, window: _WindowTally) -> Optional[CentralResult]:
        """Collect every rank's snapshot and average them here, on CPU."""
        snapshots: Dict[int, Snapshot] = {}
        began = time.monotonic()
        while not self.alive <= set(snapshots):
            taken = self._next(expect=SnapshotTaken)
            if taken is None:
                continue
            snap = self._snapshot(taken)
            self.check_snapshot(snap, window.batches[snap.rank], allowance=0)
            snapshots[snap.rank] = snap
            if time.monotonic() - began > self._stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self._round}: snapshots missing")
        snapshots = [snapshots[r] for r in sorted(self.alive)]  # a dead rank's snapshot is dropped
        return self.averager.reduce(snapshots)

    def check_snapshot(self, snap: Snapshot, window_batches: int, allowance: int) -> None:
        """A rank may not train past its window plus `allowance` before a reduce: cpu_sync and
        cpu_cadence block (allowance 0); cpu_async has its overshoot budget."""
        if snap.steps > window_batches + allowance:
            raise RunAborted("failed", f"rank {snap.rank} round {self._round}: {snap.steps} steps "
                                       f"since the last reduce, budget {window_batches} + {allowance}")

    def _snapshot(self, taken: SnapshotTaken) -> Snapshot:
        count = len(taken.dtypes)
        params = from_frames(self._payloads[:count], taken.dtypes)
        buffers = from_frames(self._payloads[count:], ["torch.float32"])[0]
        return Snapshot(taken.rank, taken.steps, params, buffers)

    def _send_updates(self, result: Optional[CentralResult], trains: Dict[int, Train]) -> None:
        """Every rank gets the result (blend 1.0 = overwrite; EASGD alpha in cpu_async)."""
        frames: List[memoryview] = []
        dtypes: List[str] = []
        blend, buffers, stepped = 0.0, False, False  # nobody trained: nothing to adopt
        if result is not None:
            alpha = self.config.elche.easgd_alpha if self.mode is Mode.cpu_async else None
            blend, stepped = (alpha if alpha is not None else 1.0), result.outer_stepped
            frames, dtypes = [as_frame(p) for p in result.params], dtype_names(result.params)
            buffers = result.float_buffers is not None
            if buffers:
                frames.append(as_frame(result.float_buffers))
        for rank in sorted(self.alive):
            self._send(rank, Update(self._round, self._global_step, blend, buffers, dtypes,
                                    stepped, trains.get(rank)), frames)

    def _maybe_report(self, epoch: int, tally: _EpochTally) -> None:
        """reports_per_epoch: one sub-epoch report each time the epoch passes another 1/n."""
        n = self.config.reports_per_epoch
        if not n:
            return
        done = sum(tally.batches)
        fraction = done / max(self._epoch_batches(epoch), 1)
        if tally.reports >= n or fraction < (tally.reports + 1) / n:
            return
        tally.reports = min(n, int(fraction * n + 1e-9))
        batches = done - tally.reported_batches
        loss = sum(tally.loss_sum) - tally.reported_loss
        tally.reported_batches, tally.reported_loss = done, sum(tally.loss_sum)
        self.observer.on_report(ReportRecord(
            epoch, tally.reports, fraction, self._global_step, loss / max(batches, 1),
            roll_up(tally.scalars, self.config.scalar_reductions)))

    def _observe_reduce(self, epoch: int, sync_ms: float, divergence: float) -> None:
        plan = self.plan
        self.observer.on_reduce(ReduceRecord(
            self._round, epoch, sync_ms, divergence, plan.anchor, plan.anchor_rank,
            list(plan.batch_counts), plan.overhead, str(plan.verdict), plan.phase.name.lower(),
            plan.nudge_factor))
        for event in plan.events:
            self.observer.on_event(event.kind, event.message)

    # ---- epoch records and callbacks --------------------------------------------------------

    def _epoch_record(self, epoch: int, tally: _EpochTally) -> EpochRecord:
        total_batches = max(sum(tally.batches), 1)
        every = self.config.eval_every_epochs
        score = self._evaluate(epoch) if every and (epoch + 1) % every == 0 else None
        return EpochRecord(
            epoch=epoch,
            avg_loss=sum(tally.loss_sum) / total_batches,  # work-weighted: per batch, all ranks
            eval=score,
            epoch_ms=(time.perf_counter() - tally.started) * 1000.0,
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
        known = [(ms, rank) for rank, ms in enumerate(self.elche.smoothed_ms())
                 if ms is not None and rank in self.alive]
        return min(known)[1] if known else min(self.alive)

    def _evaluate(self, epoch: int) -> Optional[float]:
        rank = self._callback_rank()
        center = self.averager.center if self.mode is Mode.cpu_async else None
        if center is not None:  # under EASGD, eval scores the center, not a replica
            self._send(rank, Evaluate(epoch, dtype_names(center)), [as_frame(p) for p in center])
        else:
            self._send(rank, Evaluate(epoch))
        result = self._next(expect=Evaluated)
        while result is None or result.rank not in self.alive:
            if rank not in self.alive:  # the callback rank died: ask another
                return self._evaluate(epoch)
            result = self._next(expect=Evaluated)
        return None if result.score != result.score else result.score  # NaN: no eval set

    # ---- messaging --------------------------------------------------------------------------

    def _send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        order = message.train if isinstance(message, Update) else message
        if isinstance(order, Train) and order.slices:
            self._since_reduce.setdefault(rank, []).append((order.epoch, list(order.slices)))
        self.channel.send(message, payloads, identity=self.identities[rank])

    def _next(self, expect: type | tuple) -> Optional[Message]:
        """The next message of type `expect`, or None when a rank died meanwhile (callers then
        re-check what they wait for); heartbeats and failures are handled on the way.
        Other orders' answers (e.g. WindowDone while waiting for Evaluated in cpu_async) are
        kept, in order, for the call that expects them."""
        if self._absorb_deaths():
            return None
        for i, waiting in enumerate(self._deferred):
            if getattr(waiting.message, "rank", None) not in self.alive and \
                    not isinstance(waiting.message, RankJoined):
                continue
            if isinstance(waiting.message, expect):
                del self._deferred[i]
                self._payloads = waiting.payloads
                return waiting.message
        while True:
            if self._failure is not None:
                raise self._failure
            if self._stop.is_set() and time.monotonic() > self._stop_deadline:
                raise RunAborted("interrupted", f"{self._stop_reason or 'stopped'} (no reduce "
                                                f"boundary within {STOP_GRACE_S:.0f}s: not saved)")
            received = self.channel.recv(timeout_ms=POLL_MS)
            if received is None:
                self._check_heartbeats()
                if self._absorb_deaths():
                    return None  # membership changed: the caller re-plans what it waits for
                continue
            message = received.message
            rank = getattr(message, "rank", None)
            if rank is not None and rank not in self.alive:
                continue  # a rank declared dead does not speak for the run any more
            if rank is not None:
                self.last_seen[rank] = time.monotonic()
            if isinstance(message, WindowDone):
                self._data.add(message)  # each WindowDone passes here once, deferred or not
            if isinstance(message, RankJoined):
                self.identities[message.rank] = received.identity
                self.joined[message.rank] = message
            elif isinstance(message, RankFailed):
                self.report_death(message.rank, f"failed: {message.error}")
                self._absorb_deaths()
                return None
            if isinstance(message, expect):
                self._payloads = received.payloads
                return message
            if isinstance(message, (WindowDone, SnapshotTaken, Evaluated, Reduced, ReduceFailed,
                                    CheckpointSaved, Regrouped)):
                self._deferred.append(received)
            elif not isinstance(message, (Heartbeat, RankJoined)):
                raise RunAborted("failed", f"unexpected {type(message).__name__} from rank {rank}")

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
        self.summary.wall_s = wall_s
        self.summary.syncs = len(self._sync_ms)
        self.summary.avg_sync_ms = sum(self._sync_ms) / len(self._sync_ms) if self._sync_ms else 0.0
        if self.plan is not None:
            self.summary.phase = self.plan.phase.name.lower()
        self.summary.samples_per_s = self._samples_per_s()
        if self._train_started is not None:
            train_ms = (time.perf_counter() - self._train_started) * 1000.0
            self.summary.idle_fraction = [max(0.0, 1.0 - ms / train_ms) for ms in self._compute_ms]

    def _samples_per_s(self) -> float:
        """Samples trained per second of epoch time (eval callbacks included, startup not)."""
        trained = sum(self._span(e.epoch).size for e in self.summary.epochs) if self.num_samples else 0
        train_s = sum(e.epoch_ms for e in self.summary.epochs) / 1000.0
        return trained / train_s if train_s > 0 else 0.0
