"""The non-finite ledger: ranks found with NaN/inf (a window's loss, a replica's parameters,
nccl_sync's averaged gradient), the streak of reduces that had one, the replicas the next
central update replaces, and the stop at max_nonfinite (saving the last finite consensus).
"""

from __future__ import annotations

import math
from typing import Dict, List, NoReturn, Set

from flodl_run.contracts.wire import WindowDone
from flodl_run.control.context import Bundles, Members, RunContext
from flodl_run.control.rounds import RoundBook
from flodl_run.control.runstate import RunAborted


class NonfiniteLedger:
    """Owns: the ranks found non-finite since the last reduce (rank -> "loss" | "parameters"),
    the streak of reduces in a row that had one, nccl_sync's skipped steps of the window just
    closed, and the replicas the next central update replaces (until their next snapshot).
    Given: the run context (summary, observer, max_nonfinite); the membership (who is alive);
    the round book (the round a finding is logged with); the bundles (the save at the stop)."""

    def __init__(self, ctx: RunContext, *, members: Members, book: RoundBook, bundles: Bundles):
        self.members, self.book, self.bundles = members, book, bundles
        self.config, self.summary, self.observer = ctx.config, ctx.summary, ctx.observer
        self._found: Dict[int, str] = {}  # rank -> "loss" | "parameters", since the last reduce
        self._streak = 0  # reduces in a row with a non-finite rank
        self._skipped = 0  # nccl_sync (gradients): steps skipped in the window just closed
        self._reset_next: Set[int] = set()  # non-finite ranks the next update replaces
        self._resetting: Set[int] = set()  # ... until their next snapshot (NaN windows in flight)

    def note_window(self, done: WindowDone) -> None:
        """A window's loss came in: a non-finite one marks its rank (unless it is being reset)."""
        if not math.isfinite(done.loss_sum) and done.rank not in self._resetting:
            self._found.setdefault(done.rank, "loss")

    def note_parameters(self, rank: int) -> None:
        """The rank's replica is non-finite (it gave weight 0 to this round)."""
        self._found.setdefault(rank, "parameters")

    def note_snapshot(self, rank: int, finite: bool) -> bool:
        """A snapshot came in (the rank applied its reset update before it): True when its
        weight counts (no non-finite value found on the rank since the last reduce)."""
        self._resetting.discard(rank)
        if not finite:
            self.note_parameters(rank)
        return rank not in self._found

    def nonfinite_pending(self) -> bool:
        """A rank was found non-finite since the last reduce (the next one acts on it)."""
        return bool(self._found)

    def resets(self, alive: Set[int]) -> Set[int]:
        """The replicas this central update replaces (the ranks found last round), reset until
        their next snapshot."""
        reset = self._reset_next & alive
        self._resetting |= reset
        return reset

    def note_skipped(self, rank: int, skipped: int) -> None:
        """nccl_sync (gradients): steps every rank skipped in a window for a non-finite
        averaged gradient (each rank reports the same count)."""
        self._skipped = max(self._skipped, skipped)

    def tally_skipped(self) -> bool:
        """Windows in a row with a skipped step: True when that reaches max_nonfinite."""
        skipped, self._skipped = self._skipped, 0
        if not skipped:
            self._streak = 0
            return False
        self._streak += 1
        round_ = self.book.round
        self.summary.nonfinite.append({"round": round_, "rank": None, "what": f"gradient x{skipped}"})
        self.observer.on_event("rank_nonfinite", f"round {round_}: the averaged gradient was "
                                                 f"non-finite (NaN/inf) in {skipped} step(s): every "
                                                 "rank skipped them")
        return self._streak >= self.config.max_nonfinite

    def tally_nonfinite(self) -> bool:
        """Log the ranks found non-finite since the last reduce (`rank_nonfinite`; they gave
        weight 0, and the coordinator backend's next update replaces their replica and resets
        their optimizer) and count reduces in a row that had one: True when that reaches
        max_nonfinite and the run must stop."""
        found = {r: what for r, what in self._found.items() if r in self.members.alive}
        self._found, self._reset_next = {}, set(found)
        if not found:
            self._streak = 0
            return False
        self._streak += 1
        for rank, what in sorted(found.items()):
            self.summary.nonfinite.append({"round": self.book.round, "rank": rank, "what": what})
            self.observer.on_event("rank_nonfinite", f"round {self.book.round}: rank {rank}'s {what} "
                                                     f"non-finite (NaN/inf): weight 0")
        return self._streak >= self.config.max_nonfinite

    def fail(self, epoch: int, uncovered: List[List[int]]) -> NoReturn:
        """Stop as failed, saving the consensus the ranks hold when it is finite (ranks refuse
        to write NaN, so an earlier bundle is never replaced by one)."""
        detail = (f"non-finite values in {self._streak} reduces in a row "
                  f"(max_nonfinite={self.config.max_nonfinite})")
        try:
            stem = self.bundles.save_bundle("nonfinite", epoch, uncovered)
            saved = f"saved the last finite consensus: {stem}" if stem else "not saved (no save_path)"
        except RunAborted as exc:
            saved = f"no finite consensus to save ({exc.reason}); an earlier bundle stays as it was"
        raise RunAborted("failed", f"{detail}; {saved}")
