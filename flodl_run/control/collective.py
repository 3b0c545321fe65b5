"""The collective round: the ranks average among themselves (NCCL on CUDA, Gloo on CPU) on the
coordinator's SyncNow, and a death during the round regroups the survivors and retries it.
What the ranks train between rounds is the windows'; the counters and records the round book's.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

from flodl_run.contracts.wire import Reduced, ReduceFailed, Train
from flodl_run.control.context import Members, RunContext
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.rounds import BookedRound, Closing, RoundBook
from flodl_run.control.runstate import ShutdownWithSave
from flodl_run.control.tallies import EpochTally, WindowTally


class CollectiveRound(BookedRound):
    """One consensus round among the ranks, then ElChe's report; `release` sends the next
    orders. Given: the run context (link, recorder); the membership (who is alive, whether a
    regroup is due, the regroup itself); the round book; the non-finite ledger."""

    def __init__(self, ctx: RunContext, *, members: Members, book: RoundBook, ledger: NonfiniteLedger):
        self.ctx, self.members, self.book, self.ledger = ctx, members, book, ledger
        self.recorder = ctx.recorder

    def reduce(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, *,
               ahead: Dict[int, Train], sync_sent: bool = False, final: bool = False,
               fill: bool = False) -> Closing:
        """Order the consensus and wait for every rank (`sync_sent`: the SyncNow already rode
        on the window's Train orders), then fold the window in and let ElChe plan (`fill`:
        report the window's fill). `ahead`: the orders sent before this round, part of the next
        window. `final` changes nothing here: every survivor takes part in every round."""
        book = self.book
        book.begin_round()
        began, began_ns = time.perf_counter(), self.recorder.now()
        divergence, regrouped = self._complete_round(sync_sent)
        sync_ms = (time.perf_counter() - began) * 1000.0
        self.recorder.span("reduce", began_ns, book.round)
        book.fold(window, epoch_tally, set(), ahead)
        book.report(window, sync_ms, divergence, fill_ms=window.fill_ms if fill else None)
        return Closing(epoch, window, epoch_tally, sync_ms, divergence,
                       stop=self.ledger.tally_nonfinite(), regrouped=regrouped)

    def release(self, closing: Closing, trains: Dict[int, Train],
                uncovered: Optional[List[List[int]]] = None) -> None:
        """The next window's orders out, then the round's record and reports (the ranks train
        again before the observers take their time); a round that reached max_nonfinite saves
        (`uncovered`: what of the epoch the consensus lacks) and ends the run."""
        for rank, order in trains.items():
            self.ctx.send(rank, order)
        self.book.observe(closing.epoch, closing.sync_ms, closing.divergence, closing.window)
        self.book.maybe_report(closing.epoch, closing.epoch_tally)
        if closing.stop:  # every rank has adopted the consensus by now: that is what gets saved
            self.ledger.fail(closing.epoch, uncovered)

    def _complete_round(self, sync_sent: bool) -> Tuple[Optional[float], bool]:
        """SyncNow to the survivors until one round completes on all of them: a death during
        the reduce (ReduceFailed, or a rank lost) regroups and retries the same round; each
        rank restores its pre-reduce replica before the retry. (the divergence, whether the
        survivors regrouped)."""
        began, regrouped = time.monotonic(), False
        while True:
            if self.members.regroup_needed:
                self.members.regroup()
                self.ctx.link.drop_reduce_answers()
                regrouped, sync_sent = True, False
            asked = set(self.members.alive)
            for rank in sorted(asked) if not sync_sent else ():
                self.ctx.send(rank, self.book.sync_now(self.book.round, self.book.global_step))
            sync_sent = False
            divergences, failed = self._collect(asked)
            if not failed and not self.members.regroup_needed:
                return (max(divergences) if divergences else None), regrouped
            self.members.regroup_needed = True
            if time.monotonic() - began > self.book.stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self.book.round} did not complete")

    def _collect(self, asked: Set[int]) -> Tuple[List[float], bool]:
        """Each asked survivor's answer to this round: the divergences measured, and whether
        the round failed (a ReduceFailed, or a member lost)."""
        divergences: List[float] = []
        failed = False
        answered: Set[int] = set()
        round_ = self.book.round
        while not asked & self.members.alive <= answered:
            msg = self.ctx.next(expect=(Reduced, ReduceFailed), accept=lambda m: m.round <= round_)
            if msg is None:
                failed = True  # the round lost a member: regroup and retry it
                continue
            if msg.round != round_ or msg.rank not in asked:
                continue
            answered.add(msg.rank)
            if isinstance(msg, ReduceFailed):
                failed = True
            elif not msg.finite:  # it gave weight 0; its distance to the consensus means nothing
                self.ledger.note_parameters(msg.rank)
            else:
                if msg.divergence == msg.divergence:  # NaN: not measured at this reduce
                    divergences.append(msg.divergence)
                self.book.alignment[msg.rank] = (msg.cosine, msg.magnitude)
        return divergences, failed
