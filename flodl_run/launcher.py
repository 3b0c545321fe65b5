"""The launcher: decides the topology of a materialized run and carries it out.

Owns the choice in-process vs one process per rank (DESIGN §3.2), the hardware line, the
tracker's lifetime and the run dir's summary.json. Training itself lives in `solo`
(in-process) and in the rank runtime (`supervisor`, `coordinator`, `rank`). Never touches CUDA.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from rich.console import Console

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ExperimentConfig, Topology
from flodl_run.config.validate import Problem
from flodl_run.dashboard import Dashboard
from flodl_run.devices import GpuInfo, hardware_line, pick_gpus, visible_gpus
from flodl_run.observe import Observers
from flodl_run.progress import TerminalProgress
from flodl_run.records import RecordLog
from flodl_run.say import labelled
from flodl_run.summary import Summary, write_summary
from flodl_run.tracking import make_tracker

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.hosts import HostLayout


@dataclass(frozen=True)
class Plan:
    """Where the ranks of a run go: in-process (world size 1) or one process each."""

    world_size: int
    in_process: bool
    gpus: List[GpuInfo]
    hosts: Optional["HostLayout"] = None
    """Ranks per worker host for topology hosts (DESIGN §12)."""


def plan_topology(config: ExperimentConfig, gpus: Optional[List[GpuInfo]] = None) -> Plan:
    """auto: 2+ visible GPUs -> one rank per GPU; 0-1 -> in-process (DESIGN §3.2)."""
    cluster = config.cluster
    if cluster.topology is Topology.solo:
        return Plan(1, True, [])
    if cluster.topology is Topology.cpu:
        return Plan(cluster.num_ranks or 1, False, [])
    if cluster.topology is Topology.local_gpus:
        try:
            picked = pick_gpus(list(cluster.devices)) if gpus is None else gpus
        except LookupError as exc:
            raise ConfigError([Problem("cluster.devices", list(cluster.devices), str(exc))]) from None
        return Plan(len(picked), False, picked)
    if cluster.topology is Topology.hosts:
        from flodl_run.hosts import plan_hosts

        layout = plan_hosts(config)  # asks each host over ssh; ConfigError when one cannot serve
        return Plan(layout.world_size, False, layout.gpus, layout)
    gpus = visible_gpus() if gpus is None else gpus
    if len(gpus) >= 2:
        return Plan(len(gpus), False, gpus)
    return Plan(1, True, gpus)


def launch(config: ExperimentConfig, run_dir: Path, console: Console) -> str:
    """Run the job; returns the summary status (completed, interrupted, failed, ...)."""
    plan = plan_topology(config)
    if plan.hosts is not None:
        from flodl_run.hosts import hosts_line

        console.print(hosts_line(plan.hosts), markup=False, highlight=False)
    else:
        console.print(hardware_line(plan.gpus, plan.world_size), markup=False, highlight=False)
    tracker = make_tracker(config)
    tracker.start(config, run_dir)
    progress = TerminalProgress(console)
    # Teardown outputs (record log, dashboard) finish before the tracker, which uploads them.
    outputs = [o for o in (RecordLog.for_run(config, run_dir), Dashboard.for_run(config, run_dir))
               if o is not None]
    observer = Observers(progress, *outputs, tracker)
    error: Optional[Exception] = None
    try:
        if plan.in_process:
            summary = _train_in_process(config, observer)
        else:
            from flodl_run.supervisor import launch_ranks

            _leave_cores_to_ranks(config, plan)
            summary = launch_ranks(config, plan, run_dir, console, observer, tracker.run_id)
    except Exception as exc:  # the recipe raised in this process: still close the run's records
        error = exc
        summary = Summary(status="failed", message=f"{type(exc).__name__}: {exc}",
                          mode="solo" if plan.in_process else config.elche.mode.value,
                          outer=config.outer.kind.value, world_size=plan.world_size)
    finally:
        progress.close()
    summary.mlflow_run_id = tracker.run_id
    write_summary(run_dir / "summary.json", summary)
    for output in outputs:
        output.finish(summary, run_dir)
    tracker.finish(summary, run_dir)
    if error is not None:
        raise error
    _report(summary, run_dir, console)
    return summary.status


def _leave_cores_to_ranks(config: ExperimentConfig, plan: Plan) -> None:
    """CPU ranks on this host own its cores: the coordinator's CPU averaging (cpu_* modes) gets
    what they leave, at least one thread. With torch's default of one thread per core its
    intra-op threads queue behind busy ranks: on 2 cores a 2.25 MB consensus took ~80 ms instead
    of ~6 while cpu_async ranks kept training (issue 8)."""
    if plan.gpus or plan.hosts is not None or not config.cluster.launch_ranks:
        return
    import torch

    busy = plan.world_size * (config.cluster.threads_per_rank or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - busy))


def _train_in_process(config: ExperimentConfig, observer: Observers) -> Summary:
    from flodl_run.recipe import load_recipe
    from flodl_run.solo import SoloTrainer

    recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform)
    trainer = SoloTrainer(config, recipe, observer)
    terms: List[int] = []

    def on_sigterm(signum: int, frame: object) -> None:  # stop like Ctrl-C, named as itself
        terms.append(signum)
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        trainer.run()
    except KeyboardInterrupt:
        if terms:  # the trainer marked its summary interrupted; the caller writes it
            trainer.summary.message = "stopped by SIGTERM"
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return trainer.summary


def _report(summary: Summary, run_dir: Path, console: Console) -> None:
    if summary.status == "completed":
        final = "-" if summary.final_eval is None else f"{summary.final_eval:.4f}"
        syncs = ""
        if summary.world_size > 1:
            syncs = f" | {summary.syncs} syncs ({summary.avg_sync_ms:.2f} ms avg)"
        console.print(f"done: final eval {final} | {summary.wall_s:.1f}s | "
                      f"{summary.samples_per_s:,.0f} samples/s{syncs} | {run_dir}",
                      markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(labelled(summary.status, f"{summary.message} | {run_dir}", "bold red"),
                      highlight=False, soft_wrap=True)
