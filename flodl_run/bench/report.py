"""The benchmark's figures and outputs: one entry per run from its summary.json, the ratios to
the ideal and to the torch peers (DDP, local SGD), time to DDP's quality (torch_ddp's final eval)
and to the declared target, bench.json, bench.md, the terminal table and the plot of eval
against training time.

Owns arithmetic and layout only. Which runs exist, how they are started and where the files go
is `bench`'s business; MLflow is `benchtrack`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from rich.table import Table

from flodl_run.report.quality import (  # noqa: F401  (NOT_REACHED: the bench's word for it too)
    NOT_REACHED,
    eval_points,
    speedup,
    time_to_bar,
    train_axis,
)

ENTRY_KEYS = ("name", "recipe", "kind", "mode", "outer", "status", "samples_per_s",
              "ratio_to_ideal", "ratio_to_torch_ddp", "ratio_to_torch_localsgd", "final_loss",
              "final_eval", "time_to_ddp_quality_s", "x_ddp_to_quality",
              "time_to_target_s", "wall_s", "train_s", "loss_drop_per_s", "syncs", "avg_sync_ms",
              "idle_fraction", "epochs", "load_average", "repeats", "run_dir", "command",
              "ratio_to_timeline_off", "timeline_record_share")


@dataclass
class RunOutcome:
    """One finished (or failed) run of the benchmark and what it wrote."""

    name: str
    """solo@1.0, runner_solo@1.0, torch_ddp, torch_localsgd, nccl_cadence, nccl_cadence+diloco, ..."""
    recipe: str
    kind: str
    """solo | runner_solo | torch_ddp | torch_localsgd | flodl_run."""
    mode: str
    outer: str
    wall_s: float
    """End to end, as the user waits for it: process start-up, training, teardown."""
    summary: Dict[str, Any] = field(default_factory=dict)
    """The run's summary.json; empty when it wrote none."""
    run_dir: str = ""
    command: str = ""
    load_average: List[float] = field(default_factory=list)
    """1-minute load average of the machine when the run started and when it ended."""
    repeats: List[Optional[float]] = field(default_factory=list)
    """samples/s of every run of this entry (None: that run did not complete)."""


@dataclass
class RecipeBench:
    """A recipe's reference figures: its target and the ideal of the rig."""

    name: str
    target_eval: Optional[float]
    rank_speeds: List[float]
    """Per rank of the rig, its slowdown factor (which solo run stands for it)."""
    ideal_samples_per_s: Optional[float] = None
    overrides: List[str] = field(default_factory=list)
    eval_direction: str = "max"
    """The recipe's recipe.eval_direction: max (reached when eval >= target) or min (<=)."""
    quality_bar: Optional[float] = None
    """The eval every entry is timed to: torch_ddp's final eval, else target_eval."""
    quality_source: str = ""
    """Where quality_bar comes from: torch_ddp | target_eval | "" (neither)."""
    ddp_time_to_quality_s: Union[float, str, None] = None
    """torch_ddp's own training seconds to quality_bar (the ratio's denominator)."""


def median_run(runs: Sequence[RunOutcome]) -> RunOutcome:
    """The run with the median samples/s among the completed ones (the lower middle for an even
    count), carrying every run's samples/s; the first run when none completed."""
    rates = [training_rate(r.summary) for r in runs]
    done = sorted((rate, i) for i, rate in enumerate(rates) if rate is not None)
    chosen = runs[done[(len(done) - 1) // 2][1]] if done else runs[0]
    chosen.repeats = rates
    return chosen


def _ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    if value is None or not reference:
        return None
    return value / reference


def solo_name(factor: float) -> str:
    return f"solo@{float(factor)!r}"


def training_rate(summary: Dict[str, Any]) -> Optional[float]:
    """Samples per second of training time (train_axis). The summary's own samples_per_s is per
    second of epoch time, so samples = samples_per_s x the epochs' time."""
    epochs = summary.get("epochs", [])
    epoch_s = sum(e["epoch_ms"] for e in epochs) / 1000.0
    train = train_axis(summary)
    if summary.get("status") != "completed" or not train or train[-1] <= 0:
        return None
    return summary.get("samples_per_s", 0.0) * epoch_s / train[-1]


def time_to_target(summary: Dict[str, Any], target: Optional[float],
                   direction: str = "max") -> Union[float, str, None]:
    """Training seconds until the first eval that reaches target (>= for direction max, <= for
    min); NOT_REACHED if none does; None without a target or without any eval."""
    return time_to_bar(eval_points(summary), target, direction)


def set_quality_bar(recipe: RecipeBench, outcomes: Sequence[RunOutcome]) -> None:
    """The recipe's quality bar: the final eval of its torch_ddp entry when that completed with
    one (and DDP's own time to it), else the declared target_eval (no DDP time, so no ratio)."""
    ddp = next((o.summary for o in outcomes if o.kind == "torch_ddp" and o.recipe == recipe.name
                and o.summary.get("status") == "completed"
                and o.summary.get("final_eval") is not None), None)
    if ddp is not None:
        recipe.quality_bar, recipe.quality_source = ddp["final_eval"], "torch_ddp"
        recipe.ddp_time_to_quality_s = time_to_bar(eval_points(ddp), recipe.quality_bar,
                                                   recipe.eval_direction)
    else:
        recipe.quality_bar, recipe.ddp_time_to_quality_s = recipe.target_eval, None
        recipe.quality_source = "target_eval" if recipe.target_eval is not None else ""


def ideal(recipe: RecipeBench, outcomes: Sequence[RunOutcome]) -> Optional[float]:
    """Sum over the rig's ranks of the solo samples/s at that rank's speed (None if one is
    missing)."""
    solo = {o.name: training_rate(o.summary) for o in outcomes
            if o.kind == "solo" and o.recipe == recipe.name}
    rates = [solo.get(solo_name(f)) for f in recipe.rank_speeds]
    return sum(rates) if rates and all(r for r in rates) else None


def peer_rates(outcomes: Sequence[RunOutcome]) -> Dict[str, Optional[float]]:
    """Training rate of each collective peer (torch_ddp, torch_localsgd) and of the bare solo
    loops (by name), for the ratios."""
    return {o.name: training_rate(o.summary) for o in outcomes
            if o.kind in ("solo", "torch_ddp", "torch_localsgd")}


def entry(outcome: RunOutcome, recipe: RecipeBench,
          peers: Dict[str, Optional[float]]) -> Dict[str, Any]:
    """One bench.json entry (ENTRY_KEYS). A one-rank entry (the runner's solo path) is set
    against the bare loop at its speed instead of the rig's ideal."""
    s = outcome.summary
    epochs = s.get("epochs", [])
    axis = train_axis(s)
    losses = [e["avg_loss"] for e in epochs]
    train_s = axis[-1] if axis else None
    completed = s.get("status") == "completed"
    rate = training_rate(s)
    to_quality = (time_to_bar(eval_points(s), recipe.quality_bar, recipe.eval_direction)
                  if completed else None)
    return {
        "name": outcome.name, "recipe": outcome.recipe, "kind": outcome.kind,
        "mode": outcome.mode, "outer": outcome.outer, "status": s.get("status", "failed"),
        "samples_per_s": rate,
        "ratio_to_ideal": _ratio(rate, peers.get(outcome.name[len("runner_"):])
                                 if outcome.kind == "runner_solo" else recipe.ideal_samples_per_s),
        "ratio_to_torch_ddp": _ratio(rate, peers.get("torch_ddp")),
        "ratio_to_torch_localsgd": _ratio(rate, peers.get("torch_localsgd")),
        "final_loss": losses[-1] if losses else None,
        "final_eval": s.get("final_eval"),
        "time_to_ddp_quality_s": to_quality,
        "x_ddp_to_quality": speedup(recipe.ddp_time_to_quality_s, to_quality),
        "time_to_target_s": (time_to_target(s, recipe.target_eval, recipe.eval_direction)
                             if completed else None),
        "wall_s": outcome.wall_s, "train_s": train_s,
        "loss_drop_per_s": ((losses[0] - losses[-1]) / train_s
                            if len(losses) > 1 and train_s else None),
        "syncs": s.get("syncs"), "avg_sync_ms": s.get("avg_sync_ms"),
        "idle_fraction": s.get("idle_fraction", []),
        "epochs": [{"epoch": e["epoch"], "avg_loss": e["avg_loss"], "eval": e.get("eval"),
                    "train_s": t} for e, t in zip(epochs, axis)],
        "load_average": outcome.load_average, "repeats": outcome.repeats,
        "run_dir": outcome.run_dir,
        "command": outcome.command,
        "ratio_to_timeline_off": None, "timeline_record_share": None,
    }


TIMELINE_SUFFIX = "+timeline"


def timeline_costs(entries: List[Dict[str, Any]]) -> None:
    """Fill in each `<mode>+timeline` entry's cost of the timeline: its samples/s over the same
    recipe's `<mode>` entry, and the recording time per batch over the batch time measured
    in its own trace (`flodl_run.observe.timeline.recording_share`)."""
    from flodl_run.observe.timeline import recording_share

    rates = {(e["recipe"], e["name"]): e["samples_per_s"] for e in entries}
    for e in entries:
        if e["kind"] != "flodl_run" or not e["name"].endswith(TIMELINE_SUFFIX):
            continue
        e["ratio_to_timeline_off"] = _ratio(e["samples_per_s"],
                                            rates.get((e["recipe"], e["name"][:-len(TIMELINE_SUFFIX)])))
        e["timeline_record_share"] = recording_share(Path(e["run_dir"]) / "timeline.json")


def bench_document(recipes: Sequence[RecipeBench], outcomes: Sequence[RunOutcome],
                   meta: Dict[str, Any]) -> Dict[str, Any]:
    """bench.json: `ideal_samples_per_s` (of the one recipe; null with several, see `recipes`),
    `entries`, each recipe's target and ideal, and `meta` (command, machine, rig, load)."""
    entries = []
    for recipe in recipes:
        recipe.ideal_samples_per_s = ideal(recipe, outcomes)
        set_quality_bar(recipe, outcomes)
        mine = [o for o in outcomes if o.recipe == recipe.name]
        entries += [entry(o, recipe, peer_rates(mine)) for o in mine]
    timeline_costs(entries)
    return {
        "ideal_samples_per_s": recipes[0].ideal_samples_per_s if len(recipes) == 1 else None,
        "entries": entries,
        "recipes": [{"name": r.name, "target_eval": r.target_eval,
                     "eval_direction": r.eval_direction, "overrides": r.overrides,
                     "rank_speeds": r.rank_speeds, "ideal_samples_per_s": r.ideal_samples_per_s,
                     "quality_bar": r.quality_bar, "quality_source": r.quality_source,
                     "ddp_time_to_quality_s": r.ddp_time_to_quality_s}
                    for r in recipes],
        **meta,
    }


# ---- layout ---------------------------------------------------------------------------------

COLUMNS = (("entry", "name"), ("status", "status"), ("x DDP to quality", "x_ddp_to_quality"),
           ("time to quality s", "time_to_ddp_quality_s"), ("samples/s", "samples_per_s"),
           ("x ideal", "ratio_to_ideal"), ("x torch DDP", "ratio_to_torch_ddp"),
           ("x local SGD", "ratio_to_torch_localsgd"), ("final eval", "final_eval"),
           ("final loss", "final_loss"), ("wall s", "wall_s"), ("train s", "train_s"),
           ("loss drop / s", "loss_drop_per_s"), ("syncs", "syncs"),
           ("avg sync ms", "avg_sync_ms"), ("idle per rank", "idle_fraction"),
           ("x timeline off", "ratio_to_timeline_off"), ("timeline cost", "timeline_record_share"))
"""bench.md's columns: every figure of an entry but time_to_target_s (bench.json has it)."""
TERMINAL_COLUMNS = (("entry", "name"), ("status", "status"),
                    ("x DDP to\nquality", "x_ddp_to_quality"),
                    ("time to\nquality s", "time_to_ddp_quality_s"),
                    ("samples/s", "samples_per_s"), ("x\nideal", "ratio_to_ideal"),
                    ("x torch\nDDP", "ratio_to_torch_ddp"), ("final\neval", "final_eval"))
"""The terminal's: what ranks the entries, in a width a terminal has (the rest, syncs included:
bench.md)."""
MARKERS = "osD^v<>pXh"


def cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "idle_fraction":
        return " ".join(f"{x:.2f}" for x in value) or "-"
    if key == "timeline_record_share":
        return f"{value:.3%}"
    if key.startswith("ratio_"):
        return f"{value:.2f}"
    if key in ("final_eval", "final_loss", "loss_drop_per_s"):
        return f"{value:.4f}"
    if key == "samples_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _recipe_line(recipe: Dict[str, Any]) -> str:
    overrides = " ".join(recipe["overrides"]) or "none"
    ideal_rate = recipe["ideal_samples_per_s"]
    ideal_text = f"{ideal_rate:,.0f} samples/s" if ideal_rate else "-"
    speeds = " + ".join(solo_name(f) for f in recipe["rank_speeds"])
    reached = "<=" if recipe.get("eval_direction") == "min" else ">="
    return (f"recipe `{recipe['name']}` (overrides: `{overrides}`), target eval {reached} "
            f"{cell('final_eval', recipe['target_eval'])}; ideal = {speeds} = {ideal_text}")


def quality_line(recipe: Dict[str, Any]) -> str:
    """Which eval `x DDP to quality` and `time to quality s` time every entry to, and why."""
    reached = "<=" if recipe.get("eval_direction") == "min" else ">="
    bar = f"{reached} {cell('final_eval', recipe.get('quality_bar'))}"
    source, ddp_s = recipe.get("quality_source"), recipe.get("ddp_time_to_quality_s")
    if source == "torch_ddp":
        return (f"quality bar: torch_ddp's final eval, {bar}, which DDP first reached after "
                f"{cell('time_to_ddp_quality_s', ddp_s)} s of training; x DDP to quality = "
                f"that time / the entry's (higher is sooner)")
    if source == "target_eval":
        return (f"quality bar: no completed torch_ddp entry, so the declared target eval {bar}; "
                f"x DDP to quality needs DDP's time: not computed")
    return "quality bar: none (no completed torch_ddp entry and no target eval)"


def to_markdown(doc: Dict[str, Any]) -> str:
    lines = ["# flodl_run bench", "", f"- command: `{doc['command']}`",
             f"- machine: {doc['machine']}", f"- rig: {doc['rig']}",
             f"- runs: {doc['runs']}",
             f"- load average (1 min) at start / end: {doc['load_average'][0]:.2f} / "
             f"{doc['load_average'][1]:.2f}", ""]
    for recipe in doc["recipes"]:
        lines += [f"## {recipe['name']}", "", _recipe_line(recipe), "", quality_line(recipe), "",
                  "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for e in doc["entries"]:
            if e["recipe"] == recipe["name"]:
                lines.append("| " + " | ".join(cell(k, e[k]) for _, k in COLUMNS) + " |")
        lines.append("")
    lines += [DEFINITIONS, "", "![eval and loss vs training time](bench.png)", ""]
    return "\n".join(lines)


DEFINITIONS = (
    "samples/s: samples trained per second of training time (the epochs' time less their eval "
    "callbacks; start-up excluded). solo@f: a bare training loop at speed f (data on the "
    "device, no per-step host sync); runner_solo@f: flodl_run's own in-process path, whose x "
    "ideal is its ratio to solo@f. x ideal: samples/s over the sum of the solo samples/s at "
    "each rank's speed (the physical limit of the rig). x torch DDP, x local SGD: samples/s "
    "over torch DDP's and torch local SGD's (PeriodicModelAverager), both written as a careful "
    "user would (data on the device, no per-step host sync). time to quality s: training seconds "
    "(same clock) until the entry's eval first reached the quality bar (torch_ddp's final eval; "
    "the recipe's target when DDP did not run); not reached: no eval of the entry reached it. "
    "x DDP to quality: DDP's own time to the bar over the entry's (DDP = 1.00; 2.00 = there in "
    "half DDP's training time). bench.json's time_to_target_s times the declared target the "
    "same way. wall s: the "
    "whole process, start-up and teardown included. "
    "loss drop / s: (first epoch's mean loss - final epoch's) / training seconds. avg sync ms: "
    "mean reduce time (not measured for the peers: timing their collectives would add host "
    "syncs). idle per rank: share of the run's training wall time a rank was not computing "
    "(emulated slowdown counts as computing). <mode>+timeline: the mode again with "
    "timeline=true; x timeline off: its samples/s over the plain run's (run-to-run noise "
    "included); timeline cost: the time its recording takes per batch (every event of the "
    "trace, at the per-event cost measured in the bench process) over the mean batch time "
    "in the trace.")


def tables(doc: Dict[str, Any]) -> List[Table]:
    """The terminal tables, one per recipe."""
    out = []
    for recipe in doc["recipes"]:
        table = Table(title=_recipe_line(recipe).replace("`", ""), title_justify="left",
                      show_edge=False, caption=f"{quality_line(recipe)}; every figure: bench.md",
                      caption_justify="left")
        entries = [e for e in doc["entries"] if e["recipe"] == recipe["name"]]
        rows = [[cell(k, e[k]) for _, k in TERMINAL_COLUMNS] for e in entries]
        for i, (header, key) in enumerate(TERMINAL_COLUMNS):  # two-line headers: values never cut
            widest = max([len(r[i]) for r in rows] + [len(line) for line in header.split("\n")])
            table.add_column(header, justify="left" if key in ("name", "status") else "right",
                             no_wrap=True, min_width=widest)
        for row in rows:
            table.add_row(*row)
        out.append(table)
    return out


def entry_styles(entries: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """One look per entry name, the same in every panel: its own colour (20 of them) and marker
    (10), dashed for the peers and solid for flodl_run's entries. matplotlib's own cycle has 10
    colours, so the 11th entry looked like the first (solo@1.0 and torch_localsgd)."""
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors
    kinds = {e["name"]: e["kind"] for e in entries}
    return {name: {"color": colors[i % len(colors)], "marker": MARKERS[i % len(MARKERS)],
                   "linestyle": "-" if kind == "flodl_run" else "--"}
            for i, (name, kind) in enumerate(kinds.items())}


def plot(doc: Dict[str, Any], path: Path) -> Optional[Path]:
    """Eval (left) and training loss (right) against training time, one line per entry and one
    row per recipe, the target as a dashed line; None when nothing has an epoch."""
    if not any(e["epochs"] for e in doc["entries"]):
        return None
    from matplotlib.figure import Figure  # Agg canvas, no pyplot: no global backend, no display

    recipes = doc["recipes"]
    fig = Figure(figsize=(13, 4.5 * len(recipes)), layout="constrained")
    axes = fig.subplots(len(recipes), 2, squeeze=False)
    styles = entry_styles(doc["entries"])
    for (eval_ax, loss_ax), recipe in zip(axes, recipes):
        for e in (x for x in doc["entries"] if x["recipe"] == recipe["name"] and x["epochs"]):
            style = styles[e["name"]]
            points = [(p["train_s"], p["eval"]) for p in e["epochs"] if p["eval"] is not None]
            if points:
                eval_ax.plot(*zip(*points), markersize=4, label=e["name"], **style)
            loss_ax.plot([p["train_s"] for p in e["epochs"]], [p["avg_loss"] for p in e["epochs"]],
                         markersize=4, label=e["name"], **style)
        if recipe["target_eval"] is not None:
            eval_ax.axhline(recipe["target_eval"], color="grey", linestyle=":", label="target")
        if recipe.get("quality_source") == "torch_ddp":
            eval_ax.axhline(recipe["quality_bar"], color="black", linestyle="-.", linewidth=0.8,
                            label="quality bar (torch_ddp's final eval)")
        for ax, name in ((eval_ax, "eval"), (loss_ax, "training loss (epoch mean)")):
            ax.set_xlabel("training time (s)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.set_title(f"{recipe['name']}: {name} vs training time")
        eval_ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path
