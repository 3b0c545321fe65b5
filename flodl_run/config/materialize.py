"""The materializer: composed config -> resolved, validated, typed ExperimentConfig.

Owns the one pass that gathers every problem (compose-time conversion, the strings a Python
config gives enum fields, value rules, the recipe contract, what the disk says:
`config.preflight`) into a single ConfigError. Printing and exit codes belong to the CLI.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

from omegaconf import DictConfig

from flodl_run.config.compose import to_experiment
from flodl_run.config.preflight import resume_problems, save_path_problems
from flodl_run.config.schema import ExperimentConfig
from flodl_run.config.validate import Problem, Report, epoch_splits_problem, resolve, validate
from flodl_run.contracts.recipe import RecipeError, load_recipe


class ConfigError(Exception):
    """The config breaks one or more rules; str() lists them all, one per line."""

    def __init__(self, problems: List[Problem], warnings: Optional[List[str]] = None):
        self.problems = list(problems)
        self.warnings = list(warnings or [])
        count = len(self.problems)
        lines = [f"invalid config ({count} problem{'s' if count != 1 else ''}):"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Materialized:
    """A config ready to run: resolved values plus the warnings found on the way."""

    config: ExperimentConfig
    warnings: List[str]


def materialize(cfg: DictConfig | ExperimentConfig, run_dir: Optional[str] = None,
                world_size: Optional[int] = None, check_recipe: bool = True,
                outputs_dir: Optional[str] = None) -> Materialized:
    """Validate and resolve; raises ConfigError listing every problem at once."""
    if isinstance(cfg, ExperimentConfig):
        typed = copy.deepcopy(cfg)
        problems = list(with_enum_members(typed))
    else:
        typed, problems = to_experiment(cfg)
    if typed is None or problems:
        raise ConfigError(problems)
    report: Report = validate(typed, world_size)
    problems = list(report.problems)
    if check_recipe and not report.problems:  # importing the recipe (torch) takes seconds: a
        problems += _recipe_problems(typed)      # value error is reported without waiting for it
    if not report.problems:
        problems += save_path_problems(typed)
    if typed.resume_from and not report.problems:
        problems += resume_problems(typed, world_size, check_model=check_recipe)
    if problems:
        raise ConfigError(problems, report.warnings)
    return Materialized(resolve(typed, run_dir, outputs_dir), report.warnings)


def with_enum_members(obj: Any, prefix: str = "") -> Iterator[Problem]:
    """Turn, in place, every plain string an enum field holds into its member, as the YAML
    would: `ClusterConfig(topology="cpu")` from Python means `Topology.cpu`. A string that
    names no member is a problem naming the dotted key."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value, kind = f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name]
        items = typing.get_args(kind)
        if dataclasses.is_dataclass(value):
            yield from with_enum_members(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    yield from with_enum_members(item, f"{key}[{i}].")
        elif isinstance(value, dict) and len(items) == 2 and _enum(items[1]) is not None:
            for name, item in value.items():  # scalar_reductions: {name: Reduction}
                value[name] = yield from _member(f"{key}.{name}", item, _enum(items[1]))
        elif isinstance(value, str) and _enum(kind) is not None:
            setattr(obj, f.name, (yield from _member(key, value, _enum(kind))))


def _enum(kind: Any) -> Optional[type]:
    """The enum class of a field's type (`Topology`, `Optional[Topology]`), else None."""
    for candidate in (kind, *typing.get_args(kind)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return candidate
    return None


def _member(key: str, value: Any, kind: type) -> Iterator[Problem]:
    """Yields the problem of a value that names no member; returns the member (else `value`)."""
    try:
        return kind(value)
    except ValueError:
        yield Problem(key, value, f"must be one of {', '.join(m.value for m in kind)}")
        return value


def _recipe_problems(cfg: ExperimentConfig) -> List[Problem]:
    try:
        recipe = load_recipe(cfg)
    except RecipeError as exc:
        return [Problem(exc.key, exc.value, exc.rule)]
    if cfg.data.epoch_splits > 1:  # the rule needs the train set's size: load it only then
        problem = epoch_splits_problem(len(recipe.call("train_dataset")), cfg)
        return [problem] if problem is not None else []
    return []
