"""`tracking=mlflow_server` against a real `mlflow server` on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import run_cli

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def mlflow_server(tmp_path, mlflow_db):
    """A real tracking server (SQLite backend, local artifact root); its whole process group is
    killed afterwards. The server's job runner (not needed to log runs) is switched off."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [str(mlflow_cli), "server", "--backend-store-uri", f"sqlite:///{mlflow_db}",
         "--default-artifact-root", str(tmp_path / "art"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=log,
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        start_new_session=True)  # its own process group: uvicorn workers go with it
    log.close()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):  # poll the server's own readiness endpoint
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_job_logs_to_a_real_tracking_server(mlflow_server, tmp_path):
    """Pins `tracking=mlflow_server tracking.uri=http://...`: params, per-epoch metrics with
    steps, run.yaml and summary.json as artifacts and FINISHED, read back over HTTP."""
    import mlflow

    run_dir = tmp_path / "run"
    # one intra-op thread: the solo run trains in the launcher, beside the server's process
    proc = run_cli(f"hydra.run.dir={run_dir}", "tracking=mlflow_server", f"tracking.uri={mlflow_server}",
                   "cluster=solo", "cluster.threads_per_rank=1", "num_epochs=2", "run_name=served")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    client = mlflow.MlflowClient(mlflow_server)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "served"
    assert run.data.params["tracking.kind"] == "mlflow_server"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1]
    assert {"run.yaml", "summary.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
