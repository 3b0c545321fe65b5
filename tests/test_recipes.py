"""The recipe contract: shipped recipes satisfy it, and a broken user module is a clear RecipeError.

Shipped recipes are found through conf/recipe/*.yaml (module + params), so a new recipe option
is covered without editing this file.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import default_collate

from flodl_run.contracts.recipe import RecipeError
from flodl_run.contracts.recipe import import_recipe as load_recipe
from flodl_run.rank.replica import Optimizers, Replica, as_one_optimizer
from flodl_run.rank.worker import Worker, run_loop

REPO = Path(__file__).resolve().parents[1]
# GPU-sized recipes run the contract check at a CPU size (their own tests cover the shipped size).
CPU_SIZE = {"recipes.byte_lm": dict(d_model=32, num_layers=1, num_heads=2, seq_len=32,
                                    max_bytes=50_000)}


def _shipped():
    for path in sorted((REPO / "conf" / "recipe").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if spec.get("module", "???") != "???":
            params = {**(spec.get("params") or {}), **CPU_SIZE.get(spec["module"], {})}
            yield pytest.param(spec["module"], params, spec.get("eval_direction", "max"), id=path.stem)


@pytest.fixture(autouse=True)
def _repo_recipes_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


def write_module(directory: Path, name: str, source: str, monkeypatch) -> str:
    """Write a user recipe module outside the repo and make it importable; returns its name."""
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(directory))
    return name


@pytest.mark.parametrize("module,params,direction", list(_shipped()))
def test_shipped_recipe_satisfies_the_contract(module, params, direction):
    """Pins: a shipped recipe missing a function, or returning the wrong kind of object; a
    recipe with its own loop training one batch and reporting one finite loss; an accuracy-like
    eval (direction max) counts at most one hit per sample."""
    recipe = load_recipe(module, params)
    model = recipe.call("build_model", torch.device("cpu"))
    optimizer = as_one_optimizer(recipe.call("build_optimizer", model.parameters(), model=model))
    train = recipe.call("train_dataset")
    assert isinstance(model, torch.nn.Module)
    assert isinstance(optimizer, (torch.optim.Optimizer, Optimizers))
    batch = default_collate([train[i] for i in range(8)])  # as the runner collates: tuples or dicts
    if recipe.loop is None:
        loss = recipe.train_step(model, batch)
        assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    else:
        reported: list = []
        replica = Replica(recipe, torch.device("cpu"), seed=0)
        run_loop(recipe, Worker(replica, lambda: iter([batch]), reported.append, 0, 1))
        assert len(reported) == 1 and torch.isfinite(torch.as_tensor(reported[0]))
    assert recipe.has_eval, f"{module} has no held-out eval"
    eval_set = recipe.call("eval_dataset")
    held_out = default_collate([eval_set[i] for i in range(8)])
    if recipe.eval_fn is not None:
        assert math.isfinite(recipe.call("eval_fn", model, held_out))
        return
    metric_sum, count = recipe.eval_step(model, held_out)
    assert 0 <= float(metric_sum) and count >= 8
    if direction == "max":
        assert float(metric_sum) <= float(count) == 8


def test_digits_cnn_has_batchnorm_buffers():
    """Pins: digits_cnn losing its BatchNorm (it exists to exercise the buffer rule)."""
    model = load_recipe("recipes.digits_cnn").call("build_model", torch.device("cpu"))
    buffers = dict(model.named_buffers())
    floats = [k for k, v in buffers.items() if v.is_floating_point()]
    ints = [k for k, v in buffers.items() if not v.is_floating_point()]
    assert any(k.endswith("running_mean") for k in floats)
    assert any(k.endswith("running_var") for k in floats)
    assert any(k.endswith("num_batches_tracked") for k in ints)


def test_held_out_split_does_not_overlap_training():
    """Pins: the digits eval split leaking into training (accuracy would be meaningless)."""
    recipe = load_recipe("recipes.digits_mlp")
    train = {tuple(x.tolist()) for x, _ in recipe.call("train_dataset")}
    held_out = [tuple(x.tolist()) for x, _ in recipe.call("eval_dataset")]
    assert held_out and sum(x in train for x in held_out) < 0.05 * len(held_out)


def test_missing_function_names_module_and_function(tmp_path, monkeypatch):
    """Pins: a user module without `train_step` failing later with an AttributeError mid-run."""
    name = write_module(tmp_path, "user_recipe_no_step", """
        def build_model(device): pass
        def build_optimizer(parameters): pass
        def train_dataset(): pass
    """, monkeypatch)
    with pytest.raises(RecipeError) as err:
        load_recipe(name)
    assert err.value.key == "recipe.module"
    assert name in str(err.value) and "train_step" in str(err.value)


def test_import_error_inside_module_names_module_and_cause(tmp_path, monkeypatch):
    """Pins: a broken dependency of a user recipe reported as if the recipe itself were missing."""
    name = write_module(tmp_path, "user_recipe_bad_import", "import no_such_dependency_xyz\n",
                        monkeypatch)
    with pytest.raises(RecipeError) as err:
        load_recipe(name)
    assert err.value.key == "recipe.module"
    assert name in str(err.value) and "no_such_dependency_xyz" in str(err.value)
    assert "failed to import" in str(err.value)


def test_error_raised_at_import_is_a_recipe_error(tmp_path, monkeypatch):
    """Pins: an exception raised by user code at import escaping as a traceback."""
    name = write_module(tmp_path, "user_recipe_raises", "raise RuntimeError('boom')\n", monkeypatch)
    with pytest.raises(RecipeError) as err:
        load_recipe(name)
    assert name in str(err.value) and "RuntimeError: boom" in str(err.value)


def test_missing_module_is_named():
    """Pins: a mistyped recipe.module giving anything but its name and the rule."""
    with pytest.raises(RecipeError) as err:
        load_recipe("no_such_recipe_module")
    assert str(err.value).startswith("recipe.module: must be an importable module")
    assert "'no_such_recipe_module'" in str(err.value)


def test_eval_functions_come_in_pairs(tmp_path, monkeypatch):
    """Pins: eval_dataset without eval_step (or the reverse) accepted and failing at the first eval."""
    name = write_module(tmp_path, "user_recipe_half_eval", """
        def build_model(device): pass
        def build_optimizer(parameters): pass
        def train_step(model, batch): pass
        def train_dataset(): pass
        def eval_dataset(): pass
    """, monkeypatch)
    with pytest.raises(RecipeError, match="eval_dataset and eval_step"):
        load_recipe(name)


def test_transform_must_name_a_function_of_the_module():
    """Pins: data.transform naming a missing function accepted until the first batch."""
    with pytest.raises(RecipeError) as err:
        load_recipe("recipes.digits_mlp", transform="no_such_transform")
    assert err.value.key == "data.transform" and "no_such_transform" in str(err.value)


def test_params_reach_only_functions_that_take_them():
    """Pins: a params key one function does not declare raising TypeError in that function."""
    recipe = load_recipe("recipes.digits_mlp", {"hidden": 16, "lr": 0.5, "unused": 1})
    model = recipe.call("build_model", torch.device("cpu"))
    assert model[0].out_features == 16
    assert recipe.call("build_optimizer", model.parameters()).defaults["lr"] == 0.5


@pytest.mark.e2e
def test_digits_are_sklearns_rows_read_without_importing_sklearn():
    """Pins the default recipe's data path: the table read from the CSV file sklearn ships is
    load_digits() row for row, and building both data sets imports no sklearn (its import
    costs about 2 s of CPU in every rank process)."""
    code = ("import sys; from recipes import digits_mlp as d; d.train_dataset(); d.eval_dataset();"
            "print(any(m == 'sklearn' or m.startswith('sklearn.') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
    from sklearn.datasets import load_digits

    from recipes.digits_mlp import _digits_table

    pixels, labels = _digits_table()
    reference = load_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)
