"""Two "hosts" on one machine: a real OpenSSH sshd on 127.0.0.2 and 127.0.0.3 with a generated
host key and user key, the launcher fanning ranks out over the system `ssh` client.

Skips (with the reason) only where sshd cannot run here: not installed, the loopback aliases
cannot be bound, or it refuses our key.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

import pytest

from flodl_run.config.schema import ClusterConfig, SshConfig, Topology, WorkerConfig
from flodl_run.hardware.hostinfo import metric_safe
from flodl_run.launch.probe import probe
from tests.support import HOSTS, free_common_port, run_cli, start_cli

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
SECRET_LIKE = re.compile(r"\b[0-9a-f]{64}\b")  # the run secret's hex form


def _workers(ssh: SshConfig, devices=(["cpu", "cpu"], ["cpu"])) -> List[WorkerConfig]:
    return [WorkerConfig(host=h, local_devices=list(d), nccl_socket_ifname="lo", path=str(REPO),
                         python=sys.executable, ssh=ssh) for h, d in zip(HOSTS, devices)]


def _conf_dir(tmp_path: Path, ssh: SshConfig, devices=(["cpu", "cpu"], ["cpu"])) -> Path:
    """A user conf dir with `cluster/loopback_hosts.yaml`, as docs/multi-host.md tells users."""
    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    workers = [{"host": w.host, "local_devices": w.local_devices, "nccl_socket_ifname": "lo",
                "path": w.path, "python": w.python,
                "ssh": {"user": ssh.user, "port": ssh.port, "identity_file": ssh.identity_file,
                        "options": list(ssh.options)}} for w in _workers(ssh, devices)]
    body = {"defaults": ["base_cluster", "_self_"], "topology": "hosts",
            "controller": {"host": "127.0.0.1", "port": 0, "path": str(REPO)}, "workers": workers}
    (conf / "cluster" / "loopback_hosts.yaml").write_text(json.dumps(body))  # JSON is YAML
    return conf


def _command(tmp_path: Path, ssh: SshConfig, run_dir: Path, *overrides: str,
             tracking: str = "tracking=off", devices=(["cpu", "cpu"], ["cpu"])) -> List[str]:
    # One intra-op thread a rank: both "hosts" are this machine, and each would otherwise size
    # its ranks' thread pools from all of its cores (2 threads for a host's only rank), so
    # the ranks oversubscribed the cores they share, their OpenMP threads spinning for each other.
    return [tracking, f"hydra.run.dir={run_dir}",
            f"hydra.searchpath=[file://{_conf_dir(tmp_path, ssh, devices)}]", "cluster=loopback_hosts",
            "cluster.threads_per_rank=1", *overrides]


def _processes(marker: str) -> List[int]:
    """Live processes of one run on the "remote" side: the ssh entry and its rank child."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker in cmdline and ") Z " not in stat:
            found.append(int(entry.name))
    return found


def _rank_child(rank: int, run_name: str) -> int:
    """PID of the rank process under `python -m flodl_run.launch.ssh --rank <rank> --run <run_name>`."""
    entries = [p for p in _processes(f"flodl_run.launch.ssh --rank {rank} --run {run_name}")
               if b"ssh\0-T" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in entries:
                return int(entry.name)
    raise AssertionError(f"no rank {rank} process of run {run_name}")


def _await_gone(marker: str, within_s: float = 10.0) -> List[int]:
    deadline = time.monotonic() + within_s
    while _processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _processes(marker)


def test_probe_reports_both_hosts(sshd, tmp_path):
    """Pins `python -m flodl_run.launch.probe cluster=...` over real ssh: one ready row per host with
    Python/flodl_run/torch versions, exit 0; an unreachable host makes the verdict not ready."""
    conf = _conf_dir(tmp_path, sshd)
    done = subprocess.run([sys.executable, "-m", "flodl_run.launch.probe",
                           f"hydra.searchpath=[file://{conf}]", "cluster=loopback_hosts"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for host in HOSTS:
        row = next(line for line in done.stdout.splitlines() if host in line)
        assert "ssh" in row and "0.1.0" in row and "yes" in row
    assert "2 hosts: ready" in done.stdout
    bad = _workers(SshConfig(**{**vars(sshd), "port": free_common_port(HOSTS)}))[:1]
    reports, problems, _ = probe(ClusterConfig(topology=Topology.hosts, workers=bad))
    assert not reports[0].reachable and "ssh failed" in problems[0][0]


def test_two_host_run_completes(sshd, tmp_path, mlflow_db):
    """Pins the fan-out end to end: a CPU rank on each of two sshd "hosts" trains to completion
    in a coordinator-averaged mode (the collective one across both hosts, and two ranks on one
    host, are the host-loss test's run, below), per-rank logs in <run dir>/ranks, output
    prefixed by host and rank, the shared-storage note once, no secret in any output, and
    system figures per node: each worker host under its configured name in summary.json
    and in MLflow (besides the launcher's own node). One rank a host: each is a fresh
    interpreter (~4 CPU-s of imports)."""
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    db = mlflow_db
    done = run_cli(*_command(tmp_path, sshd, run_dir, "elche=cpu_cadence", "num_epochs=1",
                             tracking=f"tracking.uri=sqlite:///{db}", devices=(["cpu"], ["cpu"])))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["syncs"] > 0
    assert "ddp: 2 ranks on 2 hosts | 127.0.0.2: cpu | 127.0.0.3: cpu" in output
    assert output.count("must be on storage every host sees") == 1
    logs = sorted(p.name for p in (run_dir / "ranks").iterdir())
    assert logs == ["rank0.log", "rank1.log"]
    texts = [output] + [(run_dir / "ranks" / name).read_text() for name in logs]
    assert not any(SECRET_LIKE.search(t) for t in texts)
    assert not _await_gone(f"--run {run_dir.name}")
    assert [n["host"] for n in summary["nodes"]] == list(HOSTS)
    assert all(n["cpu_count"] == os.cpu_count() and n["ram_bytes"] > 0 and n["gpus"] == []
               for n in summary["nodes"])
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    for host in [socket.gethostname(), *HOSTS]:
        assert metrics[f"system/{metric_safe(host)}/cpu_count"] == os.cpu_count(), host


def test_losing_rank_0s_host_is_survived_with_a_clear_message_and_no_remote_process(sshd, tmp_path,
                                                                                   mlflow_db):
    """Pins host loss in a collective mode, for the host that holds rank 0 (its only rank
    SIGKILLed mid-run): the rendezvous store lives with the launcher, so the two ranks on the
    other host rebuild their group and carry on to the end; the log names the lost host, nothing
    of the run is left on either host, and the secret never shows in a process listing. The
    surviving host's utilisation over time reaches MLflow under its node id, sampled by its
    lowest rank (an SSH host has no MLflow run of its own); summary.json lists each host once,
    the one with two ranks too."""
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    # heartbeat_timeout_secs=10 sets the survivors' group timeout (twice that) to 20 s instead of
    # 60, the backstop should a survivor again wait in a collective on a peer that failed the
    # round but kept its Gloo group open (4 runs of 8 did, before such a peer destroyed it).
    # Rank 0 dies once epoch 1 is reported, and the run must not have ended by then (on a loaded
    # machine the loss was noticed 0.8-0.9 s after epoch 1's line), and the surviving host must
    # then send two samples, a heartbeat (one a second) each. Training alone does not last for
    # that: on a quiet machine 30 epochs took about 2 s and logged one sample. So the callback
    # rank's epoch_fn sleeps 0.3 s an epoch (tests/stopping_recipe.py): 12 epochs last at least
    # 3.6 s, in wall time and not in CPU. The interval of 0.5 s still puts a sample of the
    # surviving host on every heartbeat while the launcher's own MLflow monitor samples and logs
    # its node 2.5 times less often than at 0.2 s.
    db = mlflow_db
    launcher = start_cli(*_command(tmp_path, sshd, run_dir, "elche=nccl_cadence", "num_epochs=12",
                                   "recipe=custom", "recipe.module=tests.stopping_recipe",
                                   "+recipe.params.pause_s=0.3",
                                   "heartbeat_timeout_secs=10", "tracking.system_metrics_interval_s=0.5",
                                   devices=(["cpu"], ["cpu", "cpu"]), tracking=f"tracking.uri=sqlite:///{db}"),
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = []
    for line in launcher.stdout:  # wait for training to be under way, then lose 127.0.0.2
        seen.append(line)
        if line.startswith("epoch 1/"):
            break
    ranks = [_rank_child(r, run_dir.name) for r in range(3)]
    listing = [Path(f"/proc/{p}/cmdline").read_bytes() for p in _processes(run_dir.name) + ranks]
    assert not any(SECRET_LIKE.search(c.decode(errors="replace")) for c in listing)
    os.kill(ranks[0], signal.SIGKILL)
    seen += launcher.stdout.readlines()
    assert launcher.wait(timeout=60) == 0, "".join(seen)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["dead_ranks"] == [0]
    assert summary["epochs"][-1]["per_rank_batch_share"][0] == 0.0
    assert "host 127.0.0.2 lost: rank 0 gone (killed by SIGKILL)" in "".join(seen)
    assert [n["host"] for n in summary["nodes"]] == list(HOSTS)
    assert not _await_gone(f"--run {run_dir.name}")
    assert not [p for p in ranks if Path(f"/proc/{p}").exists()]
    import mlflow

    # the surviving host's utilisation over time: its lowest rank samples it, steps 0, 1, ...
    history = mlflow.MlflowClient(f"sqlite:///{db}").get_metric_history(
        summary["mlflow_run_id"], f"system/{metric_safe(HOSTS[1])}/cpu_utilization_percentage")
    assert len(history) >= 2 and all(0.0 <= m.value <= 100.0 for m in history), history
    assert sorted(m.step for m in history) == list(range(len(history)))
