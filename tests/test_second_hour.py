"""A newcomer's second hour (issue 28), run the way they run it: the CLI as a user types it, its
exit code, its output and what it wrote. Most of these paths end before any rank starts, so each
costs a fork of the launch server and a compose, not a training run.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from flodl_run.config.compose import register_schemas
from flodl_run.config.overrides import check
from tests.support import LOCKSTEP, run_cli

REPO = Path(__file__).resolve().parents[1]
EXIT_CONFIG = 2


@pytest.mark.e2e
def test_values_hydra_refuses_are_reported_in_our_words(tmp_path):
    """Pins: `num_epochs=ten`, a mistyped group option (its list showing the schema node
    `base_elche`), `recipe.params.x=...` without `+` and a run dir under a file coming straight
    from Hydra (its own text, a traceback for the file) instead of `key: rule, got value`."""
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = run_cli("num_epochs=ten", "elche=nccl_cadenc", "recipe=digits_cnn",
                   "recipe.params.hidden=32", f"hydra.run.dir={afile}/run", cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    err = proc.stderr
    assert "invalid config (4 problems)" in err
    assert "num_epochs: must be an integer, got 'ten'" in err
    assert "elche: must be one of cpu_async, cpu_cadence, cpu_sync, nccl_cadence, nccl_sync " \
           "(did you mean nccl_cadence?), got 'nccl_cadenc'" in err
    assert "recipe.params.hidden: is not a param of recipe digits_cnn" in err
    assert "+recipe.params.hidden=32 adds one" in err
    assert f"hydra.run.dir: must be a folder path ({afile} is a file)" in err
    assert "base_elche" not in err and "Traceback" not in err and "HYDRA_FULL_ERROR" not in err
    assert not (tmp_path / "outputs").exists()


def test_option_checks_leave_other_search_paths_and_known_params_alone():
    """Pins: the option check refusing a cluster YAML of the user's own search path
    (docs/multi-host.md's `hydra.searchpath=[...] cluster=my_hosts`), a recipe's own param set
    without `+`, an interpolated value, or a sweep's good values."""
    register_schemas()
    conf = REPO / "conf"
    assert check(["hydra.searchpath=[file:///x.invalid]", "cluster=my_hosts"], conf, "config") == []
    assert check(["cluster=my_hosts"], conf, "config", extra_search_path=True) == []
    assert check(["recipe.params.hidden=8", "num_epochs=${oc.env:N}", "seed=1,2",
                  "elche=nccl_sync,cpu_sync"], conf, "config") == []
    [problem] = check(["seed=1,x"], conf, "config")
    assert str(problem) == "seed: must be an integer, got 'x'"


def test_python_configs_take_the_yamls_strings_for_every_enum_field():
    """Pins: `ClusterConfig(topology="cpu")` failing in validate with `'str' object has no
    attribute 'value'` (issue 28 #14), a string of a nested or dict enum field left a string,
    or a misspelt one passing without naming its dotted key."""
    from flodl_run.config.materialize import ConfigError, materialize
    from flodl_run.config.schema import (ClusterConfig, ElCheConfig, ExperimentConfig, GuardKind,
                                         Mode, OuterConfig, OuterKind, Reduction, Theme, Topology,
                                         TrackingConfig, TrackingKind)

    config = ExperimentConfig(
        cluster=ClusterConfig(topology="cpu", num_ranks=2),
        elche=ElCheConfig(mode="cpu_async", convergence_guard="rate"), outer=OuterConfig(kind="slowmo"),
        tracking=TrackingConfig(kind="off"), scalar_reductions={"acc": "max"}, dashboard_theme="dark")
    typed = materialize(config, check_recipe=False).config
    assert (typed.cluster.topology, typed.elche.mode, typed.elche.convergence_guard) == (
        Topology.cpu, Mode.cpu_async, GuardKind.rate)
    assert (typed.outer.kind, typed.tracking.kind, typed.dashboard_theme) == (
        OuterKind.slowmo, TrackingKind.off, Theme.dark)
    assert typed.scalar_reductions["acc"] is Reduction.max
    with pytest.raises(ConfigError) as caught:
        materialize(ExperimentConfig(cluster=ClusterConfig(topology="cpuu")), check_recipe=False)
    assert "cluster.topology: must be one of auto, solo, cpu, local_gpus, hosts, slurm, got 'cpuu'" \
        in str(caught.value)


@pytest.mark.e2e
def test_a_recipe_error_in_process_reads_as_on_ranks(tmp_path):
    """Pins: a raising `train_step` in an in-process run (`cluster=solo`, the default on one
    device) printing Hydra's `Error executing job`, our own frames and the HYDRA_FULL_ERROR hint,
    with no `failed:` or `wrote:` line, where the distributed path prints the recipe's frames
    once and exits 1."""
    (tmp_path / "bad_step.py").write_text(
        "from recipes.digits_mlp import build_model, build_optimizer, train_dataset  # noqa: F401\n"
        "def train_step(model, batch):\n"
        "    raise ValueError('boom in my step')\n")
    proc = run_cli("recipe=custom", "recipe.module=bad_step", "cluster=solo", "num_epochs=1",
                   "tracking=off", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "failed: ValueError: boom in my step\nTraceback (most recent call last):\n" in out
    assert "bad_step.py\", line 3, in train_step" in out and out.count("boom in my step") == 3
    assert "flodl_run/" not in out.split("Traceback")[1].split("wrote:")[0]  # the recipe's frames only
    assert "Error executing job" not in out and "HYDRA_FULL_ERROR" not in out
    assert "wrote: " in proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.e2e
def test_a_bundle_of_another_model_or_no_epochs_left_and_an_unwritable_save_path_exit_2(
        tmp_path, lockstep_run):
    """Pins (issue 28 #6, #7, #9): resuming another recipe's bundle or other parameter shapes
    failing in every rank's load_state_dict after the ranks started; `num_epochs` at or below
    the bundle's epoch exiting 0 after training nothing; `save_path` under a regular file found
    only after training, with no bundle."""
    stem = Path(lockstep_run["run_dir"]) / "checkpoint"  # digits_mlp, 2 ranks, 1 epoch
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = run_cli(*LOCKSTEP, "tracking=off", f"resume_from={stem}", "recipe=digits_cnn",
                   "num_epochs=1", f"save_path={afile}/ckpt", f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    err = proc.stderr
    assert f"save_path: must lie in a folder ({afile} is a file)" in err
    assert "recipe.module: must be the bundle's recipe recipes.digits_mlp" in err
    assert "num_epochs: must be above the 1 epoch the bundle holds: num_epochs counts from the " \
           "start, so num_epochs=6 trains 5 more, got 1" in err
    proc = run_cli(*LOCKSTEP, "tracking=off", f"resume_from={stem}", "recipe.params.hidden=32",
                   "num_epochs=2", f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert "resume_from: must hold this run's model (0.weight is [128, 64] in the bundle, [32, 64] " \
           "here" in proc.stderr
    assert "recipe.params.hidden 128 -> 32" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.e2e
def test_an_unreachable_tracking_server_exits_2_at_once(tmp_path):
    """Pins (issue 28 #4): `tracking=mlflow_server` with no server spending minutes in MLflow's
    retries, then a long traceback, exit 1 and a run dir left behind."""
    with socket.socket() as s:  # a loopback port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("tracking=mlflow_server", f"tracking.uri=http://127.0.0.1:{port}", "num_epochs=1",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert f"tracking.uri: must reach an MLflow tracking server (127.0.0.1:{port}: " in proc.stderr
    assert f"mlflow server --host 127.0.0.1 --port {port}" in proc.stderr
    assert "tracking=off" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()
