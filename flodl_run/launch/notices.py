"""What the launcher says before training that the plan line does not: where a resume starts,
why an in-process run writes no timeline. (A GPU-sized model on CPU is warned about by whoever
builds it: `hardware.devices.cpu_training_warning`.)

Owns those lines only; the plan itself (`launch.launcher.plan_topology`, whose LaunchPlan each
function takes as `plan`; not imported: the launcher imports this module) and the one-device
notice stay with the launcher.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from flodl_run.config.schema import ExperimentConfig
from flodl_run.report.say import say, say_labelled


def say_what_differs(config: ExperimentConfig, plan: Any, console: Console) -> None:
    """What would otherwise go unsaid: where a resume starts and why an in-process run writes no
    timeline."""
    if config.resume_from:
        from flodl_run.contracts.checkpoint import read_meta

        meta = read_meta(config.resume_from)  # _check_run read it already: it is readable
        part = " (part of it trained)" if meta.coverage.uncovered else ""
        first, last = meta.epoch + 1, config.num_epochs
        epochs = f"epoch {last}" if first == last else f"epochs {first}-{last}"
        say(console, f"resumed from {config.resume_from} at epoch {first}{part}: training {epochs}")
    if config.timeline and plan.in_process:
        say_labelled(console, "note", "timeline=true writes no trace for an in-process run: the "
                     "timeline records the coordinator and the ranks (cluster=cpu_pair has both)", "cyan")
