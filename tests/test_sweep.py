"""Hydra multirun sweeps: one MLflow parent run, each job a child, the comparison at the end."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from flodl_run.report.compare import JobOutcome, rows, to_csv
from flodl_run.report.sweep import _parent_status
from tests.support import run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_two_job_sweep_gives_one_parent_two_children_and_the_comparison(tmp_path, mlflow_db):
    """Pins `python -m flodl_run -m a,b`: exactly one parent run holding comparison.md/.csv/.png,
    two FINISHED children tagged with its id, and the same files in the multirun directory."""
    import mlflow

    db, sweep_dir = mlflow_db, tmp_path / "multirun"
    proc = run_cli("-m", "elche=nccl_sync,nccl_cadence", "cluster=solo", "num_epochs=2",
                   f"tracking.uri=sqlite:///{db}", f"hydra.sweep.dir={sweep_dir}", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert parent.info.status == "FINISHED" and {c.info.status for c in children} == {"FINISHED"}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.md", "comparison.csv", "comparison.png"} <= artifacts
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [r["overrides"] for r in table] == ["elche=nccl_sync", "elche=nccl_cadence"]
    assert {r["mlflow_run_id"] for r in table} == {c.info.run_id for c in children}
    assert all(float(r["final_loss"]) > 0 and float(r["samples_per_s"]) > 0 for r in table)
    assert (sweep_dir / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert "| elche=nccl_sync |" in (sweep_dir / "comparison.md").read_text()
    # the sweep names what it wrote, and each run says it trained in-process
    assert proc.stdout.count(f"sweep: wrote {sweep_dir}/: comparison.md, comparison.csv, comparison.png"
                             f" | mlflow parent run {parent.info.run_id} in sqlite:///{db}") == 1
    assert sorted(c.info.run_name for c in children) == ["solo-digits_mlp", "solo-digits_mlp"]


def _job(tmp_path: Path, num: int, overrides, summary) -> JobOutcome:
    run_dir = tmp_path / str(num)
    run_dir.mkdir()
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return JobOutcome.read(num, overrides, run_dir)


def _summary(losses, epoch_ms=1000.0, status="completed"):
    return {"status": status, "epochs": [{"avg_loss": x, "eval": None, "epoch_ms": epoch_ms}
                                         for x in losses],
            "final_eval": 0.9, "wall_s": 5.0, "samples_per_s": 100.0, "mlflow_run_id": None}


def test_comparison_compares_at_the_last_common_epoch_and_survives_a_crashed_job(tmp_path):
    """Pins the table's figures: loss at the last epoch every job finished, loss drop per
    training second, only the differing overrides, and a job without summary.json shown as
    failed (which makes the parent FAILED) rather than breaking the table."""
    jobs = [_job(tmp_path, 0, ["elche=a", "seed=1"], _summary([2.0, 1.0, 0.5])),
            _job(tmp_path, 1, ["elche=b", "seed=1"], _summary([2.0, 1.5], epoch_ms=500.0)),
            _job(tmp_path, 2, ["elche=c", "seed=1"], None)]
    table = rows(jobs)
    assert [r["overrides"] for r in table] == ["elche=a", "elche=b", "elche=c"]
    assert [r["loss_at_epoch_n"] for r in table] == [1.0, 1.5, None]
    assert table[0]["loss_drop_per_s"] == (2.0 - 0.5) / 3.0
    assert table[1]["loss_drop_per_s"] == (2.0 - 1.5) / 1.0
    assert table[2]["status"] == "failed" and table[2]["final_loss"] is None
    assert to_csv(jobs).splitlines()[3].startswith("2,elche=c,failed,")
    assert _parent_status([j.status for j in jobs]) == "FAILED"
    assert _parent_status(["completed", "interrupted"]) == "KILLED"
    assert _parent_status(["completed", "completed"]) == "FINISHED"
