"""A new user's first hour, run the way they run it: the CLI as a subprocess (from a directory
other than the project's), its help pages, its error text, and `flodl_run.train()` from Python.

Few subprocesses, each doing as much as one user session would: a one-epoch run checks the run
dir, the notice, the tags, the bundle and the latest link together.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_run.config.compose import register_schemas
from flodl_run.config.helppage import choose_when
from flodl_run.config.overrides import check
from flodl_run.config.schema import ExperimentConfig
from tests.support import run_cli, run_module

REPO = Path(__file__).resolve().parents[1]
EXIT_CONFIG = 2


def cli(cwd: Path, *args: str, module: str = "flodl_run", columns: int = 200) -> subprocess.CompletedProcess:
    """`python -m <module> args` from `cwd`, the project importable as an installed one would be
    (the runner itself forks from the launch server, `run_cli`)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    env.pop("FLODL_RUN_TRACEBACK", None)
    if module == "flodl_run":
        return run_cli(*args, env=env, cwd=cwd, timeout=300)
    return run_module(module, *args, env=env, cwd=cwd, timeout=300)


# --- 1. a mistyped key -----------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_mistyped_key_exits_2_whatever_the_prefix(tmp_path, prefix):
    """Pins: `+elche.overhead_targt=0.1` (Hydra's own hint) exiting 0 with the key silently
    dropped, or any prefix failing without naming the key the user meant."""
    proc = cli(tmp_path, f"{prefix}elche.overhead_targt=0.1", "tracking=off")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert "elche.overhead_targt: is not a config key (did you mean elche.overhead_target?)" in proc.stderr
    assert "Traceback" not in proc.stderr and "+elche" not in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_free_form_keys_pass_and_foreign_groups_fail():
    """Pins: the key check refusing the user's own recipe params or Hydra's keys, or letting
    the bench's group through on the runner."""
    register_schemas()
    ok = ["+recipe.params.hidden=128", "elche=cpu_async", "hydra.run.dir=x", "max_failure.percent=5",
          "cluster.workers=[]", "seed=3", "recipe=custom", "recipe.module=my.mod"]
    assert check(ok, REPO / "conf", "config") == []
    [problem] = check(["bench=quick"], REPO / "conf", "config")
    assert problem.key == "bench" and "groups: elche, outer, cluster, data, recipe, tracking" in problem.rule


# --- 2-6. one run from another directory, then its resume ------------------------------------


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, migrated_mlflow_db):
    """One epoch of `elche=cpu_async outer=diloco` on the default `cluster=auto` (one device
    here), started from an empty directory, tracked in MLflow under its outputs/."""
    home = tmp_path_factory.mktemp("elsewhere")
    (home / "outputs").mkdir()
    shutil.copyfile(migrated_mlflow_db, home / "outputs" / "mlflow.db")
    proc = cli(home, "elche=cpu_async", "outer=diloco", "num_epochs=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return home, proc, (home / "outputs" / "latest").resolve()


@pytest.mark.e2e
def test_one_device_run_says_so_and_tags_match_summary(first_run):
    """Pins: a one-device auto run silently ignoring elche/outer, and MLflow tagging it
    `mode=nccl_cadence`/`cpu_async` while summary.json says `solo`."""
    import mlflow

    home, proc, run_dir = first_run
    assert ("note: one device: solo in-process run; elche/outer apply with 2+ ranks, "
            "e.g. cluster=cpu_pair") in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{home / 'outputs' / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    tags = run.data.tags
    assert (tags["mode"], tags["outer"]) == (summary["mode"], summary["outer"]) == ("solo", "none")
    assert run.info.run_name == "solo-digits_mlp"  # what trained, not `cpu_async+diloco-...`
    assert [e["samples"] for e in summary["epochs"]] == [1437]  # was 0 in-process
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert re.search(r"\| [\d.]+s wall, [\d.]+s training \| [\d,]+ samples/s in training", done), done


@pytest.mark.e2e
def test_review_warns_on_one_device(tmp_path):
    """Pins: `review` not saying that elche/outer have no effect on this one-device host."""
    proc = cli(tmp_path, "elche=cpu_async", module="flodl_run.review")
    assert proc.returncode == 0, proc.stderr
    assert "warning: one device: solo in-process run; elche/outer apply with 2+ ranks" in proc.stdout


@pytest.mark.e2e
def test_run_dir_has_readable_logs_events_latest_link_and_final_line(first_run):
    """Pins: an empty cli.log, events.jsonl only inside MLflow, no `outputs/latest`, and a last
    line that does not say what was written (from outside the project directory)."""
    home, proc, run_dir = first_run
    assert run_dir.parent.parent == home / "outputs"  # outputs/<date>/<time>, linked as latest
    assert "done: final eval" in (run_dir / "cli.log").read_text()
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert kinds[0] == "start" and "checkpoint" in kinds and kinds[-1] == "end"
    last = proc.stdout.strip().splitlines()[-1]
    for name in ("checkpoint.* (bundle)", "cli.log", "events.jsonl", "run.yaml", "summary.json",
                 "outputs/latest -> this run", "mlflow run "):
        assert name in last, last


@pytest.mark.e2e
def test_in_process_run_writes_a_bundle_that_resumes(first_run):
    """Pins: an in-process run ending with `"checkpoint": null`, a resume that retrains
    epochs the bundle already holds or does not say where it starts, and an in-process
    `timeline=true` writing no trace without saying why."""
    home, _, run_dir = first_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint"] == str(run_dir / "checkpoint")
    proc = cli(home, f"resume_from={run_dir}/checkpoint", "num_epochs=2", "tracking=off",
               "timeline=true", f"hydra.run.dir={home / 'resumed'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {run_dir}/checkpoint at epoch 2: training epoch 2\n" in proc.stdout
    assert "note: timeline=true writes no trace for an in-process run" in proc.stdout
    resumed = json.loads((home / "resumed" / "summary.json").read_text())
    assert [e["epoch"] for e in resumed["epochs"]] == [1]


@pytest.mark.e2e
def test_config_error_leaves_no_run_dir_and_says_what_to_type(first_run):
    """Pins: a config error leaving `.hydra/` and an empty cli.log behind, a resume error
    without the `<dir>/checkpoint` form, and an 80-column terminal cutting the value in two."""
    home, _, run_dir = first_run
    target = home / "outputs" / "refused"
    proc = cli(home, f"resume_from={run_dir}", "tracking=off", f"hydra.run.dir={target}", columns=80)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert f"type resume_from={run_dir}/checkpoint" in proc.stderr
    assert not target.exists()


@pytest.mark.e2e
def test_unimportable_recipe_says_where_it_was_looked_up(tmp_path):
    """Pins: `no module named ...` without saying where modules are looked for, and the
    refused run leaving a stray outputs/ in the directory it was started from."""
    proc = cli(tmp_path, "recipe=custom", "recipe.module=nowhere.mod", "tracking=off")
    assert proc.returncode == EXIT_CONFIG
    assert f"looked up in the current directory {tmp_path}, then PYTHONPATH" in proc.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.e2e
def test_a_users_module_comes_from_the_current_directory_first(tmp_path):
    """Pins: the installed `recipes` package shadowing a user's own `recipes/` in the directory
    they run from."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("")
    (tmp_path / "recipes" / "digits_mlp.py").write_text(
        "def build_model(device): ...\ndef build_optimizer(parameters): ...\n"
        "def train_step(model, batch): ...\ndef train_dataset(): ...\n")
    code = ("import sys; from flodl_run.contracts.recipe import import_recipe as load_recipe; "
            "load_recipe('recipes.digits_mlp'); "
            "print(sys.modules['recipes.digits_mlp'].__file__)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == str(tmp_path / "recipes" / "digits_mlp.py"), proc.stderr


def test_built_in_recipes_install_with_the_package():
    """Pins: the package list of pyproject.toml leaving `recipes` out, so `recipes.digits_mlp`
    only imported from the project root."""
    from setuptools import find_packages

    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]")[1]
    include = ast.literal_eval(re.search(r"^include = (\[.*\])$", section, flags=re.M).group(1))
    packages = find_packages(str(REPO), include=include)
    assert "recipes" in packages and "flodl_run" in packages and "tests" not in packages


# --- 7. the help pages -----------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("module,groups,absent", [
    ("flodl_run", ["elche", "outer", "cluster", "data", "recipe", "tracking", "experiment"],
     ["bench"]),
    ("flodl_run.sim", ["elche"], ["cluster", "recipe"]),
    ("flodl_run.bench", ["bench", "cluster", "tracking"], ["elche"]),
])
def test_help_lists_groups_options_and_when_to_choose_them(tmp_path, module, groups, absent):
    """Pins: Hydra's generic page listing internal `base_*` schema names, the runner offering
    the bench's group, or an option shown without its "choose when" line."""
    proc = cli(tmp_path, "--help", module=module)
    assert proc.returncode == 0, proc.stderr
    page = " ".join(proc.stdout.split())  # descriptions wrap; compare word by word
    assert "base_" not in page and "Powered by Hydra" not in page
    for group in groups:
        for option in sorted((REPO / "conf" / group).glob("*.yaml")):
            assert option.stem in page
            assert choose_when(option).removeprefix("Default. ") in page, option
    listed = re.findall(r"^  (\w+) ", proc.stdout, flags=re.M)
    assert [g for g in listed if g in groups + absent] == groups
    if module == "flodl_run":
        assert "seed=0" in page and "num_epochs=10" in page


# --- 9. the Python API -----------------------------------------------------------------------


def test_train_from_python_writes_the_clis_run_dir(tmp_path, mlflow_db, monkeypatch, capsys):
    """Pins: `flodl_run.train()` leaving no run dir, summary.json or MLflow run, not returning
    where they are, or printing when progress was not asked for; and refusing the plain
    strings the YAML takes for an enum field (`topology="solo"`, `kind="mlflow"`)."""
    import flodl_run
    from flodl_run.config.schema import ClusterConfig, TrackingConfig

    monkeypatch.chdir(tmp_path)
    config = ExperimentConfig(num_epochs=1, cluster=ClusterConfig(topology="solo"),
                              tracking=TrackingConfig(kind="mlflow", uri=f"sqlite:///{mlflow_db}"))
    result = flodl_run.train(config)
    assert capsys.readouterr().out == ""
    assert result.run_dir.parent.parent == tmp_path / "outputs"
    assert json.loads(result.summary_path.read_text())["status"] == "completed"
    assert (result.run_dir / "run.yaml").is_file() and (result.run_dir / "events.jsonl").is_file()
    assert result.checkpoint == str(result.run_dir / "checkpoint") and result.model is not None
    assert result.mlflow_run_id == json.loads(result.summary_path.read_text())["mlflow_run_id"]


# --- 10. the docs ----------------------------------------------------------------------------


def _text_files():
    yield REPO / "README.md"
    yield from (REPO / "docs").glob("*.md")
    for folder in ("flodl_run", "recipes", "tests", "tools", "conf"):
        yield from (p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh"))


def test_no_doc_test_or_template_names_an_address_off_loopback():
    """Pins: the two_hosts template and docs/multi-host.md named private addresses (10.0.0.x,
    ...), so a probe tried as a new user would try it sent SSH to whatever owned them; tests
    named them too. Anything that stands for a machine is a name (`.invalid` in templates and
    docs, `.test` in tests) or a loopback address; 0.0.0.0 (listen on all) is no machine."""
    ipv4 = re.compile(r"(?<![\d.])(\d{1,3})\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\d.])")
    for path in _text_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in ipv4.finditer(line):
                assert match[1] == "127" or match[0] == "0.0.0.0", \
                    f"{path.relative_to(REPO)}:{n}: {line.strip()}"


def test_docs_are_self_contained():
    """Pins: docs and code comments citing a design document or issue numbers that are not in
    the repository, bare `python` in shell examples (fails outside the venv), docs/elche.md and
    docs/architecture.md left unlinked, and two different times for the quick bench."""
    cited = re.compile(r"DESIGN|§|\bissues? #?\d|\(#\d+\)|session \d")
    for path in _text_files():
        if path.name == "test_newcomer.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not cited.search(line), f"{path.relative_to(REPO)}:{n}: {line.strip()}"
    readme = (REPO / "README.md").read_text()
    assert "docs/elche.md" in readme and "docs/architecture.md" in readme
    timed = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "conf").rglob("*.yaml")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"(^|[\s`(])python (-m |tools/)", line), f"{path.name}:{n}: {line}"
            if "quick" in line and re.search(r"\d+ ?(s|min|minutes?)\b|a minute", line):
                timed.append(path.name)
    assert timed == ["benchmarks.md"], timed
