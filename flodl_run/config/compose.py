"""Hydra at the edge: schema registration, composition of the `conf/` tree, and conversion
of a composed DictConfig into a typed ExperimentConfig.

Owns every contact with hydra/omegaconf below the CLI. It does not validate values
(`config.validate`) or import recipes (`config.materialize`). Hydra itself loads only to
compose: a rank reads run.yaml (`experiment_from_yaml`) with OmegaConf alone.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from flodl_run.config.schema import (
    ClusterConfig,
    DataConfig,
    ElCheConfig,
    ExperimentConfig,
    OuterConfig,
    RecipeConfig,
    TrackingConfig,
)
from flodl_run.config.validate import Problem

# (group, schema name, dataclass): every YAML option of a group lists its schema first in
# `defaults`, so an unknown key or a wrong type fails at compose time.
SCHEMAS = (
    (None, "base_experiment", ExperimentConfig),
    ("elche", "base_elche", ElCheConfig),
    ("outer", "base_outer", OuterConfig),
    ("cluster", "base_cluster", ClusterConfig),
    ("data", "base_data", DataConfig),
    ("recipe", "base_recipe", RecipeConfig),
    ("tracking", "base_tracking", TrackingConfig),
)

GROUPS = ("elche", "outer", "cluster", "data", "recipe", "tracking")


class ComposeError(Exception):
    """Hydra refused the overrides (unknown key, wrong type, missing option)."""


def conf_dir() -> Path:
    """The `conf/` tree: FLODL_RUN_CONF if set, else the one beside the package."""
    override = os.environ.get("FLODL_RUN_CONF")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


_stored: Dict[tuple, Any] = {}
"""(group, name, schema) -> the ConfigNode this process stored for it: storing converts the
dataclass to a config again each time."""


def register_schemas(extra: Sequence[tuple] = ()) -> None:
    """Store the schemas in Hydra's ConfigStore and the help page's resolver (idempotent; call
    before composing). A schema whose node this process stored is still there is not stored
    again: that was 45 of each compose's 260 ms."""
    from hydra.core.config_store import ConfigStore  # here: a rank reads run.yaml without Hydra

    from flodl_run.config import helppage

    helppage.register(conf_dir)
    store = ConfigStore.instance()
    for group, name, node in (*SCHEMAS, *extra):
        key = (group, name, id(node))
        if key in _stored and _stored_node(store, group, name) is _stored[key]:
            continue
        store.store(group=group, name=name, node=_without_recipe_module(node))
        _stored[key] = _stored_node(store, group, name)


def _stored_node(store: Any, group: Optional[str], name: str) -> Any:
    """The ConfigNode `store` (Hydra's ConfigStore) holds for `<group>/<name>`, or None."""
    level: Any = store.repo
    for part in group.split("/") if group else ():
        level = level.get(part, {})
    return level.get(f"{name}.yaml")


def _without_recipe_module(node: Any) -> Any:
    """The schema node with `recipe.module` mandatory (`???`) when it has one.

    OmegaConf keeps a default when a YAML merges `???` over it, so with the dataclass default
    `recipe=custom` (`module: ???`) silently trained digits_mlp instead of asking for a module.
    Every other recipe option names its module, so only the schema nodes change.
    """
    if node is ExperimentConfig:
        cfg = OmegaConf.structured(node)
        cfg.recipe.module = MISSING
        return cfg
    if node is RecipeConfig:
        cfg = OmegaConf.structured(node)
        cfg.module = MISSING
        return cfg
    return node


def compose(overrides: Sequence[str] = (), config_dir: Optional[Path] = None,
            config_name: str = "config") -> DictConfig:
    """Compose the tree with command-line style overrides; raises ComposeError on bad input."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from flodl_run.config import overrides as checked

    register_schemas()
    config_dir = config_dir or conf_dir()
    problems = checked.check(overrides, config_dir, config_name)
    if problems:
        raise ComposeError("\n".join(str(p) for p in problems))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except Exception as exc:  # Hydra raises several unrelated types for user errors
        raise ComposeError(_first_lines(exc)) from None
    finally:
        GlobalHydra.instance().clear()


def _first_lines(exc: BaseException) -> str:
    text = str(exc).strip()
    cause = exc.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text}\n{str(cause).strip()}"
    return text


def to_experiment(cfg: DictConfig) -> tuple[Optional[ExperimentConfig], List[Problem]]:
    """Typed object from a composed config; unset mandatory values come back as problems."""
    missing = [Problem(key, "???", "is required") for key in _missing_keys(cfg)]
    if missing:
        return None, missing
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) \
        if "hydra" in cfg else cfg
    try:
        return OmegaConf.to_object(plain), []
    except (MissingMandatoryValue, OmegaConfBaseException) as exc:
        key = getattr(exc, "full_key", "") or "config"
        return None, [Problem(key, getattr(exc, "value", None), str(exc).splitlines()[0])]


def _missing_keys(cfg: Any, prefix: str = "") -> List[str]:
    keys: List[str] = []
    if isinstance(cfg, DictConfig):
        for key in cfg.keys():
            if prefix == "" and key == "hydra":
                continue
            dotted = f"{prefix}{key}"
            if OmegaConf.is_missing(cfg, key):
                keys.append(dotted)
            else:
                keys.extend(_missing_keys(cfg._get_node(key), dotted + "."))
    return keys


def experiment_to_yaml(cfg: ExperimentConfig) -> str:
    """The resolved config as YAML (the run dir's run.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def experiment_from_yaml(text: str) -> ExperimentConfig:
    """Inverse of experiment_to_yaml: ranks read run.yaml this way (no Hydra composition)."""
    merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), OmegaConf.create(text))
    return OmegaConf.to_object(merged)


def choices(overrides: Sequence[str]) -> List[str]:
    """The group selections among overrides (`elche=cpu_async`), i.e. which presets apply."""
    picked = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if sep and key.lstrip("+~") in GROUPS:
            picked.append(item)
    return picked


def dotted_items(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Flatten a dataclass tree into {dotted key: leaf value} (lists and dicts stay leaves)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(dotted_items(value, key + "."))
        elif hasattr(value, "value") and hasattr(type(value), "__members__"):
            out[key] = value.value
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                out.update(dotted_items(item, f"{key}.{i}."))
        else:
            out[key] = value
    return out
