"""The recipe contract: what to train, as a module of plain functions.

A recipe module provides `build_model(device, **params)`, `build_optimizer(parameters, **params)`,
`train_step(model, batch)` and `train_dataset(**params)`, optionally `eval_dataset(**params)`,
`eval_step(model, batch) -> (metric_sum, count)` and `build_scheduler(optimizer, **params)`.
This module loads and checks one; it never imports the repo's `recipes/` by itself.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

REQUIRED = ("build_model", "build_optimizer", "train_step", "train_dataset")
OPTIONAL = ("eval_dataset", "eval_step", "build_scheduler")


class RecipeError(Exception):
    """A recipe module cannot be used; `key` is the config key to fix."""

    def __init__(self, key: str, value: Any, rule: str):
        super().__init__(f"{key}: {rule}, got {value!r}")
        self.key, self.value, self.rule = key, value, rule


@dataclass
class Recipe:
    """Loaded recipe functions with their keyword arguments bound by name."""

    build_model: Callable[..., Any]
    build_optimizer: Callable[..., Any]
    train_step: Callable[..., Any]
    train_dataset: Callable[..., Any]
    eval_dataset: Optional[Callable[..., Any]] = None
    eval_step: Optional[Callable[..., Any]] = None
    build_scheduler: Optional[Callable[..., Any]] = None
    transform: Optional[Callable[..., Any]] = None
    params: Dict[str, Any] = field(default_factory=dict)
    name: str = "recipe"

    def call(self, fn_name: str, *args: Any) -> Any:
        """Call a recipe function with `params`, passing only the keywords it accepts."""
        fn = getattr(self, fn_name)
        return fn(*args, **_accepted(fn, self.params))

    @property
    def has_eval(self) -> bool:
        return self.eval_dataset is not None and self.eval_step is not None


def _accepted(fn: Callable[..., Any], params: Dict[str, Any]) -> Dict[str, Any]:
    """Keywords of `params` that `fn` takes (all of them if it has **kwargs)."""
    sig = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(params)
    return {k: v for k, v in params.items() if k in sig.parameters}


def _not_found(name: str, cwd: str) -> str:
    """Where the module was looked for, and what makes it importable."""
    hint = ("the built-in recipes come with the installed project: `.venv/bin/pip install -e <project>`"
            if name == "recipes" else "put its folder on PYTHONPATH or run from the folder holding it")
    return (f"must be an importable module (no module named {name!r}; looked up in the current "
            f"directory {cwd}, then PYTHONPATH and installed packages; {hint})")


def load_recipe(module: str, params: Optional[Dict[str, Any]] = None,
                transform: Optional[str] = None) -> Recipe:
    """Import `module` (current directory first, then the environment) and check the contract."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # `python -m` adds it; rank subprocesses and notebooks may not
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise RecipeError("recipe.module", module, _not_found(exc.name, cwd)) from None
        raise RecipeError("recipe.module", module,
                          f"failed to import: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # a user module can raise anything at import
        raise RecipeError("recipe.module", module,
                          f"failed to import: {type(exc).__name__}: {exc}") from None
    missing = [name for name in REQUIRED if not callable(getattr(mod, name, None))]
    if missing:
        raise RecipeError("recipe.module", module,
                          f"must define {', '.join(missing)} (the recipe contract)")
    fns = {name: getattr(mod, name, None) for name in (*REQUIRED, *OPTIONAL)}
    if (fns["eval_dataset"] is None) != (fns["eval_step"] is None):
        raise RecipeError("recipe.module", module, "must define both eval_dataset and eval_step, or neither")
    transform_fn = None
    if transform is not None:
        transform_fn = getattr(mod, transform, None)
        if not callable(transform_fn):
            raise RecipeError("data.transform", transform, f"must name a function of {module}")
    return Recipe(**fns, transform=transform_fn, params=dict(params or {}), name=module)
