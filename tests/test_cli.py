"""`python -m flodl_run` and `python -m flodl_run.review` as a user runs them: real subprocesses
from the repo root, each writing into its own tmp run dir (`hydra.run.dir`), tracking off.

Each subprocess costs a Python + Hydra (+ torch) start-up, so the cases are few and chosen;
the rules themselves are covered in-process by test_config_validate.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from flodl_run import review
from flodl_run.config.compose import experiment_from_yaml
from tests.support import run_cli, run_module

REPO = Path(__file__).resolve().parents[1]
EXIT_CONFIG = 2
EXIT_REVIEW_INVALID = 1
EASGD_MESSAGE = "elche.easgd_alpha: must be in (0, 1], got 1.5"


def run(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m <module> args` from the repo root; COLUMNS keeps rich tables unwrapped.
    The runner itself forks from the launch server (`run_cli`)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("FLODL_RUN_TRACEBACK", None)
    if module == "flodl_run":
        return run_cli(*args, env=full_env)
    return run_module(module, *args, env=full_env)


def train(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run("flodl_run", *overrides, "tracking=off", f"hydra.run.dir={tmp_path}", env=env)


def table_rows(stdout: str) -> dict:
    """{key: cells} of the rich tables in `stdout`: [value, preset, marker] for a review row,
    [this, other] for a diff row."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]  # header rows use ┃, not │
        if len(cells) == 4:
            rows[cells[1]] = [cells[2], cells[3], cells[0]]
        elif len(cells) == 3:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.e2e
def test_default_recipe_trains_and_writes_run_dir(tmp_path):
    """Pins: the README's first line (default config, solo) not reaching 0.93 held-out accuracy,
    not showing progress, or not writing summary.json (status completed) and run.yaml."""
    proc = train(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "epoch 10/10" in proc.stdout and "ETA" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_eval"] >= 0.93
    assert summary["world_size"] == 1 and len(summary["epochs"]) == 10
    config = experiment_from_yaml((tmp_path / "run.yaml").read_text())
    assert config.recipe.module == "recipes.digits_mlp"
    assert config.save_path == str(tmp_path / "checkpoint")


MALFORMED = [
    pytest.param(["elche.bogus=1"], "elche.bogus", id="unknown-key"),
    pytest.param(["elche.anchor=abc"], "elche.anchor", id="wrong-type"),
    pytest.param(["elche.easgd_alpha=1.5"], EASGD_MESSAGE, id="out-of-range"),
    pytest.param(["elche.min_anchor=50", "elche.max_anchor=20"],
                 "elche.min_anchor: must be <= elche.max_anchor (20), got 50", id="inconsistent-pair"),
    pytest.param(["recipe=custom", "recipe.module=no_such_mod"], "recipe.module", id="missing-module"),
    pytest.param(["recipe=custom"], "recipe.module: is required", id="custom-without-module"),
    pytest.param(["elche=nope"], "elche: must be one of cpu_async, ", id="missing-option"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("overrides,names", MALFORMED)
def test_malformed_override_exits_2_naming_the_key(tmp_path, overrides, names):
    """Pins: a user config error exiting with a traceback, a code other than 2, a message that
    does not name the dotted key, or starting a run anyway."""
    proc = train(tmp_path, *overrides)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG, output
    assert names in output
    assert "Traceback" not in output
    assert not (tmp_path / "run.yaml").exists()


RECIPE_OUTSIDE_REPO = """
    import torch
    from torch.utils.data import TensorDataset

    def _data(num_samples, seed):
        x = torch.randn(num_samples, 4, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, (x.sum(dim=1) > 0).long())

    def train_dataset(num_samples=64): return _data(num_samples, 0)
    def eval_dataset(num_samples=64): return _data(num_samples, 1)
    def build_model(device): return torch.nn.Linear(4, 2).to(device)
    def build_optimizer(parameters, lr=0.1): return torch.optim.SGD(parameters, lr=lr)
    def train_step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    def eval_step(model, batch):
        x, y = batch
        return (model(x).argmax(dim=1) == y).sum().item(), len(y)
"""


@pytest.mark.e2e
def test_user_recipe_outside_the_repo_runs(tmp_path):
    """Pins: `recipe=custom recipe.module=my_pkg.my_recipe` failing for a module that lives
    outside the repo (found through PYTHONPATH, as a user's own package would be)."""
    package = tmp_path / "src" / "my_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "my_recipe.py").write_text(textwrap.dedent(RECIPE_OUTSIDE_REPO))
    run_dir = tmp_path / "run"
    proc = train(run_dir, "recipe=custom", "recipe.module=my_pkg.my_recipe",
                 "+recipe.params.num_samples=96", "num_epochs=2", "device=cpu",
                 env={"PYTHONPATH": str(tmp_path / "src")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and len(summary["epochs"]) == 2
    assert summary["final_eval"] is not None
    config = experiment_from_yaml((run_dir / "run.yaml").read_text())
    assert config.recipe.module == "my_pkg.my_recipe"
    assert config.recipe.params == {"num_samples": 96}


@pytest.mark.e2e
def test_hydra_cfg_job_resolve_still_works(tmp_path):
    """Pins: our entry point breaking Hydra's own flags (`--cfg job --resolve`)."""
    # Hydra's parser takes the overrides as one run of positionals: flags go first.
    proc = run("flodl_run", "--cfg", "job", "--resolve", "elche=cpu_async", "tracking=off",
               f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "mode: cpu_async" in proc.stdout and "easgd_alpha: 0.5" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


# --- python -m flodl_run.review --------------------------------------------------------------


@pytest.mark.e2e
def test_review_shows_the_materialized_preset():
    """Pins: the review of `elche=cpu_async` losing a resolved
    value, or marking values as changed when only a preset was picked."""
    proc = run("flodl_run.review", "elche=cpu_async")
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["elche.mode"] == ["cpu_async", "cpu_async", ""]
    assert rows["elche.anchor"][0] == "10"
    assert rows["elche.easgd_alpha"][0] == "0.5"
    assert rows["elche.divergence_threshold"][0] == "0.3"
    assert [k for k, row in rows.items() if row[2]] == [], "a preset value is marked as changed"
    titles = [line.strip() for line in proc.stdout.splitlines() if line.strip() in review.SECTIONS]
    assert titles == list(review.SECTIONS)


@pytest.mark.e2e
def test_review_markdown_marks_changes_and_lists_warnings():
    """Pins: `--format markdown` not producing a pasteable table, not marking a value changed from
    its preset (including derived ones: min_anchor follows anchor), or dropping the warnings."""
    proc = run("flodl_run.review", "elche=cpu_async", "elche.anchor=20", "outer.momentum=0.5",
               "--format", "markdown")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "#### elche" in lines and "| key | value | preset |" in lines
    assert "| `elche.anchor` | **`20`** | `10` |" in lines
    assert "| `elche.min_anchor` | **`20`** | `10` |" in lines
    assert "| `elche.mode` | `cpu_async` | `cpu_async` |" in lines
    assert "**Warnings**" in lines
    assert any(line.startswith("- outer.lr/outer.momentum have no effect") for line in lines)


@pytest.mark.e2e
def test_review_against_lists_differing_fields_only():
    """Pins: `--against` missing a differing field (mode, anchor) or listing equal ones."""
    proc = run("flodl_run.review", "elche=cpu_async", "--against", "elche=nccl_sync")
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["elche.mode"] == ["cpu_async", "nccl_sync"]
    assert rows["elche.anchor"] == ["10", "1"]
    assert "elche.gamma" not in rows and "seed" not in rows


@pytest.mark.e2e
@pytest.mark.parametrize("overrides,message", [
    (["elche.easgd_alpha=1.5"], EASGD_MESSAGE),
    (["elche.bogus=1"], "elche.bogus"),
])
def test_review_of_invalid_config_exits_1_with_runner_message(overrides, message):
    """Pins: review exiting 0 (or with a traceback) on a config the runner would refuse, or
    wording the problem differently from the runner."""
    proc = run("flodl_run.review", *overrides)
    assert proc.returncode == EXIT_REVIEW_INVALID, proc.stdout
    assert message in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                   check=True, capture_output=True)


@pytest.mark.e2e
def test_review_against_ref_diffs_the_conf_tree_at_a_commit(tmp_path):
    """Pins: `--against-ref` not reading conf/ at the ref (e.g. a PR's base) or diffing the wrong
    way round: working tree is `this`, the ref is `other`."""
    repo = tmp_path / "repo"
    (repo / "conf").mkdir(parents=True)
    subprocess.run(["cp", "-r", f"{REPO / 'conf'}/.", str(repo / "conf")], check=True)
    _git(repo, "init", "-q")
    _git(repo, "add", "conf")
    _git(repo, "commit", "-q", "-m", "base")
    preset = repo / "conf" / "elche" / "nccl_cadence.yaml"
    preset.write_text(preset.read_text().replace("anchor: 10", "anchor: 12"))
    proc = run("flodl_run.review", "--against-ref", "HEAD", env={"FLODL_RUN_CONF": str(repo / "conf")})
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["elche.anchor"] == ["12", "10"]
    assert set(rows) == {"elche.anchor", "elche.min_anchor"}


def test_review_preset_of_custom_recipe_leaves_module_open():
    """Pins: the preset column inventing a module for `recipe=custom` (its preset has none)."""
    overrides = ["recipe=custom", "recipe.module=recipes.digits_cnn"]
    assert review.preset(overrides)["recipe.module"] == "???"
    assert review.section_of("max_failure.percent") == "run"
    assert review.section_of("cluster.controller.port") == "cluster"


@pytest.mark.e2e
def test_an_empty_train_set_stops_both_ranks_with_one_line_naming_the_recipe(tmp_path):
    """Pins what a pair of ranks says of an empty train set (synthetic_mlp keeps 80% of one
    sample: none): each rank's one line and the run's failed line name recipe.module and its
    train_dataset, with no traceback of our frames; it used to be a traceback ending in
    `data.epoch_splits: must be <= the batches of one pass, 0`."""
    proc = train(tmp_path / "run", "recipe=synthetic_mlp", "recipe.params.num_samples=1",
                 "cluster=cpu_pair", "num_epochs=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    said = ("RecipeError: recipe.module: must give a train_dataset with at least one sample (its "
            "train_dataset(**recipe.params) returned an empty one), got 'recipes.synthetic_mlp'")
    for rank in (0, 1):
        assert f"rank {rank}: failed to start: {said}" in out, out
    assert f"failed: rank 0 failed: {said}" in out or f"failed: rank 1 failed: {said}" in out, out
    assert "Traceback" not in out and "epoch_splits" not in out


def test_hydra_mode_is_composed_for_only_where_something_may_set_it(tmp_path):
    """Pins skipping Hydra's second compose (`Hydra.get_mode`, only to read `hydra.mode`):
    the shipped trees leave `hydra.mode` unset, composed as Hydra's get_mode composes (so the
    skip changes nothing for them), and the check says so; an override of it, another config
    tree or search path, or a conf/ file that sets it sends the run through Hydra's own read."""
    import shutil

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from flodl_run.bench.run import SCHEMAS as BENCH_SCHEMAS
    from flodl_run.config.app import _mode_may_be_set
    from flodl_run.config.compose import conf_dir, register_schemas
    from flodl_run.sim.cli import SCHEMA as SIM_SCHEMA

    register_schemas(extra=[*BENCH_SCHEMAS, SIM_SCHEMA])
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        for name in ("config", "bench", "sim"):
            cfg = GlobalHydra.instance().hydra.compose_config(
                name, [], run_mode=RunMode.MULTIRUN, with_log_configuration=False)
            assert cfg.hydra.mode is None, name
    assert not _mode_may_be_set(conf_dir(), ["elche=nccl_sync", "cluster.num_ranks=2"])
    assert not _mode_may_be_set(conf_dir(), ["-m", "elche=nccl_sync,cpu_async"])
    for argv in (["hydra.mode=MULTIRUN"], ["+hydra.searchpath=[file:///tmp]"], ["--config-dir", "/tmp"],
                 ["--no-such-flag"]):
        assert _mode_may_be_set(conf_dir(), argv), argv
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    assert not _mode_may_be_set(conf, [])
    primary = conf / "config.yaml"
    primary.write_text(primary.read_text().replace("\nhydra:\n", "\nhydra:\n  mode: MULTIRUN\n", 1))
    assert _mode_may_be_set(conf, [])
    primary.write_text("hydra: {mode: [\n")  # malformed: Hydra's compose names the problem
    assert _mode_may_be_set(conf, [])


@pytest.mark.e2e
def test_a_conf_tree_that_sets_hydra_mode_multirun_sweeps_without_dash_m(tmp_path):
    """Pins Hydra's own behaviour through the skip above: a primary config with
    `hydra.mode: MULTIRUN` and a sweeper's params sweeps on a plain `python -m flodl_run`."""
    import shutil

    from flodl_run.config.compose import conf_dir

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    primary = conf / "config.yaml"
    primary.write_text(primary.read_text().replace(
        "\nhydra:\n", "\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      seed: 3,4\n", 1))
    sweep = tmp_path / "multirun"
    proc = run("flodl_run", "cluster=solo", "num_epochs=1", "tracking=off", f"hydra.sweep.dir={sweep}",
               env={"FLODL_RUN_CONF": str(conf)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()) == ["0", "1"]
    assert [experiment_from_yaml((sweep / job / "run.yaml").read_text()).seed for job in ("0", "1")] == [3, 4]
