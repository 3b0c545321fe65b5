"""flodl_run: config-first runner for heterogeneous data-parallel PyTorch training.

The Python entry is `train(config, recipe)`; the CLI (`python -m flodl_run`) is a thin layer
on the same path. Importing this package imports neither torch nor Hydra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.config.schema import ExperimentConfig
    from flodl_run.observe import Observer
    from flodl_run.recipe import Recipe
    from flodl_run.solo import TrainResult

__version__ = "0.1.0"


def record_scalar(name: str, value: float) -> None:
    """Record a user metric from inside train_step; rolled up per epoch by `scalar_reductions`."""
    from flodl_run.scalars import record_scalar as _record

    _record(name, value)


def train(config: Optional["ExperimentConfig"] = None, recipe: Optional["Recipe"] = None,
          observer: Optional["Observer"] = None) -> "TrainResult":
    """Train in-process and return the model and its summary.

    `config` defaults to `ExperimentConfig()` (the CLI's defaults); `recipe` defaults to the
    module named by `config.recipe.module`, or pass `Recipe(build_model=..., ...)` built from
    your own functions. Raises ConfigError listing every problem of an invalid config.
    """
    from flodl_run.config.materialize import materialize
    from flodl_run.config.schema import ExperimentConfig
    from flodl_run.recipe import load_recipe
    from flodl_run.solo import SoloTrainer

    config = materialize(config or ExperimentConfig(), check_recipe=recipe is None).config
    if recipe is None:
        recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform)
    return SoloTrainer(config, recipe, observer).run()
