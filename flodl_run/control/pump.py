"""The coordinator's message pump: the one link between the coordinator's parts and the ranks.

Owns the control channel's use on the coordinator (orders out to a rank's identity, messages
in), the ranks' identities and join reports, the answers kept for the call that expects them,
and what every message does on its way in (heartbeats, clock sync, window facts, failures),
dispatched through a table from message type to handler. It decides nothing about the run.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

from flodl_run.contracts.recipe import CallbackFailed
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
    TimelineEvents,
    Train,
    Update,
    WindowDone,
    WindowFailed,
)
from flodl_run.control.context import RunContext
from flodl_run.control.membership import Membership
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.runstate import POLL_MS, RunAborted
from flodl_run.observe.timeline import Timeline

KEPT = (WindowDone, WindowFailed, SnapshotTaken, Evaluated, Reduced, ReduceFailed, CheckpointSaved,
        Regrouped)
"""Answers to orders that nobody waits for yet: kept, in order, for the call that expects them."""
QUIET = (Heartbeat, RankJoined, Listening)
"""Messages handled on the way in and otherwise dropped when nobody expects them."""
_CONSUMED = object()  # a handler's verdict: the message is fully handled, wait for the next
_GONE = object()  # a handler's verdict: membership changed, the caller re-plans what it waits for


class Pump:
    """`send` an order to a rank; `next` the message a caller expects (`next_with_frames`:
    with the frames that came with it), or None when a rank died meanwhile or the deadline
    passed (callers then re-check what they wait for).

    Owns: the ranks' `identities` and `joined` reports, the answers kept for later, the
    failure reported from another thread (`failure`), and whether the windows were cut on a
    stop. Given: the run context (stop request, holdings noted on every Train, observer,
    summary, data-plane metrics); the channel; the membership (liveness, deaths, listeners);
    the non-finite ledger (fed every WindowDone); the timeline (clock sync, rank events); and
    `cuts_windows`: whether a stop cuts the ranks' windows (not on nccl_sync's exact path)."""

    def __init__(self, ctx: RunContext, *, channel: Channel, members: Membership,
                 ledger: NonfiniteLedger, timeline: Timeline, cuts_windows: bool):
        self.ctx, self.channel, self.members, self.ledger = ctx, channel, members, ledger
        self.timeline, self.cuts_windows = timeline, cuts_windows
        self.identities: Dict[int, bytes] = {}
        self.joined: Dict[int, RankJoined] = {}
        self.failure: Optional[RunAborted] = None
        self._kept: List[Received] = []
        self._windows_cut = False  # CutWindow went out (once, on a stop request)

    # ---- out --------------------------------------------------------------------------------

    def send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        order = message.train if isinstance(message, Update) else message
        if isinstance(order, Train) and order.slices:
            self.ctx.holdings.note(rank, order.epoch, order.slices)
        self.channel.send(message, payloads, identity=self.identities[rank])

    def drop_reduce_answers(self) -> None:
        """A regroup: whatever a survivor sent before its Regrouped answered an attempt of the
        old group; a ReduceFailed of a round sent ahead, kept for later, would otherwise be
        taken as the answer to that round's attempt in the new group."""
        self._kept = [kept for kept in self._kept
                      if not isinstance(kept.message, (Reduced, ReduceFailed, WindowFailed))]

    # ---- in ---------------------------------------------------------------------------------

    def next(self, expect: type | tuple, deadline: Optional[float] = None,
             accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]:
        """The next message of type `expect` (and, given `accept`, one it accepts), or None."""
        received = self.next_with_frames(expect, deadline, accept)
        return None if received is None else received.message

    def next_with_frames(self, expect: type | tuple, deadline: Optional[float] = None,
                         accept: Optional[Callable[[Message], bool]] = None) -> Optional[Received]:
        """As `next`, the message with the frames that came with it. Other orders' answers
        (e.g. WindowDone while waiting for Evaluated in cpu_async, or the answers to orders
        sent ahead) are kept, in order, for the call that expects them."""
        if self.members.absorb():
            return None
        kept = self._take_kept(expect, accept)
        if kept is not None:
            return kept
        while True:
            if not self._tend():
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
            verdict = self._handle(received)
            if verdict is _GONE:
                return None
            if verdict is _CONSUMED:
                continue
            message = received.message
            if isinstance(message, expect) and (accept is None or accept(message)):
                return received
            if isinstance(message, KEPT):
                self._kept.append(received)
            elif not isinstance(message, QUIET):
                rank = getattr(message, "rank", None)
                raise RunAborted("failed", f"unexpected {type(message).__name__} from rank {rank}")

    def _take_kept(self, expect: type | tuple, accept) -> Optional[Received]:
        for i, kept in enumerate(self._kept):
            if getattr(kept.message, "rank", None) not in self.members.alive and \
                    not isinstance(kept.message, RankJoined):
                continue
            if isinstance(kept.message, expect) and (accept is None or accept(kept.message)):
                del self._kept[i]
                return kept
        return None

    def _tend(self) -> bool:
        """Between two reads: a failure from another thread, the stop's grace and cut, the
        liveness checks (also while messages flow: a busy socket must not hide a hang). False
        when a death changed the membership."""
        if self.failure is not None:
            raise self.failure
        if self.ctx.stop.check(self.members.any_in_batch()):
            self._unblock_stop()
        self._cut_windows()
        self.members.check_liveness()
        return not (self.members.deaths_pending() and self.members.absorb())

    def _handle(self, received: Received) -> object:
        """What the message does on its way in: None (then it is returned, kept or refused as
        any other), _CONSUMED or _GONE. A rank declared dead does not speak for the run any more."""
        message = received.message
        rank = getattr(message, "rank", None)
        if rank is not None and rank not in self.members.alive:
            if isinstance(message, RankFailed):  # why it died (its exit may be seen first)
                self.members.note_raised(message)
            return _CONSUMED
        if rank is not None:
            self.members.heard(rank, time.monotonic(), message if isinstance(message, Heartbeat) else None)
        handler = _HANDLERS.get(type(message))
        return None if handler is None else handler(self, received)

    # ---- the handlers -----------------------------------------------------------------------

    def _on_heartbeat(self, received: Received) -> None:
        beat = received.message
        if beat.busy_percent is not None:
            self.ctx.observer.on_busy(beat.rank, beat.busy_percent)
        if beat.node_sample is not None:
            self.ctx.observer.on_node_sample(beat.rank, beat.node_sample)

    def _on_timeline(self, received: Received) -> object:
        self.timeline.receive(received.message, received.identity, self.channel)
        return _CONSUMED

    def _on_window_done(self, received: Received) -> None:
        """Each WindowDone passes here once, kept for later or not."""
        done = received.message
        self.ctx.data.add(done)
        self.ctx.observer.on_window(done.rank, done.samples, done.wall_ms, done.device_bytes)
        self.ledger.note_window(done)
        self._note_graphs(done)

    def _on_joined(self, received: Received) -> None:
        self.identities[received.message.rank] = received.identity
        self.joined[received.message.rank] = received.message

    def _on_listening(self, received: Received) -> None:
        self.members.listeners[received.message.rank] = received.identity

    def _on_failed(self, received: Received) -> object:
        failed = received.message
        if failed.callback:  # the rank lives on
            raise CallbackFailed(failed.callback, failed.error, failed.rank)
        self.members.note_raised(failed)
        self.members.report_death(failed.rank, f"failed: {failed.error}")
        self.members.absorb()
        return _GONE

    def _note_graphs(self, done: WindowDone) -> None:
        """What torch.compile built on the rank so far (its counts only grow)."""
        if not done.graphs and not done.eager_frames:
            return
        summary = self.ctx.summary
        if not summary.compiled_graphs:
            summary.compiled_graphs = [0] * self.ctx.world_size
            summary.eager_frames = [0] * self.ctx.world_size
        summary.compiled_graphs[done.rank] = max(summary.compiled_graphs[done.rank], done.graphs)
        summary.eager_frames[done.rank] = max(summary.eager_frames[done.rank], done.eager_frames)

    # ---- a stop -----------------------------------------------------------------------------

    def _unblock_stop(self) -> None:
        """The stop's grace ran out with no save under way: a rank the stop waits on in an
        eval (a recipe's eval or epoch_fn that hangs) is declared hung, and the others get a
        fresh grace to save what they hold; with nobody to let go, the run stops unsaved."""
        stop = self.ctx.stop
        if not self.members.hang_orders_out("eval", f"past the stop's {stop.grace_s:g}s grace"):
            stop.give_up()
        stop.rearm()

    def _cut_windows(self) -> None:
        """A stop was asked for: every live rank ends its window after the batch in hand, so
        the reduce (and the save) come within a batch, not at the window's planned end. Not
        on nccl_sync's exact path: its steps are collective, and its windows short."""
        if self._windows_cut or not self.ctx.stop.is_set() or not self.cuts_windows:
            return
        self._windows_cut = True
        for rank in sorted(self.members.alive & set(self.identities)):
            self.send(rank, CutWindow(self.ctx.stop.reason))


_HANDLERS: Dict[type, Callable[[Pump, Received], object]] = {
    Heartbeat: Pump._on_heartbeat,
    ClockPing: Pump._on_timeline,
    TimelineEvents: Pump._on_timeline,
    WindowDone: Pump._on_window_done,
    RankJoined: Pump._on_joined,
    Listening: Pump._on_listening,
    RankFailed: Pump._on_failed,
}
"""What a message does on its way in, by type (the others only answer what a caller expects)."""
