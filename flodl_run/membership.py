"""Membership of a distributed run: deaths shrink the cohort, a dead rank's work
returns to the pool, collective survivors regroup, and the failure policy may end the run with
a save. A mixin of the Coordinator: it acts on the coordinator's state and messaging.
"""

from __future__ import annotations

import logging
import math
import time
from typing import List, Optional, Set

import zmq

from flodl_run.wire import (
    AbortGroup,
    Heartbeat,
    Regroup,
    Regrouped,
)

POLL_MS = 200
LIVENESS_EVERY_S = 0.2  # how often heartbeats and progress are checked, even while messages flow
STOP_GRACE_S = 8.0  # SIGINT -> save at a reduce boundary; ranks are gone within 15 s either way
log = logging.getLogger(__name__)


class RunAborted(Exception):
    """The run cannot go on (a rank failed or died, or a stop was requested)."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class ShutdownWithSave(Exception):
    """Membership broke the failure policy: a survivor saves, then the run stops."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail



def hung_limit_s(smoothed_ms: Optional[float], factor: float, floor_s: float) -> float:
    """How long a training rank may go without finishing a batch: `factor` of its smoothed
    batch time, never less than `floor_s` (and just the floor before any batch was timed)."""
    return max(floor_s, factor * smoothed_ms / 1000.0) if smoothed_ms else floor_s


class Membership:
    """Coordinator mixin: who is alive and what their loss means."""

    # ---- liveness: heartbeats and progress ---------------------------------------------------

    def _note_progress(self, beat: Heartbeat, now: float) -> None:
        """Restart the rank's progress clock when it finished a batch since the last beat, or
        is not training (idle, or in an ordered reduce, eval or save: never hung)."""
        last = self._batch_clock.get(beat.rank)
        if last is None or last[0] != beat.batches or not beat.training:
            self._batch_clock[beat.rank] = (beat.batches, now)

    def _check_liveness(self) -> None:
        """Heartbeat timeouts and hung ranks, at most every LIVENESS_EVERY_S."""
        now = time.monotonic()
        if now - self._liveness_checked < LIVENESS_EVERY_S:
            return
        self._liveness_checked = now
        self._check_heartbeats()
        smoothed = self.elche.smoothed_ms() if self.elche is not None else []
        for rank, (batches, since) in self._batch_clock.items():
            ms = smoothed[rank] if rank < len(smoothed) else None
            limit = hung_limit_s(ms, self.config.progress_factor, self.config.progress_timeout_secs)
            if rank in self.alive and now - since > limit:
                self.report_death(rank, f"hung: no batch finished for {now - since:.1f}s while "
                                        f"training (limit {limit:g}s; last at batch {batches})")

    def _absorb_deaths(self) -> bool:
        """Turn reported deaths into a smaller membership: forget the rank's timing, give its
        unfinished work back, re-plan, then apply the failure policy. True when it changed."""
        changed = False
        dead: List[int] = []
        while not self._deaths.empty():
            rank, reason = self._deaths.get()
            if rank not in self.alive:
                continue
            self.alive.discard(rank)
            dead.append(rank)
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
        if dead and self.mode.is_collective:
            self._abort_groups(dead)
        if dead:
            self._apply_failure_policy(reason)
        return changed

    def _abort_groups(self, dead: List[int]) -> None:
        """Tell every survivor's listener at once that its process group lost members: a
        survivor blocked in a collective with the dead aborts the group and leaves it, instead
        of waiting for a collective timeout or NCCL's watchdog. The regroup follows."""
        notice = AbortGroup(self._generation, sorted(dead))
        for rank in sorted(self.alive):
            identity = self.listeners.get(rank)
            if identity is not None:
                try:
                    self.channel.send(notice, identity=identity)
                except zmq.ZMQError as exc:  # that rank is going too: its death comes next
                    log.warning("abort notice to rank %d not sent: %s", rank, exc)

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
        # One survivor carries on alone (its reduce is the identity) and takes the pool's work.

    def _regroup(self) -> None:
        """Collective modes: survivors rebuild the process group (new store prefix, new ranks
        by ascending old rank) before the next reduce."""
        self.cancel_ahead()
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
