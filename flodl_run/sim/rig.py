"""The simulated rig of `python -m flodl_run.sim`: per-rank speeds, noise, cold start, drift,
reduce cost, divergence and LR schedule, driving the real ElChe window by window.

Owns the sim's typed config and the what-if model (values in, records out: no clock, files or
printing). It does not train anything; the Hydra app in `flodl_run.sim` prints and writes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from flodl_run.config.schema import ElCheConfig, Mode, WindowEnd
from flodl_run.elche.balancer import ElChe, Plan, ReduceReport


class TableStyle(str, enum.Enum):
    """How the per-window table shows batch counts."""

    auto = "auto"
    full = "full"
    compact = "compact"
    none = "none"


@dataclass
class ColdStartSkew:
    """Rank `rank` runs `factor` times slower for its first `windows` windows."""

    rank: int = 0
    """The skewed rank; in [0, ranks)."""
    factor: float = 1.0
    """Slowdown while cold; > 0 (3.0 = three times slower)."""
    windows: int = 0
    """Windows the skew lasts; >= 0."""


@dataclass
class RankGroup:
    """`count` ranks of one device kind (a shorthand for long sim.rank_ms lists)."""

    count: int = 1
    """Ranks in the group; >= 1."""
    ms_per_batch: float = 10.0
    """Nominal ms per batch of each rank in the group; > 0."""
    drift: float = 0.0
    """Relative change of ms per batch per window (0.001 = 0.1% slower each window)."""


@dataclass
class SimConfig:
    """The simulated rig and its training signal."""

    rank_ms: List[float] = field(default_factory=lambda: [10.0, 25.0])
    """Nominal ms per batch of each rank; each > 0. Replaced by sim.groups when that is set."""
    groups: Optional[List[RankGroup]] = None
    """Rig as groups of identical ranks, in rank order; null = use sim.rank_ms."""
    noise: float = 0.0
    """Relative standard deviation of each rank's ms per batch in each window; >= 0."""
    cold_start_skew: ColdStartSkew = field(default_factory=ColdStartSkew)
    """One rank reads slower for its first windows; windows 0 (the default) = no skew."""
    drift: Optional[List[float]] = None
    """Per-rank relative change of ms per batch per window (with sim.rank_ms); null = none."""
    fill_ms: float = 0.0
    """Extra ms on the first batch of every window (fill cost); >= 0."""
    step_fixed_ms: float = 0.0
    """nccl_sync (exact path): the part of the fastest rank's ms per batch that does not depend
    on the batch's samples (launches, hooks), in ms; every rank's is the same fraction of its
    own; >= 0 and below the fastest rank's ms per batch."""
    sync_ms: float = 5.0
    """Fixed wall of one reduce in ms; >= 0."""
    sync_ms_per_rank: float = 0.0
    """Reduce wall added per living rank in ms (latency that grows with the rig); >= 0."""
    divergence: Optional[List[float]] = None
    """Scripted D per window (the last value repeats); null = the model below."""
    divergence_per_step: float = 0.001
    """Model D per batch of the longest window at the initial LR; >= 0."""
    lr: float = 0.1
    """Initial learning rate reported to ElChe; > 0."""
    lr_drops: List[int] = field(default_factory=list)
    """Windows at which the LR is divided by 10 (a step schedule); each >= 0."""
    windows: int = 60
    """Windows (reduces) to simulate; >= 1."""
    seed: int = 0
    """Seed of the noise."""
    batch_size: int = 32
    """Samples per batch, for samples/s; >= 1."""
    epoch_batches: Optional[int] = None
    """Batches of one epoch over all ranks (caps one window); null = no cap."""
    spec_prior: bool = True
    """Tell ElChe each rank's nominal speed up front, as GPU specs (NVML) would in a real run."""
    reduce_probe: bool = True
    """Hand ElChe one reduce's wall timed before training, as the collective modes measure it
    in a real run (nccl_* only; the coordinator backend does not time one)."""
    window_end: WindowEnd = WindowEnd.count
    """count: a window ends when every rank has run its planned count. deadline: it lasts as
    long as the anchor rank's count should take (ElChe's window_ms); every rank trains until
    then, finishes its batch in hand, and never takes more than its bound (below). Sync modes
    (a reduce after every step) always end on counts."""
    deadline_headroom: Optional[float] = None
    """Deadline windows: the share beyond its planned count a rank may take from the pool
    (bound = ceil(count x (1 + headroom)); unused batches go back); 0 = the count is the
    bound; null = elche.deadline_headroom, the real runs' loan (0.1); >= 0."""
    table: TableStyle = TableStyle.auto
    """Per-window table: full counts, compact (min/median/max) or none; auto = compact above
    8 ranks."""


def expand_rank_ms(cfg: SimConfig) -> List[float]:
    """Nominal ms per batch of every rank, from sim.groups when set, else sim.rank_ms."""
    if cfg.groups:
        return [float(g.ms_per_batch) for g in cfg.groups for _ in range(g.count)]
    return [float(ms) for ms in cfg.rank_ms]


def expand_drift(cfg: SimConfig) -> List[float]:
    if cfg.groups:
        return [float(g.drift) for g in cfg.groups for _ in range(g.count)]
    if cfg.drift:
        return [float(d) for d in cfg.drift]
    return [0.0] * len(cfg.rank_ms)


@dataclass(frozen=True)
class WindowRecord:
    """One simulated window: the plan it ran with and what its reduce measured and decided."""

    window: int
    phase: str
    anchor: int
    anchor_rank: Optional[int]
    batch_counts: List[int]
    overhead: Optional[float]
    divergence: Optional[float]
    verdict: str
    nudge_factor: Optional[float]
    deadline_ms: Optional[float] = None
    """The window's deadline (window_end=deadline, after Probe); None = it ended on counts."""
    batches: int = 0
    """Batches trained in the window over all ranks (with a deadline, what fit)."""
    shares: Optional[List[int]] = None
    """nccl_sync (exact path): each rank's samples of every step of the window; else None."""


@dataclass(frozen=True)
class SimSummary:
    samples_per_s: float
    ideal_samples_per_s: float
    ratio_to_ideal: float
    idle_fraction: List[float]
    reduces_to_settle: int
    """Reduces until the anchor stays within 10% of its final value."""
    shares: Optional[List[float]] = None
    """nccl_sync (exact path): each rank's fraction of a step in the last window; else None."""


@dataclass(frozen=True)
class SimResult:
    windows: List[WindowRecord]
    summary: SimSummary
    rank_ms: List[float]


# A noisy reading never drops below 5% of the nominal speed (a Gaussian tail is not a GPU).
MIN_SPEED_FRACTION = 0.05


class SimRig:
    """The what-if model: each window's per-rank speed, reduce wall, divergence and LR."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rank_ms = np.array(expand_rank_ms(cfg))
        self.drift = np.array(expand_drift(cfg))
        self._rng = np.random.default_rng(cfg.seed)
        self._drops = sorted(cfg.lr_drops)

    @property
    def world_size(self) -> int:
        return len(self.rank_ms)

    def ms_per_batch(self, window: int) -> np.ndarray:
        """Each rank's real ms per batch in `window`: drift, then noise, then cold start."""
        base = self.rank_ms
        if self.drift.any():
            base = base * np.maximum(MIN_SPEED_FRACTION, 1 + self.drift * window)
        noise = self.cfg.noise
        if noise > 0:
            factors = 1.0 + noise * self._rng.standard_normal(len(base))
            base = base * np.maximum(factors, MIN_SPEED_FRACTION)
        skew = self.cfg.cold_start_skew
        if window < skew.windows:
            base = base.copy()
            base[skew.rank] *= skew.factor
        return base

    def lr(self, window: int) -> float:
        """The LR of `window`: divided by 10 at each drop at or before it."""
        drops = sum(1 for w in self._drops if w <= window)
        return self.cfg.lr * 0.1 ** drops

    def sync_ms(self, living_ranks: int) -> float:
        return self.cfg.sync_ms + self.cfg.sync_ms_per_rank * living_ranks

    def divergence(self, window: int, longest_window: int) -> float:
        """Scripted D (last value held), else D grows with the longest window's batches and
        scales with the LR relative to the initial one (it falls after an LR drop)."""
        script = self.cfg.divergence
        if script:
            return float(script[min(window, len(script) - 1)])
        return self.cfg.divergence_per_step * longest_window * self.lr(window) / self.cfg.lr


@dataclass
class _Totals:
    """Running sums behind the summary."""

    world_size: int
    wall_ms: float = 0.0
    samples: int = 0
    idle_ms: np.ndarray = field(init=False)
    anchors: List[int] = field(default_factory=list)
    """The anchor after each reduce."""

    def __post_init__(self) -> None:
        self.idle_ms = np.zeros(self.world_size)

    def add(self, walls: np.ndarray, living: List[bool], sync_ms: float, batches: int) -> None:
        slowest = float(walls.max())
        self.wall_ms += slowest + sync_ms
        self.samples += batches
        self.idle_ms += np.where(living, slowest - walls, 0.0)

    def summary(self, rank_ms: List[float], batch_size: int) -> SimSummary:
        seconds = self.wall_ms / 1000.0
        rate = self.samples * batch_size / seconds if seconds > 0 else 0.0
        ideal = sum(batch_size * 1000.0 / ms for ms in rank_ms)
        idle = (self.idle_ms / self.wall_ms).tolist() if self.wall_ms > 0 \
            else [0.0] * self.world_size
        return SimSummary(rate, ideal, rate / ideal if ideal > 0 else 0.0, idle,
                          reduces_to_settle(self.anchors))


# The anchor counts as settled once it stays within this share of its final value.
SETTLE_BAND = 0.10


def reduces_to_settle(anchors: List[int]) -> int:
    """Reduces until the anchor (after each reduce) stays within 10% of its final value: the
    cold start's length. 0 when the initial anchor already was."""
    if not anchors:
        return 0
    final = anchors[-1]
    for index in range(len(anchors), 0, -1):
        if abs(anchors[index - 1] - final) > SETTLE_BAND * final:
            return index
    return 0


def _window_walls(counts: np.ndarray, ms: np.ndarray, fill_ms: float) -> np.ndarray:
    return np.where(counts > 0, counts * ms + fill_ms, 0.0)


def fit_by_deadline(bound: np.ndarray, ms: np.ndarray, fill_ms: float,
                    deadline_ms: float) -> np.ndarray:
    """Batches each rank trains in a window that ends at `deadline_ms`: it starts a batch while
    the deadline has not passed and finishes the one in hand, so ceil((deadline - fill) / ms),
    at least 1, never more than its `bound` (what it may take from the pool). A dead rank
    (bound 0) trains none."""
    fit = np.ceil((deadline_ms - fill_ms) / ms)
    return np.where(bound > 0, np.clip(fit, 1, np.maximum(bound, 1)), 0).astype(np.int64)


def _async_extra(plan: Plan, counts: np.ndarray, ms: np.ndarray, sync_ms: float) -> int:
    """cpu_async: batches ranks run during the reduce's round trip, within the overshoot."""
    budget = plan.max_overshoot or 0
    if budget <= 0:
        return 0
    fit = np.minimum(budget, sync_ms // ms)  # floor division as Python's float // does it
    return int(fit[counts > 0].sum())


def simulate(sim: SimConfig, elche_config: ElCheConfig,
             on_window: Optional[Callable[[WindowRecord], None]] = None) -> SimResult:
    """Run `sim.windows` windows of the rig under ElChe; `on_window` sees each record. A sync
    mode is a reduce after every step (nccl_sync's exact path has its own model, `sim.exact`)."""
    rig = SimRig(sim)
    prior = [1.0 / ms for ms in rig.rank_ms] if sim.spec_prior else None
    probed = sim.reduce_probe and elche_config.mode.is_collective
    elche = ElChe(elche_config, rig.world_size, epoch_batches=sim.epoch_batches, prior=prior,
                  reduce_ms=rig.sync_ms(rig.world_size) if probed else None)
    is_async = elche_config.mode is Mode.cpu_async
    totals = _Totals(rig.world_size)
    records: List[WindowRecord] = []
    plan = elche.plan()
    for window in range(sim.windows):
        after, record, walls, sync_ms, extra = _step(rig, elche, plan, window, is_async)
        totals.add(walls, elche.alive, sync_ms, record.batches + extra)
        totals.anchors.append(after.anchor)
        records.append(record)
        if on_window is not None:
            on_window(record)
        plan = after
    return SimResult(records, totals.summary(rig.rank_ms.tolist(), sim.batch_size),
                     rig.rank_ms.tolist())


def _ends_on_deadline(sim: SimConfig, elche_config: ElCheConfig) -> bool:
    """Deadline windows in the cadence and async modes (sim.window_end, or the real runs'
    elche.window_end); a sync mode reduces after every step."""
    ends = (sim.window_end, elche_config.window_end)
    return WindowEnd.deadline in ends and not elche_config.mode.is_sync


def headroom_of(sim: SimConfig, elche_config: ElCheConfig) -> float:
    """The deadline windows' loan: sim.deadline_headroom, else the real runs' key."""
    return elche_config.deadline_headroom if sim.deadline_headroom is None else sim.deadline_headroom


def _step(rig: SimRig, elche: ElChe, plan: Plan, window: int, is_async: bool):
    """One window: run the plan on the rig, report the reduce, record what happened."""
    ms = rig.ms_per_batch(window)
    fill_ms = rig.cfg.fill_ms
    planned = np.array(plan.batch_counts)
    # The deadline comes from the state that made `plan`, before this window's reduce.
    deadline = elche.window_ms() if _ends_on_deadline(rig.cfg, elche.config) else None
    if deadline is None:
        counts = planned
    else:
        bound = np.ceil(planned * (1.0 + headroom_of(rig.cfg, elche.config))).astype(np.int64)
        counts = fit_by_deadline(bound, ms, fill_ms, deadline)
    walls = _window_walls(counts, ms, fill_ms)
    sync_ms = rig.sync_ms(int(np.count_nonzero(counts)))
    divergence = rig.divergence(window, int(counts.max()))
    report = ReduceReport(wall_ms=walls, batches=counts, sync_ms=sync_ms,
                          first_batch_ms=ms + fill_ms, divergence=divergence, lr=rig.lr(window))
    after = elche.on_reduce(report)
    record = WindowRecord(
        window=window, phase=plan.phase.label, anchor=plan.anchor, anchor_rank=plan.anchor_rank,
        batch_counts=list(plan.batch_counts), overhead=after.overhead, divergence=divergence,
        verdict=after.verdict.label, nudge_factor=after.nudge_factor, deadline_ms=deadline,
        batches=int(counts.sum()))
    extra = _async_extra(plan, counts, ms, sync_ms) if is_async else 0
    return after, record, walls, sync_ms, extra
