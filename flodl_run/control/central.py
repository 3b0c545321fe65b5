"""The central round of the coordinator backend (cpu_* modes): the ranks' snapshots in (through
frames or shared-memory slabs), averaged here on CPU, the consensus out as each rank's Update
(with its next orders folded in), and the snapshot timeout that leaves a late rank out.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

from flodl_run.averaging.central import CentralAverager, CentralResult, Snapshot
from flodl_run.averaging.frames import as_frame, dtype_names, from_frames
from flodl_run.averaging.shm import Mapper, Slab
from flodl_run.contracts.wire import Received, SnapshotTaken, Train, Update
from flodl_run.control.context import Members, RunContext
from flodl_run.control.nonfinite import NonfiniteLedger
from flodl_run.control.rounds import BookedRound, Closing, RoundBook
from flodl_run.control.runstate import RunAborted, ShutdownWithSave
from flodl_run.control.tallies import EpochTally, WindowTally


class CentralRound(BookedRound):
    """Owns: the snapshot-timeout state (ranks left out of a round, the steps they owe, the
    ranks `late` this round) and the shared-memory state (the mapper of the ranks' slabs,
    which ranks use it, the update slab). Given: the run context (link, recorder, config);
    the membership (who is alive); the central averager; the round book; the non-finite
    ledger; and where this run's slabs live (`shm_prefix`: ranks on the launcher's host, or
    None)."""

    def __init__(self, ctx: RunContext, *, members: Members, averager: CentralAverager,
                 book: RoundBook, ledger: NonfiniteLedger, shm_prefix: Optional[str]):
        self.ctx, self.members, self.averager = ctx, members, averager
        self.book, self.ledger = book, ledger
        self.config, self.recorder, self.observer = ctx.config, ctx.recorder, ctx.observer
        self._shm_prefix = shm_prefix
        self._shm = Mapper(shm_prefix)
        self.shm_ranks: Set[int] = set()  # ranks whose last snapshot came through shared memory
        self._update_slab: Optional[Slab] = None
        # snapshot_timeout_secs: ranks left out of a round's average (rank -> that round), the
        # steps their late snapshots carried (folded into their next snapshot), and the ranks
        # left out of the round just finished (they get a no-op update).
        self._left_out: Dict[int, int] = {}
        self._owed: Dict[int, int] = {}
        self.late: Set[int] = set()

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def reduce(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, *,
               ahead: Dict[int, Train], sync_sent: bool = False, final: bool = False,
               fill: bool = False) -> Closing:
        """SyncNow to every rank, their snapshots averaged here, the window folded in and
        ElChe's report (`fill`: with the window's fill). `final`: the run's last reduce, which
        waits for every snapshot (nothing comes later to fold a late one into). `ahead` and
        `sync_sent` are the collective round's (no order goes ahead of a central round)."""
        book = self.book
        book.begin_round()
        began, began_ns = time.perf_counter(), self.recorder.now()
        self._order_snapshots()
        result = self._collect(window, wait_all=final)
        divergence = result.divergence if result else 0.0
        sync_ms = (time.perf_counter() - began) * 1000.0
        self.recorder.span("reduce", began_ns, book.round)
        book.fold(window, epoch_tally, self.late, ahead)
        book.report(window, sync_ms, divergence, fill_ms=window.fill_ms if fill else None)
        return Closing(epoch, window, epoch_tally, sync_ms, divergence,
                       stop=self.ledger.tally_nonfinite(), result=result)

    def release(self, closing: Closing, trains: Dict[int, Train],
                uncovered: Optional[List[List[int]]] = None) -> None:
        """The consensus out with the next window's orders, then the alignment, the round's
        record and reports; a round that reached max_nonfinite saves (`uncovered`: what of the
        epoch the consensus lacks) and ends the run."""
        self.send_updates(closing.result, trains)
        self.note_alignment()  # the ranks train again before the breakdown and the observers
        self.book.observe(closing.epoch, closing.sync_ms, closing.divergence, closing.window)
        self.book.maybe_report(closing.epoch, closing.epoch_tally)
        if closing.stop:  # every rank has adopted the consensus by now: that is what gets saved
            self.ledger.fail(closing.epoch, uncovered)

    def seed_center(self, taken: Received) -> None:
        """cpu_async: rank 0's initial weights (a SnapshotTaken with its frames) start the
        EASGD center."""
        self.averager.seed_center(self.snapshot(taken).params)

    def open_round(self) -> None:
        """cpu_async: a round begins while the ranks keep training (the gate opened)."""
        self.book.begin_round()
        self._order_snapshots()

    def _order_snapshots(self) -> None:
        for rank in sorted(self.alive):
            self.ctx.send(rank, self.book.sync_now(self.book.round, self.book.global_step))

    def average_in(self, snapshots: List[Snapshot], window: WindowTally, epoch: int) -> Closing:
        """cpu_async: the EASGD round over the snapshots in, their steps counted, and ElChe's
        report. The reduce's cost is the averaging: ranks keep training while SyncNow and their
        snapshots travel, so that latency (up to a slow batch) is not overhead. Counting it let
        Warmup double the anchor on noisy rounds (10 -> 80), and the big windows then left
        the fast rank idle at the round gate."""
        book = self.book
        began, began_ns = time.perf_counter(), self.recorder.now()
        result = self.averager.reduce(snapshots)
        sync_ms = (time.perf_counter() - began) * 1000.0
        self.recorder.span("reduce.average", began_ns, book.round)
        book.add_steps(sum(s.steps for s in snapshots))
        divergence = result.divergence if result else 0.0
        book.report(window, sync_ms, divergence, fill_ms=window.fill_ms)
        return Closing(epoch, window, EpochTally.empty(0), sync_ms, divergence,
                       stop=self.ledger.tally_nonfinite(), result=result)

    def release_async(self, closing: Closing,
                      save_point: Optional[Tuple[int, List[List[int]]]] = None) -> None:
        """cpu_async: the center out (no orders ride on it), the alignment and the round's
        record, the ranks left out forgiven; at max_nonfinite, save (`save_point`: the epoch
        the bundle names and what of it the center lacks) and end the run."""
        self.send_updates(closing.result, {})
        self.note_alignment()  # off the round trip the ranks wait for
        self.book.observe(closing.epoch, closing.sync_ms, closing.divergence, closing.window)
        self.clear_late()
        if closing.stop:
            self.ledger.fail(*save_point)

    def note_alignment(self) -> None:
        """The averager's breakdown of the last central reduce, for the round's record."""
        self.book.alignment = self.averager.breakdown()

    def clear_late(self) -> None:
        """The round that left ranks out is over: their no-op updates went out."""
        self.late = set()

    def _collect(self, window: WindowTally, wait_all: bool = False) -> Optional[CentralResult]:
        """Collect the ranks' snapshots and average them here, on CPU. snapshot_timeout_secs after
        the SyncNow, and once at least one is in, a rank still missing is left out of this
        average (`wait_all`: nobody is)."""
        snapshots: Dict[int, Snapshot] = {}
        began, began_ns = time.monotonic(), self.recorder.now()
        deadline = None if wait_all else began + self.config.snapshot_timeout_secs
        self.late = set()
        while not self.alive <= set(snapshots):
            if deadline is not None and snapshots and time.monotonic() >= deadline:
                self.leave_out(self.alive - set(snapshots))
                break
            taken = self.ctx.link.next_with_frames(expect=SnapshotTaken,
                                                   deadline=deadline if snapshots else None)
            if taken is None:
                continue
            snap = self.take_snapshot(taken, window.batches[taken.message.rank], allowance=0)
            if snap is not None:
                snapshots[snap.rank] = snap
            if time.monotonic() - began > self.book.stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self.book.round}: snapshots missing")
        snapshots = [snapshots[r] for r in sorted(self.alive) if r in snapshots]  # the dead's dropped
        self.recorder.span("reduce.collect", began_ns, self.book.round)
        averaging = self.recorder.now()
        result = self.averager.reduce(snapshots, out=self._update_buffers(snapshots))
        self.recorder.span("reduce.average", averaging, self.book.round)
        return result

    def take_snapshot(self, taken: Received, window_batches: int, allowance: int) -> Optional[Snapshot]:
        """The snapshot (a SnapshotTaken with its frames) for the round in flight, with the
        steps of a late one folded in; None for the late snapshot of a round that left its
        rank out (its steps become owed)."""
        message = taken.message
        rank = message.rank
        if self._left_out.get(rank) == message.round:
            del self._left_out[rank]
            self._owed[rank] = self._owed.get(rank, 0) + message.steps
            return None
        snap = self.snapshot(taken)
        self.check_snapshot(snap, window_batches, allowance)
        owed = self._owed.pop(rank, 0)
        if owed:
            snap = Snapshot(rank, snap.steps + owed, snap.params, snap.float_buffers)
            self.observer.on_event("snapshot_folded", f"round {self.book.round}: rank {rank}'s {owed} "
                                                      "steps from a round it missed fold in now")
        return snap

    def leave_out(self, late: Set[int]) -> None:
        """Ranks without a snapshot by the deadline: out of this round's average; the steps
        their late snapshots carry fold into their next one, and they get a no-op update."""
        for rank in late:
            self._left_out[rank] = self.book.round
        self.late = set(late)
        self.observer.on_event(
            "snapshot_late", f"round {self.book.round}: rank(s) {sorted(late)} sent no snapshot within "
                             f"snapshot_timeout_secs={self.config.snapshot_timeout_secs:g}; left out "
                             "of this average, their steps fold into their next snapshot")

    def check_snapshot(self, snap: Snapshot, window_batches: int, allowance: int) -> None:
        """A rank may not train past its window plus `allowance` before a reduce: cpu_sync and
        cpu_cadence block (allowance 0); cpu_async has its overshoot budget."""
        if snap.steps > window_batches + allowance:
            raise RunAborted("failed", f"rank {snap.rank} round {self.book.round}: {snap.steps} steps "
                                       f"since the last reduce, budget {window_batches} + {allowance}")

    def snapshot(self, taken: Received) -> Snapshot:
        """The rank's parameters: mapped from its shared-memory slab (valid until its next
        snapshot, which comes only after it applied this round's update) or from the frames."""
        message, frames = taken.message, taken.payloads
        if message.shm:
            self.shm_ranks.add(message.rank)
            params = self._shm.tensors(message.shm, message.dtypes, message.numels)
            count = 0
        else:
            self.shm_ranks.discard(message.rank)
            count = len(message.dtypes)
            params = from_frames(frames[:count], message.dtypes)
        buffers = from_frames(frames[count:], ["torch.float32"])[0]
        counts = self.ledger.note_snapshot(message.rank, message.finite)
        return Snapshot(message.rank, message.steps, params, buffers, counts)

    def param_transport(self) -> List[str]:
        """How each rank's last snapshot came: "shm" or "frames"."""
        return ["shm" if r in self.shm_ranks else "frames" for r in range(self.ctx.world_size)]

    def send_updates(self, result: Optional[CentralResult], trains: Dict[int, Train]) -> None:
        """Every rank gets the result (blend 1.0 = overwrite; EASGD alpha in cpu_async): through
        the coordinator's shared-memory slab to ranks that sent theirs that way, else as frames.
        The slab is rewritten next round, after every rank has applied this one."""
        began_ns = self.recorder.now()
        params: List[memoryview] = []
        extra: List[memoryview] = []
        dtypes: List[str] = []
        blend, buffers, stepped = 0.0, False, False  # nobody trained: nothing to adopt
        slab = None
        if result is not None:
            alpha = self.averager.alpha
            blend, stepped = (alpha if alpha is not None else 1.0), result.outer_stepped
            params, dtypes = [as_frame(p) for p in result.params], dtype_names(result.params)
            buffers = result.float_buffers is not None
            if buffers:
                extra.append(as_frame(result.float_buffers))
            if self.shm_ranks & self.alive:
                slab = self._slab_for_updates(result.params)
        shared = {} if slab is None else {"shm": slab.paths, "numels": [t.numel() for t in slab.tensors]}
        reset = self.ledger.resets(self.alive) if result is not None else set()
        round_, step = self.book.round, self.book.global_step
        for rank in sorted(self.alive):
            if rank in self.late:  # left out: keep its own parameters, just move on
                self.ctx.send(rank, Update(round_, step, 0.0, False, [], False, trains.get(rank)))
                continue
            via_shm = bool(shared) and rank in self.shm_ranks
            mix = 1.0 if rank in reset else blend  # a NaN replica is replaced, never blended
            self.ctx.send(rank, Update(round_, step, mix, buffers, dtypes, stepped,
                                       trains.get(rank), reset=rank in reset, **(shared if via_shm else {})),
                          extra if via_shm else params + extra)
        self.recorder.span("reduce.send", began_ns, round_)

    def _update_buffers(self, snapshots: List[Snapshot]) -> Optional[List]:
        """The update slab's tensors to build the consensus in, when ranks read it from there
        (every rank has applied the previous round's update before sending this snapshot)."""
        if not snapshots or not (self.shm_ranks & self.alive):
            return None
        slab = self._slab_like(snapshots[0].params)
        return slab.tensors if slab is not None else None

    def _slab_for_updates(self, params: List) -> Optional[Slab]:
        """The coordinator's slab holding `params` (copied in unless the consensus was built
        there; None: frames)."""
        slab = self._slab_like(params)
        if slab is not None and any(t.data_ptr() != p.data_ptr() for t, p in zip(slab.tensors, params)):
            slab.write(params)
        return slab

    def _slab_like(self, params: List) -> Optional[Slab]:
        """The coordinator's update slab sized like `params` (created on first use)."""
        slab = self._update_slab
        shape = [(p.numel(), p.dtype) for p in params]
        if slab is None or [(t.numel(), t.dtype) for t in slab.tensors] != shape:
            if slab is not None:
                slab.unlink()
            slab = self._update_slab = Slab.create(self._shm_prefix, "update", params)
            if slab is None:
                self.shm_ranks.clear()  # no room: frames for everyone
        return slab
