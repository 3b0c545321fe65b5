"""The comparison of a sweep's jobs: one row per job from its summary.json, as a markdown and a
CSV table, and a PNG of loss and eval against wall time.

Owns the figures and their layout only; which jobs belong to a sweep and where the files go
(MLflow parent run, multirun directory) is `sweep`'s business.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from flodl_run.config.schema import EvalDirection
from flodl_run.report.quality import eval_points, speedup, time_to_bar

COLUMNS = ("job", "overrides", "status", "final_loss", "final_eval", "eval_rank",
           "time_to_quality_s", "x_first_to_quality", "wall_s",
           "samples_per_s", "loss_at_epoch_n", "loss_drop_per_s", "wall_per_epoch_s",
           "mlflow_run_id")


@dataclass
class JobOutcome:
    """One job of a sweep: what it was asked (overrides) and what it wrote (summary.json)."""

    num: int
    overrides: List[str]
    run_dir: Path
    summary: Dict = field(default_factory=dict)
    """summary.json as a dict; empty when the job wrote none (it crashed before)."""
    eval_direction: Optional[EvalDirection] = None
    """The job's recipe.eval_direction, from its run.yaml; None when it wrote none."""

    @classmethod
    def read(cls, num: int, overrides: Sequence[str], run_dir: Path) -> "JobOutcome":
        path = Path(run_dir) / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            summary = {}
        return cls(num, list(overrides), Path(run_dir), summary, _eval_direction(Path(run_dir)))

    @property
    def status(self) -> str:
        return self.summary.get("status", "failed")

    @property
    def losses(self) -> List[float]:
        return [e["avg_loss"] for e in self.summary.get("epochs", [])]

    def wall_axis(self) -> List[float]:
        """Seconds of training at the end of each epoch (cumulative epoch_ms)."""
        return [ms / 1000.0 for ms in accumulate(e["epoch_ms"] for e in self.summary.get("epochs", []))]

    def evals(self) -> Tuple[List[float], List[float]]:
        """(wall s, eval) of every evaluated epoch, plus the final eval if it came after them."""
        xs, ys = [], []
        for x, epoch in zip(self.wall_axis(), self.summary.get("epochs", [])):
            if epoch.get("eval") is not None:
                xs.append(x)
                ys.append(epoch["eval"])
        final = self.summary.get("final_eval")
        wall = self.wall_axis()
        if final is not None and wall and (not xs or xs[-1] < wall[-1]):
            xs.append(wall[-1])
            ys.append(final)
        return xs, ys


def _eval_direction(run_dir: Path) -> Optional[EvalDirection]:
    """recipe.eval_direction of the run.yaml in `run_dir`; None when unreadable or absent."""
    try:
        run = yaml.safe_load((run_dir / "run.yaml").read_text())
        return EvalDirection(run["recipe"]["eval_direction"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def shared_direction(jobs: Sequence[JobOutcome]) -> Optional[EvalDirection]:
    """The eval direction every job that says one shares (max when none says); None when they
    differ, so their evals do not rank."""
    directions = {j.eval_direction for j in jobs if j.eval_direction is not None}
    if len(directions) > 1:
        return None
    return directions.pop() if directions else EvalDirection.max


def eval_ranks(jobs: Sequence[JobOutcome]) -> List[Optional[int]]:
    """Per job, 1 + how many jobs have a strictly better final eval in the shared direction
    (ties share a rank); None without a final eval, or for all when directions differ."""
    direction = shared_direction(jobs)
    finals = [j.summary.get("final_eval") for j in jobs]
    if direction is None:
        return [None] * len(jobs)
    return [None if f is None else
            1 + sum(o is not None and direction.is_better(o, f) for o in finals) for f in finals]


def quality_reference(jobs: Sequence[JobOutcome]) -> Optional[JobOutcome]:
    """The job whose final eval is the sweep's quality bar: its first job (lowest number), when
    that completed with a final eval and the jobs share one eval direction; else None."""
    first = min(jobs, key=lambda j: j.num) if jobs else None
    if (first is None or first.status != "completed" or first.summary.get("final_eval") is None
            or shared_direction(jobs) is None):
        return None
    return first


def times_to_quality(jobs: Sequence[JobOutcome]) -> List[Tuple[object, object]]:
    """Per job, (training s until its eval first reached the first job's final eval, the first
    job's own time to it over that); (None, None) without a bar or for a job that did not
    complete. Training s: epoch time less its evals, as the bench counts it."""
    reference, direction = quality_reference(jobs), shared_direction(jobs)
    if reference is None or direction is None:
        return [(None, None)] * len(jobs)
    bar = reference.summary["final_eval"]
    own = time_to_bar(eval_points(reference.summary), bar, direction.value)
    out: List[Tuple[object, object]] = []
    for job in jobs:
        t = (time_to_bar(eval_points(job.summary), bar, direction.value)
             if job.status == "completed" else None)
        out.append((t, speedup(own, t)))
    return out


def varying(jobs: Sequence[JobOutcome]) -> Tuple[List[List[str]], List[str]]:
    """Per job, the overrides that differ between jobs; and the ones every job shares."""
    common = [o for o in jobs[0].overrides if all(o in j.overrides for j in jobs)] if jobs else []
    return [[o for o in j.overrides if o not in common] for j in jobs], common


def common_epochs(jobs: Sequence[JobOutcome]) -> int:
    """N of "loss at epoch N": the most epochs every job with any epoch completed."""
    counts = [len(j.losses) for j in jobs if j.losses]
    return min(counts) if counts else 0


def rows(jobs: Sequence[JobOutcome]) -> List[Dict[str, object]]:
    """One dict per job with the COLUMNS; None where a job has no such figure."""
    n = common_epochs(jobs)
    out = []
    for job, own, rank, (to_quality, x_quality) in zip(jobs, varying(jobs)[0], eval_ranks(jobs),
                                                        times_to_quality(jobs)):
        s, losses, wall = job.summary, job.losses, job.wall_axis()
        train_s = wall[-1] if wall else None
        drop = (losses[0] - losses[-1]) / train_s if len(losses) > 1 and train_s else None
        out.append({
            "job": job.num, "overrides": " ".join(own), "status": job.status,
            "final_loss": losses[-1] if losses else None, "final_eval": s.get("final_eval"),
            "eval_rank": rank, "time_to_quality_s": to_quality, "x_first_to_quality": x_quality,
            "wall_s": s.get("wall_s"), "samples_per_s": s.get("samples_per_s"),
            "loss_at_epoch_n": losses[n - 1] if n and len(losses) >= n else None,
            "loss_drop_per_s": drop,
            "wall_per_epoch_s": train_s / len(losses) if losses and train_s else None,
            "mlflow_run_id": s.get("mlflow_run_id"),
        })
    return out


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def to_markdown(jobs: Sequence[JobOutcome]) -> str:
    n = common_epochs(jobs)
    common = varying(jobs)[1]
    at = f"loss @ epoch {n}" if n else "loss @ epoch -"  # epochs count from 1, as the terminal's
    header = ["job", "overrides", "status", "final loss", "final eval", "eval rank",
              "time to quality s", "x first job to quality", "wall s",
              "samples/s", at, "loss drop / s", "wall s / epoch", "MLflow run"]
    lines = [f"# Sweep comparison ({len(jobs)} jobs)", ""]
    if common:
        lines += [f"Shared overrides: `{' '.join(common)}`", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows(jobs):
        lines.append("| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |")
    finished = (f"`{at}`: mean training loss of epoch {n}, the last epoch every job finished."
                if n else f"`{at}`: no job finished an epoch.")
    lines += ["", f"{finished} `loss drop / s`: (loss of the first epoch - final loss) / training "
              "wall seconds (sum of epoch_ms); higher is better. " + _rank_note(jobs) + " "
              + _quality_note(jobs), ""]
    return "\n".join(lines)


def _rank_note(jobs: Sequence[JobOutcome]) -> str:
    direction = shared_direction(jobs)
    if direction is None:
        return "`eval rank`: none, the jobs' recipes disagree on recipe.eval_direction."
    return (f"`eval rank`: 1 = best final eval; {_better(direction)} is better "
            f"(recipe.eval_direction={direction.value}).")


def _quality_note(jobs: Sequence[JobOutcome]) -> str:
    reference = quality_reference(jobs)
    if reference is None:
        return ("`time to quality s`: none, the first job has no final eval or the jobs' "
                "recipes disagree on recipe.eval_direction.")
    direction = shared_direction(jobs) or EvalDirection.max
    reached = "<=" if direction is EvalDirection.min else ">="
    return (f"`time to quality s`: training seconds (epoch time less its evals) until the job's "
            f"eval first reached the quality bar: the final eval of job #{reference.num}, the "
            f"sweep's first, {reached} {reference.summary['final_eval']:.4g}; not reached: none of its evals "
            f"did. `x first job to quality`: job #{reference.num}'s own time to the bar over "
            f"the job's (higher is sooner).")


def _better(direction: EvalDirection) -> str:
    return "lower" if direction is EvalDirection.min else "higher"


def to_csv(jobs: Sequence[JobOutcome]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows(jobs):
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def plot(jobs: Sequence[JobOutcome], path: Path) -> Optional[Path]:
    """Loss and eval against training wall time, one line per job; None when nothing to draw."""
    if not any(j.losses for j in jobs):
        return None
    from matplotlib.figure import Figure  # Agg canvas, no pyplot: no global backend, no display

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    loss_ax, eval_ax = fig.subplots(1, 2)
    for job, own in zip(jobs, varying(jobs)[0]):
        label = f"#{job.num} {' '.join(own) or 'job'}"
        if job.losses:
            loss_ax.plot(job.wall_axis(), job.losses, marker="o", markersize=3, label=label)
        xs, ys = job.evals()
        if xs:
            eval_ax.plot(xs, ys, marker="o", markersize=3, label=label)
    direction = shared_direction(jobs)
    eval_name = "eval" if direction is None else f"eval ({_better(direction)} is better)"
    for ax, name in ((loss_ax, "training loss (epoch mean)"), (eval_ax, eval_name)):
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    loss_ax.set_title("loss vs wall time")
    eval_ax.set_title("eval vs wall time")
    loss_ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path
