"""The coordinator: the control plane of a distributed run (DESIGN §2, §5, §8).

Owns the window loop: hands out data (equal split for sync, throughput-sized chunks for
cadence), opens the reduce gate, orders reduces, feeds ElChe, aggregates epochs in order and
runs the eval callback. It never touches a device; ranks do the training and the averaging.
"""

from __future__ import annotations

import json
import logging
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
from flodl_run.dispatch import EpochPool, EpochSpan, epoch_span, equal_split, window_samples
from flodl_run.elche import ElChe, Plan, ReduceReport
from flodl_run.observe import Observer
from flodl_run.outer import OuterOptimizer
from flodl_run.scalars import merge, roll_up
from flodl_run.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.wire import (
    Channel, CheckpointSaved, Evaluate, Evaluated, Heartbeat, Message, RankFailed, RankJoined,
    Reduced, SaveCheckpoint,
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
        """A rank process died (seen by the launcher): abort the run."""
        self._failure = RunAborted(status, reason)

    # ---- the run ----------------------------------------------------------------------------

    def run(self) -> Summary:
        started = time.perf_counter()
        try:
            self._await_ranks()
            self._train_all_epochs()
            self.summary.status = "completed"
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

    # ---- checkpoints ------------------------------------------------------------------------

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]:
        """The callback rank writes model and optimizer, the coordinator the rest (DESIGN §10).
        `epoch` is where a resume starts; `uncovered` what of it the weights do not include."""
        stem = self.config.save_path
        if not stem:
            return None
        writer = self._callback_rank()
        center = self.averager.center if self.mode is Mode.cpu_async else None
        for rank in range(self.world_size):
            if rank != writer:  # the others keep their own optimizer state (momentum differs)
                self._send(rank, SaveCheckpoint(stem, write_model=False))
        if center is not None:  # under EASGD the model of record is the center
            self._send(writer, SaveCheckpoint(stem, dtype_names(center)), [as_frame(p) for p in center])
        else:
            self._send(writer, SaveCheckpoint(stem))
        for _ in range(self.world_size):
            saved = self._next(expect=CheckpointSaved)
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
                          json.loads(json.dumps(dotted_items(self.config), default=str)))

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

        def plan_window() -> Dict[int, Train]:
            sizes = window_samples(pool.remaining, self.plan.batch_counts, self.config.batch_size)
            trains = {}
            for rank, size in enumerate(sizes):
                slices = pool.take(size)
                if slices:
                    trains[rank] = self._train_order(epoch, slices)
            return trains

        trains = plan_window()
        for rank, order in trains.items():
            self._send(rank, order)
        reduces = 0
        while trains:
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
        while any(part.remaining for part in parts):
            window = _WindowTally.empty(self.world_size)
            self._sync_window(epoch, parts, window, epoch_tally)
            self._reduce(window, epoch_tally, epoch)
            if self._stop.is_set():
                self._graceful_stop(epoch, [r for part in parts for r in part.uncovered()])

    def _sync_window(self, epoch: int, parts: List[EpochPool], window: _WindowTally,
                     epoch_tally: _EpochTally) -> None:
        in_flight: Dict[int, float] = {}  # rank -> when its batch was sent

        def give(rank: int) -> None:
            self._send(rank, self._train_order(epoch, parts[rank].take(self.config.batch_size)))
            in_flight[rank] = time.perf_counter()

        for rank in range(self.world_size):
            if parts[rank].remaining:
                give(rank)
        while in_flight:
            done = self._next(expect=WindowDone)
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
        while waiting:
            done = self._next(expect=WindowDone)
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
        for rank in range(self.world_size):
            self._send(rank, SyncNow(self._round, self._global_step))
        result = None
        if self.mode.is_collective:
            divergence = self._collect_reduced()
        else:
            result = self._central_round(window)
            divergence = result.divergence if result else 0.0
        sync_ms = (time.perf_counter() - began) * 1000.0
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

    def _collect_reduced(self) -> float:
        divergences: List[float] = []
        while len(divergences) < self.world_size:
            divergences.append(self._next(expect=Reduced).divergence)
        return max(divergences)

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
        snapshots: List[Snapshot] = []
        while len(snapshots) < self.world_size:
            snapshots.append(self._snapshot(self._next(expect=SnapshotTaken)))
            self.check_snapshot(snapshots[-1], window.batches[snapshots[-1].rank], allowance=0)
        snapshots.sort(key=lambda snap: snap.rank)
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
        for rank in range(self.world_size):
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
        )

    def _callback_rank(self) -> int:
        policy = self.config.epoch_callback_policy
        if policy.startswith("rank:"):
            return int(policy.split(":", 1)[1])
        known = [(ms, rank) for rank, ms in enumerate(self.elche.smoothed_ms()) if ms is not None]
        return min(known)[1] if known else 0

    def _evaluate(self, epoch: int) -> Optional[float]:
        rank = self._callback_rank()
        center = self.averager.center if self.mode is Mode.cpu_async else None
        if center is not None:  # under EASGD, eval scores the center, not a replica
            self._send(rank, Evaluate(epoch, dtype_names(center)), [as_frame(p) for p in center])
        else:
            self._send(rank, Evaluate(epoch))
        result = self._next(expect=Evaluated)
        return None if result.score != result.score else result.score  # NaN: no eval set

    # ---- messaging --------------------------------------------------------------------------

    def _send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        self.channel.send(message, payloads, identity=self.identities[rank])

    def _next(self, expect: type | tuple) -> Message:
        """The next message of type `expect`; heartbeats and failures are handled on the way.
        Other orders' answers (e.g. WindowDone while waiting for Evaluated in cpu_async) are
        kept, in order, for the call that expects them."""
        for i, waiting in enumerate(self._deferred):
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
                continue
            message = received.message
            rank = getattr(message, "rank", None)
            if rank is not None:
                self.last_seen[rank] = time.monotonic()
            if isinstance(message, RankJoined):
                self.identities[message.rank] = received.identity
                self.joined[message.rank] = message
            elif isinstance(message, RankFailed):
                raise RunAborted("failed", f"rank {message.rank} failed: {message.error}")
            if isinstance(message, expect):
                self._payloads = received.payloads
                return message
            if isinstance(message, (WindowDone, SnapshotTaken, Evaluated, Reduced, CheckpointSaved)):
                self._deferred.append(received)
            elif not isinstance(message, (Heartbeat, RankJoined)):
                raise RunAborted("failed", f"unexpected {type(message).__name__} from rank {rank}")

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout_secs
        for rank, seen in self.last_seen.items():
            if now - seen > timeout:
                raise RunAborted("failed", f"rank {rank} silent for {now - seen:.0f}s (heartbeat timeout)")

    def _finish(self, wall_s: float) -> None:
        for rank in list(self.identities):
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
