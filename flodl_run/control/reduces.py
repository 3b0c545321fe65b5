"""Reduces: the collective round with regroup-and-retry, the coordinator backend's central
round (snapshots in, through frames or shared memory; the consensus out), ElChe's report,
updates folded with the next chunk, non-finite ranks, and sub-epoch reports. What the ranks
train between reduces is the windows' part (or the async loop's).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from flodl_run.averaging.central import CentralAverager, CentralResult, Snapshot
from flodl_run.averaging.frames import as_frame, dtype_names, from_frames
from flodl_run.averaging.shm import Mapper, Slab
from flodl_run.config.schema import Mode, lr_factor
from flodl_run.contracts.scalars import roll_up
from flodl_run.contracts.summary import ReduceRecord, ReportRecord
from flodl_run.contracts.wire import (
    Reduced,
    ReduceFailed,
    SnapshotTaken,
    SyncNow,
    Train,
    Update,
    WindowDone,
)
from flodl_run.control.context import Members, Run, RunContext
from flodl_run.control.runstate import RunAborted, ShutdownWithSave
from flodl_run.control.tallies import EpochTally, WindowTally
from flodl_run.elche.balancer import ReduceReport

DIVERGENCE_EVERY = 16
log = logging.getLogger(__name__)


class Reduces:
    """One consensus round, then ElChe's plan.

    Owns: the round and global-step counters, the reduce times, the snapshot-timeout state
    (ranks left out of a round, the steps they owe, the ranks late this round), the non-finite
    bookkeeping (ranks found non-finite, the streak, the replicas the next update replaces),
    each rank's alignment to the consensus, and the shared-memory state of the coordinator
    backend (the mapper of the ranks' slabs, which ranks use it, the update slab).
    Given: the run context (its balance: ElChe's report and plan; its holdings, reset after
    each round; `payloads()`: the frames of the message `next` returned last); the
    membership (who is alive; a regroup due); the central averager; where this run's
    shared-memory slabs live (`shm_prefix`: ranks on the launcher's host, or None); and what
    the run offers around a reduce (`run`: regroup, save_bundle, uncovered_now,
    epoch_batches)."""

    def __init__(self, ctx: RunContext, *, members: Members, averager: CentralAverager,
                 shm_prefix: Optional[str], run: Run):
        self.ctx, self.members, self.averager, self.run = ctx, members, averager, run
        self.world_size, self.mode, self.config = ctx.world_size, ctx.mode, ctx.config
        self.balance, self.holdings = ctx.balance, ctx.holdings
        self.recorder, self.summary, self.observer = ctx.recorder, ctx.summary, ctx.observer
        self.round = 0
        self.global_step = 0
        self.sync_ms: List[float] = []
        self._shm_prefix = shm_prefix
        self._shm = Mapper(shm_prefix)
        self.shm_ranks: Set[int] = set()  # ranks whose last snapshot came through shared memory
        self._update_slab: Optional[Slab] = None
        self._nonfinite: Dict[int, str] = {}  # rank -> "loss" | "parameters", since the last reduce
        # rank -> (cosine, magnitude) of its window update against the consensus, this reduce
        self._alignment: Dict[int, Tuple[Optional[float], Optional[float]]] = {}
        self._nonfinite_streak = 0  # reduces in a row with a non-finite rank
        self._skipped = 0  # nccl_sync (gradients): steps skipped in the window just closed
        self._reset_next: Set[int] = set()  # non-finite ranks the next update replaces
        self._resetting: Set[int] = set()  # ... until their next snapshot (NaN windows in flight)
        # snapshot_timeout_secs: ranks left out of a round's average (rank -> that round), the
        # steps their late snapshots carried (folded into their next snapshot), and the ranks
        # left out of the round just finished (they get a no-op update).
        self._left_out: Dict[int, int] = {}
        self._owed: Dict[int, int] = {}
        self.late: Set[int] = set()

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def resume(self, global_step: int, round_: int) -> None:
        """Continue a bundle's counters."""
        self.global_step, self.round = global_step, round_

    def trajectory(self) -> Tuple[int, int]:
        """(global step, round): where the run stands, as a bundle records it."""
        return self.global_step, self.round

    def begin_round(self) -> int:
        """A reduce begins (the async loop's gate opened): its round number."""
        self.round += 1
        return self.round

    def add_steps(self, steps: int) -> None:
        """Steps that just went into the consensus."""
        self.global_step += steps

    def clear_late(self) -> None:
        """The round that left ranks out is over: their no-op updates went out."""
        self.late = set()

    def note_window(self, done: WindowDone) -> None:
        """A window's loss came in: a non-finite one marks its rank (unless it is being reset)."""
        if not math.isfinite(done.loss_sum) and done.rank not in self._resetting:
            self._nonfinite.setdefault(done.rank, "loss")

    def nonfinite_pending(self) -> bool:
        """A rank was found non-finite since the last reduce (the next one acts on it)."""
        return bool(self._nonfinite)

    def average(self, snapshots: List[Snapshot]) -> Optional[CentralResult]:
        """cpu_async: the EASGD round over the snapshots in (the async loop times it)."""
        return self.averager.reduce(snapshots)

    def note_alignment(self) -> None:
        """The averager's breakdown of the last central reduce, for `observe_reduce`."""
        self._alignment = self.averager.breakdown()

    def reduce(self, window: WindowTally, epoch_tally: EpochTally, epoch: int,
               plan_next: Optional[Callable[[], Dict[int, Train]]] = None,
               sync_sent: bool = False, final: bool = False,
               ahead: Callable[[], Dict[int, Train]] = dict) -> Dict[int, Train]:
        """Order the consensus, wait for every rank, let ElChe plan, then send the next window
        (`plan_next`) — after the collective, or folded into the coordinator's update.
        `sync_sent`: the SyncNow already rode on the window's Train orders (nccl_sync).
        `final`: the run's last reduce, which waits for every snapshot (nothing comes later
        to fold a late one into)."""
        self.begin_round()
        began, began_ns = time.perf_counter(), self.recorder.now()
        result = None
        if self.mode.is_collective:
            divergence = self._collective_round(sync_sent)
        else:
            for rank in sorted(self.alive):
                self.ctx.send(rank, self.sync_now(self.round, self.global_step))
            result = self._central_round(window, wait_all=final)
            divergence = result.divergence if result else 0.0
        sync_ms = (time.perf_counter() - began) * 1000.0
        self.recorder.span("reduce", began_ns, self.round)
        window.drop(set(range(self.world_size)) - self.alive)  # the dead's work is redone
        # A rank left out of the average still owes what it trained since its last fold.
        self.holdings.reset({r: self.holdings.of(r) if r in self.late else [] for r in self.alive})
        for rank, order in ahead().items():  # sent ahead: part of the next window
            if rank in self.alive:
                self.holdings.note(rank, order.epoch, order.slices)
        self.add_steps(sum(window.batches))
        epoch_tally.add(window)
        self.after_reduce(window, epoch, sync_ms, divergence)
        stop = self.tally_nonfinite()
        trains = plan_next() if plan_next is not None and not stop else {}
        if result is not None or not self.mode.is_collective:
            self.send_updates(result, trains)
        else:
            for rank, order in trains.items():
                self.ctx.send(rank, order)
        # the ranks train again before the breakdown of D and the observers (tracking, records,
        # progress) take their time
        if not self.mode.is_collective:
            self.note_alignment()
        self.observe_reduce(epoch, sync_ms, divergence, window)
        self._maybe_report(epoch, epoch_tally)
        if stop:  # every rank has adopted the consensus by now: that is what gets saved
            self.fail_nonfinite(epoch, self.run.uncovered_now())
        return trains

    def note_skipped(self, rank: int, skipped: int) -> None:
        """nccl_sync (gradients): steps every rank skipped in a window for a non-finite
        averaged gradient (each rank reports the same count)."""
        self._skipped = max(self._skipped, skipped)

    def close_exact_window(self, window: WindowTally, epoch_tally: EpochTally, epoch: int, steps: int,
                           per_batch: Tuple[List[float], List[int]], sync_ms: float) -> None:
        """nccl_sync (gradients): a window of `steps` global steps is in every survivor's
        state. One round of bookkeeping: the counters, the holdings folded, ElChe's report
        (`per_batch`: the timing in its unit), the skipped steps and the observers."""
        self.begin_round()
        self.sync_ms.append(sync_ms)
        self.holdings.reset({rank: [] for rank in self.alive})
        self.add_steps(steps)
        epoch_tally.add(window)
        lr = next((x for x in window.lr if x is not None), None)
        walls, batches = per_batch
        plan = self.balance.on_reduce(ReduceReport(wall_ms=walls, batches=batches, sync_ms=sync_ms, lr=lr))
        self.summary.anchor_trajectory.append(plan.anchor)
        stop = self._tally_skipped()
        self.observe_reduce(epoch, sync_ms, None)
        self._maybe_report(epoch, epoch_tally)
        if stop:
            self.fail_nonfinite(epoch, self.run.uncovered_now())

    def _tally_skipped(self) -> bool:
        """Windows in a row with a skipped step: True when that reaches max_nonfinite."""
        skipped, self._skipped = self._skipped, 0
        if not skipped:
            self._nonfinite_streak = 0
            return False
        self._nonfinite_streak += 1
        self.summary.nonfinite.append({"round": self.round, "rank": None, "what": f"gradient x{skipped}"})
        self.observer.on_event("rank_nonfinite", f"round {self.round}: the averaged gradient was "
                                                 f"non-finite (NaN/inf) in {skipped} step(s): every "
                                                 "rank skipped them")
        return self._nonfinite_streak >= self.config.max_nonfinite

    def _collective_round(self, sync_sent: bool = False) -> Optional[float]:
        """SyncNow to the survivors until one round completes on all of them: a death during
        the reduce (ReduceFailed, or a rank lost) regroups and retries the same round; each
        rank restores its pre-reduce replica before the retry. With `sync_sent` the first
        attempt's SyncNow went out with the Train orders."""
        began = time.monotonic()
        while True:
            if self.members.regroup_needed:
                self.run.regroup()
                sync_sent = False
            asked = set(self.alive)
            for rank in sorted(asked) if not sync_sent else ():
                self.ctx.send(rank, self.sync_now(self.round, self.global_step))
            sync_sent = False
            divergences, failed = self._collect_reduced(asked)
            if not failed and not self.members.regroup_needed:
                return max(divergences) if divergences else None
            self.members.regroup_needed = True
            if time.monotonic() - began > self._stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self.round} did not complete")

    def _collect_reduced(self, asked: Set[int]) -> tuple:
        divergences: List[float] = []
        failed = False
        answered: Set[int] = set()
        while not asked & self.alive <= answered:
            msg = self.ctx.next(expect=(Reduced, ReduceFailed), accept=lambda m: m.round <= self.round)
            if msg is None:
                failed = True  # the round lost a member: regroup and retry it
                continue
            if msg.round != self.round or msg.rank not in asked:
                continue
            answered.add(msg.rank)
            if isinstance(msg, ReduceFailed):
                failed = True
            elif not msg.finite:  # it gave weight 0; its distance to the consensus means nothing
                self._nonfinite.setdefault(msg.rank, "parameters")
            else:
                if msg.divergence == msg.divergence:  # NaN: not measured at this reduce
                    divergences.append(msg.divergence)
                self._alignment[msg.rank] = (msg.cosine, msg.magnitude)
        return divergences, failed

    def sync_now(self, round_: int, global_step: int) -> SyncNow:
        """The reduce order of `round_`. nccl_sync reduces after every step and takes no verdicts,
        so it measures the divergence at one reduce in DIVERGENCE_EVERY (the others report
        None): on a short step the extra pass and device read would cost a tenth of it."""
        measure = self.mode is not Mode.nccl_sync or round_ % DIVERGENCE_EVERY == 1
        return SyncNow(round_, global_step, self._lr_factor(), measure)

    def _lr_factor(self) -> float:
        """Linear LR scaling for the ranks alive now: a smaller cohort averages fewer steps."""
        return lr_factor(len(self.alive), self.config.lr_scale_ratio)

    def _stall_ceiling_s(self) -> float:
        """A reduce stuck past max(10 x heartbeat timeout, 300 s) saves and stops."""
        return max(10 * self.config.heartbeat_timeout_secs, 300.0)

    def after_reduce(self, window: WindowTally, epoch: int, sync_ms: float, divergence: float) -> None:
        """Feed ElChe one ReduceReport; the caller publishes what it decided
        (`_observe_reduce`) once the next orders are out."""
        self.sync_ms.append(sync_ms)
        lr = next((x for x in window.lr if x is not None), None)
        plan = self.balance.on_reduce(ReduceReport(
            wall_ms=window.wall_ms, batches=window.batches, sync_ms=sync_ms,
            fill_ms=window.fill_ms if self.mode.is_progressive else None,
            divergence=divergence, lr=lr))
        self.summary.anchor_trajectory.append(plan.anchor)

    # ---- the coordinator backend (cpu_* modes) -----------------------------------------------

    def _central_round(self, window: WindowTally, wait_all: bool = False) -> Optional[CentralResult]:
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
            taken = self.ctx.next(expect=SnapshotTaken, deadline=deadline if snapshots else None)
            if taken is None:
                continue
            snap = self.take_snapshot(taken, window.batches[taken.rank], allowance=0)
            if snap is not None:
                snapshots[snap.rank] = snap
            if time.monotonic() - began > self._stall_ceiling_s():
                raise ShutdownWithSave("reduce_stall", f"round {self.round}: snapshots missing")
        snapshots = [snapshots[r] for r in sorted(self.alive) if r in snapshots]  # the dead's dropped
        self.recorder.span("reduce.collect", began_ns, self.round)
        averaging = self.recorder.now()
        result = self.averager.reduce(snapshots, out=self._update_buffers(snapshots))
        self.recorder.span("reduce.average", averaging, self.round)
        return result

    def take_snapshot(self, taken: SnapshotTaken, window_batches: int,
                      allowance: int) -> Optional[Snapshot]:
        """The snapshot for the round in flight, with the steps of a late one folded in; None
        for the late snapshot of a round that left its rank out (its steps become owed)."""
        rank = taken.rank
        if self._left_out.get(rank) == taken.round:
            del self._left_out[rank]
            self._owed[rank] = self._owed.get(rank, 0) + taken.steps
            return None
        snap = self.snapshot(taken)
        self.check_snapshot(snap, window_batches, allowance)
        owed = self._owed.pop(rank, 0)
        if owed:
            snap = Snapshot(rank, snap.steps + owed, snap.params, snap.float_buffers)
            self.observer.on_event("snapshot_folded", f"round {self.round}: rank {rank}'s {owed} "
                                                      "steps from a round it missed fold in now")
        return snap

    def leave_out(self, late: Set[int]) -> None:
        """Ranks without a snapshot by the deadline: out of this round's average; the steps
        their late snapshots carry fold into their next one, and they get a no-op update."""
        for rank in late:
            self._left_out[rank] = self.round
        self.late = set(late)
        self.observer.on_event(
            "snapshot_late", f"round {self.round}: rank(s) {sorted(late)} sent no snapshot within "
                             f"snapshot_timeout_secs={self.config.snapshot_timeout_secs:g}; left out "
                             "of this average, their steps fold into their next snapshot")

    def _update_buffers(self, snapshots: List[Snapshot]) -> Optional[List]:
        """The update slab's tensors to build the consensus in, when ranks read it from there
        (every rank has applied the previous round's update before sending this snapshot)."""
        if not snapshots or not (self.shm_ranks & self.alive):
            return None
        slab = self._slab_like(snapshots[0].params)
        return slab.tensors if slab is not None else None

    def check_snapshot(self, snap: Snapshot, window_batches: int, allowance: int) -> None:
        """A rank may not train past its window plus `allowance` before a reduce: cpu_sync and
        cpu_cadence block (allowance 0); cpu_async has its overshoot budget."""
        if snap.steps > window_batches + allowance:
            raise RunAborted("failed", f"rank {snap.rank} round {self.round}: {snap.steps} steps "
                                       f"since the last reduce, budget {window_batches} + {allowance}")

    def snapshot(self, taken: SnapshotTaken) -> Snapshot:
        """The rank's parameters: mapped from its shared-memory slab (valid until its next
        snapshot, which comes only after it applied this round's update) or from the frames."""
        if taken.shm:
            self.shm_ranks.add(taken.rank)
            params = self._shm.tensors(taken.shm, taken.dtypes, taken.numels)
            count = 0
        else:
            self.shm_ranks.discard(taken.rank)
            count = len(taken.dtypes)
            params = from_frames(self.ctx.payloads()[:count], taken.dtypes)
        buffers = from_frames(self.ctx.payloads()[count:], ["torch.float32"])[0]
        self._resetting.discard(taken.rank)  # it applied its reset update before this snapshot
        if not taken.finite:
            self._nonfinite.setdefault(taken.rank, "parameters")
        return Snapshot(taken.rank, taken.steps, params, buffers, taken.rank not in self._nonfinite)

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
            alpha = self.config.elche.easgd_alpha if self.mode is Mode.cpu_async else None
            blend, stepped = (alpha if alpha is not None else 1.0), result.outer_stepped
            params, dtypes = [as_frame(p) for p in result.params], dtype_names(result.params)
            buffers = result.float_buffers is not None
            if buffers:
                extra.append(as_frame(result.float_buffers))
            if self.shm_ranks & self.alive:
                slab = self._slab_for_updates(result.params)
        shared = {} if slab is None else {"shm": slab.paths, "numels": [t.numel() for t in slab.tensors]}
        reset = self._reset_next & self.alive if result is not None else set()
        self._resetting |= reset
        for rank in sorted(self.alive):
            if rank in self.late:  # left out: keep its own parameters, just move on
                self.ctx.send(rank, Update(self.round, self.global_step, 0.0, False, [], False,
                                        trains.get(rank)))
                continue
            via_shm = bool(shared) and rank in self.shm_ranks
            mix = 1.0 if rank in reset else blend  # a NaN replica is replaced, never blended
            self.ctx.send(rank, Update(self.round, self.global_step, mix, buffers, dtypes, stepped,
                                    trains.get(rank), reset=rank in reset, **(shared if via_shm else {})),
                       extra if via_shm else params + extra)
        self.recorder.span("reduce.send", began_ns, self.round)

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

    # ---- non-finite values -------------------------------------------------------------------

    def tally_nonfinite(self) -> bool:
        """Log the ranks found non-finite since the last reduce (`rank_nonfinite`; they gave
        weight 0, and the coordinator backend's next update replaces their replica and resets
        their optimizer) and count reduces in a row that had one: True when that reaches
        max_nonfinite and the run must stop."""
        found = {r: what for r, what in self._nonfinite.items() if r in self.alive}
        self._nonfinite, self._reset_next = {}, set(found)
        if not found:
            self._nonfinite_streak = 0
            return False
        self._nonfinite_streak += 1
        for rank, what in sorted(found.items()):
            self.summary.nonfinite.append({"round": self.round, "rank": rank, "what": what})
            self.observer.on_event("rank_nonfinite", f"round {self.round}: rank {rank}'s {what} "
                                                     f"non-finite (NaN/inf): weight 0")
        return self._nonfinite_streak >= self.config.max_nonfinite

    def fail_nonfinite(self, epoch: int, uncovered: List[List[int]]) -> None:
        """Stop as failed, saving the consensus the ranks hold when it is finite (ranks refuse
        to write NaN, so an earlier bundle is never replaced by one)."""
        detail = (f"non-finite values in {self._nonfinite_streak} reduces in a row "
                  f"(max_nonfinite={self.config.max_nonfinite})")
        try:
            stem = self.run.save_bundle("nonfinite", epoch, uncovered)
            saved = f"saved the last finite consensus: {stem}" if stem else "not saved (no save_path)"
        except RunAborted as exc:
            saved = f"no finite consensus to save ({exc.reason}); an earlier bundle stays as it was"
        raise RunAborted("failed", f"{detail}; {saved}")

    def _maybe_report(self, epoch: int, tally: EpochTally) -> None:
        """reports_per_epoch: one sub-epoch report each time the epoch passes another 1/n of its
        samples (in samples, not batches: nccl_sync's ranks each count a batch of every step, and
        a step's last one is short, so batches overran the epoch's, 102% and more)."""
        n = self.config.reports_per_epoch
        if not n:
            return
        fraction = sum(tally.samples) / max(self.run.epoch_samples(epoch), 1)
        if tally.reports >= n or fraction < (tally.reports + 1) / n:
            return
        tally.reports = min(n, int(fraction * n + 1e-9))
        counted = sum(tally.loss_batches) - tally.reported_loss_batches  # the batches that gave a loss
        loss = sum(tally.loss_sum) - tally.reported_loss
        tally.reported_loss, tally.reported_loss_batches = sum(tally.loss_sum), sum(tally.loss_batches)
        self.observer.on_report(ReportRecord(
            epoch, tally.reports, fraction, self.global_step, loss / max(counted, 1),
            roll_up(tally.scalars, self.config.scalar_reductions)))

    def observe_reduce(self, epoch: int, sync_ms: float, divergence: float,
                       window: Optional[WindowTally] = None) -> None:
        """The reduce's record (ElChe's plan for the next window, the alignment, what the
        window's deadlines left), then ElChe's events."""
        plan = self.balance.plan
        parts = [self._alignment.get(r, (None, None)) for r in range(self.world_size)]
        self._alignment = {}
        self.observer.on_reduce(ReduceRecord(
            self.round, epoch, sync_ms, divergence, plan.anchor, plan.anchor_rank,
            list(plan.batch_counts), plan.overhead, str(plan.verdict), plan.phase.name.lower(),
            plan.nudge_factor, [c for c, _ in parts], [m for _, m in parts],
            list(window.left) if window is not None else []))
        for event in plan.events:
            self.observer.on_event(event.kind, event.message)
