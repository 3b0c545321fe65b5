"""The coordinator: the control plane of a distributed run.

Owns the control socket and the order of a run (ranks join, epochs train, the run finishes or
stops), and composes the parts that do the rest: the message pump, membership, the round book
and non-finite ledger, saving, epochs (records, evals, callbacks) and the part of the mode's
family that trains the epochs (control.modes picks it: exact steps, windows with a collective
or central round, async chunks). It never touches a device; ranks train and average.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional

import zmq

from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts import checkpoint
from flodl_run.contracts.recipe import Recipe, load_recipe
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import (
    Channel,
    Message,
    RankFailed,
    RankJoined,
    SnapshotTaken,
    Stop,
    bind_router,
)
from flodl_run.control.async_chunks import AsyncChunks
from flodl_run.control.central import CentralRound
from flodl_run.control.collective import CollectiveRound
from flodl_run.control.context import RunContext
from flodl_run.control.dispatch import Course, EpochPool
from flodl_run.control.epochs import Epochs
from flodl_run.control.exact import ExactSteps
from flodl_run.control.membership import Membership
from flodl_run.control.modes import (
    Family,
    WindowRules,
    averages_here,
    central_averager,
    divergence_every,
    family_of,
    forms_groups,
    seeds_center,
)
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.pump import Pump
from flodl_run.control.rounds import RoundBook
from flodl_run.control.runstate import RunAborted, ShutdownWithSave
from flodl_run.control.saving import Saving
from flodl_run.control.windows import Windows
from flodl_run.elche.balancer import ElChe
from flodl_run.hardware.hostinfo import merge_nodes
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Timeline

log = logging.getLogger(__name__)


class Losses:
    """What a death does beyond the membership: the summary records it, the launcher's
    `on_rank_dead` kills the process, the trainer takes its work back, ElChe forgets its speed.
    Given: the run context (summary, observer, holdings, balance); the `trainer` is set once
    the mode's part is built."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.trainer = None
        self.on_rank_dead: Optional[Callable[[int], None]] = None

    def lost(self, rank: int, reason: str) -> None:
        """A rank was declared dead: record it, kill it, give its work back and re-plan."""
        self.ctx.summary.dead_ranks.append(rank)
        self.ctx.observer.on_event("rank_lost", f"rank {rank} lost: {reason}")
        log.info("rank %d lost: %s", rank, reason)  # the terminal has it from the progress (rank_lost)
        if self.on_rank_dead is not None:
            self.on_rank_dead(rank)
        for epoch, slices in self.ctx.holdings.lose(rank):  # what it trained since its last fold
            self.trainer.give_back(epoch, slices)
        self.ctx.balance.forget_rank(rank)


class Coordinator:
    """Runs on a thread of the launcher; `run()` returns the Summary of the whole run.

    Owns the control socket, where a resume starts, and the order of a run (ranks join,
    epochs train, the run finishes or stops). It builds the run's `context` (config, the
    `pump` as its link to the ranks, observer, recorder, summary, and the shared facts:
    `stop`, `balance`, `holdings`) and its parts, each holding its own state and given by
    name the parts it asks of: `members` (membership), the round `book`, the non-finite
    `ledger`, `saving`, `epochs`, the `pump`, and `windows`: the part of the mode's family
    (control.modes picks it) that trains the epochs, with the reduce round it uses."""

    def __init__(self, config: ExperimentConfig, world_size: int, secret: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 observer: Optional[Observer] = None, shm_prefix: Optional[str] = None,
                 max_frame_bytes: int = -1, timeline: Optional[Timeline] = None):
        self.config, self.world_size = config, world_size
        self.timeline = timeline or Timeline()
        self.recorder = self.timeline.recorder  # the coordinator's own spans
        self.observer = observer or Observer()
        self._zmq = zmq.Context()  # its own: the handshake gate is one per context
        sock, self.address, self._gate = bind_router(self._zmq, bind_host, port, max_frame_bytes, secret)
        self.channel = Channel(sock, secret, admitted=self._gate.cap.admitted)
        self.summary = Summary(mode=config.elche.mode.value, outer=config.outer.kind.value,
                               world_size=world_size)
        self.averager = central_averager(config)
        self._start_epoch = 0
        self._resume_uncovered: List[List[int]] = []
        self._pending_events: List[tuple] = []
        self._train_started: Optional[float] = None
        recipe = None  # as the launcher imports it, for its callbacks (metrics_fn, eval_result_fn)
        if config.recipe is not None:
            recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform,
                                 config.recipe.loop)
        self.family = family_of(config, recipe)
        self._compose(shm_prefix, recipe)

    def _compose(self, shm_prefix: Optional[str], recipe: Optional[Recipe]) -> None:
        """Build the run's context, then the parts, each given by name the parts it asks of
        (docs/architecture.md has the table of who may call whom)."""
        self.context = ctx = RunContext(self.config, self.world_size, observer=self.observer,
                                        recorder=self.recorder, summary=self.summary)
        self.stop, self.balance, self.holdings = ctx.stop, ctx.balance, ctx.holdings
        self.losses = Losses(ctx)
        members = self.members = Membership(ctx, channel=self.channel, losses=self.losses,
                                            collective=forms_groups(self.config))
        book = self.book = RoundBook(ctx, members=members, divergence_every=divergence_every(self.config))
        self.averaging_here = averages_here(self.config)  # else the ranks average among themselves
        kept_here = self.averager if self.averaging_here else None
        self.saving = Saving(ctx, members=members, averager=kept_here, trajectory=book)
        ledger = self.ledger = NonfiniteLedger(ctx, members=members, book=book, bundles=self.saving)
        self.epochs = Epochs(ctx, recipe=recipe, members=members, averager=self.averager,
                             bundles=self.saving)
        self.central = CentralRound(ctx, members=members, averager=self.averager, book=book,
                                    ledger=ledger, shm_prefix=shm_prefix)
        self.windows = self.losses.trainer = self._BUILDERS[self.family](self)
        self.pump = ctx.link = Pump(ctx, channel=self.channel, members=members, ledger=ledger,
                                    timeline=self.timeline, cuts_windows=self.windows.cuts_windows)

    def _exact_steps(self) -> ExactSteps:
        return ExactSteps(self.context, members=self.members, book=self.book, ledger=self.ledger,
                          bundles=self.saving, epochs=self.epochs)

    def _collective_windows(self) -> Windows:
        self.rounds = CollectiveRound(self.context, members=self.members, book=self.book, ledger=self.ledger)
        return self._windows()

    def _central_windows(self) -> Windows:
        self.rounds = self.central
        return self._windows()

    def _windows(self) -> Windows:
        return Windows(self.context, members=self.members, rounds=self.rounds, bundles=self.saving,
                       epochs=self.epochs, rules=WindowRules.of(self.config))

    def _async_chunks(self) -> AsyncChunks:
        return AsyncChunks(self.context, members=self.members, central=self.central, epochs=self.epochs,
                           bundles=self.saving, deadline_windows=WindowRules.of(self.config).deadline_windows)

    _BUILDERS: Dict[Family, Callable[["Coordinator"], object]] = {
        Family.exact_steps: _exact_steps,
        Family.collective_windows: _collective_windows,
        Family.central_windows: _central_windows,
        Family.async_chunks: _async_chunks,
    }
    """The part of each mode family (control.modes.family_of picks the family)."""

    # ---- what the launcher and tests set ------------------------------------------------------

    @property
    def recipe(self) -> Optional[Recipe]:
        """The recipe whose callbacks run in this process (the epochs' part)."""
        return self.epochs.recipe

    @recipe.setter
    def recipe(self, recipe: Optional[Recipe]) -> None:
        self.epochs.recipe = recipe

    @property
    def mlflow_run_id(self) -> Optional[str]:
        """The tracked run, recorded in bundles so a resume can link to it."""
        return self.saving.run_id

    @mlflow_run_id.setter
    def mlflow_run_id(self, run_id: Optional[str]) -> None:
        self.saving.run_id = run_id

    @property
    def on_rank_dead(self) -> Optional[Callable[[int], None]]:
        """The launcher's kill of a rank declared dead."""
        return self.losses.on_rank_dead

    @on_rank_dead.setter
    def on_rank_dead(self, kill: Optional[Callable[[int], None]]) -> None:
        self.losses.on_rank_dead = kill

    # ---- thread-safe controls ---------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Cut the windows after the batch in hand, reduce what was trained and save
        (SIGINT/SIGTERM). A rank still in an eval STOP_GRACE_S after the ranks' last batch is
        let go (declared hung) and the others save; a second request stops at once without
        saving (a save under way gets until STOP_GRACE_S after the first)."""
        self.stop.request(reason)

    def report_failure(self, status: str, reason: str) -> None:
        """Something the run cannot survive (not a rank death): abort."""
        self.pump.failure = RunAborted(status, reason)

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
            if self.balance.elche is None:  # lost before training began: nothing to save
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
        seeded = not seeds_center(self.config)
        joined = self.pump.joined
        while len(joined) < self.world_size or not seeded:
            if time.monotonic() > deadline:
                raise RunAborted("failed", f"only {len(joined)} of {self.world_size} ranks joined")
            received = self.pump.next_with_frames(expect=(RankJoined, SnapshotTaken))
            if received is None:
                raise RunAborted("failed", self.members.failed_ranks(
                    f"a rank died before all {self.world_size} joined"))
            if isinstance(received.message, SnapshotTaken):  # cpu_async: rank 0's initial weights
                self.averager.seed_center(self.central.snapshot(received).params)
                seeded = True
        sizes = {j.num_samples for j in joined.values()}
        if len(sizes) != 1:
            raise RunAborted("failed", f"ranks see different train set sizes: {sorted(sizes)}")
        self.context.num_samples = sizes.pop()
        self.summary.devices = [joined[r].device_name for r in range(self.world_size)]
        nodes = merge_nodes(joined[r].node for r in range(self.world_size) if joined[r].node)
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
        self.book.resume(meta.global_step, meta.sync_round)
        span = self.context.epoch_span(meta.epoch)  # only now known: the train set's size came with the ranks
        for i, (pass_index, start, end) in enumerate(meta.coverage.uncovered):
            if pass_index != span.pass_index or start < span.start or end > span.end:
                raise RunAborted("failed", f"resume_from: coverage.uncovered.{i} "
                                           f"{[pass_index, start, end]} is not within epoch {meta.epoch} "
                                           f"(pass {span.pass_index}, samples {span.start}-{span.end}): "
                                           f"an edited or damaged bundle")

    def _reduce_ms(self) -> Optional[float]:
        """The slowest rank's view of one reduce timed before training (collective modes,
        unless the trainer's window boundary is no all-reduce: nccl_sync's exact path)."""
        timed = [j.reduce_ms for j in self.pump.joined.values() if j.reduce_ms is not None]
        if not timed or not self.windows.times_reduce:
            return None
        self._pending_events.append(("reduce_timed", f"one reduce before training: {max(timed):.1f} ms"))
        return max(timed)

    def epoch_batches(self, epoch: int) -> int:
        """The batches of batch_size the epoch's samples make."""
        return -(-self.context.epoch_span(epoch).size // self.config.batch_size)

    def _train_all_epochs(self) -> None:
        total = self.config.num_epochs * self.config.data.epoch_splits
        self.observer.on_start(total, self.epoch_batches(0), self.world_size)
        course = self._course(total)
        if self.config.resume_from:  # the resumed epoch's progress counts on from the bundle's
            before = course.batches_before[self._start_epoch] = self._batches_before()
            self.observer.on_resume(self._start_epoch, before)
        for kind, message in self._pending_events:  # noted while the ranks joined: after the start
            self.observer.on_event(kind, message)
        self._train_started = time.perf_counter()
        self.windows.train(course)
        self._stop_if_asked(total)
        self.epochs.final_eval(total)
        self._stop_if_asked(total)  # asked during the final eval: the run ends interrupted
        self.saving.save_bundle("checkpoint", total, [])

    def _course(self, total: int) -> Course:
        """The epochs to train from the resume point on: the whole epoch, or of a resumed
        mid-epoch bundle only what it left uncovered."""
        spans = [self.context.epoch_span(e) for e in range(total)]
        pools = [EpochPool(0, []) if e < self._start_epoch else EpochPool.whole(span)
                 for e, span in enumerate(spans)]
        if self._resume_uncovered and self._start_epoch < total:
            pools[self._start_epoch] = EpochPool(spans[self._start_epoch].pass_index,
                                                 [(s, e) for _, s, e in self._resume_uncovered])
        return Course(spans, pools, self._start_epoch, self._resume_uncovered)

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

    # ---- messaging --------------------------------------------------------------------------

    def _next(self, expect: type | tuple, deadline: Optional[float] = None,
              accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]:
        """The next message expected (see Pump.next)."""
        return self.pump.next(expect, deadline, accept)

    def _shutdown_with_save(self, reason: str, detail: str) -> None:
        """Save from a survivor (when any), then stop with status shutdown_with_save; with a
        save_path and nothing saved (nobody left, or the save failed) the run failed, and the
        message says what the save path still holds (it said shutdown_with_save and "no
        bundle", even with an earlier bundle there)."""
        stem, failed = None, ""
        if self.members.alive:
            try:
                stem = self.saving.save_bundle(reason, *self.windows.save_point())
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
        identities = self.pump.identities
        for rank in list(identities):
            self.members.stopped.add(rank)
            try:
                self.pump.send(rank, Stop(self.summary.status))
            except zmq.ZMQError:
                pass
        self.timeline.await_final(self.channel, sorted(self.members.alive & set(identities)))
        self._close_socket()
        summary = self.summary
        summary.wall_s = wall_s
        sync_ms = self.book.sync_ms
        summary.syncs = len(sync_ms)
        summary.avg_sync_ms = sum(sync_ms) / len(sync_ms) if sync_ms else 0.0
        if self.balance.plan is not None:
            summary.phase = self.balance.plan.phase.name.lower()
        summary.samples_per_s = samples_per_s(summary, self.context)
        if self.averaging_here:
            summary.param_transport = self.central.param_transport()
        if self._train_started is not None:
            train_ms = (time.perf_counter() - self._train_started) * 1000.0
            summary.idle_fraction = [max(0.0, 1.0 - ms / train_ms) for ms in self.epochs.compute_ms]

    def _close_socket(self) -> None:
        """Close the control plane now (the Stop orders still go out, within LINGER), not when
        the garbage collector finds the context: nobody joins or speaks to a finished run. A
        flood of connections without the secret: the run went on; say what it turned away."""
        self.channel.socket.close(linger=1000)
        self._gate.stop()
        self._zmq.term()
        cap = self._gate.cap
        if cap.shut_down:
            self.observer.on_event("connection_flood", (
                f"the control plane closed {cap.shut_down} connections that had not passed the "
                f"handshake (up to {cap.most_pending} at once, at most {cap.max_pending} kept)"))


def samples_per_s(summary: Summary, ctx: RunContext) -> float:
    """Samples trained per second of epoch time (eval callbacks included, startup not)."""
    trained = sum(ctx.epoch_span(e.epoch).size for e in summary.epochs) if ctx.num_samples else 0
    train_s = sum(e.epoch_ms for e in summary.epochs) / 1000.0
    return trained / train_s if train_s > 0 else 0.0
