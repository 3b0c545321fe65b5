"""The launcher: decides the topology of a materialized run and carries it out.

Owns the choice in-process vs one process per rank (DESIGN §3.2), the hardware line, the
tracker's lifetime and the run dir's summary.json. Training itself lives in `solo`
(in-process) and in the rank runtime (`supervisor`, `coordinator`, `rank`). Never touches CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from rich.console import Console

from flodl_run.config.schema import ExperimentConfig, Topology
from flodl_run.devices import GpuInfo, hardware_line, visible_gpus
from flodl_run.progress import TerminalProgress
from flodl_run.summary import Summary, write_summary
from flodl_run.observe import Observers
from flodl_run.tracking import make_tracker


@dataclass(frozen=True)
class Plan:
    """Where the ranks of a run go: in-process (world size 1) or one process each."""

    world_size: int
    in_process: bool
    gpus: List[GpuInfo]


def plan_topology(config: ExperimentConfig, gpus: Optional[List[GpuInfo]] = None) -> Plan:
    """auto: 2+ visible GPUs -> one rank per GPU; 0-1 -> in-process (DESIGN §3.2)."""
    cluster = config.cluster
    if cluster.topology is Topology.solo:
        return Plan(1, True, [])
    if cluster.topology is Topology.cpu:
        return Plan(cluster.num_ranks or 1, False, [])
    if cluster.topology is Topology.local_gpus:
        return Plan(len(cluster.devices), False, [])
    if cluster.topology is Topology.hosts:
        return Plan(0, False, [])
    gpus = visible_gpus() if gpus is None else gpus
    if len(gpus) >= 2:
        return Plan(len(gpus), False, gpus)
    return Plan(1, True, gpus)


def launch(config: ExperimentConfig, run_dir: Path, console: Console) -> str:
    """Run the job; returns the summary status (completed, interrupted, failed, ...)."""
    plan = plan_topology(config)
    console.print(hardware_line(plan.gpus, plan.world_size), highlight=False)
    tracker = make_tracker(config)
    tracker.start(config, run_dir)
    progress = TerminalProgress(console)
    observer = Observers(progress, tracker)
    try:
        if plan.in_process:
            summary = _train_in_process(config, observer)
        else:
            from flodl_run.supervisor import launch_ranks

            summary = launch_ranks(config, plan, run_dir, console, observer)
    finally:
        progress.close()
    summary.mlflow_run_id = tracker.run_id
    write_summary(run_dir / "summary.json", summary)
    tracker.finish(summary, run_dir)
    _report(summary, run_dir, console)
    return summary.status


def _train_in_process(config: ExperimentConfig, observer: Observers) -> Summary:
    from flodl_run.recipe import load_recipe
    from flodl_run.solo import SoloTrainer

    recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform)
    trainer = SoloTrainer(config, recipe, observer)
    try:
        trainer.run()
    except KeyboardInterrupt:
        pass  # the trainer marked its summary interrupted; the caller writes it
    return trainer.summary


def _report(summary: Summary, run_dir: Path, console: Console) -> None:
    if summary.status == "completed":
        final = "-" if summary.final_eval is None else f"{summary.final_eval:.4f}"
        syncs = f" | {summary.syncs} syncs ({summary.avg_sync_ms:.2f} ms avg)" if summary.world_size > 1 else ""
        console.print(f"done: final eval {final} | {summary.wall_s:.1f}s | "
                      f"{summary.samples_per_s:,.0f} samples/s{syncs} | {run_dir}",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"[bold red]{summary.status}:[/] {summary.message} | {run_dir}",
                      highlight=False, soft_wrap=True)
