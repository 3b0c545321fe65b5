"""The conf/ tree composes and materializes, matches the typed presets, and its key set is frozen.

Options are discovered from conf/<group>/*.yaml, so a new option is covered without editing this
file. Composition runs in-process (no subprocess): Hydra's compose API is what the CLI uses.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from flodl_run.config.compose import (
    GROUPS,
    compose,
    experiment_from_yaml,
    experiment_to_yaml,
    to_experiment,
)
from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import ElCheConfig, ExperimentConfig, Mode, Reduction

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GOLDEN_KEYS = Path(__file__).parent / "golden" / "config_keys.txt"

# Options that cannot stand alone: the extra overrides a user must add to pick them.
TWO_HOSTS_EDITED = ["cluster.controller.host=127.0.0.1", "cluster.workers.0.host=127.0.0.1",
                    "cluster.workers.1.host=127.0.0.2"]
"""The two_hosts template with its placeholder hosts put in (loopback: nothing is reached)."""
REQUIRED_WITH = {("recipe", "custom"): ["recipe.module=recipes.digits_mlp"],
                 ("cluster", "two_hosts"): TWO_HOSTS_EDITED}


def _options():
    for group in GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            yield pytest.param(group, path.stem, id=f"{group}={path.stem}")


@pytest.fixture(scope="module")
def composed():
    """`compose(overrides)`, each distinct list composed once for the module (about 0.2
    CPU-seconds each; 60 of the module's compositions repeated another's overrides): each call
    gets its own deep copy (8 ms), so a test that changes its config changes no other's. Being
    module-scoped puts the module's tests on one pytest worker."""
    cache = {}

    def compose_once(overrides):
        key = tuple(overrides)
        if key not in cache:
            cache[key] = compose(list(overrides))
        return copy.deepcopy(cache[key])

    return compose_once


@pytest.fixture(autouse=True)
def _repo_recipes_importable(monkeypatch):
    """The recipe check imports `recipes.*` the way the CLI does from the repo root."""
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("group,option", list(_options()))
def test_every_option_composes_and_materializes(group, option, tmp_path, composed):
    """Pins: an option of a group that no longer composes or fails validation on its own."""
    overrides = [f"{group}={option}", *REQUIRED_WITH.get((group, option), [])]
    result = materialize(composed(overrides), run_dir=str(tmp_path))
    assert result.config.save_path == str(tmp_path / "checkpoint")
    assert result.warnings == [], f"{group}={option} warns on its own: {result.warnings}"


@pytest.mark.parametrize("group,option", list(_options()))
def test_option_values_reach_the_composed_config(group, option, composed):
    """Pins: a YAML value silently replaced by the schema default (OmegaConf keeps a default when
    `???` is merged over it, which once made `recipe=custom` train digits_mlp)."""
    written = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    written.pop("defaults", None)
    values = OmegaConf.to_container(composed([f"{group}={option}"])[group])
    for key, value in written.items():
        assert values[key] == value, f"{group}/{option}.yaml {key}: {value!r} became {values[key]!r}"


def test_custom_recipe_without_module_is_a_config_error(composed):
    """Pins: `recipe=custom` without `recipe.module` must ask for the module, not train a default."""
    with pytest.raises(ConfigError) as err:
        materialize(composed(["recipe=custom"]))
    assert "recipe.module: is required" in str(err.value)


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_yaml_option_starts_with_a_comment(path):
    """Pins: an option file without the leading comment that says when to choose it (STYLE.md)."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 10, f"{path}: first line {first!r}"


@pytest.mark.parametrize("mode", [m.value for m in Mode])
def test_elche_preset_constructors_equal_yaml_presets(mode, composed):
    """Pins: `ElCheConfig.<mode>()` (Python API) drifting from conf/elche/<mode>.yaml (CLI)."""
    typed, problems = to_experiment(composed([f"elche={mode}"]))
    assert problems == []
    assert getattr(ElCheConfig, mode)() == typed.elche
    assert ElCheConfig.preset(mode) == typed.elche


def test_default_composition_is_the_python_default(composed):
    """Pins: the CLI's no-override config and `ExperimentConfig()` (Python API) disagreeing.

    The recipe section is the one deliberate difference: conf/recipe/digits_mlp.yaml spells out
    params and a target the Python default leaves to the recipe's own function defaults.
    """
    typed, problems = to_experiment(composed([]))
    assert problems == []
    assert typed.recipe.module == ExperimentConfig().recipe.module
    assert dataclasses.replace(typed, recipe=ExperimentConfig().recipe) == ExperimentConfig()


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema class; list-of-dataclass items appear as `<key>.*.<field>`."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        item = (typing.get_args(kind) or [None])[0]
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, key + ".")
        elif typing.get_origin(kind) is list and dataclasses.is_dataclass(item):
            keys += [key] + schema_keys(item, key + ".*.")
        else:
            keys.append(key)
    return keys


def test_config_keys_are_frozen():
    """Pins: a config key added, renamed or removed by accident.

    Config keys are user-facing (command lines, PR diffs, run.yaml of old runs), so changing the
    set must be deliberate: if this fails on purpose, update tests/golden/config_keys.txt (and the
    docs that list the key) in the same commit.
    """
    frozen = {line for line in GOLDEN_KEYS.read_text().splitlines()
              if line and not line.startswith("#")}
    actual = set(schema_keys(ExperimentConfig))
    assert actual == frozen, (f"added: {sorted(actual - frozen)}; removed: {sorted(frozen - actual)}; "
                              f"update {GOLDEN_KEYS.name} if this is deliberate")


ROUND_TRIP_OVERRIDES = [
    [],
    ["elche=cpu_async", "outer=diloco", "cluster=cpu_pair", "elche.partition_ratios=[1,3]",
     "max_failure.percent=0.5", "+scalar_reductions.acc=max", "recipe=synthetic_mlp"],
    ["cluster=two_hosts", *TWO_HOSTS_EDITED, "data=generous", "tracking=mlflow_server",
     "epoch_callback_policy=rank:2"],
]


@pytest.mark.parametrize("overrides", ROUND_TRIP_OVERRIDES, ids=lambda o: " ".join(o) or "default")
def test_run_yaml_round_trip(overrides, tmp_path, composed):
    """Pins: ranks reading run.yaml (no Hydra) getting a different config than the launcher wrote."""
    config = materialize(composed(overrides), run_dir=str(tmp_path)).config
    back = experiment_from_yaml(experiment_to_yaml(config))
    assert back == config
    if "+scalar_reductions.acc=max" in overrides:
        assert back.scalar_reductions == {"acc": Reduction.max}
