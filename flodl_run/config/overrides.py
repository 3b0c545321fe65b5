"""Command-line overrides checked against the schema before Hydra sees them.

Hydra answers a mistyped key with "use +key=value to append", and `+key`/`++key` on a
structured config is then accepted and silently dropped when the config becomes a dataclass.
Here every override key, whatever its prefix, must name a field of the app's schema (or sit
under a free-form dict such as `recipe.params`), and every group choice a group the app uses;
each problem suggests the nearest real names. A value its key's type refuses, a group option
no YAML defines, a recipe param set without `+` that the recipe does not have, and a run folder
under a file are refused here too, in the validator's words (Hydra's own would name no rule).
Hydra's other keys (`hydra.*`) are left to Hydra.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from flodl_run.config.validate import Problem


def app_groups(config_dir: Path, config_name: str) -> List[str]:
    """The config groups the root YAML `config_name` selects in its defaults list, in order."""
    return list(_default_choices(config_dir, config_name))


def _default_choices(config_dir: Path, config_name: str) -> Dict[str, str]:
    """Each group of the root YAML's defaults list with the option it selects."""
    root = OmegaConf.load(config_dir / f"{config_name}.yaml")
    choices = {}
    for entry in root.get("defaults", []):
        if isinstance(entry, DictConfig):
            for key, option in entry.items():
                group = str(key).replace("override ", "").strip()
                if not group.startswith("hydra"):
                    choices[group] = str(option)
    return choices


def root_schema(config_dir: Path, config_name: str) -> Optional[Any]:
    """The schema node the root YAML extends (its first defaults entry, e.g. `base_sim`), as
    stored in Hydra's ConfigStore; None when it has none or it is not stored."""
    from hydra.core.config_store import ConfigStore

    root = OmegaConf.load(config_dir / f"{config_name}.yaml")
    first = next((e for e in root.get("defaults", []) if isinstance(e, str) and e != "_self_"), None)
    try:
        return ConfigStore.instance().load(f"{first}.yaml").node if first else None
    except Exception:  # not registered: Hydra will say so when it composes
        return None


@dataclass(frozen=True)
class _App:
    """What the overrides are checked against: the command's schema tree, its groups with the
    options each selects by default, and where its YAML options live."""

    tree: DictConfig
    choices: Dict[str, str]
    config_dir: Path
    own_options_only: bool
    """No search path beyond `conf/`: a group option must be one of its YAML files."""


def check(overrides: Sequence[str], config_dir: Path, config_name: str,
          extra_search_path: bool = False) -> List[Problem]:
    """The problems of `overrides` for the command whose root YAML is `config_name` (schemas
    registered first). `extra_search_path`: options may come from a --config-dir as well."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    schema = root_schema(config_dir, config_name)
    if schema is None:
        return []
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # a syntax error: Hydra's message names it better than we could
        return []
    searched = extra_search_path or any(o.key_or_group == "hydra.searchpath" for o in parsed)
    app = _App(OmegaConf.structured(schema), _default_choices(config_dir, config_name),
               config_dir, not searched)
    problems = []
    for override in parsed:
        if override.is_delete():
            continue
        problems += _problems(override, app, _recipe_choice(parsed, app))
    return problems


def _problems(override: Any, app: _App, recipe: Optional[str]) -> List[Problem]:
    key = override.key_or_group
    text = override.input_line.partition("=")[2] if override.input_line else None
    values = _values(override)
    if key in ("hydra.run.dir", "hydra.sweep.dir"):
        return [p for v in values if (p := _folder_problem(key, v)) is not None]
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return []
    if key in app.choices:
        return [p for v in values if (p := _option_problem(key, v, app)) is not None]
    parts = key.split(".")
    if not _has_key(app.tree, parts):
        return [_unknown(key, text, app.tree, list(app.choices))]
    if parts[:2] == ["recipe", "params"] and len(parts) == 3 and not override.is_force_add():
        value = values[0] if len(values) == 1 else text
        problem = _param_problem(key, value, app, recipe, adds=override.is_add())
        return [problem] if problem is not None else []
    return [p for v in values if (p := _type_problem(key, v, app.tree)) is not None]


def _values(override: Any) -> List[Any]:
    """The value of an override, or each value of a sweep (none for a sweep of intervals)."""
    if not override.is_sweep_override():
        return [override.value()]
    try:
        return list(override.sweep_iterator())
    except Exception:  # interval(...) and tagged sweeps have no list of values
        return []


def _folder_problem(key: str, value: Any) -> Optional[Problem]:
    """A run folder Hydra cannot make: some part of the path is a file."""
    if not isinstance(value, str) or "${" in value:
        return None
    for path in [Path(value), *Path(value).parents]:
        if path.exists():
            return None if path.is_dir() else Problem(key, value, f"must be a folder path ({path} is a file)")
    return None


def _options(app: _App, group: str) -> List[str]:
    return sorted(p.stem for p in (app.config_dir / group).glob("*.yaml"))


def _option_problem(group: str, option: Any, app: _App) -> Optional[Problem]:
    """A group choice that names no YAML of the group (the schema `base_*` is not an option)."""
    options = _options(app, group)
    if not app.own_options_only or str(option) in options:
        return None
    near = difflib.get_close_matches(str(option), options, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return Problem(group, str(option), f"must be one of {', '.join(options)}{hint}")


def _recipe_choice(parsed: Sequence[Any], app: _App) -> Optional[str]:
    """The recipe option the overrides select (None for a sweep over recipes)."""
    choice = app.choices.get("recipe")
    for override in parsed:
        if override.key_or_group == "recipe" and not override.is_delete():
            choice = None if override.is_sweep_override() else str(override.value())
    return choice


def _param_problem(key: str, value: Any, app: _App, recipe: Optional[str],
                   adds: bool) -> Optional[Problem]:
    """`recipe.params.x=v` without `+` for a param the recipe's YAML does not set (Hydra: `not
    in struct`), or `+recipe.params.x=v` for one it sets (Hydra: `could not append`): say so in
    our words, with the form that works."""
    yaml = app.config_dir / "recipe" / f"{recipe}.yaml"
    if recipe is None or not yaml.is_file():
        return None
    option = OmegaConf.load(yaml)
    if any(d not in ("base_recipe", "_self_") for d in option.get("defaults", [])):
        return None  # it inherits params from another option: Hydra knows them, we do not
    params = [str(k) for k in (option.get("params") or {})]
    name = key.split(".")[2]
    if adds:
        return Problem(key, value, f"is already a param of recipe {recipe}: set it without `+` "
                                   f"({key}={value})") if name in params else None
    if name in params:
        return None
    near = difflib.get_close_matches(name, params, n=1, cutoff=0.75)
    hint = f"did you mean recipe.params.{near[0]}? " if near else ""
    listed = f"its params: {', '.join(params)}; " if params else ""
    return Problem(key, value, f"is not a param of recipe {recipe} ({hint}{listed}"
                               f"+{key}={value} adds one)")


def _type_problem(key: str, value: Any, tree: DictConfig) -> Optional[Problem]:
    """A value the key's type refuses (`num_epochs=ten`), in the validator's words."""
    from omegaconf.errors import ValidationError

    if isinstance(value, str) and "${" in value:
        return None  # an interpolation is typed when it is resolved
    if any(part.isdigit() for part in key.split(".")):
        return None  # a list entry (cluster.workers.0.host): the template's own, typed at compose
    from omegaconf import BooleanNode

    *path, leaf = key.split(".")
    parent = _node(tree, path)
    if not isinstance(parent, DictConfig):  # below a free-form dict: the key's level is not there yet
        parent, leaf = tree, key
    node = _node(parent, leaf.split("."))
    try:  # on a copy of the key's own level: a copy of the whole tree cost 4 ms an override
        OmegaConf.update(parent.copy(), leaf, value, merge=True)
    except ValidationError as exc:
        rule = "must not be null" if value is None else str(exc).splitlines()[0]
        return Problem(key, value, _type_rule(node, rule, value))
    if isinstance(node, BooleanNode) and value is not None and not isinstance(value, bool):
        # OmegaConf takes yes/no/on/off/1/0 as a bool; a typo of them (`ye`) it refuses: only
        # the words Hydra itself parses as a bool are taken, so nothing is a bool by accident
        return Problem(key, value, "must be true or false")
    return None


def _type_rule(node: Any, fallback: str, value: Any = None) -> str:
    from omegaconf import BooleanNode, EnumNode, FloatNode, IntegerNode

    if fallback == "must not be null":
        return fallback
    if isinstance(node, EnumNode):
        names = [m.name for m in node.enum_type]
        near = difflib.get_close_matches(str(value), names, n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        return f"must be one of {', '.join(names)}{hint}"
    rules = {IntegerNode: "must be an integer", FloatNode: "must be a number",
             BooleanNode: "must be true or false"}
    return next((rule for kind, rule in rules.items() if isinstance(node, kind)), fallback)


def _node(tree: DictConfig, parts: List[str]) -> Any:
    node: Any = tree
    for part in parts:
        node = node._get_node(part) if isinstance(node, DictConfig) else None
    return node


def _has_key(node: Any, parts: List[str]) -> bool:
    """Whether the dotted path exists in the schema tree; anything goes below a free-form dict
    (`recipe.params`) or a list (their entries are the user's)."""
    for part in parts:
        if isinstance(node, ListConfig) or _is_free_dict(node):
            return True
        if not isinstance(node, DictConfig) or part not in node.keys():  # `in` skips ??? values
            return False
        node = node._get_node(part)
    return True


def _is_free_dict(node: Any) -> bool:
    return isinstance(node, DictConfig) and node._metadata.object_type in (None, dict)


def _dotted_keys(node: Any, prefix: str = "") -> Iterator[str]:
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        dotted = f"{prefix}{key}"
        yield dotted
        yield from _dotted_keys(node._get_node(key), dotted + ".")


def _unknown(key: str, value: Any, tree: DictConfig, groups: Sequence[str]) -> Problem:
    names = list(dict.fromkeys([*groups, *_dotted_keys(tree)]))
    near = difflib.get_close_matches(key, names, n=2, cutoff=0.75)
    hint = f"did you mean {' or '.join(near)}?" if near else ""
    if "." not in key:  # perhaps meant as a group: say which ones this command has
        hint = f"{hint} groups: {', '.join(groups)}".strip()
    return Problem(key, value, f"is not a config key ({hint})" if hint else "is not a config key")
