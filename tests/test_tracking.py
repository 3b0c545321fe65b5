"""MLflow from the launcher: a real local SQLite store, queried back with MlflowClient.

One distributed job (2 CPU ranks, a user recipe in its own git repo, record log, dashboard and
sub-epoch reports on) is shared by the module; FAILED and KILLED runs go through the launcher
in-process, which is the same code path without paying for another interpreter start.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import _run

REPO = Path(__file__).resolve().parents[1]

RECIPE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

import flodl_run

RAISE_AT_STEP = {raise_at}  # None: train normally
_steps = [0]


def train_dataset(**_):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def eval_dataset(**_):
    return train_dataset()


def build_model(device, **_):
    return nn.Linear(8, 2).to(device)


def build_optimizer(parameters, **_):
    return torch.optim.SGD(parameters, lr=0.1)


def train_step(model, batch):
    _steps[0] += 1
    if RAISE_AT_STEP is not None and _steps[0] == RAISE_AT_STEP:
        raise {error}("recipe broke at step 40")
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    flodl_run.record_scalar("batch_max_abs", float(x.abs().max()))
    return loss


def eval_step(model, batch):
    x, y = batch
    return (model(x).argmax(1) == y).sum().item(), len(y)
"""


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory):
    """A 2-rank cpu_pair job, 3 epochs, tracked into a fresh local store."""
    root = tmp_path_factory.mktemp("tracked")
    recipe_repo = root / "recipe_repo"
    recipe_repo.mkdir()
    (recipe_repo / "tracked_recipe.py").write_text(RECIPE.format(raise_at=None, error="RuntimeError"))
    _git(recipe_repo, "init", "-q")
    _git(recipe_repo, "add", "tracked_recipe.py")
    _git(recipe_repo, "commit", "-q", "-m", "recipe")
    db = root / "store" / "mlflow.db"
    db.parent.mkdir()
    run_dir = root / "run"
    proc, _ = _run(root, f"tracking.uri=sqlite:///{db}", "cluster=cpu_pair", "num_epochs=3",
                   "run_name=tracked", "recipe=custom", "recipe.module=tracked_recipe",
                   "reports_per_epoch=2", "record_log_dir=records", "dashboard_html=dashboard.html",
                   "+scalar_reductions.batch_max_abs=max", "tracking.system_metrics_interval_s=0.2",
                   tracking="mlflow",
                   env=dict(os.environ, PYTHONPATH=str(recipe_repo)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    return {"client": client, "run": client.get_run(summary["mlflow_run_id"]), "summary": summary,
            "run_dir": run_dir, "db": db, "commit": _git(recipe_repo, "rev-parse", "HEAD"),
            "stdout": proc.stdout}


def _history(pair_run, key):
    return pair_run["client"].get_metric_history(pair_run["run"].info.run_id, key)


@pytest.mark.e2e
def test_local_store_gets_params_metrics_artifacts_and_status(pair_run):
    """Pins the default tracking path: one FINISHED run with the key params, per-epoch metrics
    with epoch steps, run.yaml, summary.json, events.jsonl and the dashboard as artifacts, its id
    in summary.json, and the artifact store beside the database."""
    run, client, summary = pair_run["run"], pair_run["client"], pair_run["summary"]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["elche.mode"] == "nccl_cadence"
    assert run.data.tags["mode"] == "nccl_cadence" and run.data.tags["world_size"] == "2"
    history = _history(pair_run, "loss")
    assert [m.step for m in history] == [0, 1, 2]
    assert history[-1].value == summary["epochs"][-1]["avg_loss"]
    assert [m.step for m in _history(pair_run, "throughput/rank1")] == [0, 1, 2]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"run.yaml", "summary.json", "events.jsonl", "dashboard.html"} <= artifacts
    assert (pair_run["db"].parent / "mlartifacts").is_dir()


@pytest.mark.e2e
def test_per_reduce_metrics_follow_every_reduce(pair_run):
    """Pins the batched per-reduce metrics: one point per reduce (step = round) for anchor,
    sync_ms, divergence, phase (as a number), each rank's batch count and the divergence's
    breakdown per rank (cosine in [-1, 1], magnitude > 0); the anchor series is summary.json's
    anchor trajectory (nothing lost in the buffer)."""
    summary = pair_run["summary"]
    anchor = _history(pair_run, "reduce/anchor")
    assert summary["syncs"] >= 3
    assert [m.step for m in anchor] == list(range(1, summary["syncs"] + 1))
    assert [m.value for m in anchor] == summary["anchor_trajectory"]
    for key in ("reduce/sync_ms", "reduce/divergence", "reduce/overhead", "reduce/batches/rank0",
                "reduce/batches/rank1", "reduce/cosine/rank0", "reduce/magnitude/rank1"):
        assert len(_history(pair_run, key)) == summary["syncs"], key
    assert all(-1.0 <= m.value <= 1.0 for m in _history(pair_run, "reduce/cosine/rank1"))
    assert all(m.value > 0 for m in _history(pair_run, "reduce/magnitude/rank0"))
    assert {m.value for m in _history(pair_run, "reduce/phase")} <= {0.0, 1.0, 2.0, 3.0}


@pytest.mark.e2e
def test_user_scalars_and_sub_epoch_reports(pair_run):
    """Pins user scalars per epoch (rolled up by scalar_reductions) and reports_per_epoch
    logged at the global step of the reduce they fired at."""
    scalar = _history(pair_run, "batch_max_abs")
    assert [m.step for m in scalar] == [0, 1, 2]
    assert [m.value for m in scalar] == [e["scalars"]["batch_max_abs"] for e in pair_run["summary"]["epochs"]]
    reports = _history(pair_run, "report/loss")
    steps = [m.step for m in reports]
    assert len(reports) >= 3 and steps == sorted(steps) and steps[-1] == 32 * 3  # 1024/32 per epoch


@pytest.mark.e2e
def test_git_commit_comes_from_the_recipe_repo_not_the_cwd(pair_run):
    """Pins 'git commit of the recipe's repo': the job ran from the flodl_run checkout, the
    recipe lives in another repo, and the tag names the recipe repo's HEAD."""
    tags = pair_run["run"].data.tags
    assert tags["git_commit"] == pair_run["commit"]
    assert tags["mlflow.source.git.commit"] == pair_run["commit"]
    assert tags["git_dirty"] == "false"


@pytest.mark.e2e
def test_system_metrics_once_for_the_launcher_node(pair_run):
    """Pins system figures once per node: one point of CPU count and RAM for this host, though
    the launcher and both ranks (which report their node on joining) run on it."""
    import socket

    from flodl_run.hardware.hostinfo import metric_safe

    host = metric_safe(socket.gethostname())
    cpus = _history(pair_run, f"system/{host}/cpu_count")
    assert [(m.step, m.value) for m in cpus] == [(0, float(os.cpu_count()))]
    assert len(_history(pair_run, f"system/{host}/ram_gib")) == 1
    nodes = pair_run["summary"]["nodes"]
    assert [(n["host"], n["cpu_count"], n["gpus"]) for n in nodes] == [
        (socket.gethostname(), os.cpu_count(), [])]


@pytest.mark.e2e
def test_the_launcher_host_is_sampled_over_time_by_mlflows_monitor(pair_run):
    """Pins utilisation over time: MLflow's system-metrics monitor samples this host into the
    run under the same node id as its once-per-node figures (`system/<host>/...`), CPU
    utilisation as a percentage and memory in use, at more than one step."""
    import socket

    from flodl_run.hardware.hostinfo import metric_safe

    host = metric_safe(socket.gethostname())
    cpu = _history(pair_run, f"system/{host}/cpu_utilization_percentage")
    assert len(cpu) >= 2 and all(0.0 <= m.value <= 100.0 for m in cpu)
    assert sorted(m.step for m in cpu) == list(range(len(cpu)))
    assert _history(pair_run, f"system/{host}/system_memory_usage_megabytes")


@pytest.mark.e2e
def test_each_rank_reports_its_device_busy_over_time(tmp_path, mlflow_db):
    """Pins per-rank utilisation over time: every rank's heartbeats (one a second) carry its
    device's busy percent (CPU here: its CPU time per thread), logged as `utilization/rank<k>`
    at steps 0, 1, ... and plotted in the dashboard beside the shares."""
    proc, summary = _run(tmp_path, f"tracking.uri=sqlite:///{mlflow_db}", "cluster=cpu_pair",
                         "num_epochs=80", "dashboard_html=dashboard.html", tracking="mlflow")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    client, run, _ = _run_of(mlflow_db, tmp_path / "run")
    busy = [client.get_metric_history(run.info.run_id, f"utilization/rank{k}") for k in (0, 1)]
    for history in busy:
        assert history and all(0.0 <= m.value <= 100.0 for m in history)
        assert sorted(m.step for m in history) == list(range(len(history)))
    html = (tmp_path / "run" / "dashboard.html").read_text()
    assert 'aria-label="device busy (%)"' in html and 'aria-label="rank 1 device busy (%)"' in html


@pytest.mark.e2e
def test_events_artifact_holds_elche_events(pair_run):
    """Pins events.jsonl: ElChe's events (phase changes at least) as JSON lines."""
    client, run_id = pair_run["client"], pair_run["run"].info.run_id
    path = client.download_artifacts(run_id, "events.jsonl")
    events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert any(e["kind"] == "phase" for e in events)
    assert all({"time", "kind", "message"} <= set(e) for e in events)


@pytest.mark.e2e
def test_record_log_and_dashboard_are_written_by_a_distributed_run(pair_run):
    """Pins the launcher wiring: record_log_dir and dashboard_html are relative to the run dir
    and filled from the coordinator's hooks (reduces in root.log, per-rank files)."""
    records = pair_run["run_dir"] / "records"
    kinds = [json.loads(line)["kind"] for line in (records / "root.log").read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("reduce") == pair_run["summary"]["syncs"] and kinds.count("epoch") == 3
    assert len(list((records / "root").glob("*/rank1.log"))) == 1
    html = (pair_run["run_dir"] / "dashboard.html").read_text()
    assert "anchor (batches)" in html and "<polyline" in html


# ---- in-process launcher: FAILED and KILLED --------------------------------------------------


def _launch_in_process(tmp_path: Path, monkeypatch, db: Path, module: str, error: str):
    from rich.console import Console

    from flodl_run.config.compose import experiment_to_yaml
    from flodl_run.config.materialize import materialize
    from flodl_run.config.schema import ClusterConfig, ExperimentConfig, RecipeConfig, Topology
    from flodl_run.launch.launcher import launch

    (tmp_path / f"{module}.py").write_text(RECIPE.format(raise_at=40, error=error))
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = ExperimentConfig(recipe=RecipeConfig(module=module), num_epochs=3,
                              cluster=ClusterConfig(topology=Topology.solo), device="cpu")
    config = materialize(config, run_dir=str(run_dir), outputs_dir=str(db.parent)).config
    assert config.tracking.uri == f"sqlite:///{db}"  # the default local store, under outputs_dir
    (run_dir / "run.yaml").write_text(experiment_to_yaml(config))
    console = Console(file=io.StringIO())
    return launch, config, run_dir, console, db


def _run_of(db: Path, run_dir: Path):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return client, client.get_run(summary["mlflow_run_id"]), summary


def test_recipe_raising_in_train_step_ends_the_run_failed(tmp_path, monkeypatch, mlflow_db):
    """Pins FAILED: an exception from train_step (in-process run) still closes the MLflow run
    as FAILED with the error as the last event, writes summary.json, and is reported as a rank
    reports it (the `failed:` line, then the recipe's frames), not raised to Hydra."""
    launch, config, run_dir, console, db = _launch_in_process(
        tmp_path, monkeypatch, mlflow_db, "failing_recipe", "RuntimeError")
    assert launch(config, run_dir, console) == "failed"
    shown = console.file.getvalue()
    assert "failed: RuntimeError: recipe broke at step 40\nTraceback" in shown and "wrote: " in shown
    client, run, summary = _run_of(db, run_dir)
    assert summary["status"] == "failed" and run.info.status == "FAILED"
    # marked a training experiment: MLflow 3's UI then opens it on its runs, not a GenAI overview
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    assert run.data.tags["last_event"].startswith("failed: RuntimeError: recipe broke")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0]


def test_interrupt_in_train_step_ends_the_run_killed(tmp_path, monkeypatch, mlflow_db):
    """Pins KILLED: Ctrl-C (KeyboardInterrupt in the training loop) marks the MLflow run KILLED
    and summary.json interrupted."""
    launch, config, run_dir, console, db = _launch_in_process(
        tmp_path, monkeypatch, mlflow_db, "interrupted_recipe", "KeyboardInterrupt")
    assert launch(config, run_dir, console) == "interrupted"
    _, run, summary = _run_of(db, run_dir)
    assert summary["status"] == "interrupted" and run.info.status == "KILLED"
