"""The rank's control loop: one replica on one device, following the coordinator's orders.

RankWorker handles every order that arrived, then hands the recipe's loop one batch of its
queued windows, batch by batch, until the coordinator's Stop; it reports facts (WindowDone,
Reduced, SnapshotTaken, Evaluated, CheckpointSaved) and decides nothing about cadence. The
group, the two kinds of reduce, the bundle and the side channels are collaborators it owns.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Deque, Iterator, List, Optional

import torch
import zmq

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.moments import FlatMoments
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.averaging.shm import PREFIX_ENV
from flodl_run.config.schema import ExperimentConfig, Mode, TrackingKind, WindowEnd, lr_factor
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
    Regrouped,
    SaveCheckpoint,
    Stop,
    SyncNow,
    Train,
    Update,
    WindowDone,
    WindowFailed,
    connect_dealer,
)
from flodl_run.data.dataplane import DataPlane
from flodl_run.hardware.devices import cpu_training_warning
from flodl_run.hardware.hostinfo import node_facts
from flodl_run.hardware.slowdown import slowdown_for
from flodl_run.observe.timeline import RankTimeline
from flodl_run.rank.bundle import resume, swapped_in, write_share
from flodl_run.rank.busy import BusySampler
from flodl_run.rank.channels import HeartbeatThread, ListenerThread
from flodl_run.rank.compiled import graph_counts
from flodl_run.rank.env import RankEnv, pick_device
from flodl_run.rank.exact import ExactSync, micro_plan
from flodl_run.rank.group import RankGroup, timed_reduce_ms
from flodl_run.rank.jobs import BatchCutter, Job, Waits, deadline_s, fill_ms
from flodl_run.rank.nodesample import node_sampler
from flodl_run.rank.reduce import CollectiveReduce, after_outer_step
from flodl_run.rank.replica import Replica
from flodl_run.rank.snapshot import SnapshotExchange
from flodl_run.rank.worker import Loss, Worker, run_loop


class RankWorker:
    """Follows orders: Train, SyncNow, Update, Evaluate, SaveCheckpoint, Regroup, CutWindow,
    Stop."""

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
        self.replica = Replica(self.recipe, self.device, config.seed,
                               lr_scale=lr_factor(env.world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm, options=config.recipe)
        self.flat = FlatParams(self.replica.model)
        warning = cpu_training_warning(config.recipe.module, self.flat.numel) \
            if env.rank == 0 and self.device.type == "cpu" else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.outer = OuterOptimizer(config.outer)
        self.source = DataPlane(self.recipe.call("train_dataset"), self.device, config,
                                self.recipe.transform, rank=env.rank)
        self.cutter = BatchCutter(len(self.source), config.data.augment, config.seed, config.batch_size)
        warning = batch_size_warning(len(self.source), config, env.world_size) if env.rank == 0 else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None
        self.slowdown = slowdown_for(config.cluster.emulate_slowdown,
                                     config.cluster.emulate_jitter, env.rank, config.seed)
        self.mode = config.elche.mode
        self.group = RankGroup(env.rank, self.device, max(5.0, 2 * config.heartbeat_timeout_secs),
                               config.cluster.backend.value)
        self.jobs: Deque[Job] = deque()
        self._steps_since_reduce = 0
        self._awaiting_update = False
        self._sync_pending = False  # cpu_async: window done, SyncNow not yet received
        self._overshoot_used = 0
        self._reduces_seen = 0
        self._batches_total = 0
        self._training = False  # inside the train loop (not idle, not serving an order)
        self._reported: Optional[Loss] = None  # what the loop reported for the batch in hand
        self._stopped = False  # the coordinator's Stop arrived: the batches have ended
        self._cut = False  # the run is stopping (CutWindow): every window ends after a batch
        self._reduced_round = 0  # the last round whose reduce completed here (orders sent ahead)
        self._heartbeat: Optional[HeartbeatThread] = None
        self._listener: Optional[ListenerThread] = None
        self.waits = Waits(os.environ.get("FLODL_RUN_WAITS") == "1")
        if config.resume_from:
            resume(config.resume_from, env.rank, self.replica, self.outer, self.mode.is_collective,
                   self.device)
        self.timeline = RankTimeline(env.rank, config.timeline, f"{socket.gethostname()} {self.device}",
                                     self.device.index if self.device.type == "cuda" else None,
                                     aligns=config.elche.window_end is WindowEnd.deadline)
        self.recorder = self.timeline.recorder
        # the exact path below steps one optimizer on the same gradient everywhere: nothing to average
        moments = FlatMoments(self.replica.model, self.replica.optimizer) \
            if config.elche.reduce_optimizer_state and not self._exact_path() else None
        self.collective = CollectiveReduce(env.rank, self.replica, self.flat, self.outer, self.group,
                                           self.recorder, config.elche.gamma,
                                           track_start=self.mode is Mode.nccl_cadence,
                                           moments=moments)
        self.ctx = zmq.Context()
        sock = connect_dealer(self.ctx, env.coord, env.secret, linger_ms=1000)
        self.channel = Channel(sock, env.secret)
        self.exchange = SnapshotExchange(env.rank, self.flat, self.channel, os.environ.get(PREFIX_ENV))
        # nccl_sync's exact path (gradients averaged inside backward); a recipe with its own
        # loop steps its optimizers itself, so it averages parameters instead
        self.exact = (ExactSync(self.replica, self.flat, self.group, self.slowdown,
                                config.recipe.find_unused_parameters)
                      if self._exact_path() else None)

    def _exact_path(self) -> bool:
        return self.config.elche.averages_gradients and self.recipe.loop is None

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        collective = self.mode.is_collective
        if collective:  # the coordinator backend needs no process group (and no NCCL)
            self.group.join(0, list(range(self.env.world_size)))
            if self.exact is not None:
                self.exact.rebuild()
        heartbeat = self._start_heartbeat()
        listener = ListenerThread(self.ctx, self.env, self.group.abort, self.group.watch)
        if collective:
            listener.start()
            self._listener = listener
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        # a cohort of one (a run started on one rank) has no group to time
        reduce_ms = timed_reduce_ms(self.flat.buffers) if collective and not self.group.alone else None
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
            self.exchange.close()
            self.group.leave()
        return 0

    def close(self) -> None:
        """Deliver what is still queued for the coordinator (the main channel lingers up to
        1 s: a rank's last facts and its failure report), then free every socket of the rank,
        the side channels' once their threads have seen the stop. What the rank sent is then
        delivered however the process exits, a forked rank's skipped teardown included."""
        for thread in (self._heartbeat, self._listener):
            if thread is not None:
                thread.stopped.set()
                thread.join(timeout=2.0)
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

    def _regroup(self, order: Regroup) -> None:
        if self.env.rank not in order.members:
            raise SystemExit(f"rank {self.env.rank}: declared dead by the coordinator; exiting")
        # orders sent ahead of a reduce that failed here are void (the coordinator redoes them);
        # so is what is left of an exact window (the coordinator re-plans its steps)
        self.jobs = deque(job for job in self.jobs if job.order.after_round <= self._reduced_round
                          and not job.micro)
        if self.exact is not None:
            self.exact.ddp = None  # its reducer holds the old group
        self.group.join(order.generation, order.members)
        if self.exact is not None:
            if order.source >= 0:
                self.exact.adopt_from(order.members.index(order.source))
            self.exact.rebuild()
        self.channel.send(Regrouped(self.env.rank, order.generation))

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
                        step=self.exact.step if self.exact is not None else None)
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
                self.collective.forget()  # (sent ahead: a failed round may still be, and undone)
            self.jobs.append(self._job(order))
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
        elif isinstance(order, CutWindow):
            self._cut_windows()

    def _cut_windows(self) -> None:
        """The run is stopping: the window in hand ends now if a batch of it was trained (orders
        are read between batches, so the batch in hand is done), else after its first batch;
        every later window ends after its first. An exact window is not cut: its steps are
        collective (the coordinator sends no cut on that path)."""
        self._cut = True
        if self.jobs and self.jobs[0].done and not self.jobs[0].micro:
            self._window_done(self.jobs.popleft())

    # ---- training --------------------------------------------------------------------------

    def _job(self, order: Train) -> Job:
        """The order's batches: whole batches, or an exact window's micro-batches."""
        if not order.shares:
            return Job(order, self.cutter.cut(order),
                       deadline_s=deadline_s(order, self.timeline.clock.estimate()))
        limit = self.config.elche.micro_batch_size or self.config.batch_size
        micro = micro_plan(order.shares, order.totals, limit)
        return Job(order, self.cutter.cut_sizes(order, [m.samples for m in micro]), micro=micro)

    def _can_train(self) -> bool:
        """Work queued, no update awaited (cpu_sync/cadence), within the async overshoot, and
        not an order sent ahead of a reduce that has not completed here (nccl_sync)."""
        if not self.jobs or self._awaiting_update or self.jobs[0].order.after_round > self._reduced_round:
            return False
        return not (self._sync_pending and self._overshoot_used >= self.jobs[0].order.overshoot)

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
        if job.micro:
            if job.done == 0:
                self.exact.reset_window()
            self.exact.begin(job.micro[job.done])
        yield batch
        if job.micro and self.exact.failed:
            self._window_failed(job)
            return
        loss, self._reported = self._reported, None
        if loss is not None and len(indices):  # read at window end; an empty batch's mean is NaN
            job.loss_sum = loss if job.loss_sum is None else job.loss_sum + loss
            job.loss_batches += 1
        # a deadline window reads the clock after every batch, so each waits for the device
        timed = job.done == 0 or job.done + 1 == len(job.batches) or bool(job.order.deadline_ms)
        self._settle_step(began, timed=timed, emulate=not job.micro)
        job.step_ms.append((time.perf_counter() - began) * 1000.0)
        self.recorder.batch(began_ns, data_ns, self._batches_total)
        job.done += 1
        job.samples += len(indices)
        self._steps_since_reduce += 1
        self._batches_total += 1
        self.env.faults.after_batch(self.env.rank, self._batches_total, self._hang)
        if self._sync_pending:
            self._overshoot_used += 1
        if job.is_over(time.perf_counter()) or (self._cut and not job.micro):
            self.jobs.popleft()
            self._window_done(job)

    def _settle_step(self, began: float, timed: bool, emulate: bool = True) -> None:
        """Wait for the device only where a clock reading needs it: the first batch of a window
        (its fill cost), the last (the window's compute time) and every batch of an emulated
        slower rank (its sleep is a multiple of the step time). In between the host queues
        batches ahead of the GPU, so a step's host time is its launch cost and the wait at the
        window's end carries the rest: the window's total stays exact. An exact step emulates
        its slowdown itself, before its gradient goes out (`emulate` False)."""
        if self.device.type == "cuda" and (timed or (emulate and self.slowdown.active)):
            torch.cuda.synchronize(self.device)
        if emulate:
            self.slowdown.after_step(began)

    def _window_failed(self, job: Job) -> None:
        """An exact window broke inside a step: say after how many steps, drop the rest of it
        and wait for the Regroup (its steps are re-planned among the survivors)."""
        self.jobs.popleft()
        self.channel.send(WindowFailed(self.env.rank, job.order.window, self.exact.steps,
                                       self.exact.failed))
        self._reported = None

    def _window_done(self, job: Job) -> None:
        order = job.order
        self.recorder.instant("window_end", order.window)
        self.waits.sent("WindowDone")
        exact = self.exact if job.micro else None
        graphs, eager_frames = graph_counts()
        self.channel.send(WindowDone(
            self.env.rank, order.window, order.epoch, exact.steps if exact else job.done, job.samples,
            _compute_ms(exact, job.step_ms),
            0.0 if exact else fill_ms(job.step_ms), _read(job.loss_sum), self.replica.lr,
            scalars.drain(), reduces_seen=self._reduces_seen, device_bytes=_device_bytes(self.device),
            skipped=exact.window_skipped() if exact else 0, window_wall_ms=sum(job.step_ms),
            graphs=graphs, eager_frames=eager_frames,
            left=job.left, loss_batches=job.loss_batches,
            began_ns=job.began_ns(self.timeline.clock.estimate()), **self.source.take_stats()))
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
        fact, self._steps_since_reduce = self.collective.run(order, self._steps_since_reduce)
        if isinstance(fact, Reduced):
            self._reduced_round = order.round
            self.waits.sent("Reduced")
        self.channel.send(fact)

    def _send_snapshot(self, round_: int, steps: Optional[int] = None) -> None:
        """Coordinator backend: the snapshot out; then wait for the update (cpu_sync,
        cpu_cadence) or keep training while the round trip is in flight (cpu_async)."""
        self.exchange.send(round_, self._steps_since_reduce if steps is None else steps)
        self._steps_since_reduce = 0
        if self.mode is Mode.cpu_async:
            self._sync_pending = False  # keep training while the round trip is in flight
        else:
            self._awaiting_update = True  # cpu_sync / cpu_cadence: block until the update lands

    def _apply_update(self, update: Update, payloads: List[memoryview]) -> None:
        """The coordinator's parameters in, then what they mean for the optimizer and schedule;
        a Train order folded into the update is queued."""
        self.exchange.apply_(update, payloads)
        if update.outer_stepped:
            after_outer_step(self.replica, self.config.outer)
        if update.reset:  # we were non-finite: so are the optimizer's moments
            self.replica.optimizer.state.clear()
        self.replica.seek_schedule(update.global_step)
        self._awaiting_update = False
        if update.train is not None:
            self.jobs.append(self._job(update.train))

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
                                           self.outer, self.mode.is_collective)
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


def _compute_ms(exact: Optional[ExactSync], step_ms: List[float]) -> float:
    """A window's compute: the exact step's own timing (waits at the all-reduce left out),
    else the steps' wall."""
    timed = exact.window_compute_ms() if exact is not None else None
    return timed if timed is not None else sum(step_ms)


def _read(total: Optional[torch.Tensor]) -> float:
    return 0.0 if total is None else float(total)


def _device_bytes(device: torch.device) -> int:
    """What the caching allocator holds on the rank's GPU (its share of the device's memory, as
    the live dashboard shows it); 0 on CPU. A counter read: no sync, no CUDA call that waits."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0
