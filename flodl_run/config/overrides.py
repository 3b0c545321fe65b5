"""Command-line overrides checked against the schema before Hydra sees them.

Hydra answers a mistyped key with "use +key=value to append", and `+key`/`++key` on a
structured config is then accepted and silently dropped when the config becomes a dataclass.
Here every override key, whatever its prefix, must name a field of the app's schema (or sit
under a free-form dict such as `recipe.params`), and every group choice a group the app uses;
each problem suggests the nearest real names. Hydra's own keys (`hydra.*`) are left to Hydra.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from flodl_run.config.validate import Problem


def app_groups(config_dir: Path, config_name: str) -> List[str]:
    """The config groups the root YAML `config_name` selects in its defaults list, in order."""
    root = OmegaConf.load(config_dir / f"{config_name}.yaml")
    groups = []
    for entry in root.get("defaults", []):
        if isinstance(entry, DictConfig):
            for key in entry.keys():
                group = str(key).replace("override ", "").strip()
                if not group.startswith("hydra"):
                    groups.append(group)
    return groups


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


def check(overrides: Sequence[str], config_dir: Path, config_name: str) -> List[Problem]:
    """The problems of `overrides` for the command whose root YAML is `config_name` (schemas
    registered first)."""
    schema = root_schema(config_dir, config_name)
    if schema is None:
        return []
    return override_problems(overrides, schema, app_groups(config_dir, config_name))


def override_problems(overrides: Sequence[str], schema: Any, groups: Sequence[str]) -> List[Problem]:
    """Problems of keys the schema does not have and groups the app does not use.

    `schema` is the app's root dataclass (or its stored node); overrides Hydra cannot parse are
    left to Hydra, which reports them itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # a syntax error: Hydra's message names it better than we could
        return []
    tree = OmegaConf.structured(schema)
    problems = []
    for override in parsed:
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or key in groups:
            continue
        if not _has_key(tree, key.split(".")):
            value = override.input_line.partition("=")[2] if override.input_line else None
            problems.append(_unknown(key, value, tree, groups))
    return problems


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
