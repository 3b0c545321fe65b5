"""Config review in pull requests: named experiments, their snapshots and the check, the meaning
lines under a diff, the workflow users copy and the pre-commit hook.

Most tests compose in this process, on a temporary git repository (e2e: git runs) holding the
project's conf/ with two named experiments (FLODL_RUN_CONF points at it); the sim and pre-commit
run once each as processes of their own, because the real command's answer is what they pin
(the sim forked from the launch server, as the suite runs `python -m` commands).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flodl_run.config.compose import compose
from flodl_run.config.materialize import materialize
from flodl_run.review import snapshots
from flodl_run.review.cli import main
from flodl_run.review.meaning import meaning_lines, rig_from
from flodl_run.review.workflow import WORKFLOW
from tests.support import run_module

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("pair_cadence", "pair_exact")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "-C", str(repo),
                    *args], check=True, capture_output=True)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A git repository with the project's conf/ and two of its named experiments, committed;
    the review reads its conf/."""
    repo = tmp_path / "project"
    shutil.copytree(REPO / "conf", repo / "conf")
    for path in (repo / "conf" / "experiment").glob("*.yaml"):
        if path.stem not in EXPERIMENTS:
            path.unlink()
    _git(repo, "init", "-q")
    _git(repo, "add", "conf")
    _git(repo, "commit", "-q", "-m", "conf")
    monkeypatch.setenv("FLODL_RUN_CONF", str(repo / "conf"))
    monkeypatch.chdir(repo)
    return repo


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer holds {old!r}"
    path.write_text(text.replace(old, new))


def _review(capsys, *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().out


@pytest.mark.e2e
def test_check_names_every_experiment_a_preset_change_touches(project, capsys):
    """Pins the snapshot check: a change to a preset both experiments use must exit 1 naming
    both and the field (snapshot then now), `--update` must make it pass again, and a change to
    a preset neither uses must pass (a check that compared text, not the resolved config, or
    missed an experiment, fails here)."""
    snaps = project / "conf_snapshots"
    assert _review(capsys, "--snapshot", str(snaps))[0] == 0
    assert sorted(p.stem for p in snaps.glob("*.yaml")) == list(EXPERIMENTS)
    _edit(project / "conf" / "cluster" / "cpu_pair.yaml", "emulate_slowdown: [1.0, 2.5]",
          "emulate_slowdown: [1.0, 3.0]")

    status, out = _review(capsys, "--check", str(snaps), "--format", "markdown")
    assert status == 1, out
    for name in EXPERIMENTS:
        assert f"#### experiment {name} differs from its snapshot" in out
    assert out.count("| `cluster.emulate_slowdown` | `[1.0, 2.5]` | `[1.0, 3.0]` |") == 2
    assert "(2): pair_cadence, pair_exact" in out

    assert _review(capsys, "--update", str(snaps))[0] == 0
    assert "cluster.emulate_slowdown: [1.0, 3.0]" in (snaps / "pair_exact.yaml").read_text()
    assert _review(capsys, "--check", str(snaps))[0] == 0

    _edit(project / "conf" / "elche" / "cpu_async.yaml", "easgd_alpha: 0.5", "easgd_alpha: 0.6")
    status, out = _review(capsys, "--check", str(snaps))
    assert status == 0 and "no experiment differs from its snapshot" in out, out


@pytest.mark.e2e
def test_check_fails_for_an_experiment_without_snapshot_and_a_snapshot_without_experiment(
        project, capsys):
    """Pins that drift is more than a changed value: a new experiment with no snapshot, and a
    snapshot whose experiment was removed, both exit 1 by name; an unknown directory exits 2."""
    snaps = project / "conf_snapshots"
    main(["--snapshot", str(snaps)])
    (project / "conf" / "experiment" / "pair_exact.yaml").rename(
        project / "conf" / "experiment" / "pair_renamed.yaml")
    status, out = _review(capsys, "--check", str(snaps))
    assert status == 1
    assert "experiment pair_renamed has no snapshot" in out
    assert "experiment pair_exact has a snapshot but is no longer an experiment" in out
    assert _review(capsys, "--check", str(snaps), "experiment=pair_cadence")[0] == 0
    assert _review(capsys, "--check", str(project / "nowhere"))[0] == 2
    own = project / "mine" / "experiment"  # a user's own experiments, on Hydra's search path
    own.mkdir(parents=True)
    (own / "big_batch.yaml").write_text("# @package _global_\n# Choose to test.\nbatch_size: 64\n")
    status, out = _review(capsys, "--check", str(snaps), "experiment=big_batch",
                          f"hydra.searchpath=[file://{project / 'mine'}]")
    assert status == 1 and "experiment big_batch has no snapshot" in out, out


@pytest.mark.e2e
def test_review_names_a_recipe_module_that_cannot_be_found(project, capsys):
    """Pins review's recipe check now that it does not import the recipe (torch): a module
    that does not exist still fails the review (exit 1) naming recipe.module, and in the
    snapshot commands (exit 2) naming the experiment too."""
    assert main(["recipe=custom", "recipe.module=no_such_pkg.recipe"]) == 1
    assert "recipe.module: must be an importable module" in capsys.readouterr().err
    status = main(["--snapshot", str(project / "snaps"), "recipe.module=no_such_pkg.recipe"])
    assert status == 2
    assert "experiment pair_cadence: invalid config" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_snapshot_holds_no_secret_and_no_path_of_the_machine(project):
    """Pins the snapshot form: a password in a tracking URI and a token among the recipe's
    params are redacted, the auto tracking store (an absolute path under the cwd) and the
    cores-derived threads stay null, and the keys keep the schema's order."""
    now = snapshots.current("pair_cadence", [
        "tracking=mlflow_server", "tracking.uri=https://me:hunter2@mlflow.invalid",
        "+recipe.params.hf_token=abc123", "cluster.threads_per_rank=null"])
    text = "\n".join(f"{k}: {v}" for k, v in now.items.items())
    assert "hunter2" not in text and "abc123" not in text
    assert now.items["tracking.uri"] == "https://me:<redacted>@mlflow.invalid"
    assert now.items["recipe.params"]["hf_token"] == "<redacted>"
    assert now.items["cluster.threads_per_rank"] is None
    plain = snapshots.current("pair_exact", [])
    assert plain.items["tracking.uri"] is None
    assert str(Path.cwd()) not in str(plain.items) and str(Path.home()) not in str(plain.items)
    assert list(plain.items)[:2] == ["elche.mode", "elche.anchor"]


@functools.lru_cache(maxsize=None)
def _materialized(*overrides: str):
    """Composed from the project's conf/ (a composition costs ~0.3 s: each is done once)."""
    return materialize(compose(list(overrides)), check_recipe=False)


def _lines(before: tuple, after: tuple) -> list[str]:
    return meaning_lines(_materialized(*before), _materialized(*after))


def test_meaning_lines_of_a_batch_a_sync_average_and_a_knob_change():
    """Pins the meaning lines: a batch change states the global batch (world size x batch), a
    sync_average change what is averaged, a knob that the new mode ignores is named; a change
    of neither kind adds no line."""
    pair = ("cluster=cpu_pair",)
    assert _lines(pair, (*pair, "batch_size=64"))[0] == (
        "global batch 2 x 32 = 64 -> 2 x 64 = 128 samples a step; learning rate 0.05 x 2 = 0.1 "
        "-> 0.05 x 2 = 0.1 (lr_factor = 1 + (world_size - 1) x lr_scale_ratio)")
    sync = (*pair, "elche=nccl_sync")
    assert _lines(sync, (*sync, "elche.sync_average=params")) == [
        "averages gradients, exactly, inside backward at every step (torch DDP's trajectory) -> "
        "parameters after every rank's own step (floDl's variant, elche.sync_average=params)"]
    lines = _lines((*pair, "elche=cpu_async"), (*pair, "elche.easgd_alpha=0.5"))
    assert any(line.startswith("now does nothing: elche.easgd_alpha") for line in lines), lines
    assert _lines(pair, (*pair, "num_epochs=3")) == []


@pytest.mark.e2e
def test_a_cluster_change_gives_the_sims_own_estimate(tmp_path):
    """Pins that the estimate under a cluster change (a third, slower rank) is the number
    `python -m flodl_run.sim` prints for the command the line names, and that the same change
    states the new global batch and learning rate."""
    lines = _lines(("cluster=cpu_pair",),
                   ("cluster=cpu", "cluster.num_ranks=3", "cluster.emulate_slowdown=[1.0,2.5,4.0]",
                    "elche.anchor=20"))
    assert lines[0].startswith("global batch 2 x 32 = 64 -> 3 x 32 = 96 samples a step; "
                               "learning rate 0.05 x 2 = 0.1 -> 0.05 x 3 = 0.15")
    estimate = lines[-1]
    said = re.search(r"-> ([\d,.]+) samples/s, ([\d.]+) of ideal, rank shares (\S+);", estimate)
    assert said and said[3].count("/") == 2, estimate
    command = shlex.split(estimate.split("; after: ")[1].strip("`"))
    assert command[:3] == [".venv/bin/python", "-m", "flodl_run.sim"] and "elche.anchor=20" in command
    assert command[1] == "-m"  # run as `python -m flodl_run.sim` runs, forked from the launch server
    proc = run_module(command[2], *command[3:], "sim.table=none", f"hydra.run.dir={tmp_path}",
                      cwd=REPO, timeout=120, env={**os.environ, "FLODL_RUN_CONF": str(REPO / "conf")})
    assert proc.returncode == 0, proc.stderr
    printed = re.search(r"simulated samples/s\s+\S\s+([\d,.]+)", proc.stdout)
    ratio = re.search(r"ratio to ideal\s+\S\s+([\d.]+)", proc.stdout)
    assert printed and ratio, proc.stdout
    assert (printed[1], ratio[1]) == (said[1], said[2])


def test_an_against_diff_says_what_the_change_means(capsys):
    """Pins the meaning lines under `--against` (this side is the change, the other the base):
    a doubled batch on the two-rank rig reads as a global batch of 64 -> 128."""
    status, out = _review(capsys, "cluster=cpu_pair", "batch_size=64", "--against",
                          "cluster=cpu_pair", "--format", "markdown")
    assert status == 0
    assert "**What it changes**" in out
    assert "- global batch 2 x 32 = 64 -> 2 x 64 = 128 samples a step;" in out


def test_a_rig_measured_by_a_run_drives_the_estimate(tmp_path):
    """Pins `--rig-from RUN_DIR`: each rank's ms per batch comes from the run's last epoch
    (batch size x 1000 / samples per s) and the reduce's wall from its avg_sync_ms, and the
    estimate line names where the speeds came from."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps(
        {"epochs": [{"per_rank_throughput": [1.0, 1.0]}, {"per_rank_throughput": [3200.0, 1600.0]}],
         "avg_sync_ms": 2.5}))
    (run_dir / "run.yaml").write_text("batch_size: 32\n")
    rig = rig_from(None, None, run_dir)
    assert rig.rank_ms == (10.0, 20.0) and rig.sync_ms == 2.5
    lines = meaning_lines(_materialized("cluster=cpu_pair"),
                          _materialized("cluster=cpu_pair", "elche=cpu_cadence"), rig)
    assert lines[-1].startswith(f"sim estimate (measured in {run_dir}): "), lines
    assert "sim.rank_ms=[10.0,20.0] sim.batch_size=32 sim.sync_ms=2.5`" in lines[-1]


@pytest.mark.e2e
def test_the_printed_workflow_is_the_documented_one_and_well_formed(capsys):
    """Pins the workflow users copy: `--print-workflow` prints docs/pr-review.md's text, it is a
    pull_request workflow allowed to comment, every step runs something, and its shell steps
    parse (`bash -n`)."""
    status, out = _review(capsys, "--print-workflow")
    assert status == 0 and out == WORKFLOW
    assert WORKFLOW in (REPO / "docs" / "pr-review.md").read_text()
    doc = yaml.safe_load(WORKFLOW)
    trigger = doc.get("on", doc.get(True))  # YAML 1.1 reads the key `on` as true
    assert "conf/**" in trigger["pull_request"]["paths"]
    assert doc["permissions"] == {"contents": "read", "pull-requests": "write"}
    steps = doc["jobs"]["review"]["steps"]
    assert all(("uses" in s) != ("run" in s) for s in steps)
    for step in (s for s in steps if "run" in s):
        proc = subprocess.run(["bash", "-n"], input=step["run"], capture_output=True, text=True)
        assert proc.returncode == 0, (step.get("name"), proc.stderr)
    assert any("--check conf_snapshots" in s.get("run", "") for s in steps)


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("pre_commit") is None,
                    reason="pre-commit is not installed (pip install -e '.[dev]')")
def test_the_hook_fails_a_commit_that_changes_a_preset_without_its_snapshots(project, tmp_path):
    """Pins `.pre-commit-hooks.yaml` through pre-commit itself, on a repository of two commits
    (snapshots, then a preset change without them): the hook must run on the conf/ change, fail,
    and name both experiments."""
    assert main(["--snapshot", "conf_snapshots"]) == 0
    _git(project, "add", "conf_snapshots")
    _git(project, "commit", "-q", "-m", "snapshots")
    _edit(project / "conf" / "data" / "default.yaml", "ram_max_usage: 0.50", "ram_max_usage: 0.40")
    _git(project, "commit", "-q", "-am", "data: less RAM for the cache")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(REPO),
                           "flodl-run-review", "--from-ref", "HEAD~1", "--to-ref", "HEAD"],
                          capture_output=True, text=True, cwd=project, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "flodl_run config review" in out and "Failed" in out
    assert "(2): pair_cadence, pair_exact" in out


def test_the_projects_own_snapshots_are_current(capsys, monkeypatch):
    """Pins the review on this repository itself: conf_snapshots/ holds what each of conf/'s
    experiments resolves to, so a change to a preset or a default that moves one fails here
    until `.venv/bin/python -m flodl_run.review --update conf_snapshots` is run and the
    snapshot diff is committed with it (the diff the PR then shows)."""
    monkeypatch.chdir(REPO)
    status, out = _review(capsys, "--check", "conf_snapshots")
    assert status == 0, out
