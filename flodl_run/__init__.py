"""flodl_run: config-first runner for heterogeneous data-parallel PyTorch training.

The Python entry is `train(config, recipe)`; the CLI (`python -m flodl_run`) is a thin layer
on the same path, and both write the same run dir. Importing this package imports neither
torch nor Hydra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.config.schema import ExperimentConfig
    from flodl_run.contracts.recipe import Recipe
    from flodl_run.launch.launcher import RunResult
    from flodl_run.observe.observer import Observer

__version__ = "0.1.0"


def record_scalar(name: str, value: float) -> None:
    """Record a user metric from inside train_step; rolled up per epoch by `scalar_reductions`."""
    from flodl_run.contracts.scalars import record_scalar as _record

    _record(name, value)


def train(config: Optional["ExperimentConfig"] = None, recipe: Optional["Recipe"] = None,
          observer: Optional["Observer"] = None, run_dir: Optional[str] = None,
          progress: bool = False) -> "RunResult":
    """Train as `python -m flodl_run` does and return where it wrote: the same run dir
    (`outputs/<date>/<time>/` under the current directory unless `run_dir` names one), run.yaml,
    summary.json, events.jsonl, the bundle and the MLflow run (`tracking=off` skips it).

    `config` defaults to `ExperimentConfig()` (the CLI's defaults); `recipe` defaults to the
    module named by `config.recipe.module`, or pass `Recipe(build_model=..., ...)` built from
    your own functions. `progress=True` prints what the CLI prints; otherwise nothing is
    printed. The result has `summary`, `run_dir`, `summary_path`, `checkpoint`,
    `mlflow_run_id`, and `model` for an in-process run. Raises ConfigError listing every
    problem of an invalid config, before any folder is made.
    """
    from pathlib import Path

    from rich.console import Console

    from flodl_run.config.compose import experiment_to_yaml
    from flodl_run.config.materialize import materialize
    from flodl_run.config.schema import ExperimentConfig
    from flodl_run.launch.launcher import run
    from flodl_run.report.rundir import new_run_dir

    outputs = Path.cwd() / "outputs"
    config = config or ExperimentConfig()
    materialize(config, check_recipe=recipe is None)  # every problem, before a folder exists
    folder = Path(run_dir) if run_dir else new_run_dir(outputs)
    folder.mkdir(parents=True, exist_ok=True)
    resolved = materialize(config, run_dir=str(folder), outputs_dir=str(outputs),
                           check_recipe=False).config
    (folder / "run.yaml").write_text(experiment_to_yaml(resolved))
    return run(resolved, folder, Console(quiet=not progress), recipe=recipe, observer=observer,
               show_progress=progress)
