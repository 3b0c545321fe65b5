"""The start of a run: the ranks join (their reports, the train set's size, the nodes), ElChe
is seeded, a resume continues a bundle's trajectory, and the course of epochs to train from
there. What the epochs then train is the mode's part; the bundle format is contracts'.
"""

from __future__ import annotations

import time
from typing import List, Optional

from flodl_run.contracts.wire import RankJoined, SnapshotTaken
from flodl_run.control.central import CentralRound
from flodl_run.control.context import RunContext
from flodl_run.control.dispatch import Course, EpochPool
from flodl_run.control.membership import Membership
from flodl_run.control.pump import Pump
from flodl_run.control.rounds import RoundBook
from flodl_run.control.runstate import RunAborted
from flodl_run.control.saving import Saving
from flodl_run.elche.balancer import ElChe
from flodl_run.hardware.hostinfo import merge_nodes


class Joining:
    """Owns where a resume starts (`start_epoch`, what of it the bundle lacked) and the events
    noted while the ranks joined (published once training starts). Given: the run context
    (config, summary, observer, balance: ElChe seated there; the train set's size set
    there); the pump (the join reports); the membership (who failed while joining); the
    central round (cpu_async's initial weights); saving (a bundle restored); and the round
    book (its counters resumed)."""

    def __init__(self, ctx: RunContext, *, pump: Pump, members: Membership, central: CentralRound,
                 saving: Saving, book: RoundBook):
        self.ctx, self.pump, self.members, self.central = ctx, pump, members, central
        self.saving, self.book = saving, book
        self.config, self.world_size = ctx.config, ctx.world_size
        self.start_epoch = 0
        self.resume_uncovered: List[List[int]] = []
        self.pending_events: List[tuple] = []

    def await_ranks(self, seeds_center: bool, times_reduce: bool) -> None:
        """Every rank joined (and, `seeds_center`, rank 0's initial weights seeded the EASGD
        center); ElChe seeded (from the reduce the ranks timed, `times_reduce`), and a resume
        restored."""
        deadline = time.monotonic() + max(300.0, self.config.heartbeat_timeout_secs)
        seeded, joined = not seeds_center, self.pump.joined
        while len(joined) < self.world_size or not seeded:
            if time.monotonic() > deadline:
                raise RunAborted("failed", f"only {len(joined)} of {self.world_size} ranks joined")
            received = self.pump.next_with_frames(expect=(RankJoined, SnapshotTaken))
            if received is None:
                raise RunAborted("failed", self.members.failed_ranks(
                    f"a rank died before all {self.world_size} joined"))
            if isinstance(received.message, SnapshotTaken):  # cpu_async: rank 0's initial weights
                self.central.seed_center(received)
                seeded = True
        self._note_joined()
        balance = self.ctx.balance
        balance.elche = ElChe(self.config.elche, self.world_size, epoch_batches=self.epoch_batches(0),
                              reduce_ms=self._reduce_ms() if times_reduce else None)
        if self.config.resume_from:
            self._restore(self.config.resume_from)
        balance.plan = balance.elche.plan()

    def _note_joined(self) -> None:
        """The train set's size (every rank must see the same), the devices and the nodes."""
        joined, summary = self.pump.joined, self.ctx.summary
        sizes = {j.num_samples for j in joined.values()}
        if len(sizes) != 1:
            raise RunAborted("failed", f"ranks see different train set sizes: {sorted(sizes)}")
        self.ctx.num_samples = sizes.pop()
        summary.devices = [joined[r].device_name for r in range(self.world_size)]
        nodes = merge_nodes(joined[r].node for r in range(self.world_size) if joined[r].node)
        summary.nodes = [node.record() for node in nodes]
        self.ctx.observer.on_nodes(nodes)

    def _restore(self, stem: str) -> None:
        """Continue a bundle's trajectory: epoch, step, round, ElChe (no warm-up re-run)."""
        meta = self.saving.restore(stem, self.epoch_batches(0))
        self.start_epoch, self.resume_uncovered = meta.epoch, meta.coverage.uncovered
        self.book.resume(meta.global_step, meta.sync_round)
        span = self.ctx.epoch_span(meta.epoch)  # only now known: the train set's size came with the ranks
        for i, (pass_index, start, end) in enumerate(meta.coverage.uncovered):
            if pass_index != span.pass_index or start < span.start or end > span.end:
                raise RunAborted("failed", f"resume_from: coverage.uncovered.{i} "
                                           f"{[pass_index, start, end]} is not within epoch {meta.epoch} "
                                           f"(pass {span.pass_index}, samples {span.start}-{span.end}): "
                                           f"an edited or damaged bundle")

    def _reduce_ms(self) -> Optional[float]:
        """The slowest rank's view of one reduce timed before training (collective modes)."""
        timed = [j.reduce_ms for j in self.pump.joined.values() if j.reduce_ms is not None]
        if not timed:
            return None
        self.pending_events.append(("reduce_timed", f"one reduce before training: {max(timed):.1f} ms"))
        return max(timed)

    def epoch_batches(self, epoch: int) -> int:
        """The batches of batch_size the epoch's samples make."""
        return -(-self.ctx.epoch_span(epoch).size // self.config.batch_size)

    def course(self, total: int) -> Course:
        """The epochs to train from the resume point on: the whole epoch, or of a resumed
        mid-epoch bundle only what it left uncovered (its progress counting on from the
        batches the bundle holds)."""
        start, uncovered = self.start_epoch, self.resume_uncovered
        spans = [self.ctx.epoch_span(e) for e in range(total)]
        pools = [EpochPool(0, []) if e < start else EpochPool.whole(span) for e, span in enumerate(spans)]
        if uncovered and start < total:
            pools[start] = EpochPool(spans[start].pass_index, [(s, e) for _, s, e in uncovered])
        course = Course(spans, pools, start, uncovered)
        if self.config.resume_from:
            course.batches_before[start] = self._batches_before()
        return course

    def _batches_before(self) -> int:
        """The batches of the resumed epoch the bundle holds (none when it resumes an epoch
        whole); the progress of that epoch counts on from them."""
        if not self.resume_uncovered:
            return 0
        size = self.config.batch_size
        left = sum(-(-(end - start) // size) for _, start, end in self.resume_uncovered)
        return max(0, self.epoch_batches(self.start_epoch) - left)
