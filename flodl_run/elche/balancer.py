"""ElChe, the cadence balancer: one call per reduce, timing in, a plan out.

Owns the per-reduce sequence (timing intake, phase, anchor-rank election, guard and
meta-controller verdicts, anchor auto-tune, overshoot, batch counts) and its checkpointable
state (`elche_state`). It does not measure, send or log anything: the coordinator
builds a ReduceReport from what ranks sent and acts on the Plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from flodl_run.config.schema import ElCheConfig, Mode
from flodl_run.elche import autotune, batch_counts, election
from flodl_run.elche.guard import (
    STABLE,
    Verdict,
    is_divergent,
    make_guard,
    resolved_threshold,
    verdict_from_json,
    verdict_to_json,
)
from flodl_run.elche.meta import MetaController, combine
from flodl_run.elche.phase import Phase
from flodl_run.elche.throttle import Overshoot
from flodl_run.elche.timing import RankTiming, TimingHistory, column, known, read_columns

STATE_VERSION = 1


@dataclass(frozen=True)
class ReduceReport:
    """What the coordinator measured for one reduce. Lists (or numpy arrays, as the sim passes)
    are indexed by rank (the ranks of the run's start); a None entry means the rank sent no
    timing for the window."""

    wall_ms: Sequence[Optional[float]]
    """Each rank's compute wall for the window, callbacks included, in ms."""
    batches: Sequence[Optional[int]]
    """Batches each rank actually did in the window."""
    sync_ms: float
    """Wall of the reduce (collective: sync order to last ack; coordinator: round trip)."""
    callback_ms: Optional[Sequence[float]] = None
    """Eval/checkpoint/hook time inside each rank's window, subtracted from its wall."""
    first_batch_ms: Optional[Sequence[Optional[float]]] = None
    """Wall of each rank's first batch (fill cost; used by cadence/async)."""
    fill_ms: Optional[Sequence[Optional[float]]] = None
    """Or each rank's own split: its first batch's excess over its mean batch, in ms."""
    divergence: Optional[float] = None
    """D of this reduce (guard.divergence_from_norms); None = not measured."""
    lr: Optional[float] = None
    """Learning rate of the lowest rank that reports one; None = unknown."""
    epoch_batches: Optional[int] = None
    """New one-epoch window cap (batches over all ranks); None = keep the current one."""

    @classmethod
    def from_timings(cls, timings: Iterable[RankTiming], world_size: int, sync_ms: float,
                     **kwargs: Any) -> "ReduceReport":
        """Build the columns from per-rank RankTiming records (ranks missing = no timing)."""
        wall: List[Optional[float]] = [None] * world_size
        batches: List[Optional[int]] = [None] * world_size
        callback = [0.0] * world_size
        first: List[Optional[float]] = [None] * world_size
        fill: List[Optional[float]] = [None] * world_size
        for t in timings:
            wall[t.rank], batches[t.rank] = t.wall_ms, t.batches
            callback[t.rank], first[t.rank] = t.callback_ms, t.first_batch_ms
            fill[t.rank] = t.fill_ms
        return cls(wall_ms=wall, batches=batches, sync_ms=sync_ms, callback_ms=callback,
                   first_batch_ms=first, fill_ms=fill, **kwargs)


@dataclass(frozen=True)
class Event:
    """Something ElChe changed or noticed at a reduce, for logs and the record stream."""

    kind: str
    """phase, anchor_rank, anchor, nudge, growth_suppressed, growth_rearmed, timing_cleared,
    rank_forgotten."""
    message: str


@dataclass(frozen=True)
class Plan:
    """ElChe's orders for the next window."""

    reduce: int
    """Reduces seen so far (0 for the initial plan)."""
    batch_counts: Tuple[int, ...]
    """Batches per rank for the next window; 0 for a dead rank."""
    anchor: int
    """Batches the anchor rank runs per window."""
    anchor_rank: Optional[int]
    """The rank setting the pace; None until one is pinned or elected."""
    phase: Phase
    overhead: Optional[float] = None
    """sync_ms / compute_ms of the reduce that produced this plan."""
    divergence: Optional[float] = None
    verdict: Verdict = STABLE
    """The combined verdict of this reduce (guard, overridden by a meta-controller nudge)."""
    nudge_factor: Optional[float] = None
    """The factor a NudgeDown applied to the anchor at this reduce, if any."""
    max_overshoot: Optional[int] = None
    """cpu_async lookahead past each window, in batches; None in the other modes."""
    settled: bool = False
    """The meta-controller's is_settled() (an early-stop hint)."""
    events: Tuple[Event, ...] = field(default_factory=tuple)


@dataclass
class _Cycle:
    """Scratch of one on_reduce call."""

    events: List[Event] = field(default_factory=list)
    overhead: Optional[float] = None
    verdict: Verdict = STABLE
    nudge_factor: Optional[float] = None
    anchor_step: int = 0
    sync_ms: float = 0.0
    compute_ms: float = 0.0

    def note(self, kind: str, message: str) -> None:
        self.events.append(Event(kind, message))


class ElChe:
    """The balancer. Call `plan()` for the first window, then `on_reduce()` once per reduce.

    `prior`: per-rank relative speeds known before timing (e.g. from the GPU model; higher =
    faster) that pin the first anchor rank. `epoch_batches`: batches of one epoch over all
    ranks, the cap of one window's counts (None = no cap). `reduce_ms`: the wall of one reduce
    timed before training (None = not measured); with it the first report sizes the anchor.
    """

    def __init__(self, config: ElCheConfig, world_size: int, *,
                 epoch_batches: Optional[int] = None, prior: Optional[Sequence[float]] = None,
                 reduce_ms: Optional[float] = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.epoch_batches = epoch_batches
        self.min_anchor = config.anchor if config.min_anchor is None else config.min_anchor
        self.threshold = resolved_threshold(config.divergence_threshold, config.easgd_alpha)
        self.anchor = min(max(1, config.anchor), config.max_anchor)
        self.shares = _normalized(config.partition_ratios, world_size)
        self.anchor_rank = election.initial_pin(world_size, self.shares, prior)
        self.timing = TimingHistory(world_size)
        self.guard = make_guard(config.convergence_guard, self.threshold)
        self.meta = MetaController()
        self.latch = autotune.GrowthLatch()
        self.overshoot = Overshoot.from_config(config.max_overshoot)
        self.calibration_count = 0
        self.reduces = 0
        self.alive = [True] * world_size
        self.calibrated = [False] * world_size
        self.reduce_ms = reduce_ms
        self.wanted: List[float] = []
        """Recent wanted anchors (autotune.wanted_anchor), the trust window of growth."""
        self.batch_counts = self._initial_counts()
        self._last = self._plan(_Cycle())

    @property
    def phase(self) -> Phase:
        return Phase.after(self.calibration_count)

    @property
    def _tunes_anchor(self) -> bool:
        # Sync modes reduce as soon as every rank has stepped: their anchor is not a cadence;
        # nccl_sync's exact path makes it the window's steps between two control round trips.
        return not self.config.mode.is_sync or self.config.averages_gradients

    @property
    def _takes_verdicts(self) -> bool:
        # Replicas that never drift apart (sync modes; the exact path's identical ones) give
        # the guard and the meta-controller nothing to act on.
        return not self.config.mode.is_sync

    def _initial_counts(self) -> List[int]:
        """Probe counts: by the stated partition_ratios (the smallest share runs the anchor),
        else equal; from the first report on, the measured speeds set them."""
        if self.shares is not None:
            return batch_counts.ratio_counts(self.anchor, self.shares, self.alive)
        return batch_counts.cap_to_window([self.anchor] * self.world_size, self.epoch_batches)

    def plan(self) -> Plan:
        """The current plan (the initial one before any reduce: equal split, Probe)."""
        return self._last

    def smoothed_ms(self) -> List[Optional[float]]:
        """Smoothed ms per batch of every rank (None = no valid reading kept)."""
        return self.timing.all_smoothed_ms()

    def window_ms(self) -> Optional[float]:
        """The deadline of the next window when windows end on time: how long the anchor rank's
        planned count takes at its smoothed speed, plus its smoothed first-batch fill. None
        until the anchor rank has a reading (Probe): that window ends on its counts."""
        rank = self.anchor_rank
        ms = self.timing.smoothed_ms(rank) if rank is not None and self.alive[rank] else None
        if ms is None:
            return None
        return self.batch_counts[rank] * ms + (self.timing.fill_ms(rank) or 0.0)

    def on_reduce(self, report: ReduceReport) -> Plan:
        """Take one reduce's measurements; return the plan of the next window."""
        cycle = _Cycle()
        self.reduces += 1
        if report.epoch_batches is not None:
            self.epoch_batches = report.epoch_batches
        before = self.phase
        if self._ingest(report, cycle):
            self.calibration_count += 1
        if self.phase != before:
            cycle.note("phase", f"{before.label} -> {self.phase.label}")
        cycle.sync_ms = report.sync_ms
        cycle.compute_ms = autotune.compute_ms(report.wall_ms, report.callback_ms)
        cycle.overhead = autotune.overhead(report.sync_ms, cycle.compute_ms)
        self._maybe_elect(cycle)
        cycle.verdict = self._verdict(report, cycle)
        if self.phase >= Phase.WARMUP:  # Probe: gather timings, no actions
            if self._tunes_anchor:
                self._tune_anchor(cycle)
            self.overshoot = self.overshoot.after(cycle.verdict)
        self._recount(cycle)
        self._last = self._plan(cycle, report.divergence)
        return self._last

    def _ingest(self, report: ReduceReport, cycle: _Cycle) -> bool:
        """Record every living rank's reading; True when at least one was valid."""
        readings = read_columns(report.wall_ms, report.batches, report.callback_ms,
                                report.first_batch_ms, report.fill_ms,
                                self.config.mode.is_progressive)
        living = np.array(self.alive, dtype=bool)
        for rank in self.timing.record_columns(readings, living):
            cycle.note("timing_cleared", f"rank {rank}: 5 windows without a valid reading")
        return bool(np.any(living & ~np.isnan(readings.ms_per_batch)))

    def _maybe_elect(self, cycle: _Cycle) -> None:
        current = self.anchor_rank
        streak = self.timing.invalid_streak(current) if current is not None else 0
        if not election.should_elect(self.phase, current, streak):
            return
        chosen = election.elect(self.timing.smoothed_column(), current)
        if chosen is None and current is not None and streak < election.DEAD_WINDOW_REPORTS:
            return  # nobody has data: keep the pin
        if chosen != current:
            self.anchor_rank = chosen
            cycle.note("anchor_rank", _anchor_change(current, chosen))

    def _verdict(self, report: ReduceReport, cycle: _Cycle) -> Verdict:
        """The guard's verdict, replaced by a meta-controller nudge when one fires. Sync modes
        get Stable: nothing there can act on a verdict (their anchor is not a cadence), and a
        SuppressGrowth or a nudge in the record would read as if the guard had done something.
        D is still reported."""
        if not self._takes_verdicts:
            return STABLE
        done = column(report.batches)
        steps = int(np.max(done, initial=0, where=done > 0))  # NaN (no report) fails > 0
        verdict = self.guard.observe(report.divergence, steps)
        if not self.config.meta_controller:
            return verdict
        nudge = self.meta.observe(self.phase, self.anchor, verdict, report.lr)
        if nudge is None:
            return verdict
        cycle.note("nudge", f"meta-controller ({', '.join(nudge.reasons)}): x{nudge.factor:.3f}")
        return combine(verdict, nudge)

    def _tune_anchor(self, cycle: _Cycle) -> None:
        """Proposal, then the verdict's ruling, then relax_up."""
        before = self.anchor
        c = self.config
        proposal = max(autotune.propose(before, cycle.overhead, self.phase, c.overhead_target,
                                        self.min_anchor, c.max_anchor, self.calibration_count == 1),
                       self._cold_start_step(cycle))
        was_latched = self.latch.latched
        ruling = autotune.rule(before, proposal, cycle.verdict, self.latch)
        self.latch = ruling.latch
        cycle.nudge_factor = ruling.nudge_factor
        if ruling.dropped_growth:
            cycle.note("growth_suppressed", f"proposal {before} -> {proposal} vetoed")
        if was_latched and not ruling.latch.latched:
            cycle.note("growth_rearmed", "5 Stable verdicts in a row")
        anchor = ruling.anchor
        if c.relax_up:
            anchor = autotune.relax_up(anchor, before, cycle.verdict, self.latch, self.phase,
                                       c.max_anchor, self._lead_allows(anchor + 1))
        self.anchor = min(anchor, c.max_anchor)
        if self.anchor != before:
            cycle.anchor_step = self.anchor - before
            cycle.note("anchor", f"{before} -> {self.anchor}")

    def _cold_start_step(self, cycle: _Cycle) -> int:
        """Growth past the 2x cap: the first report sized from the reduce timed before training,
        later reduces by the trust window's agreement (see autotune). `anchor` = no step.
        Readings count only while growth is armed: after a veto or a nudge the window refills
        from scratch, so divergence, not an old overhead reading, decides how fast it regrows."""
        c = self.config
        if self.latch.latched or is_divergent(cycle.verdict):
            self.wanted = []
            return self.anchor
        wanted = autotune.wanted_anchor(self.anchor, cycle.overhead, c.overhead_target)
        if wanted is not None:
            self.wanted = (self.wanted + [wanted])[-autotune.TRUST_WINDOW:]
        if self.calibration_count == 1:
            return autotune.sized_first_anchor(self.anchor, self.reduce_ms, cycle.sync_ms,
                                               cycle.compute_ms, c.overhead_target, c.max_anchor)
        return autotune.agreed_anchor(self.anchor, self.wanted, c.max_anchor)

    def _lead_allows(self, anchor: int) -> bool:
        """Whether the fastest rank's lead at `anchor` stays within max_batch_diff."""
        limit = self.config.max_batch_diff
        if limit is None or self.anchor_rank is None:
            return True
        ms = self.timing.smoothed_column()
        targets = batch_counts.targets(anchor, ms, known(ms[self.anchor_rank]))
        living = targets[np.array(self.alive, dtype=bool)]
        fastest = int(living.max()) if len(living) else anchor
        return fastest - anchor <= limit

    def _recount(self, cycle: _Cycle) -> None:
        if self.shares is not None and self.calibration_count == 0:
            counts = batch_counts.ratio_counts(self.anchor, self.shares, self.alive)
        else:
            ms = self.timing.smoothed_column()
            counts = batch_counts.next_counts(
                self.batch_counts, self.anchor, self.anchor_rank, ms, self.alive,
                self.calibrated, cycle.anchor_step, self.config.max_batch_diff)
            if self.anchor_rank is not None:
                self.calibrated = (np.array(self.alive) & ~np.isnan(ms)).tolist()
        self.batch_counts = batch_counts.cap_to_window(counts, self.epoch_batches)

    def _plan(self, cycle: _Cycle, divergence: Optional[float] = None) -> Plan:
        overshoot = self.overshoot.batches if self.config.mode is Mode.cpu_async else None
        return Plan(
            reduce=self.reduces, batch_counts=tuple(self.batch_counts), anchor=self.anchor,
            anchor_rank=self.anchor_rank, phase=self.phase, overhead=cycle.overhead,
            divergence=divergence, verdict=cycle.verdict, nudge_factor=cycle.nudge_factor,
            max_overshoot=overshoot, settled=self.meta.is_settled(), events=tuple(cycle.events),
        )

    def forget_rank(self, rank: int) -> Plan:
        """A rank died: drop its timing, re-seat the anchor rank if it was this one, and give
        the survivors their counts. Returns the updated plan of the next window."""
        if not self.alive[rank]:
            return self._last
        cycle = _Cycle()
        self.alive[rank] = False
        self.calibrated[rank] = False
        self.timing.forget(rank)
        cycle.note("rank_forgotten", f"rank {rank}")
        if self.anchor_rank == rank:
            self.anchor_rank = self._successor()
            cycle.note("anchor_rank", _anchor_change(rank, self.anchor_rank))
        self._recount(cycle)
        self._last = self._plan(cycle, self._last.divergence)
        return self._last

    def rejoin_all(self) -> Plan:
        """A resume starts with every rank alive: a rank the saved run had lost trains again,
        its speed measured afresh (the anchor's count until its first reading, as in Probe).
        Returns the plan of the first window."""
        lost = [rank for rank in range(self.world_size) if not self.alive[rank]]
        if not lost:
            return self._last
        cycle = _Cycle()
        for rank in lost:
            self.alive[rank], self.calibrated[rank] = True, False
            cycle.note("rank_rejoined", f"rank {rank}")
        if self.anchor_rank is None:
            self.anchor_rank = self._successor()
        self._recount(cycle)
        self._last = self._plan(cycle, self._last.divergence)
        return self._last

    def _successor(self) -> Optional[int]:
        if self.shares is not None and self.calibration_count == 0:
            living = [r for r in range(self.world_size) if self.alive[r]]
            return min(living, key=lambda r: (self.shares[r], r)) if living else None
        return election.elect(self.timing.smoothed_column(), None)

    def export_state(self) -> Dict[str, Any]:
        """JSON-ready `elche_state` for the checkpoint; knobs are not included."""
        return {
            "version": STATE_VERSION,
            "world_size": self.world_size,
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "phase": self.phase.label,
            "calibration_count": self.calibration_count,
            "reduces": self.reduces,
            "smoothed_ms": self.timing.all_smoothed_ms(),
            "timing": self.timing.export_state(),
            "batch_counts": list(self.batch_counts),
            "calibrated": list(self.calibrated),
            "alive": list(self.alive),
            "guard": self.guard.export_state(),
            "growth_latch": {"latched": self.latch.latched,
                             "stable_streak": self.latch.stable_streak},
            "overshoot": self.overshoot.batches,
            "meta": self.meta.export_state(),
            "last_verdict": verdict_to_json(self._last.verdict),
            "wanted_anchors": list(self.wanted),
        }

    @classmethod
    def from_state(cls, config: ElCheConfig, state: Dict[str, Any], *,
                   world_size: Optional[int] = None,
                   epoch_batches: Optional[int] = None) -> "ElChe":
        """Resume from `export_state()` under (possibly changed) knobs `config`.

        Raises ValueError when `world_size` is given and differs from the saved one. A guard
        history of another guard kind than `config.convergence_guard` is not restored.
        """
        saved = int(state["world_size"])
        if world_size is not None and world_size != saved:
            raise ValueError(f"elche_state was saved with world size {saved}, not {world_size}")
        if int(state.get("version", STATE_VERSION)) != STATE_VERSION:
            raise ValueError(f"elche_state version {state.get('version')} is not {STATE_VERSION}")
        problems = state_problems(state, saved)
        if problems:
            raise ValueError("; ".join(problems))
        elche = cls(config, saved, epoch_batches=epoch_batches)
        elche._restore(state)
        return elche

    def _restore(self, state: Dict[str, Any]) -> None:
        self.anchor = min(max(1, int(state["anchor"])), self.config.max_anchor)
        rank = state.get("anchor_rank")
        self.anchor_rank = None if rank is None else int(rank)
        self.calibration_count = int(state["calibration_count"])
        self.reduces = int(state.get("reduces", 0))
        self.timing = TimingHistory.from_state(state["timing"])
        self.alive = [bool(a) for a in state["alive"]]
        self.calibrated = [bool(c) for c in state["calibrated"]]
        self.batch_counts = [int(c) for c in state["batch_counts"]]
        if state["guard"].get("kind") == self.guard.kind.value:
            self.guard.restore(state["guard"])
        latch = state.get("growth_latch", {})
        self.latch = autotune.GrowthLatch(bool(latch.get("latched")),
                                          int(latch.get("stable_streak", 0)))
        if not self.overshoot.fixed and state.get("overshoot") is not None:
            self.overshoot = Overshoot(int(state["overshoot"]))
        self.meta.restore(state.get("meta", {}))
        self.wanted = [float(w) for w in state.get("wanted_anchors", [])]
        verdict = verdict_from_json(state.get("last_verdict", {"kind": "stable"}))
        self._last = self._plan(_Cycle(verdict=verdict))


PER_RANK_STATE = ("alive", "calibrated", "batch_counts")


def state_problems(state: Dict[str, Any], world_size: int) -> List[str]:
    """What of an exported state `from_state` must not take, each naming the key, its value and
    the rule: an anchor below 1 (it was clamped silently), an unknown phase, a per-rank list
    of another length than the world (`alive=[True]` for two ranks was carried into the next
    bundle)."""
    problems = []
    anchor = state.get("anchor")
    if not isinstance(anchor, int) or isinstance(anchor, bool) or anchor < 1:
        problems.append(f"elche_state.anchor must be an integer >= 1, got {anchor!r}")
    phase = state.get("phase")
    labels = [p.label for p in Phase]
    if phase is not None and phase not in labels:
        problems.append(f"elche_state.phase must be one of {', '.join(labels)}, got {phase!r}")
    for key in PER_RANK_STATE:
        value = state.get(key)
        if not isinstance(value, list) or len(value) != world_size:
            problems.append(f"elche_state.{key} must be a list of {world_size} (one per rank), "
                            f"got {value!r}")
    return problems


def _normalized(ratios: Optional[Sequence[float]], world_size: int) -> Optional[List[float]]:
    if ratios is None:
        return None
    if len(ratios) != world_size:
        raise ValueError(
            f"elche.partition_ratios has {len(ratios)} shares for world size {world_size}")
    total = sum(ratios)
    return [r / total for r in ratios]


def _anchor_change(before: Optional[int], after: Optional[int]) -> str:
    """`rank 0 -> rank 1`; the first election reads `rank 1 (first)`, never `None -> 1`."""
    if before is None:
        return f"rank {after} (first)"
    return f"rank {before} -> {'none' if after is None else f'rank {after}'}"
