"""What a config change does to the run: one line beside the field diff for each change of
meaning. The global batch and the learning rate it implies, what the sync mode averages, the
knobs that now do nothing, and the simulator's throughput against the ideal before and after.

Owns those lines and the rig the estimate runs on (speeds given, a run dir's measured ones, or
the config's emulated slowdown). The estimate is `flodl_run.sim.rig.simulate` on the inputs
`python -m flodl_run.sim` gives it; each estimate line names that command.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from rich.console import Console

from flodl_run.config.materialize import Materialized
from flodl_run.config.schema import (
    ElCheConfig,
    ExperimentConfig,
    Mode,
    OuterKind,
    SyncAverage,
    lr_factor,
)
from flodl_run.config.validate import planned_world_size
from flodl_run.report.say import labelled
from flodl_run.review.table import ReviewError, show
from flodl_run.sim.rig import SimConfig, SimResult, simulate

# Without speeds given or measured, an emulated rig's ranks run at factor x the sim's own
# default fastest rank (sim.rank_ms=[10, 25]): the ratio to the ideal does not depend on it,
# the samples/s scale with it.
EMULATED_BASE_MS = SimConfig().rank_ms[0]


@dataclass(frozen=True)
class Rig:
    """Speeds the estimate runs on: ms per batch of each rank, and a reduce's wall."""

    rank_ms: Optional[Tuple[float, ...]] = None
    """Given (--rig-ms) or measured (--rig-from); None = from cluster.emulate_slowdown."""
    sync_ms: Optional[float] = None
    """A reduce's wall in ms; None = the sim's default."""
    source: str = ""


def rig_from(rank_ms: Optional[str], sync_ms: Optional[float], run_dir: Optional[Path]) -> Rig:
    """The rig of the command line: `--rig-ms 10,25`, or a run dir's measured speeds."""
    if run_dir is not None:
        from flodl_run.sim.measured import measure

        try:
            measured = measure(run_dir)
        except (OSError, KeyError, IndexError, ValueError) as exc:
            raise ReviewError(f"--rig-from: cannot read the speeds of {run_dir}: {exc}") from None
        return Rig(tuple(measured.ms_per_batch), sync_ms if sync_ms is not None else measured.sync_ms,
                   f"measured in {run_dir}")
    if rank_ms is not None:
        speeds = tuple(float(ms) for ms in rank_ms.replace("[", "").replace("]", "").split(","))
        return Rig(speeds, sync_ms, "--rig-ms")
    return Rig(None, sync_ms, "")


@dataclass(frozen=True)
class Shape:
    """What the meaning lines read of one config."""

    world_size: Optional[int]
    """None when only a probe of the hardware knows it (cluster=auto)."""
    batch_size: int
    lr_scale_ratio: float
    base_lr: Optional[float]
    """recipe.params.lr when the recipe has one."""
    elche: ElCheConfig
    outer: OuterKind
    emulate_slowdown: Optional[Tuple[float, ...]]


def shape_of(config: ExperimentConfig) -> Shape:
    lr = config.recipe.params.get("lr") if isinstance(config.recipe.params, dict) else None
    slowdown = config.cluster.emulate_slowdown
    return Shape(planned_world_size(config), config.batch_size, config.lr_scale_ratio,
                 float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None,
                 config.elche, config.outer.kind, tuple(slowdown) if slowdown else None)


def meaning_lines(before: Materialized, after: Materialized, rig: Rig = Rig()) -> List[str]:
    """The lines for a change from `before` to `after` (none when its meaning is the same)."""
    a, b = shape_of(before.config), shape_of(after.config)
    lines = [line for line in (global_batch_line(a, b), averaging_line(a, b)) if line]
    lines += [f"now does nothing: {w}" for w in after.warnings if w not in before.warnings]
    estimate = estimate_line(a, b, rig)
    return lines + ([estimate] if estimate else [])


def global_batch_line(before: Shape, after: Shape) -> Optional[str]:
    """`global batch 2 x 32 = 64 -> 2 x 64 = 128 samples a step; learning rate ...` when the
    world size, the batch or the LR scaling changes."""
    a, b = _batch_and_lr(before), _batch_and_lr(after)
    if a == b:
        return None
    return (f"global batch {a[0]} -> {b[0]} samples a step; learning rate {a[1]} -> {b[1]} "
            "(lr_factor = 1 + (world_size - 1) x lr_scale_ratio)")


def _batch_and_lr(shape: Shape) -> Tuple[str, str]:
    world, batch, ratio = shape.world_size, shape.batch_size, shape.lr_scale_ratio
    if world is None:
        return (f"world_size x {batch}", f"x (1 + (world_size - 1) x {ratio:g})")
    factor = lr_factor(world, ratio)
    base = shape.base_lr
    implied = f"{base:g} x {factor:g} = {base * factor:g}" if base is not None else f"x {factor:g}"
    return (f"{world} x {batch} = {world * batch}", implied)


def averaging(shape: Shape) -> str:
    """What the run averages, and when, in words."""
    if shape.world_size == 1:
        return "nothing (one rank)"
    elche = shape.elche
    said = {
        Mode.nccl_sync: "gradients, exactly, inside backward at every step (torch DDP's trajectory)"
        if elche.sync_average is SyncAverage.grads else
        "parameters after every rank's own step (floDl's variant, elche.sync_average=params)",
        Mode.cpu_sync: "parameters after every step, on the coordinator",
        Mode.nccl_cadence: "parameters at the end of each window, among the ranks",
        Mode.cpu_cadence: "parameters at the end of each window, on the coordinator",
        Mode.cpu_async: "parameters at the end of each window, on the coordinator, blended in "
                        "with EASGD while the ranks keep training",
    }[elche.mode]
    if shape.outer is not OuterKind.none:
        said += f", then an outer {shape.outer.value} step"
    return said


def averaging_line(before: Shape, after: Shape) -> Optional[str]:
    a, b = averaging(before), averaging(after)
    return None if a == b else f"averages {a} -> {b}"


def estimate_line(before: Shape, after: Shape, rig: Rig) -> Optional[str]:
    """The sim's samples/s and ratio to the ideal on both sides, when the rig is known for both
    and the estimate (or the command that gives it) changes."""
    a, b = sim_inputs(before, rig), sim_inputs(after, rig)
    if a is None or b is None:
        return None
    (sim_a, elche_a), (sim_b, elche_b) = a, b
    if sim_command(sim_a, elche_a) == sim_command(sim_b, elche_b):
        return None
    ra, rb = simulate(sim_a, elche_a), simulate(sim_b, elche_b)
    source = f" ({rig.source})" if rig.source else " (cluster.emulate_slowdown x " \
        f"{EMULATED_BASE_MS:g} ms)"
    caveats = []
    if any(shape.elche.averages_gradients for shape in (before, after)):
        caveats.append("the sim models nccl_sync as parameter averaging after each step")
    if before.batch_size != after.batch_size:  # the rig's speeds are per batch, of either size
        caveats.append("the same ms per batch at both batch sizes")
    caveat = f" ({'; '.join(caveats)})" if caveats else ""
    return (f"sim estimate{source}: {_estimate(ra)} -> {_estimate(rb)}{caveat}; "
            f"before: `{sim_command(sim_a, elche_a)}`; after: `{sim_command(sim_b, elche_b)}`")


def _estimate(result: SimResult) -> str:
    s = result.summary
    counts = result.windows[-1].batch_counts if result.windows else []
    total = sum(counts) or 1
    shares = "/".join(f"{c / total:.2f}" for c in counts)
    return (f"{s.samples_per_s:,.1f} samples/s, {s.ratio_to_ideal:.3f} of ideal, "
            f"rank shares {shares}")


def sim_inputs(shape: Shape, rig: Rig) -> Optional[Tuple[SimConfig, ElCheConfig]]:
    """What `python -m flodl_run.sim` would be given for this config on this rig; None when
    neither the rig nor the config says how fast each rank is, or they disagree on the ranks."""
    world = shape.world_size
    if rig.rank_ms is not None:
        rank_ms = list(rig.rank_ms)
    elif shape.emulate_slowdown and world == len(shape.emulate_slowdown):
        rank_ms = [EMULATED_BASE_MS * f for f in shape.emulate_slowdown]
    else:
        return None
    if (world is not None and world != len(rank_ms)) or len(rank_ms) < 2:
        return None
    sim = SimConfig(rank_ms=rank_ms, batch_size=shape.batch_size)
    if rig.sync_ms is not None:
        sim = replace(sim, sync_ms=rig.sync_ms)
    # The sim models every sync as floDl's parameter averaging after each step (it says so).
    return sim, replace(shape.elche, sync_average=SyncAverage.params)


def sim_command(sim: SimConfig, elche: ElCheConfig) -> str:
    """The `python -m flodl_run.sim` command that simulates exactly this: the mode's preset,
    every elche key that differs from it, and the rig."""
    preset = ElCheConfig.preset(elche.mode)
    words = [f"elche={elche.mode.value}"]
    words += [f"elche.{f.name}={_typed(getattr(elche, f.name))}" for f in fields(ElCheConfig)
              if f.name != "sync_average" and getattr(elche, f.name) != getattr(preset, f.name)]
    words += [f"sim.rank_ms={_typed(sim.rank_ms)}", f"sim.batch_size={sim.batch_size}"]
    if sim.sync_ms != SimConfig().sync_ms:
        words.append(f"sim.sync_ms={sim.sync_ms:g}")
    return ".venv/bin/python -m flodl_run.sim " + " ".join(words)


def _typed(value: object) -> str:
    """A value as a Hydra override takes it, without spaces (one shell word)."""
    return show(value).replace(" ", "")


def render_meaning(lines: Sequence[str], fmt: str, console: Console) -> None:
    """The meaning lines under a diff: `meaning:` lines, or a markdown list."""
    if not lines:
        return
    if fmt == "markdown":
        text = "\n**What it changes**\n\n" + "".join(f"- {line}\n" for line in lines) + "\n"
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return
    for line in lines:
        console.print(labelled("meaning", line, "cyan"), highlight=False, soft_wrap=True)
