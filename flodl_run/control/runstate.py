"""The facts the coordinator's parts share, each with one owner: how a run stops (the
exceptions that end it, the stop request and its grace), the seat of the balancer (ElChe and
its current plan), and the work each rank holds since its last fold into the consensus.

It imports none of the coordinator's parts; they and the coordinator import it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Sequence

from flodl_run.control.dispatch import SliceT, as_range
from flodl_run.elche.balancer import ElChe, Plan, ReduceReport
from flodl_run.elche.shares import SharePlanner

POLL_MS = 200
"""How long the coordinator waits on its socket before it checks deaths, liveness and stops."""
STOP_GRACE_S = 8.0
"""SIGINT -> the ranks end their windows after the batch in hand, then reduce and save: the save
must begin within this of the last rank leaving its batch. Past it, a rank the stop waits on
in an eval is declared hung and the others save (with none to blame, the run stops unsaved);
after a second signal, a save under way gets until this long after the first, then the run
ends."""


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

    Owns the request (thread-safe: set from the launcher's thread), its reason, the grace
    (`grace_s`, STOP_GRACE_S but in tests) and its end (`deadline`), the save under way
    (`saving`: what it writes) and, after a second request, the instant the run ends whatever
    is under way (`cut_at`). The grace counts from the last batch's end, not from the
    request: a batch is never cut, however long it takes (a rank that never finishes one is
    found hung by the liveness rule), and the reduce and save that follow get the grace. A
    stop always ends: a second request ends the run at once, or, while a save is under way, a
    grace after the first request (a save already that late is hung, and cut)."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self._event = threading.Event()
        self.reason = ""
        self.first_at = float("inf")
        self.deadline = float("inf")
        self.cut_at = float("inf")
        self.saving: Optional[str] = None
        self.again = False
        """A second request came: stop at once (the grace was cut short, not run out)."""

    def request(self, reason: str) -> None:
        """The first request starts the grace; a second one stops at once (a save under way
        gets until a grace after the first). The reason names every signal that came
        (`interrupted by SIGTERM; then SIGINT`)."""
        now = time.monotonic()
        if self._event.is_set():
            self.again = True
            self.cut_at = min(self.cut_at, max(now, self.first_at + self.grace_s))
        else:
            self.first_at, self.deadline = now, now + self.grace_s
        if self.reason and reason != self.reason:
            reason = f"{self.reason}; then {reason.rsplit(' ', 1)[-1]}"
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self, in_batch: bool = False) -> bool:
        """Raise RunAborted(interrupted) when a second request ends the run now: at once with
        no save under way, else once `cut_at` passed. True when the grace ran out with no save
        under way: the caller declares hung the ranks that hold the stop up (then `rearm`),
        or gives up (`give_up`). `in_batch`: a live rank is still in a batch (its heartbeats
        say so): the grace starts afresh."""
        if not self._event.is_set():
            return False
        now = time.monotonic()
        if self.again and (self.saving is None or now >= self.cut_at):
            cut = "" if self.saving is None else f", cutting {self.saving}"
            raise RunAborted("interrupted", f"{self.reason or 'stopped'} (stopped at once{cut}: not saved)")
        if in_batch and not self.again:
            self.deadline = max(self.deadline, now + self.grace_s)
        return self.saving is None and now > self.deadline

    def rearm(self) -> None:
        """The ranks that held the stop up were let go: the others get a fresh grace to save."""
        self.deadline = time.monotonic() + self.grace_s

    def give_up(self) -> NoReturn:
        """The grace ran out and nobody holds the stop up that could be let go: stop unsaved."""
        raise RunAborted("interrupted", f"{self.reason or 'stopped'} (no save within "
                                        f"{self.grace_s:g}s of the ranks' last batch: not saved)")

    @contextmanager
    def while_saving(self, what: str) -> Iterator[None]:
        """A save of `what` is under way: the grace waits for it (a second request cuts it
        only at `cut_at`)."""
        self.saving = what
        try:
            yield
        finally:
            self.saving = None


class Balance:
    """The seat of the balancer: the ElChe instance (built once the ranks joined, or restored
    from a bundle) and the plan it last made. Its users read the plan and the smoothed batch
    times here and report through `on_reduce` / `forget_rank`; nobody else holds ElChe."""

    def __init__(self) -> None:
        self.elche: Optional[ElChe] = None
        self.plan: Optional[Plan] = None
        self.shares: Optional[SharePlanner] = None
        """nccl_sync's exact steps' split planner (set by that part), saved beside ElChe."""

    def export_state(self) -> Dict[str, Any]:
        """A bundle's `elche_state`: ElChe's, and the split planner's under `shares`."""
        state = self.elche.export_state()
        if self.shares is not None:
            state["shares"] = self.shares.export_state()
        return state

    def restore_shares(self, state: Dict[str, Any]) -> None:
        """The split planner as a bundle left it (a bundle of another mode, or older, has none)."""
        if self.shares is not None and isinstance(state.get("shares"), dict):
            self.shares.load_state(state["shares"])

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
    sent, and each reduce round resets it."""

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

