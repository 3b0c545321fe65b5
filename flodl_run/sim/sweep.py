"""`python -m flodl_run.sim sweep.ranks=[8,64] sweep.noise=[0,0.05] ...`: one rig, many sizes.

Owns the sweep's config (`sweep.` keys), the grid (the rig's mix of groups scaled to each rank
count, x noise, x window end and deadline headroom, each over a few noise seeds) and its table.
Every cell is an ordinary `simulate` run; the Hydra app in `flodl_run.sim.cli` prints the table
and writes `sweep.json`.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from rich.table import Table

from flodl_run.config.schema import ElCheConfig
from flodl_run.sim.exact import simulate_mode
from flodl_run.sim.rig import RankGroup, SimConfig, WindowEnd, headroom_of


@dataclass
class SweepConfig:
    """The grid of a sweep; every list left empty keeps the `sim.` value (no sweep at all when
    all are empty)."""

    ranks: List[int] = field(default_factory=list)
    """Rig sizes: the rig's mix of groups scaled to each count; each >= 1."""
    noise: List[float] = field(default_factory=list)
    """sim.noise values; each >= 0."""
    window_end: List[WindowEnd] = field(default_factory=list)
    """sim.window_end values."""
    deadline_headroom: List[float] = field(default_factory=list)
    """sim.deadline_headroom values (deadline windows only); each >= 0."""
    seeds: int = 1
    """Noise seeds per cell (sim.seed, sim.seed + 1, ...); the table shows their mean; >= 1."""

    @property
    def is_set(self) -> bool:
        return bool(self.ranks or self.noise or self.window_end or self.deadline_headroom)


@dataclass(frozen=True)
class Variant:
    """How windows end in one column of the sweep."""

    window_end: WindowEnd
    deadline_headroom: float

    @property
    def label(self) -> str:
        if self.window_end is WindowEnd.count:
            return "count"
        return f"deadline +{self.deadline_headroom:g}" if self.deadline_headroom else "deadline"


@dataclass(frozen=True)
class Cell:
    """One rig size and noise under one variant: means over the seeds."""

    ranks: int
    noise: float
    variant: str
    ratio_to_ideal: float
    samples_per_s: float
    ideal_samples_per_s: float
    idle_fraction: float
    """Mean over ranks and seeds of the share of wall time spent waiting."""


def scaled_groups(groups: List[RankGroup], ranks: int) -> List[RankGroup]:
    """The rig's mix at `ranks` ranks: each group keeps its share of the rig (largest
    remainder, ties to the earlier group); a group rounded to no rank is left out."""
    total = sum(g.count for g in groups)
    exact = [g.count * ranks / total for g in groups]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(groups)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:ranks - sum(counts)]:
        counts[i] += 1
    return [dataclasses.replace(g, count=c) for g, c in zip(groups, counts) if c > 0]


def base_groups(sim: SimConfig) -> List[RankGroup]:
    """The rig as groups: sim.groups, else one group per entry of sim.rank_ms."""
    if sim.groups:
        return list(sim.groups)
    drift = sim.drift or [0.0] * len(sim.rank_ms)
    return [RankGroup(1, ms, d) for ms, d in zip(sim.rank_ms, drift)]


def variants(sweep: SweepConfig, sim: SimConfig, elche: ElCheConfig) -> List[Variant]:
    """The columns: each window end; a deadline once per headroom (a count window has none)."""
    ends = sweep.window_end or [sim.window_end]
    headrooms = sweep.deadline_headroom or [headroom_of(sim, elche)]
    out = [Variant(WindowEnd.count, 0.0)] if WindowEnd.count in ends else []
    if WindowEnd.deadline in ends:
        out += [Variant(WindowEnd.deadline, h) for h in headrooms]
    return out


def run_sweep(sweep: SweepConfig, sim: SimConfig, elche: ElCheConfig) -> List[Cell]:
    """Every cell of the grid, rig size by rig size, noise by noise, variant by variant."""
    groups = base_groups(sim)
    sizes = sweep.ranks or [sum(g.count for g in groups)]
    cells = []
    for ranks, noise in itertools.product(sizes, sweep.noise or [sim.noise]):
        rig = dataclasses.replace(sim, groups=scaled_groups(groups, ranks), noise=noise)
        for variant in variants(sweep, sim, elche):
            cells.append(_cell(rig, elche, variant, sweep.seeds, ranks))
    return cells


def _cell(rig: SimConfig, elche: ElCheConfig, variant: Variant, seeds: int, ranks: int) -> Cell:
    runs = [simulate_mode(dataclasses.replace(rig, seed=rig.seed + i, window_end=variant.window_end,
                                         deadline_headroom=variant.deadline_headroom),
                     elche).summary for i in range(seeds)]
    return Cell(ranks, rig.noise, variant.label,
                statistics.fmean(s.ratio_to_ideal for s in runs),
                statistics.fmean(s.samples_per_s for s in runs), runs[0].ideal_samples_per_s,
                statistics.fmean(statistics.fmean(s.idle_fraction) for s in runs))


def sweep_table(cells: List[Cell]) -> Table:
    """One row per rig size and noise with its ideal samples/s, one column per variant: ratio
    to ideal (mean idle share); a variant's samples/s is its ratio x the ideal."""
    labels = list(dict.fromkeys(c.variant for c in cells))
    rows: Dict[Tuple[int, float], Dict[str, Cell]] = {}
    for c in cells:
        rows.setdefault((c.ranks, c.noise), {})[c.variant] = c
    table = Table(title="Ratio to ideal (mean idle share)", title_justify="left", show_edge=False)
    for name in ["ranks", "noise", "ideal samples/s"] + labels:
        table.add_column(name, justify="right")
    for (ranks, noise), by_label in rows.items():
        first = next(iter(by_label.values()))
        table.add_row(str(ranks), f"{noise:g}", f"{first.ideal_samples_per_s:,.0f}",
                      *(f"{by_label[v].ratio_to_ideal:.3f} ({by_label[v].idle_fraction:.3f})"
                        for v in labels))
    return table
