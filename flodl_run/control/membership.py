"""Membership of a distributed run: who is alive, how a rank is found dead (heartbeat timeout,
hung while training, its exit or exception), what a death does (the cohort shrinks, the
survivors' process group is aborted and later rebuilt), and the failure policy that may end
the run with a save. What the dead rank's work becomes is the caller's (`losses`).
"""

from __future__ import annotations

import logging
import math
import queue
import time
from typing import Dict, List, Optional, Set, Tuple

import zmq

from flodl_run.contracts.wire import AbortGroup, Channel, Heartbeat, RankFailed, Regroup, Regrouped
from flodl_run.control.context import Losses, RunContext
from flodl_run.control.runstate import RunAborted, ShutdownWithSave

__all__ = ["Membership", "OrderClock", "RunAborted", "ShutdownWithSave", "hung_limit_s"]

LIVENESS_EVERY_S = 0.2  # how often heartbeats and progress are checked, even while messages flow
STOP_PROGRESS_FACTOR = 4.0
"""While the run stops, a batch may take this many times the rank's smoothed batch time (at
least the stop's grace) before the rank is declared hung: the stop's save must not wait for
progress_factor (20) x a batch, or the 300 s floor, on a rank stuck in its train_step."""
log = logging.getLogger(__name__)


def hung_limit_s(smoothed_ms: Optional[float], factor: float, floor_s: float) -> float:
    """How long a training rank may go without finishing a batch: `factor` of its smoothed
    batch time, never less than `floor_s` (and just the floor before any batch was timed)."""
    return max(floor_s, factor * smoothed_ms / 1000.0) if smoothed_ms else floor_s


class OrderClock:
    """How long a rank may take over an ordered eval or save (the recipe's callbacks in it
    included): `factor` times the longest of that kind measured so far, never less than
    `floor_s`; before one was measured, `factor` times the floor (a first eval or save of a
    large model may well outlast the floor that suits batches). The batch clock cannot judge
    these: a rank that is not training restarts it. Also which rank is on such an order now
    (`out`: rank -> (kind, since when)), so that a stop can let go of one that holds it up."""

    def __init__(self, factor: float, floor_s: float):
        self.factor, self.floor_s = factor, floor_s
        self.longest_s: Dict[str, float] = {}
        self.out: Dict[int, Tuple[str, float]] = {}

    def limit_s(self, kind: str) -> float:
        return max(self.floor_s, self.factor * self.longest_s.get(kind, self.floor_s))

    def took(self, kind: str, seconds: float) -> None:
        self.longest_s[kind] = max(seconds, self.longest_s.get(kind, 0.0))

    def sent(self, kind: str, rank: int) -> float:
        """`rank` was given a `kind` order now; when (time.monotonic)."""
        began = time.monotonic()
        self.out[rank] = (kind, began)
        return began

    def answered(self, rank: int) -> None:
        """`rank` answered its order, or is gone."""
        self.out.pop(rank, None)


class Membership:
    """Who is alive and what their loss means.

    Owns: `alive`, the queue of reported deaths, when each rank was last heard (`last_seen`)
    and its progress clock, the ranks told to stop, the exceptions ranks reported (`raised`),
    each collective rank's listener socket, the process-group `generation` with whether a
    regroup is due (`regroup_needed`), and the choice of the callback rank.
    Given: the run context (the limits: heartbeat timeout, progress factor and floor,
    max_failure; `send`/`next` to order a regroup; the balance's smoothed batch times), the
    channel (abort notices go straight to listeners), the `losses`, told of each death before
    the failure policy is applied (the rank's work given back, a re-plan), and whether the
    ranks form a process group (`collective`: a death regroups the survivors)."""

    def __init__(self, ctx: RunContext, *, channel: Optional[Channel], losses: Losses, collective: bool):
        config = ctx.config
        self.ctx, self.channel, self.losses = ctx, channel, losses
        self.world_size, self.collective = ctx.world_size, collective
        self.heartbeat_timeout_s = config.heartbeat_timeout_secs
        self.progress_factor, self.progress_floor_s = config.progress_factor, config.progress_timeout_secs
        self.max_failure = config.max_failure
        self.alive: Set[int] = set(range(self.world_size))
        self._deaths: "queue.Queue[Tuple[int, str]]" = queue.Queue()
        self.last_seen: Dict[int, float] = {}
        self.batch_clock: Dict[int, tuple] = {}  # rank -> (batches finished, since when)
        self.seen_batch_ms: Dict[int, float] = {}
        """Per rank, its longest batch as its heartbeats show it (batches finished between two
        beats while training): a batch time before ElChe has one (the first window)."""
        self.in_batch: Set[int] = set()  # ranks whose last heartbeat said they were training
        self.liveness_checked = 0.0
        self.loop_seen: Optional[float] = None  # when the coordinator's loop last came by
        self.verdicts_postponed: Optional[float] = None  # since when queued input put verdicts off
        self.stopped: Set[int] = set()
        self.raised: Dict[int, str] = {}  # rank -> the exception it reported (RankFailed)
        self.listeners: Dict[int, bytes] = {}  # each collective rank's listener (AbortGroup goes there)
        self.generation = 0
        self.regroup_needed = False
        self.orders = OrderClock(self.progress_factor, self.progress_floor_s)

    def callback_rank(self) -> int:
        """The rank that runs the evals and writes the model: epoch_callback_policy's
        `rank:k` while k is alive, else the fastest live rank by smoothed batch time."""
        policy = self.ctx.config.epoch_callback_policy
        if policy.startswith("rank:") and int(policy.split(":", 1)[1]) in self.alive:
            return int(policy.split(":", 1)[1])
        known = [(ms, rank) for rank, ms in enumerate(self.ctx.balance.smoothed_ms())
                 if ms is not None and rank in self.alive]
        return min(known)[1] if known else min(self.alive)

    # ---- what the coordinator hears ----------------------------------------------------------

    def report_death(self, rank: int, reason: str) -> None:
        """A rank is gone (thread-safe: the launcher reports exits from its own thread)."""
        self._deaths.put((rank, reason))

    def deaths_pending(self) -> bool:
        return not self._deaths.empty()

    def heard(self, rank: int, now: float, beat: Optional[Heartbeat] = None) -> None:
        """A live rank spoke; a heartbeat also carries its progress."""
        self.last_seen[rank] = now
        if beat is not None:
            self.note_progress(beat, now)

    def note_raised(self, failed: RankFailed) -> None:
        """Why the rank failed (the first report wins; its exit may be seen first)."""
        self.raised.setdefault(failed.rank, failed.error)

    # ---- liveness: heartbeats and progress ---------------------------------------------------

    def note_progress(self, beat: Heartbeat, now: float) -> None:
        """Restart the rank's progress clock when it finished a batch since the last beat, or
        is not training (idle, or in an ordered reduce, eval or save: never hung)."""
        last = self.batch_clock.get(beat.rank)
        if last is not None and beat.training and beat.batches > last[0]:
            per_batch_ms = (now - last[1]) * 1000.0 / (beat.batches - last[0])
            self.seen_batch_ms[beat.rank] = max(per_batch_ms, self.seen_batch_ms.get(beat.rank, 0.0))
        if last is None or last[0] != beat.batches or not beat.training:
            self.batch_clock[beat.rank] = (beat.batches, now)
        (self.in_batch.add if beat.training else self.in_batch.discard)(beat.rank)

    def any_in_batch(self) -> bool:
        """A live rank's last heartbeat (at most a period old) said it was in a batch."""
        return bool(self.in_batch & self.alive)

    def check_liveness(self) -> None:
        """Heartbeat timeouts and hung ranks, at most every LIVENESS_EVERY_S (the coordinator's
        loop calls this on every pass), judged once the heartbeats queued for us are read:
        while input waits on the channel a verdict waits too, for at most one more heartbeat
        timeout (a socket kept busy must not hide a dead rank). A loop that did not come by
        for longer than the timeout (the launcher was stopped: Ctrl-Z, SIGSTOP, a VM pause)
        heard nobody meanwhile: every rank gets a fresh grace period instead of a verdict."""
        now = time.monotonic()
        gap = None if self.loop_seen is None else now - self.loop_seen
        self.loop_seen = now
        if gap is not None and gap > self.heartbeat_timeout_s:
            self._grace(now, gap)
            return
        if now - self.liveness_checked < LIVENESS_EVERY_S:
            return
        self.liveness_checked = now
        verdicts = self._silent(now) + self._hung(now)
        if verdicts and self._input_queued():
            self.verdicts_postponed = self.verdicts_postponed or now
            if now - self.verdicts_postponed <= self.heartbeat_timeout_s:
                return
        self.verdicts_postponed = None
        for rank, reason in verdicts:
            self.report_death(rank, reason)

    def overdue(self, kind: str, ranks: Set[int], began: float) -> bool:
        """Report as hung each of `ranks` still alive that has not answered its `kind` order
        (eval, save) within the order's limit since `began`; True when any was."""
        waited, limit = time.monotonic() - began, self.orders.limit_s(kind)
        late = sorted(ranks & self.alive) if waited > limit else []
        for rank in late:
            self.report_death(rank, f"hung: its {kind} ran for {waited:.1f}s (limit {limit:g}s)")
        return bool(late)

    def hang_orders_out(self, kind: str, why: str) -> bool:
        """Report as hung each live rank on a `kind` order now (`why`: the rule it broke);
        True when any was."""
        now = time.monotonic()
        late = sorted((rank, began) for rank, (k, began) in self.orders.out.items()
                      if k == kind and rank in self.alive)
        for rank, began in late:
            self.report_death(rank, f"hung: its {kind} ran for {now - began:.1f}s, {why}")
        return bool(late)

    def _silent(self, now: float) -> List[Tuple[int, str]]:
        timeout = self.heartbeat_timeout_s
        return [(rank, f"silent for {now - seen:.1f}s (heartbeat timeout {timeout:g}s)")
                for rank, seen in self.last_seen.items() if rank in self.alive and now - seen > timeout]

    def _hung(self, now: float) -> List[Tuple[int, str]]:
        smoothed = self.ctx.balance.smoothed_ms()
        hung = []
        for rank, (batches, since) in self.batch_clock.items():
            ms = (smoothed[rank] if rank < len(smoothed) else None) or self.seen_batch_ms.get(rank)
            limit, during = self._batch_limit_s(ms), " during a stop" if self.ctx.stop.is_set() else ""
            if rank in self.alive and now - since > limit:
                hung.append((rank, f"hung: no batch finished for {now - since:.1f}s while "
                                   f"training (limit {limit:g}s{during}; last at batch {batches})"))
        return hung

    def _batch_limit_s(self, ms: Optional[float]) -> float:
        """How long a rank may go without finishing a batch (`ms`: its smoothed batch time, or
        before ElChe has one its longest batch seen in its heartbeats). While the run stops, a
        rank whose batch time is known gets STOP_PROGRESS_FACTOR of it (never less than the
        stop's grace): a stop waits for a slow batch, not a hung one. In the first window that
        waited the usual rule out (max(20 x, 300 s)), and a second Ctrl-C stopped unsaved."""
        limit = hung_limit_s(ms, self.progress_factor, self.progress_floor_s)
        if self.ctx.stop.is_set() and ms:
            limit = min(limit, hung_limit_s(ms, STOP_PROGRESS_FACTOR, self.ctx.stop.grace_s))
        return limit

    def _grace(self, now: float, gap: float) -> None:
        """Restart every rank's heartbeat and progress clocks: the silence was ours."""
        log.warning("the coordinator did not run for %.1fs (stopped?): every rank gets a fresh "
                    "heartbeat and progress period", gap)
        self.last_seen = {rank: now for rank in self.last_seen}
        self.batch_clock = {rank: (batches, now) for rank, (batches, _) in self.batch_clock.items()}
        self.verdicts_postponed = None

    def _input_queued(self) -> bool:
        return self.channel is not None and bool(self.channel.socket.poll(0, zmq.POLLIN))

    # ---- deaths ------------------------------------------------------------------------------

    def absorb(self) -> bool:
        """Turn reported deaths into a smaller membership (`losses` for each), abort the
        survivors' group, then apply the failure policy. True when the membership changed."""
        dead: List[int] = []
        reason = ""
        while not self._deaths.empty():
            rank, reason = self._deaths.get()
            if rank not in self.alive:
                continue
            self.alive.discard(rank)
            self.orders.answered(rank)
            dead.append(rank)
            self.losses.lost(rank, reason)
            self.regroup_needed = self.collective
        if dead and self.collective:
            self._abort_groups(dead)
        if dead:
            self._apply_failure_policy(reason)
        return bool(dead)

    def _abort_groups(self, dead: List[int]) -> None:
        """Tell every survivor's listener at once that its process group lost members: a
        survivor blocked in a collective with the dead aborts the group and leaves it, instead
        of waiting for a collective timeout or NCCL's watchdog. The regroup follows."""
        notice = AbortGroup(self.generation, sorted(dead))
        for rank in sorted(self.alive):
            identity = self.listeners.get(rank)
            if identity is not None:
                try:
                    self.channel.send(notice, identity=identity)
                except zmq.ZMQError as exc:  # that rank is going too: its death comes next
                    log.warning("abort notice to rank %d not sent: %s", rank, exc)

    def _apply_failure_policy(self, reason: str) -> None:
        dead = self.world_size - len(self.alive)
        limit = self.max_failure
        if not self.alive:
            raise ShutdownWithSave("all_ranks_lost", reason)
        if self.ctx.stop.is_set():  # the stop saves with the survivors anyway
            return
        if (limit.absolute is not None and dead >= limit.absolute) or \
                (limit.percent is not None and dead >= math.ceil(limit.percent * self.world_size)):
            raise ShutdownWithSave("max_failure_exceeded", f"{dead} of {self.world_size} ranks dead")
        # One survivor carries on alone (its reduce is the identity) and takes the pool's work.

    def regroup(self, source: int = -1) -> None:
        """Collective modes: survivors rebuild the process group (new store prefix, new ranks
        by ascending old rank) before the next reduce. The caller voids the orders sent ahead
        first. `source` (nccl_sync's exact path): the member whose state all adopt."""
        self.generation += 1
        members = sorted(self.alive)
        for rank in members:
            self.ctx.send(rank, Regroup(self.generation, members, source if source in members else -1))
        joined: Set[int] = set()
        while joined < self.alive:
            msg = self.ctx.next(expect=Regrouped)
            if msg is None:  # another death while regrouping: start over with fewer members
                return self.regroup(source)
            if msg.generation == self.generation:
                joined.add(msg.rank)
        self.regroup_needed = False
        self.ctx.observer.on_event("regroup", f"generation {self.generation}: ranks {members}")

    def failed_ranks(self, fallback: str) -> str:
        """`rank k failed: <its exception>` for the ranks that raised (their RankFailed may
        trail their exit: wait for it briefly), else `fallback`."""
        deadline = time.monotonic() + 1.0
        while len(self.raised) < self.world_size - len(self.alive) and time.monotonic() < deadline:
            received = self.channel.recv(timeout_ms=100)
            if received is not None and isinstance(received.message, RankFailed):
                self.note_raised(received.message)
        if not self.raised:
            return fallback
        first = min(self.raised)
        others = sorted(r for r, e in self.raised.items() if r != first and e == self.raised[first])
        also = f" (also rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" \
            if others else ""
        return f"rank {first} failed: {self.raised[first]}{also}"
