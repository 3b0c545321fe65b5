"""What the launcher says before training that the plan line does not: where a resume starts,
why an in-process run writes no timeline, and that a GPU-sized model is about to train on CPU.

Owns those lines only; the plan itself (`launch.launcher.plan_topology`, whose Plan each
function takes as `plan`; not imported: the launcher imports this module) and the one-device
notice stay with the launcher.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console

from flodl_run.config.schema import ExperimentConfig, RecipeConfig
from flodl_run.hardware.devices import visible_gpus
from flodl_run.report.progress import LINE_EVERY_S
from flodl_run.report.say import say, say_labelled


def say_what_differs(config: ExperimentConfig, plan: Any, console: Console) -> None:
    """What would otherwise go unsaid: where a resume starts, a GPU-sized model on CPU, and why
    an in-process run writes no timeline."""
    if config.resume_from:
        from flodl_run.contracts.checkpoint import read_meta

        meta = read_meta(config.resume_from)  # _check_run read it already: it is readable
        part = " (part of it trained)" if meta.coverage.uncovered else ""
        first, last = meta.epoch + 1, config.num_epochs
        epochs = f"epoch {last}" if first == last else f"epochs {first}-{last}"
        say(console, f"resumed from {config.resume_from} at epoch {meta.epoch}{part}: training {epochs}")
    warning = cpu_sized_warning(config.recipe, config.data.transform, config.device, plan)
    if warning:
        say_labelled(console, "warning", warning, "yellow")
    if config.timeline and plan.in_process:
        say_labelled(console, "note", "timeline=true writes no trace for an in-process run: the "
                     "timeline records the coordinator and the ranks (cluster=cpu_pair has both)", "cyan")


GPU_SIZED_PARAMS = 10_000_000
"""Parameters above which a model is GPU-sized: byte_lm's 25.5 M trains for tens of minutes an
epoch on CPU ranks, digits_mlp's 0.03 M in a second."""


def cpu_sized_warning(recipe_config: RecipeConfig, transform: Optional[str], device: str,
                      plan: Any) -> Optional[str]:
    """A warning when a GPU-sized model is about to train on this host's CPUs (ranks or the
    in-process run on `device`), counted on the meta device (no memory); None otherwise."""
    local = plan.hosts is None and plan.slurm is None
    on_cpu = not plan.gpus if not plan.in_process else (device == "cpu" or not visible_gpus())
    if not (local and on_cpu):
        return None
    import torch

    from flodl_run.contracts.recipe import load_recipe

    try:
        recipe = load_recipe(recipe_config.module, recipe_config.params, transform, recipe_config.loop)
        with torch.device("meta"):
            count = sum(p.numel() for p in recipe.call("build_model", torch.device("meta")).parameters())
    except Exception:  # a recipe that cannot build on the meta device: nothing to say
        return None
    if count < GPU_SIZED_PARAMS:
        return None
    return (f"{recipe_config.module} builds a {count / 1e6:.1f} M-parameter model and trains it "
            f"on CPU: expect long epochs (a line every {LINE_EVERY_S:.0f} s shows the epoch's ETA); "
            "a GPU or smaller recipe.params train faster")
