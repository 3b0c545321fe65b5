"""`python -m flodl_run.sim [overrides]`: what ElChe would do on a rig, without training.

Owns the sim's Hydra app (conf/sim.yaml over the registered SimRunConfig), its config checks
(exit 2 naming the dotted key), the per-window table, the summary and `sim.json` in the Hydra
run dir. The rig model and the window loop are pure and live in `flodl_run.sim.rig`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

import msgspec
from rich.console import Console
from rich.table import Table

from flodl_run.config.app import fail_config, run_hydra_app, typed_or_exit
from flodl_run.config.schema import ElCheConfig, ExperimentConfig
from flodl_run.config.validate import Problem, validate
from flodl_run.report.say import labelled
from flodl_run.sim.exact import simulate_mode
from flodl_run.sim.rig import (
    SimConfig,
    SimResult,
    TableStyle,
    WindowEnd,
    WindowRecord,
    expand_rank_ms,
    headroom_of,
)
from flodl_run.sim.sweep import SweepConfig, run_sweep, sweep_table

PROG = "flodl_run.sim"
# Above this many ranks `table=auto` shows batch counts as min / median / max.
FULL_TABLE_MAX_RANKS = 8


@dataclass
class SimRunConfig:
    """Root of conf/sim.yaml: the ElChe knobs the runner takes, the simulated rig, and an
    optional sweep over its size, noise and window end."""

    elche: ElCheConfig = field(default_factory=ElCheConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


SCHEMA = (None, "base_sim", SimRunConfig)


def check(cfg: SimRunConfig) -> tuple[List[Problem], List[str]]:
    """Every problem of the sim config (the elche rules are the runner's own) and warnings."""
    problems = list(_sim_problems(cfg.sim)) + list(_sweep_problems(cfg.sweep))
    skew = cfg.sim.cold_start_skew
    if cfg.sweep.ranks and skew.windows and skew.rank >= min(cfg.sweep.ranks):
        problems.append(Problem("sim.cold_start_skew.rank", skew.rank,
                                f"must be below the smallest sweep.ranks ({min(cfg.sweep.ranks)})"))
    ranks = len(expand_rank_ms(cfg.sim)) or None
    report = validate(ExperimentConfig(elche=cfg.elche), world_size=ranks)
    problems += [p for p in report.problems if p.key.startswith("elche.")]
    warnings = [w for w in report.warnings if w.startswith("elche.")]
    if cfg.elche.mode.is_sync and (cfg.sim.window_end is WindowEnd.deadline
                                   or WindowEnd.deadline in cfg.sweep.window_end):
        warnings.append(f"sim.window_end=deadline has no effect in mode {cfg.elche.mode.value} "
                        "(a reduce after every step): windows end on counts")
    if cfg.sim.step_fixed_ms and not cfg.elche.averages_gradients:
        warnings.append(f"sim.step_fixed_ms={cfg.sim.step_fixed_ms:g} has no effect in mode "
                        f"{cfg.elche.mode.value} (it models nccl_sync's split of a step)")
    if cfg.sim.groups and cfg.sim.drift:
        warnings.append("sim.drift has no effect with sim.groups (set drift per group)")
    return problems, warnings


def _sim_problems(s: SimConfig) -> Iterator[Problem]:
    if s.groups:
        for i, g in enumerate(s.groups):
            if g.count < 1:
                yield Problem(f"sim.groups.{i}.count", g.count, "must be >= 1")
            if not g.ms_per_batch > 0:
                yield Problem(f"sim.groups.{i}.ms_per_batch", g.ms_per_batch, "must be > 0")
    else:
        if not s.rank_ms:
            yield Problem("sim.rank_ms", list(s.rank_ms), "must list at least one rank")
        elif any(not ms > 0 for ms in s.rank_ms):
            yield Problem("sim.rank_ms", list(s.rank_ms), "every ms per batch must be > 0")
        if s.drift is not None and len(s.drift) != len(s.rank_ms):
            yield Problem("sim.drift", list(s.drift),
                          f"must have one value per rank ({len(s.rank_ms)})")
    yield from _skew_problems(s)
    fastest = min(expand_rank_ms(s), default=0.0)
    if not 0 <= s.step_fixed_ms < max(fastest, 1e-9):
        yield Problem("sim.step_fixed_ms", s.step_fixed_ms,
                      f"must be >= 0 and below the fastest rank's ms per batch ({fastest:g})")
    for key in ("noise", "fill_ms", "sync_ms", "sync_ms_per_rank", "divergence_per_step",
                "deadline_headroom"):
        value = getattr(s, key)
        if value is not None and not value >= 0:  # only the headroom may be null
            yield Problem(f"sim.{key}", value, "must be >= 0")
    if s.divergence is not None and (not s.divergence or any(d < 0 for d in s.divergence)):
        yield Problem("sim.divergence", list(s.divergence), "must be a non-empty list of D >= 0")
    if not s.lr > 0:
        yield Problem("sim.lr", s.lr, "must be > 0")
    if any(w < 0 for w in s.lr_drops):
        yield Problem("sim.lr_drops", list(s.lr_drops), "every window must be >= 0")
    for key, value in (("windows", s.windows), ("batch_size", s.batch_size),
                       ("epoch_batches", s.epoch_batches)):
        if value is not None and value < 1:
            yield Problem(f"sim.{key}", value, "must be >= 1")


def _sweep_problems(s: SweepConfig) -> Iterator[Problem]:
    if any(n < 1 for n in s.ranks):
        yield Problem("sweep.ranks", list(s.ranks), "every rank count must be >= 1")
    for key in ("noise", "deadline_headroom"):
        if any(not x >= 0 for x in getattr(s, key)):
            yield Problem(f"sweep.{key}", list(getattr(s, key)), "every value must be >= 0")
    if s.seeds < 1:
        yield Problem("sweep.seeds", s.seeds, "must be >= 1")


def _skew_problems(s: SimConfig) -> Iterator[Problem]:
    skew = s.cold_start_skew
    if skew.windows == 0:
        return
    ranks = len(expand_rank_ms(s))
    if not 0 <= skew.rank < max(ranks, 1):
        yield Problem("sim.cold_start_skew.rank", skew.rank, f"must be in [0, {ranks - 1}]")
    if not skew.factor > 0:
        yield Problem("sim.cold_start_skew.factor", skew.factor, "must be > 0")
    if skew.windows < 0:
        yield Problem("sim.cold_start_skew.windows", skew.windows, "must be >= 0")


def sim_json(result: SimResult) -> dict:
    """The sim.json document: {"windows": [...], "summary": {...}}."""
    keys = [f.name for f in fields(WindowRecord)]
    # A plain comprehension, not asdict(): asdict deep-copies every 1024-rank counts list.
    rows = [{key: getattr(w, key) for key in keys} for w in result.windows]
    return {"windows": rows, "summary": asdict(result.summary)}


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _counts(counts: Sequence[int], compact: bool) -> str:
    if not compact:
        return " ".join(str(c) for c in counts)
    living = sorted(c for c in counts if c > 0) or [0]
    return f"{living[0]}/{statistics.median_low(living)}/{living[-1]}"


def window_table(records: Sequence[WindowRecord], compact: bool) -> Table:
    """One row per window: the plan it ran with, and its reduce's overhead, D and verdict."""
    table = Table(title="ElChe per window", title_justify="left", show_edge=False)
    exact = bool(records) and records[0].shares is not None
    counted = "step shares" if exact else "batch counts"
    for name in ("window", "phase", "anchor", "anchor rank",
                 f"{'shares' if exact else 'counts'} min/median/max" if compact else counted,
                 "overhead", "D", "verdict", "nudge"):
        table.add_column(name, justify="left" if name in ("phase", "verdict") else "right",
                         no_wrap=name != "anchor rank")
    for r in records:
        table.add_row(str(r.window), r.phase, str(r.anchor), _fmt(r.anchor_rank, "d"),
                      _counts(r.shares if exact else r.batch_counts, compact), _fmt(r.overhead, ".4f"),
                      _fmt(r.divergence, ".4f"), r.verdict, _fmt(r.nudge_factor, ".3f"))
    return table


def summary_table(result: SimResult) -> Table:
    s = result.summary
    table = Table(title="Summary", title_justify="left", show_header=False, show_edge=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("simulated samples/s", f"{s.samples_per_s:,.1f}")
    table.add_row("ideal samples/s (sum of per-rank throughputs)", f"{s.ideal_samples_per_s:,.1f}")
    table.add_row("ratio to ideal", f"{s.ratio_to_ideal:.3f}")
    table.add_row("reduces until the anchor is within 10% of its final value",
                  str(s.reduces_to_settle))
    if s.shares is not None and len(s.shares) <= FULL_TABLE_MAX_RANKS:
        table.add_row("shares of a step (last window)", "  ".join(f"{x:.3f}" for x in s.shares))
    idle = s.idle_fraction
    if len(idle) <= FULL_TABLE_MAX_RANKS:
        table.add_row("idle fraction per rank", "  ".join(f"{x:.3f}" for x in idle))
    else:
        table.add_row("idle fraction (min / mean / max over ranks)",
                      f"{min(idle):.3f} / {statistics.fmean(idle):.3f} / {max(idle):.3f}")
    return table


def report(cfg: SimRunConfig, result: SimResult, console: Console) -> None:
    """Print the header, the per-window table (unless table=none) and the summary."""
    rank_ms = result.rank_ms
    style = cfg.sim.table
    compact = style is TableStyle.compact or (
        style is TableStyle.auto and len(rank_ms) > FULL_TABLE_MAX_RANKS)
    speeds = ", ".join(f"{ms:g}" for ms in rank_ms) if len(rank_ms) <= FULL_TABLE_MAX_RANKS \
        else f"{min(rank_ms):g}..{max(rank_ms):g}"
    on_deadline = WindowEnd.deadline in (cfg.sim.window_end, cfg.elche.window_end) \
        and not cfg.elche.mode.is_sync
    end = f"deadline (headroom {headroom_of(cfg.sim, cfg.elche):g})" if on_deadline else "count"
    console.print(f"sim: {len(rank_ms)} ranks ({speeds} ms/batch) | elche {cfg.elche.mode.value} "
                  f"| {cfg.sim.windows} windows ending on {end}", highlight=False)
    if style is not TableStyle.none:
        console.print(window_table(result.windows, compact))
    console.print(summary_table(result))


def run_job(cfg: Any) -> None:
    """The body of one Hydra job: check, simulate (or sweep), print, write sim.json (or
    sweep.json)."""
    from hydra.core.hydra_config import HydraConfig

    err = Console(stderr=True)
    typed = typed_or_exit(cfg, PROG)
    problems, warnings = check(typed)
    if problems:
        count = len(problems)
        lines = [f"invalid config ({count} problem{'s' if count != 1 else ''}):"]
        fail_config("\n".join(lines + [f"  {p}" for p in problems]), err, PROG)
    for warning in warnings:
        err.print(labelled("warning", warning, "yellow"), highlight=False, soft_wrap=True)
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)  # piped or captured: do not squeeze the table to 80 columns
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if typed.sweep.is_set:
        path, doc = run_dir / "sweep.json", _sweep(typed, out)
    else:
        result = simulate_mode(typed.sim, typed.elche)
        report(typed, result, out)
        path, doc = run_dir / "sim.json", sim_json(result)
    path.write_bytes(msgspec.json.encode(doc))  # 4 MB for 1024 ranks x 1000 windows: 20x json's speed
    out.print(f"wrote {path}", markup=False, highlight=False)


def _sweep(cfg: SimRunConfig, out: Console) -> dict:
    """Run the sweep, print its table; the sweep.json document {"cells": [...]}."""
    s = cfg.sweep
    out.print(f"sweep: ranks {s.ranks or 'as given'} | noise {s.noise or [cfg.sim.noise]} | "
              f"{cfg.sim.windows} windows | {s.seeds} seed(s) | elche {cfg.elche.mode.value}",
              highlight=False)
    cells = run_sweep(s, cfg.sim, cfg.elche)
    out.print(sweep_table(cells))
    return {"cells": [asdict(c) for c in cells]}


def main() -> None:
    """Entry point; Hydra's flags (-m, --cfg, --help) work as usual."""
    run_hydra_app("sim", run_job, extra_schemas=[SCHEMA])


if __name__ == "__main__":
    main()
