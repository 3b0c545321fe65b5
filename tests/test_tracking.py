"""MLflow from the launcher: a real local SQLite store, queried back with MlflowClient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_local_store_gets_params_metrics_artifacts_and_status(tmp_path):
    """Pins the default tracking path: one FINISHED run with the key params, per-epoch metrics
    with steps, run.yaml and summary.json as artifacts, and its id in summary.json."""
    import mlflow

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flodl_run", f"hydra.run.dir={run_dir}", f"tracking.uri=sqlite:///{db}",
         "num_epochs=3", "cluster=solo", "run_name=tracked"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["elche.mode"] == "nccl_cadence"
    assert run.data.tags["mode"] == "nccl_cadence"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2]
    assert history[-1].value == summary["epochs"][-1]["avg_loss"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"run.yaml", "summary.json"} <= artifacts
    assert (tmp_path / "store" / "mlartifacts").is_dir()  # the artifact store sits beside the db
