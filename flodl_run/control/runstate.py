"""The facts the coordinator's parts share, each with one owner: how a run stops (the
exceptions that end it, the stop request and its grace), the seat of the balancer (ElChe and
its current plan), and the work each rank holds since its last fold into the consensus.

It imports none of the coordinator's parts; they and the coordinator import it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

from flodl_run.control.dispatch import SliceT, as_range
from flodl_run.elche.balancer import ElChe, Plan, ReduceReport

POLL_MS = 200
"""How long the coordinator waits on its socket before it checks deaths, liveness and stops."""
STOP_GRACE_S = 8.0
"""SIGINT -> the ranks end their windows after the batch in hand, then reduce and save: the save
must begin within this of the last rank leaving its batch, or the run stops unsaved."""


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


class StopRequest:
    """A SIGINT/SIGTERM seen by the launcher: the ranks cut their windows after the batch in
    hand, the coordinator reduces what they trained and saves it, then the run stops.

    Owns the request (thread-safe: set from the launcher's thread), its reason, the deadline
    after which the run stops without saving, and whether a bundle is being written (a
    deadline waits for that save). The grace counts from the last batch's end, not from the
    request: a batch is never cut, however long it takes (a rank that never finishes one is
    found hung by the liveness rule), and the reduce and save that follow get STOP_GRACE_S."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.deadline = float("inf")
        self.saving = False
        self.again = False
        """A second request came: stop at once (the grace was cut short, not run out)."""

    def request(self, reason: str) -> None:
        """A second request, or no save within STOP_GRACE_S of the ranks' last batch, stops at
        once without saving. The reason names every signal that came (`interrupted by SIGTERM;
        then SIGINT`)."""
        now = time.monotonic()
        self.deadline = now if self._event.is_set() else now + STOP_GRACE_S
        self.again = self._event.is_set()
        if self.reason and reason != self.reason:
            reason = f"{self.reason}; then {reason.rsplit(' ', 1)[-1]}"
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self, in_batch: bool = False) -> None:
        """Raise RunAborted(interrupted) once the grace is over and no save is under way.
        `in_batch`: a live rank is still in a batch (its heartbeats say so): the grace starts
        afresh, unless a second request asked to stop at once."""
        if not self._event.is_set():
            return
        now = time.monotonic()
        if in_batch and not self.again:
            self.deadline = max(self.deadline, now + STOP_GRACE_S)
        if not self.saving and now > self.deadline:
            why = "stopped at once" if self.again else \
                f"no save within {STOP_GRACE_S:.0f}s of the ranks' last batch"
            raise RunAborted("interrupted", f"{self.reason or 'stopped'} ({why}: not saved)")

    @contextmanager
    def while_saving(self) -> Iterator[None]:
        self.saving = True
        try:
            yield
        finally:
            self.saving = False


class Balance:
    """The seat of the balancer: the ElChe instance (built once the ranks joined, or restored
    from a bundle) and the plan it last made. Its users read the plan and the smoothed batch
    times here and report through `on_reduce` / `forget_rank`; nobody else holds ElChe."""

    def __init__(self) -> None:
        self.elche: Optional[ElChe] = None
        self.plan: Optional[Plan] = None

    def smoothed_ms(self) -> List[Optional[float]]:
        return self.elche.smoothed_ms() if self.elche is not None else []

    def window_ms(self) -> Optional[float]:
        """How long the window of the current plan lasts when windows end on a deadline (ElChe's
        window_ms); None before ElChe has the anchor rank's timing."""
        return self.elche.window_ms() if self.elche is not None else None

    def forget_rank(self, rank: int) -> None:
        if self.elche is not None:
            self.plan = self.elche.forget_rank(rank)

    def on_reduce(self, report: ReduceReport) -> Plan:
        self.plan = self.elche.on_reduce(report)
        return self.plan


Chunk = tuple  # (epoch, [slices])


class Holdings:
    """What each rank trained or was handed since its work last folded into the consensus:
    lost with the rank if it dies (its chunks are then given back and redone), and what a
    save records as uncovered. Owns that ledger; the coordinator notes every Train order
    sent, and the reduces reset it after each round."""

    def __init__(self, world_size: int):
        self.chunks: Dict[int, List[Chunk]] = {r: [] for r in range(world_size)}

    def note(self, rank: int, epoch: int, slices: Sequence[SliceT]) -> None:
        self.chunks.setdefault(rank, []).append((epoch, list(slices)))

    def forget(self, rank: int, epoch: int, slices: Sequence[SliceT]) -> None:
        """An order voided before it trained (a regroup cancelled the orders sent ahead)."""
        chunks = self.chunks.get(rank, [])
        if (epoch, list(slices)) in chunks:
            chunks.remove((epoch, list(slices)))

    def lose(self, rank: int) -> List[Chunk]:
        """The rank died: everything it held, to be given back."""
        return self.chunks.pop(rank, [])

    def reset(self, kept: Dict[int, List[Chunk]]) -> None:
        """After a round: each live rank now holds only `kept[rank]`."""
        self.chunks = {r: list(chunks) for r, chunks in kept.items()}

    def trim(self, rank: int, epoch: int, sent: Sequence[SliceT], trained: Sequence[SliceT]) -> None:
        """An order ended on its deadline: the rank holds only what it trained of it (the rest
        went back to the pool, and must not be given back a second time if the rank dies)."""
        self.forget(rank, epoch, sent)
        if trained:
            self.note(rank, epoch, trained)

    def of(self, rank: int) -> List[Chunk]:
        return self.chunks.get(rank, [])

    def uncovered(self, epoch: int) -> List[List[int]]:
        """The slices of `epoch` the ranks hold, as [pass, start, end] ranges (what a save records)."""
        return [as_range(s) for chunks in self.chunks.values() for e, slices in chunks if e == epoch
                for s in slices]

