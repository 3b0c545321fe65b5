"""The rank's part in a collective reduce (nccl_sync, nccl_cadence): average in place with the
cohort, step the outer optimizer, and undo all of it when the coordinator retries the round
after a death.

Owns what a retry needs (the pre-reduce replica, the optimizer's moments when they ride) and,
under nccl_cadence, the parameters this window began from (the divergence's cosine and
magnitude). The group is RankGroup's; when to reduce is the coordinator's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from flodl_run.averaging.collective import (
    CollectiveError,
    ReduceOutcome,
    all_finite,
    consensus_weight,
    weighted_reduce_,
)
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.moments import FlatMoments
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.wire import Reduced, ReduceFailed, SyncNow
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.group import RankGroup
from flodl_run.rank.replica import Replica


def after_outer_step(replica: Replica, outer: OuterConfig) -> None:
    """What an outer step means for the inner optimizer (in every mode): its state is kept
    unless `outer.reset_inner_state` asks for DiLoCo's published reset."""
    if outer.reset_inner_state:
        replica.optimizer.state.clear()  # inner state restarts from the new global


@dataclass
class _Undo:
    """The replica before the last completed reduce, kept until training moves on."""

    round: int
    scratch: Optional[List[torch.Tensor]]
    steps: int
    outer: Optional[Dict[str, List[torch.Tensor]]]
    start: Optional[List[torch.Tensor]]
    moments: Optional[List[torch.Tensor]] = None
    """The optimizer's moments before the reduce (None: they did not ride it)."""
    layout: int = 0
    """Their layout's fingerprint: restored only while the optimizer still holds that layout."""


@dataclass(frozen=True)
class ReduceOptions:
    """How a rank's collective reduce weighs and what rides along with the parameters."""

    gamma: float
    """elche.gamma: a replica's weight is its batch count since the last reduce to this power."""
    track_start: bool = False
    """Keep the parameters each window began from (nccl_cadence's divergence breakdown)."""
    moments: Optional[FlatMoments] = None
    """elche.reduce_optimizer_state: the optimizer state averaged with the parameters."""


class CollectiveReduce:
    """One rank's reduces over its RankGroup. `run` is called on the main thread per SyncNow."""

    def __init__(self, rank: int, replica: Replica, flat: FlatParams, outer: OuterOptimizer,
                 group: RankGroup, recorder: Recorder, options: ReduceOptions):
        self.rank, self.replica, self.flat, self.outer = rank, replica, flat, outer
        self.group, self.recorder, self.gamma = group, recorder, options.gamma
        self.moments = options.moments
        track_start = options.track_start
        self._last: Optional[_Undo] = None
        # nccl_cadence: where this window began (the last consensus), for the divergence's
        # cosine/magnitude; a spare buffer of the same size takes the next one (no allocation).
        # nccl_sync reduces after every step, where the breakdown's extra passes over the
        # parameters would cost a good part of a short step (and sync modes take no verdicts).
        self._start = flat.clone() if track_start else None
        self._spare: Optional[List[torch.Tensor]] = None

    def forget(self) -> None:
        """Training moved on: the last reduce will not be retried (nothing to undo)."""
        self._last = None

    def run(self, order: SyncNow, steps: int) -> Tuple[Union[Reduced, ReduceFailed], int]:
        """Reduce this replica (`steps` batches since the last reduce) with the cohort. Returns
        the fact to send and the batch count since the last reduce now in effect: 0 after
        success; after a failure the replica is as before, and so is the count."""
        if self._last is not None and self._last.round == order.round:
            steps = self._undo()  # a retry after a death: start again from our own replica
        if self.group.broken():  # a member died: wait for the Regroup, touch nothing
            self.group.fail()  # (peers already inside this round must not wait on us)
            return ReduceFailed(self.rank, order.round, "process group aborted"), steps
        outer_before = self._outer_copy()
        began_ns = self.recorder.now()
        try:
            outcome = self._weighted_reduce(steps, order.measure)
        except CollectiveError as exc:
            self.group.fail()
            return ReduceFailed(self.rank, order.round, str(exc)), steps
        averaged_ns = self.recorder.now()
        self._last = _Undo(order.round, outcome.scratch, steps, outer_before, self._start,
                           outcome.moments, self.moments.fingerprint() if self.moments else 0)
        if outcome.applied and self.outer.step_(self.flat.buffers):
            after_outer_step(self.replica, self.outer.config)
        if self._start is not None:
            self._begin_window()
        self.replica.seek_schedule(order.global_step)
        if not outcome.finite:
            self.replica.optimizer.state.clear()  # its moments are NaN too: restart them
        self._trace(order.round, began_ns, averaged_ns)
        return Reduced(self.rank, order.round, outcome.divergence, outcome.weight, outcome.finite,
                       outcome.cosine, outcome.magnitude), 0

    def _outer_copy(self) -> Optional[Dict[str, Any]]:
        """The outer optimizer's state, copied (a retry restores it); None while it has none."""
        state = self.outer.state_dict() if self.outer.active and self.outer.prev is not None else None
        return {k: [t.clone() for t in v] for k, v in state.items()} if state else None

    def _trace(self, round_: int, began_ns: int, averaged_ns: int) -> None:
        """Timeline: the collective reduce's phases. wait: until the cohort's weights were
        all-reduced (every peer arrived); average: the snapshot for a retry, the parameters'
        all-reduce and the divergence (it ends reading a result back, so the device is done);
        apply: the outer step and the next window's start."""
        lined_up = self.recorder.last_lap(began_ns)
        self.recorder.span_between("reduce.wait", began_ns, lined_up, round_)
        self.recorder.span_between("reduce.average", lined_up, averaged_ns, round_)
        self.recorder.span("reduce.apply", averaged_ns, round_)

    def _begin_window(self) -> None:
        """The next window starts from the parameters now held: copy them into the spare
        buffer and make it the start (the old start stays intact for an undo)."""
        spare = self._spare if self._spare is not None else self.flat.clone()
        for dst, src in zip(spare, self.flat.buffers):
            dst.copy_(src)
        self._start, self._spare = spare, self._start

    def _weighted_reduce(self, steps: int, measure: bool) -> ReduceOutcome:
        """The cohort's consensus; alone, the identity (this replica is the consensus)."""
        if self.group.alone:  # a non-finite lone replica has nobody to adopt: the coordinator decides
            finite = bool(all_finite(self.flat))
            weight = consensus_weight(steps, self.gamma) if finite else 0.0
            return ReduceOutcome(weight > 0.0, weight, weight, 0.0, None, finite)
        with self.group.collective():
            return weighted_reduce_(self.flat, steps, self.gamma, broken=self.group.broken,
                                    start=self._start, measure=measure, lined_up=self.recorder.lap,
                                    moments=self.moments)

    def _undo(self) -> int:
        """Back to the pre-reduce replica (parameters, outer state, the window's start, the
        optimizer's moments unless its state was cleared since); returns the batch count since
        the reduce before it."""
        last, self._last = self._last, None
        if last.scratch is not None:
            self.flat.copy_(last.scratch)
        if last.start is not self._start:  # the window's start goes back too; the new one is spare
            self._start, self._spare = last.start, self._start
        if last.outer is not None:
            self.outer.load_state_dict(last.outer)
        if last.moments is not None and self.moments is not None:
            self.moments.bind()  # a cleared state (reset, non-finite) restarts on the retry too
            if self.moments.fingerprint() == last.layout:
                self.moments.copy_(last.moments)
        return last.steps
