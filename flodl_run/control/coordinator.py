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
from typing import Callable, Optional

import zmq

from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts import checkpoint
from flodl_run.contracts.recipe import Recipe, load_recipe
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import Channel, ControlEndpoint, Message, RankFailed, Stop, bind_router
from flodl_run.control.async_chunks import AsyncChunks
from flodl_run.control.central import CentralRound
from flodl_run.control.collective import CollectiveRound
from flodl_run.control.context import RunContext
from flodl_run.control.dispatch import Course
from flodl_run.control.epochs import Epochs
from flodl_run.control.exact import ExactSteps
from flodl_run.control.joining import Joining
from flodl_run.control.membership import Membership
from flodl_run.control.modes import (
    Family,
    WindowRules,
    averages_here,
    central_averager,
    divergence_every,
    family_of,
    forms_groups,
)
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.pump import Pump
from flodl_run.control.rounds import RoundBook
from flodl_run.control.runstate import RunAborted, ShutdownWithSave
from flodl_run.control.saving import Saving
from flodl_run.control.windows import Windows
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Timeline

log = logging.getLogger(__name__)


class RankLosses:
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

    Owns the control socket and the order of a run (ranks join, epochs train, the run
    finishes or stops). It builds the run's `context` (config, the `pump` as its link to the
    ranks, observer, recorder, summary, and the shared facts: `stop`, `balance`, `holdings`)
    and its parts, each holding its own state and given by name the parts it asks of:
    `members` (membership, told of a death's consequences through `losses`), the round
    `book`, the non-finite `ledger`, `saving`, `epochs`, the `central` round, the `pump`,
    `joining` (the start and where a resume starts), and `windows`: the part of the mode's
    family (control.modes picks it) that trains the epochs."""

    def __init__(self, config: ExperimentConfig, world_size: int, secret: bytes,
                 endpoint: ControlEndpoint = ControlEndpoint(), observer: Optional[Observer] = None,
                 shm_prefix: Optional[str] = None, timeline: Optional[Timeline] = None):
        self.config, self.world_size = config, world_size
        self.timeline = timeline or Timeline()
        self.recorder = self.timeline.recorder  # the coordinator's own spans
        self.observer = observer or Observer()
        self._zmq = zmq.Context()  # its own: the handshake gate is one per context
        sock, self.address, self._gate = bind_router(self._zmq, endpoint.host, endpoint.port,
                                                       endpoint.max_frame_bytes, secret)
        self.channel = Channel(sock, secret, admitted=self._gate.cap.admitted)
        self.summary = Summary(mode=config.elche.mode.value, outer=config.outer.kind.value,
                               world_size=world_size)
        self.averager = central_averager(config.elche, config.outer)
        self._train_started: Optional[float] = None
        recipe = None  # as the launcher imports it, for its callbacks (metrics_fn, eval_result_fn)
        if config.recipe is not None:
            recipe = load_recipe(config)
        self.family = family_of(config.elche, recipe)
        self._compose(shm_prefix, recipe)

    def _compose(self, shm_prefix: Optional[str], recipe: Optional[Recipe]) -> None:
        """Build the run's context, then the parts, each given by name the parts it asks of
        (docs/architecture.md has the table of who may call whom)."""
        self.context = ctx = RunContext(self.config, self.world_size, observer=self.observer,
                                        recorder=self.recorder, summary=self.summary)
        self.stop, self.balance, self.holdings = ctx.stop, ctx.balance, ctx.holdings
        self.losses = RankLosses(ctx)
        mode = self.config.elche.mode
        collective, every = forms_groups(mode), divergence_every(mode)
        members = self.members = Membership(ctx, channel=self.channel, losses=self.losses,
                                            collective=collective)
        book = self.book = RoundBook(ctx, members=members, divergence_every=every)
        self.averaging_here = averages_here(mode)  # else the ranks average among themselves
        kept_here = self.averager if self.averaging_here else None
        self.saving = Saving(ctx, members=members, averager=kept_here, trajectory=book)
        ledger = self.ledger = NonfiniteLedger(ctx, members=members, book=book, bundles=self.saving)
        self.epochs = Epochs(ctx, recipe=recipe, members=members, averager=self.averager,
                             bundles=self.saving)
        self.central = CentralRound(ctx, members=members, averager=self.averager, book=book,
                                    ledger=ledger, shm_prefix=shm_prefix)
        self.windows = self.losses.trainer = self._trainer()
        self.pump = ctx.link = Pump(ctx, channel=self.channel, members=members, ledger=ledger,
                                    timeline=self.timeline, cuts_windows=self.windows.cuts_windows)
        self.joining = Joining(ctx, pump=self.pump, members=members, central=self.central,
                               saving=self.saving, book=book)

    def _trainer(self) -> object:
        """The part of the run's mode family (control.modes.family_of picked the family); the
        windows' reduce round is the collective or the central one."""
        ctx, members = self.context, self.members
        rules = WindowRules.of(self.config.elche, self.config.progressive_dispatch)
        if self.family is Family.collective_windows:
            self.rounds = CollectiveRound(ctx, members=members, book=self.book, ledger=self.ledger)
        else:
            self.rounds = self.central
        build = {
            Family.exact_steps: lambda: ExactSteps(ctx, members=members, book=self.book, ledger=self.ledger,
                                                   bundles=self.saving, epochs=self.epochs),
            Family.collective_windows: lambda: Windows(ctx, members=members, rounds=self.rounds,
                                                       bundles=self.saving, epochs=self.epochs, rules=rules),
            Family.async_chunks: lambda: AsyncChunks(ctx, members=members, central=self.central,
                                                     epochs=self.epochs, bundles=self.saving,
                                                     deadline_windows=rules.deadline_windows),
        }
        build[Family.central_windows] = build[Family.collective_windows]
        return build[self.family]()

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
            self.joining.await_ranks(self.windows.seeds_center, self.windows.times_reduce)
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

    def _train_all_epochs(self) -> None:
        total = self.config.num_epochs * self.config.data.epoch_splits
        self.observer.on_start(total, self.joining.epoch_batches(0), self.world_size)
        course = self.joining.course(total)
        if self.config.resume_from:  # the resumed epoch's progress counts on from the bundle's
            self.observer.on_resume(course.start, course.batches_before[course.start])
        for kind, message in self.joining.pending_events:  # noted while the ranks joined
            self.observer.on_event(kind, message)
        self._train_started = time.perf_counter()
        self.windows.train(course)
        self._stop_if_asked(total, course)
        self.epochs.final_eval(total)
        self._stop_if_asked(total, course)  # asked during the final eval: the run ends interrupted
        self.saving.save_bundle("checkpoint", total, [])

    def _stop_if_asked(self, epoch: int, course: Course) -> None:
        """A stop asked before `epoch` began (while the one before it closed, or at its last
        reduce): save with none of `epoch` trained (of a resumed one, what the bundle lacked)."""
        if self.stop.is_set():
            self.saving.graceful_stop(epoch, course.left_before(epoch))

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
                f"the control plane closed {cap.shut_down} connections that had sent nothing "
                f"(up to {cap.most_pending} at once, at most {cap.max_pending} kept)"))


def samples_per_s(summary: Summary, ctx: RunContext) -> float:
    """Samples trained per second of epoch time (eval callbacks included, startup not)."""
    trained = sum(ctx.epoch_span(e.epoch).size for e in summary.epochs) if ctx.num_samples else 0
    train_s = sum(e.epoch_ms for e in summary.epochs) / 1000.0
    return trained / train_s if train_s > 0 else 0.0
