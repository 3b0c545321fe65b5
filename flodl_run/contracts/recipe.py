"""The recipe contract: what to train, as a module of plain functions.

A recipe module provides `build_model(device, **params)`, `build_optimizer(parameters, **params)`
(it may also take `model`, and return several optimizers), `train_step(model, batch)` (or a
`loop(worker)` that steps itself, see flodl_run.rank.worker) and `train_dataset(**params)`,
optionally `eval_dataset(**params)`,
`eval_step(model, batch) -> (metric_sum, count)` (or `eval_fn(model, batch) -> float`, averaged
per batch) and `build_scheduler(optimizer, **params)`, and callbacks: `metrics_fn(metrics)` and
`eval_result_fn(epoch, value)` (run in the launcher), `epoch_fn(epoch, model)` and
`checkpoint_fn(epoch, model)` (run on the callback rank). `build_model` may return its model
through `torch.compile`: state dicts are taken from `eager_module(model)`. This module loads and
checks one, and turns what a callback raises into CallbackFailed; it never imports the repo's
`recipes/` by itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.contracts.summary import EpochRecord

REQUIRED = ("build_model", "build_optimizer", "train_dataset")
CALLBACKS = ("metrics_fn", "eval_result_fn", "eval_fn", "epoch_fn", "checkpoint_fn")
OPTIONAL = ("train_step", "eval_dataset", "eval_step", "build_scheduler", "loop", *CALLBACKS)


class RecipeError(Exception):
    """A recipe module cannot be used; `key` is the config key to fix."""

    def __init__(self, key: str, value: Any, rule: str):
        super().__init__(f"{key}: {rule}, got {value!r}")
        self.key, self.value, self.rule = key, value, rule


class CallbackFailed(Exception):
    """A recipe callback raised: the run ends `failed` after saving what it holds. `error` is
    the user's exception as `Type: message`; `rank` is None when it raised in this process
    (the user's exception is then the `__cause__`)."""

    def __init__(self, name: str, error: str, rank: Optional[int] = None):
        where = "" if rank is None else f"rank {rank}: "
        super().__init__(f"{where}{name} raised {error}")
        self.name, self.error, self.rank = name, error, rank

    def describe(self) -> str:
        """The one-line reason, then the traceback of the user's own frames."""
        cause = self.__cause__
        trace = user_traceback(cause) if cause is not None else ""
        return f"{self}\n{trace}"


_PACKAGE = str(Path(__file__).resolve().parents[1])  # flodl_run/, above contracts/


def _is_ours(frame: traceback.FrameSummary) -> bool:
    return frame.filename.startswith((_PACKAGE, "<frozen"))


def raised_by_recipe(exc: BaseException) -> bool:
    """The innermost frame of `exc` is the recipe's (or a library's it called), not ours: a
    SystemExit from there is the recipe's sys.exit, where ours (a rank told it is dead) is not."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and not _is_ours(frames[-1])


def user_traceback(exc: BaseException, error: Optional[str] = None) -> str:
    """The traceback's frames outside flodl_run (the recipe's), or all of them when the error
    is ours (none outside) or FLODL_RUN_TRACEBACK is set; it ends with `error` when given (the
    error line as reported), else with the exception as Python prints it. Empty for a
    train_step that returned no loss and for a recipe that breaks its contract (RecipeError:
    an empty train set, found by the rank's data plane): the message says where."""
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if not _is_ours(f)]
    if isinstance(exc, (NotALoss, RecipeError)) and not os.environ.get("FLODL_RUN_TRACEBACK"):
        return ""  # its message names the function (or the key to fix); every frame would be ours
    if os.environ.get("FLODL_RUN_TRACEBACK") or not theirs:
        theirs = frames
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(theirs),
                    *([f"{error}\n"] if error else traceback.format_exception_only(type(exc), exc))])


@dataclass
class Recipe:
    """Loaded recipe functions with their keyword arguments bound by name."""

    build_model: Callable[..., Any]
    build_optimizer: Callable[..., Any]
    train_step: Optional[Callable[..., Any]]
    train_dataset: Callable[..., Any]
    eval_dataset: Optional[Callable[..., Any]] = None
    eval_step: Optional[Callable[..., Any]] = None
    build_scheduler: Optional[Callable[..., Any]] = None
    metrics_fn: Optional[Callable[..., Any]] = None
    eval_result_fn: Optional[Callable[..., Any]] = None
    eval_fn: Optional[Callable[..., Any]] = None
    epoch_fn: Optional[Callable[..., Any]] = None
    checkpoint_fn: Optional[Callable[..., Any]] = None
    loop: Optional[Callable[..., Any]] = None
    """The rank's loop body, `loop(worker)`; None = the built-in step (train_step per batch)."""
    transform: Optional[Callable[..., Any]] = None
    params: Dict[str, Any] = field(default_factory=dict)
    name: str = "recipe"

    def call(self, fn_name: str, *args: Any, **extra: Any) -> Any:
        """Call a recipe function with `params`, passing only the keywords it accepts, and each
        `extra` keyword only to a function that names it (a `**kwargs` that forwards the
        params to torch must not receive the runtime's extras)."""
        fn = getattr(self, fn_name)
        named = inspect.signature(fn).parameters
        return fn(*args, **_accepted(fn, self.params), **{k: v for k, v in extra.items() if k in named})

    def run_callback(self, name: str, *args: Any) -> Any:
        """Call callback `name` like any recipe function (None when the recipe has none); what it
        raises comes back as CallbackFailed, the user's exception as its `__cause__`."""
        if getattr(self, name) is None:
            return None
        try:
            return self.call(name, *args)
        except Exception as exc:  # user code can raise anything; KeyboardInterrupt passes
            raise CallbackFailed(name, f"{type(exc).__name__}: {exc}") from exc

    def report_epoch(self, record: "EpochRecord") -> None:
        """The launcher's callbacks for a closed epoch, in order: eval_result_fn (when it was
        scored), then metrics_fn with the epoch as summary.json records it."""
        if record.eval is not None:
            self.run_callback("eval_result_fn", record.epoch, record.eval)
        if self.metrics_fn is not None:
            self.run_callback("metrics_fn", asdict(record))

    @property
    def has_eval(self) -> bool:
        return self.eval_dataset is not None and (self.eval_step is not None or self.eval_fn is not None)


def eager_module(model: Any) -> Any:
    """The module whose state dict a bundle holds: what a `torch.compile` wrapper wraps (its
    `_orig_mod`: the same Parameter objects, keys without the `_orig_mod.` prefix), else the
    model itself. So a bundle of a compiled run loads into an eager one and back."""
    return getattr(model, "_orig_mod", model)


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


def _import(module: str, key: str) -> Any:
    """Import `module` (current directory first, then the environment); RecipeError on `key`."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # `python -m` adds it; rank subprocesses and notebooks may not
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise RecipeError(key, module, _not_found(exc.name, cwd)) from None
        raise RecipeError(key, module, f"failed to import: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # a user module can raise anything at import
        raise RecipeError(key, module, f"failed to import: {type(exc).__name__}: {exc}") from None


def locate(module: str, key: str = "recipe.module") -> None:
    """Check that `module` can be imported (current directory first) without running it: only
    its parent packages are imported. RecipeError on `key` when it cannot be found. For checks
    that must not pay a recipe's imports (torch): the full contract is `load_recipe`'s."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:
        raise RecipeError(key, module, _not_found(exc.name or module, cwd)) from None
    except Exception as exc:  # a parent package can raise anything at import
        raise RecipeError(key, module, f"failed to import: {type(exc).__name__}: {exc}") from None
    if spec is None:
        raise RecipeError(key, module, _not_found(module, cwd))


def _named_loop(mod: Any, name: str) -> Callable[..., Any]:
    """recipe.loop: `fn` (a function of the recipe module) or `pkg.module.fn`."""
    owner, _, attr = name.rpartition(".")
    try:
        fn = getattr(_import(owner, "recipe.loop") if owner else mod, attr, None)
    except RecipeError as exc:  # name the whole value, not only its module part
        raise RecipeError("recipe.loop", name, exc.rule) from None
    if not callable(fn):
        where = owner or mod.__name__
        raise RecipeError("recipe.loop", name, f"must name a function `loop(worker)` ({attr} of {where})")
    return fn


def load_recipe(config: Any) -> Recipe:
    """The run's recipe, as every process of the run loads it: `config` is the run's
    ExperimentConfig (its `recipe` group and `data.transform`; not imported here, contracts
    import nothing of flodl_run)."""
    recipe = config.recipe
    return import_recipe(recipe.module, recipe.params, config.data.transform, recipe.loop)


def import_recipe(module: str, params: Optional[Dict[str, Any]] = None,
                  transform: Optional[str] = None, loop: Optional[str] = None) -> Recipe:
    """Import `module` (current directory first, then the environment) and check the contract.
    `loop` (recipe.loop) names the rank's loop; None = the module's `loop`, if it has one.
    A run loads its recipe with `load_recipe(config)`; this is for a module named alone."""
    mod = _import(module, "recipe.module")
    missing = [name for name in REQUIRED if not callable(getattr(mod, name, None))]
    if missing:
        raise RecipeError("recipe.module", module,
                          f"must define {', '.join(missing)} (the recipe contract)")
    fns = {name: getattr(mod, name, None) for name in (*REQUIRED, *OPTIONAL)}
    if loop is not None:
        fns["loop"] = _named_loop(mod, loop)
    if fns["train_step"] is None and fns["loop"] is None:
        raise RecipeError("recipe.module", module,
                          "must define train_step, or a loop (a `loop` function or recipe.loop)")
    if fns["eval_step"] is not None and fns["eval_fn"] is not None:
        raise RecipeError("recipe.module", module, "must define eval_step or eval_fn, not both "
                          "(eval_step -> (metric_sum, count); eval_fn -> float, averaged per batch)")
    if (fns["eval_dataset"] is None) != (fns["eval_step"] is None and fns["eval_fn"] is None):
        raise RecipeError("recipe.module", module,
                          "must define both eval_dataset and eval_step (or eval_fn), or neither")
    transform_fn = None
    if transform is not None:
        transform_fn = getattr(mod, transform, None)
        if not callable(transform_fn):
            raise RecipeError("data.transform", transform, f"must name a function of {module}")
    for name in PER_BATCH:  # called per batch as fn(model, batch): bind their params once
        fns[name] = _with_params(fns[name], dict(params or {}))
    if fns["train_step"] is not None:
        fns["train_step"] = _returning_a_loss(fns["train_step"])
    return Recipe(**fns, transform=transform_fn, params=dict(params or {}), name=module)


PER_BATCH = ("train_step", "eval_step")
"""Recipe functions the runtime calls directly, `fn(model, batch)`, once per batch."""


class NotALoss(TypeError):
    """train_step returned something the runtime cannot call backward() on."""


def _short(value: Any, limit: int = 60) -> str:
    """`value`'s repr cut to `limit` characters, with an ellipsis where it was cut."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def loss_of(out: Any, where: str = "") -> Any:
    """The loss in what train_step returned: the tensor itself, or the `loss` of a model output
    (a transformers ModelOutput, any object with a `.loss`, a dict with "loss"), as the
    ecosystem's models return it. NotALoss when there is none, or when it is not a scalar
    (backward() needs one number: an unreduced loss would fail inside torch with no recipe frame)."""
    loss = out if hasattr(out, "backward") else _field(out)
    if not hasattr(loss, "backward"):
        raise NotALoss(f"train_step{where} must return the loss as a scalar tensor (one that "
                       f"backward() works on) or an output with a .loss, got {_describe(out)}")
    if loss.numel() != 1:
        raise NotALoss(f"train_step{where} must return a scalar loss, got a tensor of shape "
                       f"{list(loss.shape)}: reduce it (loss.mean(), or the loss function's "
                       "reduction='mean')")
    return loss


def _describe(out: Any) -> str:
    """What train_step returned instead of a loss, with the fix that fits it."""
    kind = type(out).__name__
    if isinstance(out, (int, float)):
        return f"{kind} {out!r}; return the tensor, not loss.item()"
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        return (f"{kind} whose loss is {_short(_field(out))}: pass the labels to the model so that "
                "it computes the loss, or compute it in train_step")
    return f"{kind} {_short(out)}"


def _field(out: Any) -> Any:
    """The `loss` of a model output: a mapping's "loss", else a `.loss` attribute (None if none)."""
    return out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)


def _returning_a_loss(step: Callable[..., Any]) -> Callable[..., Any]:
    """`train_step` checked for what it returns, and its loss taken out of a model output: a
    float (`loss.item()`) or None would fail inside the runtime as `'float' object has no
    attribute 'backward'`, naming none of it."""
    code = getattr(inspect.unwrap(getattr(step, "func", step)), "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""

    @functools.wraps(step)
    def train_step(model: Any, batch: Any) -> Any:
        return loss_of(step(model, batch), where)
    return train_step


def _with_params(fn: Optional[Callable[..., Any]], params: Dict[str, Any]) -> Optional[Callable[..., Any]]:
    """`fn` with the `recipe.params` it declares bound by keyword (`fn` itself when none); a
    param named like one of the two arguments the runtime passes is not bound."""
    if fn is None:
        return None
    passed = list(inspect.signature(fn).parameters)[:2]
    accepted = {k: v for k, v in _accepted(fn, params).items() if k not in passed}
    return functools.partial(fn, **accepted) if accepted else fn
