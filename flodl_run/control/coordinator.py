"""The coordinator: the control plane of a distributed run.

Owns the control socket, the message pump and the order of a run (ranks join, epochs train,
the run finishes or stops), and composes the parts that do the rest: membership, windows
(sync/cadence dispatch), reduces, saving, epochs (records, evals, callbacks) and, in
cpu_async, the async loop. It never touches a device; ranks do the training and the averaging.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

import zmq

from flodl_run.averaging.central import CentralAverager
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import ExperimentConfig, Mode
from flodl_run.contracts import checkpoint
from flodl_run.contracts.recipe import CallbackFailed, Recipe, load_recipe
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import (
    Channel,
    CheckpointSaved,
    ClockPing,
    CutWindow,
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
    WindowFailed,
    bind_router,
)
from flodl_run.control.context import RunContext
from flodl_run.control.dispatch import EpochPool, EpochSpan, epoch_span
from flodl_run.control.epochs import Epochs
from flodl_run.control.exact import ExactWindows
from flodl_run.control.membership import Membership
from flodl_run.control.overlap import AsyncLoop
from flodl_run.control.reduces import Reduces
from flodl_run.control.runstate import (
    POLL_MS,
    RunAborted,
    ShutdownWithSave,
)
from flodl_run.control.saving import Saving
from flodl_run.control.windows import Windows
from flodl_run.elche.balancer import ElChe, Plan
from flodl_run.hardware.hostinfo import merge_nodes
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Timeline

log = logging.getLogger(__name__)


class Coordinator:
    """Runs on a thread of the launcher; `run()` returns the Summary of the whole run.

    Owns the control socket and the message pump (`_send`, `_next`: deferred answers, the
    frames of the last message), the ranks' identities and join reports, where a resume
    starts, and the order of a run. It builds the run's `context` (config, send/next/payloads,
    observer, recorder, summary, and the shared facts: `stop`, `balance`, `holdings`) and its
    parts, each holding its own state and given by name the parts it asks of: `members`
    (membership), `reduces`, `saving`, `epochs`, `windows`, and in cpu_async the `async_loop`.
    What it offers them itself is named in `control.context` (`Run`, `Group`): the regroup,
    which also drops the old group's answers from its pump, and the facts only it knows."""

    def __init__(self, config: ExperimentConfig, world_size: int, secret: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 observer: Optional[Observer] = None, shm_prefix: Optional[str] = None,
                 max_frame_bytes: int = -1, timeline: Optional[Timeline] = None):
        self.config, self.world_size = config, world_size
        self.timeline = timeline or Timeline()
        self.recorder = self.timeline.recorder  # the coordinator's own spans
        self.mode = config.elche.mode
        self.observer = observer or Observer()
        self._zmq = zmq.Context()  # its own: the handshake gate is one per context
        sock, self.address, self._gate = bind_router(self._zmq, bind_host, port, max_frame_bytes, secret)
        self.channel = Channel(sock, secret, admitted=self._gate.cap.admitted)
        self.identities: Dict[int, bytes] = {}
        self.joined: Dict[int, RankJoined] = {}
        self.num_samples = 0
        self.summary = Summary(mode=self.mode.value, outer=config.outer.kind.value,
                               world_size=world_size)
        self.averager = CentralAverager(OuterOptimizer(config.outer), config.elche.gamma,
                                        config.elche.easgd_alpha if self.mode is Mode.cpu_async else None)
        self._payloads: List[memoryview] = []
        self._deferred: List[Received] = []
        self._failure: Optional[RunAborted] = None
        self._pending_events: List[tuple] = []
        self.on_rank_dead: Optional[Callable[[int], None]] = None
        self._start_epoch = 0
        self._resume_uncovered: List[List[int]] = []
        self._train_started: Optional[float] = None
        self._windows_cut = False  # CutWindow went out (once, on a stop request)
        self.async_loop: Optional[AsyncLoop] = None
        recipe = None  # as the launcher imports it, for its callbacks (metrics_fn, eval_result_fn)
        if config.recipe is not None:
            recipe = load_recipe(config)
        self._compose(shm_prefix, recipe)

    def _compose(self, shm_prefix: Optional[str], recipe: Optional[Recipe]) -> None:
        """Build the run's context, then the parts, each given by name the parts it asks of
        (docs/architecture.md has the table of who may call whom)."""
        self.context = ctx = RunContext(
            self.config, self.world_size, send=self._send, next=self._next, payloads=self._frames,
            observer=self.observer, recorder=self.recorder, summary=self.summary)
        self.stop, self.balance, self.holdings = ctx.stop, ctx.balance, ctx.holdings
        self.members = Membership(ctx, channel=self.channel, on_lost=self._on_lost)
        self.reduces = Reduces(ctx, members=self.members, averager=self.averager,
                               shm_prefix=shm_prefix, run=self)
        self.saving = Saving(ctx, members=self.members, averager=self.averager,
                             trajectory=self.reduces)
        self.epochs = Epochs(ctx, recipe=recipe, members=self.members, averager=self.averager,
                             bundles=self.saving)
        self.windows = Windows(ctx, members=self.members, reduces=self.reduces, bundles=self.saving)
        if self.exact:
            self.windows.exact = ExactWindows(ctx, windows=self.windows, reduces=self.reduces, group=self)

    # ---- what the coordinator offers its parts (context.Run, context.Group) -------------------

    @property
    def alive(self):
        return self.members.alive

    @property
    def recipe(self) -> Optional[Recipe]:
        """The recipe whose callbacks run in this process (the epochs' part)."""
        return self.epochs.recipe

    @recipe.setter
    def recipe(self, recipe: Optional[Recipe]) -> None:
        self.epochs.recipe = recipe

    @property
    def elche(self) -> Optional[ElChe]:
        return self.balance.elche

    @property
    def plan(self) -> Optional[Plan]:
        return self.balance.plan

    @property
    def mlflow_run_id(self) -> Optional[str]:
        """The tracked run, recorded in bundles so a resume can link to it."""
        return self.saving.run_id

    @mlflow_run_id.setter
    def mlflow_run_id(self, run_id: Optional[str]) -> None:
        self.saving.run_id = run_id

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]:
        return self.saving.save_bundle(reason, epoch, uncovered)

    def fail_callback(self, failure: CallbackFailed, epoch: int, uncovered: List[List[int]]):
        return self.saving.fail_callback(failure, epoch, uncovered)

    @property
    def exact(self) -> bool:
        """nccl_sync's exact path: gradients averaged inside backward (a recipe with its own
        loop steps its optimizers itself, so it averages parameters; the ranks decide alike)."""
        has_loop = self.recipe is not None and self.recipe.loop is not None
        return self.config.elche.averages_gradients and not has_loop

    def regroup(self, source: int = -1) -> None:
        """Void the orders sent ahead (their batches back to the pool), rebuild the group, then
        drop the reduce answers that came before it. A survivor answers in order on its one
        channel, so whatever it sent before its Regrouped answered an attempt of the old group:
        a ReduceFailed of the round sent ahead, kept for later, would otherwise be taken as the
        answer to that round's attempt in the new group (a second regroup, and the retry of a
        round the survivors had completed). `source`: see Membership.regroup."""
        self.windows.cancel_ahead()
        self.members.regroup(source)
        self._deferred = [waiting for waiting in self._deferred
                          if not isinstance(waiting.message, (Reduced, ReduceFailed, WindowFailed))]

    def _on_lost(self, rank: int, reason: str) -> None:
        """A rank was declared dead: record it, kill it, give its work back and re-plan."""
        self.summary.dead_ranks.append(rank)
        self.observer.on_event("rank_lost", f"rank {rank} lost: {reason}")
        log.info("rank %d lost: %s", rank, reason)  # the terminal has it from the progress (rank_lost)
        if self.on_rank_dead is not None:
            self.on_rank_dead(rank)
        for epoch, slices in self.holdings.lose(rank):  # what it trained since its last fold
            if not self.windows.give_back(epoch, slices) and self.async_loop is not None:
                self.async_loop.give_back(epoch, slices)
        self.balance.forget_rank(rank)

    def uncovered_now(self) -> List[List[int]]:
        """What of the current epoch the survivors' weights may not include."""
        return self.windows.uncovered() + self.holdings.uncovered(self.windows.pool_epoch)

    # ---- thread-safe controls ---------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Cut the windows after the batch in hand, reduce what was trained and save
        (SIGINT/SIGTERM). A rank still in an eval STOP_GRACE_S after the ranks' last batch is
        let go (declared hung) and the others save; a second request stops at once without
        saving (a save under way gets until STOP_GRACE_S after the first)."""
        self.stop.request(reason)

    def report_failure(self, status: str, reason: str) -> None:
        """Something the run cannot survive (not a rank death): abort."""
        self._failure = RunAborted(status, reason)

    def report_death(self, rank: int, reason: str) -> None:
        """A rank process ended without being told to (seen by the launcher)."""
        self.members.report_death(rank, reason)

    def report_recipe_exit(self, rank: int, reason: str) -> None:
        """A rank process ended itself before it was told to: a recipe error, reported as the
        rank's failure (thread-safe, as report_death)."""
        self.members.note_raised(RankFailed(rank, reason))
        self.members.report_death(rank, f"failed: {reason}")

    def left_behind(self, where: str, waited_s: float) -> None:
        """The launcher stops waiting for this run's thread, stuck in `where` (a launcher-side
        callback, an output that blocks) `waited_s` past the instant a second stop signal
        ended the run: the summary says so (thread-safe: the thread is not getting anywhere).
        No observer is told: the thread may be stuck in one of them."""
        self.summary.status = "interrupted"
        self.summary.message = (f"{self.stop.reason} (stopped at once, leaving the coordinator stuck "
                                f"in {where} {waited_s:g}s past the stop: not saved)")

    def stopped(self, rank: int) -> bool:
        """The rank was sent Stop: its exit is clean, never a death."""
        return rank in self.members.stopped

    # ---- the run ----------------------------------------------------------------------------

    def run(self) -> Summary:
        started = time.perf_counter()
        try:
            self._await_ranks()
            self._train_all_epochs()
            self.summary.status = "completed"
            if self.members.raised:  # the survivors carried on; the outcome still says who failed
                self.summary.message = self.members.failed_ranks("")
        except ShutdownWithSave as exc:
            if self.elche is None:  # lost before training began: nothing to save
                self.summary.status, self.summary.message = "failed", self.members.failed_ranks(exc.detail)
            else:
                self._shutdown_with_save(exc.reason, exc.detail)
                if self.members.raised:  # the cohort shrank because ranks raised: a failure
                    self.summary.status = "failed"
                    self.summary.message = f"{self.members.failed_ranks('')}; {self.summary.message}"
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
                raise RunAborted("failed", self.members.failed_ranks(
                    f"a rank died before all {self.world_size} joined"))
            if isinstance(message, SnapshotTaken):  # cpu_async: rank 0's initial weights
                self.averager.seed_center(self.reduces.snapshot(message).params)
                seeded = True
        sizes = {j.num_samples for j in self.joined.values()}
        if len(sizes) != 1:
            raise RunAborted("failed", f"ranks see different train set sizes: {sorted(sizes)}")
        self.num_samples = sizes.pop()
        self.summary.devices = [self.joined[r].device_name for r in range(self.world_size)]
        nodes = merge_nodes(self.joined[r].node for r in range(self.world_size) if self.joined[r].node)
        self.summary.nodes = [node.record() for node in nodes]
        self.observer.on_nodes(nodes)
        self.balance.elche = ElChe(self.config.elche, self.world_size,
                                   epoch_batches=self.epoch_batches(0), reduce_ms=self._reduce_ms())
        if self.config.resume_from:
            self._restore(self.config.resume_from)
        self.balance.plan = self.balance.elche.plan()

    def _restore(self, stem: str) -> None:
        """Continue a bundle's trajectory: epoch, step, round, ElChe (no warm-up re-run)."""
        meta = self.saving.restore(stem, self.epoch_batches(0))
        self._start_epoch, self._resume_uncovered = meta.epoch, meta.coverage.uncovered
        self.reduces.resume(meta.global_step, meta.sync_round)
        span = self._span(meta.epoch)  # only now known: the train set's size came with the ranks
        for i, (pass_index, start, end) in enumerate(meta.coverage.uncovered):
            if pass_index != span.pass_index or start < span.start or end > span.end:
                raise RunAborted("failed", f"resume_from: coverage.uncovered.{i} "
                                           f"{[pass_index, start, end]} is not within epoch {meta.epoch} "
                                           f"(pass {span.pass_index}, samples {span.start}-{span.end}): "
                                           f"an edited or damaged bundle")

    def _reduce_ms(self) -> Optional[float]:
        """The slowest rank's view of one reduce timed before training (collective modes)."""
        timed = [j.reduce_ms for j in self.joined.values() if j.reduce_ms is not None]
        if not timed or self.exact:  # the exact path's window boundary is no all-reduce
            return None
        self._pending_events.append(("reduce_timed", f"one reduce before training: {max(timed):.1f} ms"))
        return max(timed)

    def epoch_batches(self, epoch: int) -> int:
        """The batches of batch_size the epoch's samples make."""
        return -(-self.epoch_samples(epoch) // self.config.batch_size)

    def epoch_samples(self, epoch: int) -> int:
        return self._span(epoch).size

    def _span(self, epoch: int) -> EpochSpan:
        data = self.config.data
        return epoch_span(epoch, self.num_samples, data.augment, data.epoch_splits)

    def _train_all_epochs(self) -> None:
        total = self.config.num_epochs * self.config.data.epoch_splits
        self.observer.on_start(total, self.epoch_batches(0), self.world_size)
        if self.config.resume_from:  # the resumed epoch's progress counts on from the bundle's
            before = self.windows.batches_before[self._start_epoch] = self._batches_before()
            self.observer.on_resume(self._start_epoch, before)
        for kind, message in self._pending_events:  # noted while the ranks joined: after the start
            self.observer.on_event(kind, message)
        self._train_started = time.perf_counter()
        if self.mode is Mode.cpu_async:
            self._run_async(total)
        else:
            for epoch in range(self._start_epoch, total):
                self._stop_if_asked(epoch)
                self.epochs.close(epoch, self.windows.run_epoch(epoch, self._epoch_pool(epoch)))
        self._stop_if_asked(total)
        self.epochs.final_eval(total)
        self._stop_if_asked(total)  # asked during the final eval: the run ends interrupted
        self.save_bundle("checkpoint", total, [])

    def _stop_if_asked(self, epoch: int) -> None:
        """A stop asked before `epoch` began (while the one before it closed, or at its last
        reduce): save with none of `epoch` trained (of a resumed one, what the bundle lacked)."""
        if self.stop.is_set():
            self.saving.graceful_stop(epoch, self._resume_uncovered if epoch == self._start_epoch else [])

    def _batches_before(self) -> int:
        """The batches of the resumed epoch the bundle holds (none when it resumes an epoch
        whole); the progress of that epoch counts on from them."""
        if not self._resume_uncovered:
            return 0
        size = self.config.batch_size
        left = sum(-(-(end - start) // size) for _, start, end in self._resume_uncovered)
        return max(0, self.epoch_batches(self._start_epoch) - left)

    def _run_async(self, total: int) -> None:
        """cpu_async: the async loop trains every epoch from the resume point on."""
        start = self._start_epoch
        self.async_loop = AsyncLoop(self.context, members=self.members, windows=self.windows,
                                    reduces=self.reduces, epochs=self.epochs, bundles=self.saving)
        self.async_loop.run([self._span(e) for e in range(total)],
                            [self._epoch_pool(e) if e >= start else EpochPool(0, []) for e in range(total)],
                            start)

    def _epoch_pool(self, epoch: int) -> EpochPool:
        """The whole epoch, or only what a resumed mid-epoch bundle left uncovered."""
        span = self._span(epoch)
        if epoch == self._start_epoch and self._resume_uncovered:
            return EpochPool(span.pass_index, [(s, e) for _, s, e in self._resume_uncovered])
        return EpochPool.whole(span)

    # ---- messaging --------------------------------------------------------------------------

    def _send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        order = message.train if isinstance(message, Update) else message
        if isinstance(order, Train) and order.slices:
            self.holdings.note(rank, order.epoch, order.slices)
        self.channel.send(message, payloads, identity=self.identities[rank])

    def _frames(self) -> List[memoryview]:
        """The frames that came with the message `_next` returned last."""
        return self._payloads

    def _next(self, expect: type | tuple, deadline: Optional[float] = None,
              accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]:
        """The next message of type `expect` (and, given `accept`, one it accepts), or None when
        a rank died meanwhile or the `deadline` (time.monotonic) passed (callers then re-check
        what they wait for); heartbeats and failures are handled on the way.
        Other orders' answers (e.g. WindowDone while waiting for Evaluated in cpu_async, or the
        answers to orders sent ahead) are kept, in order, for the call that expects them."""
        if self.members.absorb():
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
            if self.stop.check(self.members.any_in_batch()):
                self._unblock_stop()
            self._cut_windows()
            self.members.check_liveness()  # also while messages flow: a busy socket must not hide a hang
            if self.members.deaths_pending() and self.members.absorb():
                return None
            wait_ms = POLL_MS
            if deadline is not None:  # checked on every pass: a busy socket must not postpone it
                left_ms = (deadline - time.monotonic()) * 1000.0
                if left_ms <= 0:
                    return None
                wait_ms = max(1, min(POLL_MS, int(left_ms)))
            received = self.channel.recv(timeout_ms=wait_ms)
            if received is None:
                if self.members.absorb():
                    return None  # membership changed: the caller re-plans what it waits for
                continue
            message = received.message
            rank = getattr(message, "rank", None)
            if rank is not None and rank not in self.alive:
                if isinstance(message, RankFailed):  # why it died (its exit may be seen first)
                    self.members.note_raised(message)
                continue  # a rank declared dead does not speak for the run any more
            if rank is not None:
                self.members.heard(rank, time.monotonic(),
                                   message if isinstance(message, Heartbeat) else None)
            if isinstance(message, Heartbeat) and message.busy_percent is not None:
                self.observer.on_busy(message.rank, message.busy_percent)
            if isinstance(message, Heartbeat) and message.node_sample is not None:
                self.observer.on_node_sample(message.rank, message.node_sample)
            if isinstance(message, (ClockPing, TimelineEvents)):
                self.timeline.receive(message, received.identity, self.channel)
                continue
            if isinstance(message, WindowDone):
                self.epochs.data.add(message)  # each WindowDone passes here once, deferred or not
                self.observer.on_window(message.rank, message.samples, message.wall_ms,
                                        message.device_bytes)
                self.reduces.note_window(message)
                self._note_graphs(message)
            if isinstance(message, RankJoined):
                self.identities[message.rank] = received.identity
                self.joined[message.rank] = message
            elif isinstance(message, Listening):
                self.members.listeners[message.rank] = received.identity
            elif isinstance(message, RankFailed) and message.callback:  # the rank lives on
                raise CallbackFailed(message.callback, message.error, message.rank)
            elif isinstance(message, RankFailed):
                self.members.note_raised(message)
                self.report_death(message.rank, f"failed: {message.error}")
                self.members.absorb()
                return None
            if isinstance(message, expect) and (accept is None or accept(message)):
                self._payloads = received.payloads
                return message
            if isinstance(message, (WindowDone, WindowFailed, SnapshotTaken, Evaluated, Reduced,
                                    ReduceFailed, CheckpointSaved, Regrouped)):
                self._deferred.append(received)
            elif not isinstance(message, (Heartbeat, RankJoined, Listening)):
                raise RunAborted("failed", f"unexpected {type(message).__name__} from rank {rank}")

    def _unblock_stop(self) -> None:
        """The stop's grace ran out with no save under way: a rank the stop waits on in an
        eval (a recipe's eval or epoch_fn that hangs) is declared hung, and the others get a
        fresh grace to save what they hold; with nobody to let go, the run stops unsaved."""
        if not self.members.hang_orders_out("eval", f"past the stop's {self.stop.grace_s:g}s grace"):
            self.stop.give_up()
        self.stop.rearm()

    def _cut_windows(self) -> None:
        """A stop was asked for: every live rank ends its window after the batch in hand, so
        the reduce (and the save) come within a batch, not at the window's planned end. Not
        on nccl_sync's exact path: its steps are collective, and its windows short."""
        if self._windows_cut or not self.stop.is_set() or self.exact:
            return
        self._windows_cut = True
        for rank in sorted(self.alive & set(self.identities)):
            self._send(rank, CutWindow(self.stop.reason))

    def _shutdown_with_save(self, reason: str, detail: str) -> None:
        """Save from a survivor (when any), then stop with status shutdown_with_save; with a
        save_path and nothing saved (nobody left, or the save failed) the run failed, and the
        message says what the save path still holds (it said shutdown_with_save and "no
        bundle", even with an earlier bundle there)."""
        stem, failed = None, ""
        if self.alive:
            try:
                epoch, uncovered = (self.async_loop.save_point() if self.async_loop is not None
                                    else self.windows.resume_point(self.windows.pool_epoch,
                                                                   self.uncovered_now()))
                stem = self.save_bundle(reason, epoch, uncovered)
            except (RunAborted, zmq.ZMQError) as exc:
                failed = f"the save failed: {exc}"
        if stem is not None or not self.config.save_path:  # saved, or no bundle was asked for
            self.summary.status = "shutdown_with_save"
            self.summary.message = f"{reason}: {detail}; " + (f"bundle {stem}" if stem else "no save_path")
        else:
            held = failed or f"no rank left to save; {checkpoint.still_held(self.config.save_path)}"
            self.summary.status, self.summary.message = "failed", f"{reason}: {detail}; not saved: {held}"
        self.observer.on_event("shutdown", self.summary.message)

    def _finish(self, wall_s: float) -> None:
        for rank in list(self.identities):
            self.members.stopped.add(rank)
            try:
                self._send(rank, Stop(self.summary.status))
            except zmq.ZMQError:
                pass
        self.timeline.await_final(self.channel, sorted(self.alive & set(self.identities)))
        self._close_socket()
        self._report_flood()
        self.summary.wall_s = wall_s
        sync_ms = self.reduces.sync_ms
        self.summary.syncs = len(sync_ms)
        self.summary.avg_sync_ms = sum(sync_ms) / len(sync_ms) if sync_ms else 0.0
        if self.plan is not None:
            self.summary.phase = self.plan.phase.name.lower()
        self.summary.samples_per_s = self._samples_per_s()
        if not self.mode.is_collective:
            self.summary.param_transport = ["shm" if r in self.reduces.shm_ranks else "frames"
                                            for r in range(self.world_size)]
        if self._train_started is not None:
            train_ms = (time.perf_counter() - self._train_started) * 1000.0
            self.summary.idle_fraction = [max(0.0, 1.0 - ms / train_ms) for ms in self.epochs.compute_ms]

    def _note_graphs(self, done: WindowDone) -> None:
        """What torch.compile built on the rank so far (its counts only grow)."""
        if not done.graphs and not done.eager_frames:
            return
        summary = self.summary
        if not summary.compiled_graphs:
            summary.compiled_graphs = [0] * self.world_size
            summary.eager_frames = [0] * self.world_size
        summary.compiled_graphs[done.rank] = max(summary.compiled_graphs[done.rank], done.graphs)
        summary.eager_frames[done.rank] = max(summary.eager_frames[done.rank], done.eager_frames)

    def _close_socket(self) -> None:
        """Close the control plane now (the Stop orders still go out, within LINGER), not when
        the garbage collector finds the context: nobody joins or speaks to a finished run."""
        self.channel.socket.close(linger=1000)
        self._gate.stop()
        self._zmq.term()

    def _report_flood(self) -> None:
        """A flood of connections without the secret: the run went on; say what it turned away."""
        cap = self._gate.cap
        if cap.shut_down:
            self.observer.on_event("connection_flood", (
                f"the control plane closed {cap.shut_down} connections that had not passed the "
                f"handshake (up to {cap.most_pending} at once, at most {cap.max_pending} kept)"))

    def _samples_per_s(self) -> float:
        """Samples trained per second of epoch time (eval callbacks included, startup not)."""
        trained = sum(self._span(e.epoch).size for e in self.summary.epochs) if self.num_samples else 0
        train_s = sum(e.epoch_ms for e in self.summary.epochs) / 1000.0
        return trained / train_s if train_s > 0 else 0.0

