"""One rank's run: one replica on one device, following the coordinator's orders.

RankRunner handles every order that arrived (a table from order type to handler), then hands
the recipe's loop one batch of its queued windows, batch by batch, until the coordinator's
Stop; it reports facts (WindowDone, Reduced, SnapshotTaken, Evaluated, CheckpointSaved) and
decides nothing about cadence. What the modes do differently is its mode part's, picked once
by rank.modes; the replica, the data, the bundle and the side channels are its own.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

import torch
import zmq

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.averaging.shm import PREFIX_ENV
from flodl_run.config.schema import ExperimentConfig, TrackingKind, WindowEnd, lr_factor
from flodl_run.config.validate import batch_size_warning
from flodl_run.contracts import scalars
from flodl_run.contracts.recipe import CallbackFailed, load_recipe
from flodl_run.contracts.wire import (
    Channel,
    CheckpointSaved,
    CutWindow,
    Evaluate,
    Evaluated,
    RankFailed,
    RankJoined,
    Reduced,
    Regroup,
    SaveCheckpoint,
    Stop,
    SyncNow,
    Train,
    Update,
    WindowDone,
    connect_dealer,
)
from flodl_run.data.dataplane import DataPlane
from flodl_run.hardware.devices import cpu_training_warning
from flodl_run.hardware.hostinfo import node_facts
from flodl_run.hardware.slowdown import slowdown_for
from flodl_run.observe.timeline import RankTimeline
from flodl_run.rank.bundle import resume, swapped_in, write_share
from flodl_run.rank.busy import BusySampler
from flodl_run.rank.channels import HeartbeatThread
from flodl_run.rank.compiled import graph_counts
from flodl_run.rank.env import RankEnv, pick_device
from flodl_run.rank.exact import micro_plan
from flodl_run.rank.group import RankGroup
from flodl_run.rank.jobs import BatchCutter, Job, Waits, deadline_s
from flodl_run.rank.modes import rank_mode
from flodl_run.rank.nodesample import node_sampler
from flodl_run.rank.part import RankParts
from flodl_run.rank.replica import Replica
from flodl_run.rank.worker import Loss, Worker, run_loop


class RankRunner:
    """Follows orders: Train, SyncNow, Update, Evaluate, SaveCheckpoint, Regroup, CutWindow,
    Stop. `part` is the mode's (rank.part.RankMode)."""

    def __init__(self, env: RankEnv, config: ExperimentConfig):
        self.env, self.config = env, config
        tracking = config.tracking
        # built first: its collectors import MLflow on a thread while the recipe and data load
        self._node_sample = node_sampler(os.environ, env.local_rank, tracking.system_metrics
                                         and tracking.kind is not TrackingKind.off,
                                         tracking.system_metrics_interval_s)
        self.device = pick_device(env)
        if self.device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        self.recipe = load_recipe(config)
        self._build_replica()
        self._build_data()
        self.slowdown = slowdown_for(config.cluster.emulate_slowdown,
                                     config.cluster.emulate_jitter, env.rank, config.seed)
        self.group = RankGroup(env.rank, self.device, max(5.0, 2 * config.heartbeat_timeout_secs),
                               config.cluster.backend.value)
        self.jobs: Deque[Job] = deque()
        self._steps_since_reduce = 0
        self._reduces_seen = 0
        self._batches_total = 0
        self._training = False  # inside the train loop (not idle, not serving an order)
        self._reported: Optional[Loss] = None  # what the loop reported for the batch in hand
        self._stopped = False  # the coordinator's Stop arrived: the batches have ended
        self._cut = False  # the run is stopping (CutWindow): every window ends after a batch
        self._heartbeat: Optional[HeartbeatThread] = None
        self.waits = Waits(os.environ.get("FLODL_RUN_WAITS") == "1")
        part = rank_mode(config.elche, own_loop=self.recipe.loop is not None)
        if config.resume_from:
            resume(config.resume_from, env.rank, self.replica, self.outer, part.holds_outer_state,
                   self.device)
        self.timeline = RankTimeline(env.rank, config.timeline, f"{socket.gethostname()} {self.device}",
                                     self.device.index if self.device.type == "cuda" else None,
                                     aligns=config.elche.window_end is WindowEnd.deadline)
        self.recorder = self.timeline.recorder
        self.ctx = zmq.Context()
        sock = connect_dealer(self.ctx, env.coord, env.secret, linger_ms=1000)
        self.channel = Channel(sock, env.secret)
        self.part = part(RankParts(
            env=env, ctx=self.ctx, channel=self.channel, replica=self.replica, flat=self.flat,
            outer=self.outer, group=self.group, recorder=self.recorder, slowdown=self.slowdown,
            elche=config.elche, find_unused_parameters=config.recipe.find_unused_parameters,
            optimize_ddp=config.recipe.optimize_ddp,
            shm_prefix=os.environ.get(PREFIX_ENV)))
        self._handlers: Dict[type, Callable[[Any, List[memoryview]], None]] = {
            Train: self._train, SyncNow: self._reduce, Update: self._apply_update,
            Evaluate: self._evaluate, SaveCheckpoint: self._save, Regroup: self._regroup,
            CutWindow: self._cut_windows}

    def _build_replica(self) -> None:
        """The model replica on this rank's device, its flat view and the outer optimizer."""
        config = self.config
        self.replica = Replica(self.recipe, self.device, config.seed,
                               lr_scale=lr_factor(self.env.world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm, options=config.recipe)
        self.flat = FlatParams(self.replica.model)
        warning = cpu_training_warning(config.recipe.module, self.flat.num_params) \
            if self.env.rank == 0 and self.device.type == "cpu" else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.outer = OuterOptimizer(config.outer)

    def _build_data(self) -> None:
        """The training data on this rank's device, the cutter of orders into batches, and the
        recipe's eval data."""
        config, rank = self.config, self.env.rank
        self.source = DataPlane(self.recipe.call("train_dataset"), self.device, config,
                                self.recipe.transform, rank=rank)
        self.cutter = BatchCutter(len(self.source), config.data.augment, config.seed, config.batch_size)
        warning = batch_size_warning(len(self.source), config, self.env.world_size) if rank == 0 else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        self.part.join()  # the coordinator-averaged modes need no process group (and no NCCL)
        heartbeat = self._start_heartbeat()
        reduce_ms = self.part.start()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.channel.send(RankJoined(self.env.rank, self.env.world_size, os.getpid(),
                                     socket.gethostname(), str(self.device), name,
                                     len(self.source), node_facts(self.device.type == "cuda"),
                                     reduce_ms=reduce_ms))
        self.part.joined()
        try:
            self._run_loop()
        finally:
            heartbeat.stopped.set()
            self.part.stop()
        return 0

    def close(self) -> None:
        """Deliver what is still queued for the coordinator (the main channel lingers up to
        1 s: a rank's last facts and its failure report), then free every socket of the rank,
        the side channels' once their threads have seen the stop. What the rank sent is then
        delivered however the process exits, a forked rank's skipped teardown included."""
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            self._heartbeat.join(timeout=2.0)
        self.part.close()
        self.ctx.destroy()  # each socket closes with its own linger

    def _start_heartbeat(self) -> HeartbeatThread:
        """The heartbeat, with the device's busy share and, on the lowest rank of a node the
        launcher does not run on, the node's system metrics (both only with system_metrics on)."""
        tracking = self.config.tracking
        busy = BusySampler(self.device, torch.get_num_threads()).sample \
            if tracking.system_metrics else (lambda: None)
        heartbeat = HeartbeatThread(self.ctx, self.env, lambda: (self._batches_total, self._training),
                                    self.timeline.on_beat, busy, self._node_sample)
        heartbeat.start()
        self._heartbeat = heartbeat
        return heartbeat

    def _regroup(self, order: Regroup, payloads: List[memoryview]) -> None:
        if self.env.rank not in order.members:
            raise SystemExit(f"rank {self.env.rank}: declared dead by the coordinator; exiting")
        self.jobs, regrouped = self.part.regroup(order, self.jobs)
        self.channel.send(regrouped)

    def _hang(self) -> None:
        """An injected hang (FLODL_RUN_FAULT `hang`): no more batches and no more heartbeats, and
        no exit, as a rank stuck for good looks to the coordinator. The heartbeat thread still
        ends the process if the launcher dies; the launcher kills a rank declared dead."""
        print(f"rank {self.env.rank}: hanging (injected fault)", file=sys.stderr, flush=True)
        if self._heartbeat is not None:
            self._heartbeat.silence()
        threading.Event().wait()

    # ---- orders ----------------------------------------------------------------------------

    def _run_loop(self) -> None:
        """The recipe's loop (or the built-in one) over this rank's batches, to the Stop."""
        worker = Worker(self.replica, self._serve, self._report, self.env.rank, self.env.world_size,
                        step=self.part.worker_step())
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
                throttled = bool(self.jobs) and not self.part.awaiting_update  # the overshoot cap
            received = self.channel.recv(timeout_ms=0 if can_train else 1000)
            self._training = received is None and self._can_train()  # what heartbeats report
            if received is None:
                if self._can_train():
                    yield from self._train_one()
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
            handler = self._handlers.get(type(received.message))  # others are not orders: ignored
            if handler is not None:
                handler(received.message, received.payloads)
            self.waits.handled(received.message, began)
            self.timeline.order_span(received.message, began_ns)

    def _cut_windows(self, order: CutWindow, payloads: List[memoryview]) -> None:
        """The run is stopping: the window in hand ends now if a batch of it was trained (orders
        are read between batches, so the batch in hand is done), else after its first batch;
        every later window ends after its first. Unless the mode's windows are not cut (exact
        steps: the coordinator sends no cut on that path)."""
        self._cut = self.part.cuts_windows
        if self._cut and self.jobs and self.jobs[0].done:
            self._window_done(self.jobs.popleft())

    # ---- training --------------------------------------------------------------------------

    def _train(self, order: Train, payloads: List[memoryview]) -> None:
        self.part.train_ordered(order)
        self.jobs.append(self._job(order))

    def _job(self, order: Train) -> Job:
        """The order's batches: whole batches, or an exact window's micro-batches."""
        if not order.shares:
            return Job(order, self.cutter.cut(order),
                       deadline_s=deadline_s(order, self.timeline.clock.estimate()))
        limit = self.config.elche.micro_batch_size or self.config.batch_size
        micro = micro_plan(order.shares, order.totals, limit)
        return Job(order, self.cutter.cut_sizes(order, [m.samples for m in micro]), micro=micro)

    def _can_train(self) -> bool:
        """Work queued, and the mode lets its next batch train (no update awaited, within the
        async overshoot, not an order sent ahead of a reduce that has not completed here)."""
        return bool(self.jobs) and self.part.may_train(self.jobs[0])

    def _train_one(self) -> Iterator[Any]:
        """Hand the loop the next batch of the window; once it comes back for another, the batch
        was trained: account for it (and end the window after its last batch)."""
        job = self.jobs[0]
        indices = job.batches[job.done]
        began, began_ns = time.perf_counter(), self.recorder.now()
        if job.began is None:
            job.began = began
        batch = self.source.gather(indices, self.jobs)
        data_ns = self.recorder.now()
        self._reported = None
        self.part.before_batch(job)
        yield batch
        failed = self.part.batch_failed(job)
        if failed is not None:  # the rest of the window is dropped: its steps are re-planned
            self.jobs.popleft()
            self.channel.send(failed)
            self._reported = None
            return
        loss, self._reported = self._reported, None
        if loss is not None and len(indices):  # read at window end; an empty batch's mean is NaN
            job.loss_sum = loss if job.loss_sum is None else job.loss_sum + loss
            job.loss_batches += 1
        # a deadline window reads the clock after every batch, so each waits for the device
        timed = (job.done == 0 and self.part.times_fill) or job.done + 1 == len(job.batches) \
            or bool(job.order.deadline_ms)
        self._settle_step(began, timed=timed, emulate=self.part.emulates_slowdown)
        job.step_ms.append((time.perf_counter() - began) * 1000.0)
        self.recorder.batch(began_ns, data_ns, self._batches_total)
        job.done += 1
        job.samples += len(indices)
        self._steps_since_reduce += 1
        self._batches_total += 1
        self.env.faults.after_batch(self.env.rank, self._batches_total, self._hang)
        self.part.after_batch()
        if job.is_over(time.perf_counter()) or self._cut:
            self.jobs.popleft()
            self._window_done(job)

    def _settle_step(self, began: float, timed: bool, emulate: bool = True) -> None:
        """Wait for the device only where a clock reading needs it: the first batch of a window
        (its fill cost, where the mode has one), the last (the window's compute time) and every
        batch of an emulated slower rank (its sleep is a multiple of the step time). In between
        the host queues batches ahead of the GPU, so a step's host time is its launch cost and
        the wait at the window's end carries the rest: the window's total stays exact. An exact step emulates
        its slowdown itself, before its gradient goes out (`emulate` False)."""
        if self.device.type == "cuda" and (timed or (emulate and self.slowdown.active)):
            torch.cuda.synchronize(self.device)
        if emulate:
            self.slowdown.after_step(began)

    def _window_done(self, job: Job) -> None:
        order = job.order
        self.recorder.instant("window_end", order.window)
        self.waits.sent("WindowDone")
        counts = self.part.window_counts(job)
        graphs, eager_frames = graph_counts()
        self.channel.send(WindowDone(
            self.env.rank, order.window, order.epoch, counts.steps, job.samples, counts.compute_ms,
            counts.fill_ms, _read(job.loss_sum), self.replica.lr,
            scalars.drain(), reduces_seen=self._reduces_seen, device_bytes=_device_bytes(self.device),
            skipped=counts.skipped, window_wall_ms=sum(job.step_ms),
            graphs=graphs, eager_frames=eager_frames,
            left=job.left, loss_batches=job.loss_batches,
            began_ns=job.began_ns(self.timeline.clock.estimate()), **self.source.take_stats()))
        self.part.window_ended()
        if order.then_sync is not None:  # the coordinator folded the SyncNow into the order
            self._reduce(order.then_sync, [])

    # ---- reduces ---------------------------------------------------------------------------

    def _reduce(self, order: SyncNow, payloads: List[memoryview]) -> None:
        self._training = False  # waiting on peers in a reduce is not a hang of ours
        self._reduces_seen += 1
        self.replica.rescale_lr(order.lr_factor)
        fact, self._steps_since_reduce = self.part.reduce(order, self._steps_since_reduce)
        if isinstance(fact, Reduced):
            self.waits.sent("Reduced")
        if fact is not None:
            self.channel.send(fact)

    def _apply_update(self, update: Update, payloads: List[memoryview]) -> None:
        """The coordinator's parameters in (the mode's); a Train order folded into the update
        is queued."""
        train = self.part.apply_update(update, payloads)
        if train is not None:
            self.jobs.append(self._job(train))

    # ---- evaluation and checkpoints --------------------------------------------------------

    def _evaluate(self, order: Evaluate, payloads: List[memoryview]) -> None:
        """Score the consensus (this replica after a reduce) or the parameters sent along, then
        run the recipe's epoch_fn on the same parameters when told to. A callback that raises
        is reported (RankFailed naming it) instead of the score."""
        score = float("nan")
        try:
            with swapped_in(self.flat, payloads, order.dtypes):
                if order.score and self.eval_data is not None:
                    score = self.replica.evaluate(self.eval_data)
                if order.epoch_fn:
                    self.recipe.run_callback("epoch_fn", order.epoch, self.replica.model)
        except CallbackFailed as failure:
            self._callback_failed(failure)
            return
        self.channel.send(Evaluated(self.env.rank, order.epoch, score))

    def _save(self, order: SaveCheckpoint, payloads: List[memoryview]) -> None:
        """This rank's share of the bundle, then the recipe's checkpoint_fn on what was just
        saved (the center under EASGD); CheckpointSaved carries a write error, if any."""
        error, written, disk = write_share(order, payloads, self.env.rank, self.replica, self.flat,
                                           self.outer, self.part.holds_outer_state)
        if not error and order.write_model and order.epoch is not None:
            try:
                with swapped_in(self.flat, payloads, order.dtypes):
                    self.recipe.run_callback("checkpoint_fn", order.epoch, self.replica.model)
            except CallbackFailed as failure:
                self._callback_failed(failure)
                return
        self.channel.send(CheckpointSaved(self.env.rank, order.stem, error, written, disk))

    def _callback_failed(self, failure: CallbackFailed) -> None:
        """Print the user's exception once (this rank's log and the launcher's terminal) and
        tell the coordinator, which fails the run with a save; this rank lives on to save."""
        print(f"rank {self.env.rank}: {failure.describe()}", file=sys.stderr, end="", flush=True)
        self.channel.send(RankFailed(self.env.rank, failure.error, callback=failure.name))


def _read(total: Optional[torch.Tensor]) -> float:
    return 0.0 if total is None else float(total)


def _device_bytes(device: torch.device) -> int:
    """What the caching allocator holds on the rank's GPU (its share of the device's memory, as
    the live dashboard shows it); 0 on CPU. A counter read: no sync, no CUDA call that waits."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0
