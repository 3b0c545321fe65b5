"""Workers whose ranks run in a compose service (`cluster.workers[i].docker`).

No Docker engine runs here, so: the command lines are checked as text, the service check is
run by a real POSIX shell against a stand-in `docker` on PATH, and the probe's error path runs
for real (sshd on loopback, the installed docker client failing without an engine).
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from rich.console import Console

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ControllerConfig, Mode, WorkerConfig
from flodl_run.config.validate import validate
from flodl_run.launch import hosts
from flodl_run.launch.dockerhost import NOT_UP_EXIT, docker_command, docker_reason
from flodl_run.launch.hosts import rank_command, rank_environment, start_hosts
from flodl_run.launch.probe import inventory, probe
from flodl_run.launch.ssh import decode_handshake
from tests.support import GPUS, HOSTS, config, facts, fake_ask, plan_layout

SECRET = bytes(range(32))


def _mixed(**worker) -> Any:
    """Controller bare metal on gpu-a.test with one GPU rank; gpu-b.test runs one in docker."""
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices=[0], nccl_socket_ifname="eth0"),
                 WorkerConfig(host="gpu-b.test", local_devices=[1], nccl_socket_ifname="eth0",
                              path="/srv/deploy", docker="trainer", **worker),
                 controller=ControllerConfig(host="gpu-a.test"), master_port=29511)
    layout = plan_layout(cfg, ask=fake_ask({"gpu-a.test": facts(GPUS), "gpu-b.test": facts(GPUS)}))
    return cfg, layout


def _exec_words(command: str) -> List[str]:
    """The words after the remote command's final `exec`."""
    return shlex.split(command.rsplit("&& exec ", 1)[1])


def test_docker_rank_command_execs_the_ssh_entry_in_the_service_with_the_torchrun_env():
    """Pins the docker command line: in the worker's path (the compose project), the service
    check, then `docker compose exec -T` with the torchrun variables and the GPU pin as -e,
    the service, the worker's python and the same remote entry as bare metal."""
    cfg, layout = _mixed(python="/opt/venv/bin/python")
    slots = layout.workers[1]
    env = rank_environment(cfg.cluster, layout, slots, 0, "tcp://gpu-a.test:29400")
    command = rank_command(slots, env, 1, "run-x")
    assert command.startswith("cd /srv/deploy && { up=$(docker compose ps --status running")
    assert _exec_words(command) == [
        "docker", "compose", "exec", "-T", "-e", "RANK=1", "-e", "LOCAL_RANK=0",
        "-e", "WORLD_SIZE=2", "-e", "LOCAL_WORLD_SIZE=1", "-e", "MASTER_ADDR=gpu-a.test",
        "-e", "MASTER_PORT=29511", "-e", "CUDA_VISIBLE_DEVICES=GPU-bbbb-1",
        "trainer", "/opt/venv/bin/python", "-m", "flodl_run.launch.ssh", "--rank", "1", "--run", "run-x"]
    bare = rank_command(layout.workers[0], env, 0, "run-x")
    assert "docker" not in bare and bare.endswith("-m flodl_run.launch.ssh --rank 0 --run run-x")


def test_secret_goes_on_stdin_and_never_into_a_docker_ranks_argv(monkeypatch, tmp_path):
    """Pins the secret rule for docker workers: start_hosts puts the run secret in the stdin
    handshake (with CUDA_VISIBLE_DEVICES and the rest of the env) and in no argv word."""
    cfg, layout = _mixed()
    started: List[Dict[str, Any]] = []

    class Recorder:
        def __init__(self, argv, **kwargs):
            self.stdin, self.stdout, self.argv = io.StringIO(), io.StringIO(), argv
            started.append({"argv": argv, "stdin": self.stdin})

    monkeypatch.setattr(hosts.subprocess, "Popen", Recorder)
    monkeypatch.setattr(hosts, "host_store", lambda addr, port: type("Store", (), {"port": 29999})())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text("seed: 0\n")
    start_hosts(cfg.cluster, layout, "tcp://gpu-a.test:29400", SECRET, run_dir,
                Console(file=io.StringIO()), save_path=cfg.save_path)
    docker = started[1]
    assert docker["argv"][0] == "ssh" and "docker compose exec -T" in docker["argv"][-1]
    assert not any(SECRET.hex() in word for s in started for word in s["argv"])
    env, run_yaml = decode_handshake(docker["stdin"].getvalue().encode())
    assert env["FLODL_RUN_SECRET"] == SECRET.hex() and run_yaml == "seed: 0\n"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb-1" and env["MASTER_PORT"] == "29999"


def _fake_docker(tmp_path: Path, running: str) -> Dict[str, str]:
    """PATH with a stand-in `docker`: `compose ps` lists `running`; `compose exec` prints its
    words and echoes its stdin (what the process in the container would read)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text("#!/bin/sh\nif [ \"$2\" = ps ]; then printf '%s' \"$RUNNING\"; exit 0; fi\n"
                      "echo \"ARGS $*\"\ncat\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUNNING": running}


@pytest.mark.parametrize("running, up", [("web\ntrainer\n", True), ("web\ntrainer-2\n", False),
                                         ("", False)])
def test_service_check_runs_in_a_posix_shell(tmp_path, running, up):
    """Pins the service check as a shell runs it: a running `trainer` (exact name, not a
    prefix) reaches `docker compose exec` with stdin passed through; otherwise exit 3 and one
    marker line naming the service and what is running."""
    command = docker_command(str(tmp_path), "trainer", "python3", ["-m", "flodl_run.launch.ssh"],
                             {"RANK": "0"})
    done = subprocess.run(["sh", "-c", command], input="HANDSHAKE\n", capture_output=True,
                          text=True, env=_fake_docker(tmp_path, running), timeout=30)
    if up:
        assert done.returncode == 0, done.stderr
        assert done.stdout == ("ARGS compose exec -T -e RANK=0 trainer python3 -m flodl_run.launch.ssh\n"
                               "HANDSHAKE\n")
    else:
        assert done.returncode == NOT_UP_EXIT and done.stdout == ""
        assert docker_reason(done.stderr) == (
            f"service trainer is not running (running: {running.strip().replace(chr(10), ' ')})")


def test_docker_key_is_validated_as_a_service_name():
    """Pins the config rule: a docker value that is no compose service name (spaces, shell
    characters) is refused naming cluster.workers.<i>.docker."""
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices=[0], docker="trainer; rm -rf /"))
    problems = [str(p) for p in validate(cfg).problems]
    assert any(p.startswith("cluster.workers.0.docker: must be a compose service name")
               for p in problems), problems
    assert not validate(config(WorkerConfig(host="gpu-a.test", local_devices=[0],
                                            docker="gpu_worker-1.a"))).problems


@pytest.mark.e2e
def test_probe_names_host_and_service_when_docker_compose_fails_for_real(sshd, tmp_path):
    """Pins the probe's error path against the real docker client with no engine behind it
    (over real ssh): not ready, and the message names the host, the path and the service; the
    launcher's layout refuses the worker naming cluster.workers.0.docker (exit 2)."""
    (tmp_path / "compose.yaml").write_text("services:\n  trainer:\n    image: python:3.11\n")
    worker = WorkerConfig(host=HOSTS[0], local_devices=["cpu"], path=str(tmp_path),
                          python=sys.executable, ssh=sshd, docker="trainer")
    report = inventory(worker, str(tmp_path), full=False)
    assert not report.reachable and report.via == "ssh+docker trainer"
    assert report.error.startswith(f"docker compose on {HOSTS[0]} in {tmp_path}: service trainer ")
    reports, problems, _ = probe(config(worker).cluster)
    assert HOSTS[0] in problems[0][0] and "service trainer" in problems[0][0]
    cfg = config(worker, mode=Mode.cpu_cadence, controller=ControllerConfig(host="127.0.0.1"))
    with pytest.raises(ConfigError) as caught:
        plan_layout(cfg)
    message = str(caught.value)
    assert "cluster.workers.0.docker: must be a running compose service" in message
    assert HOSTS[0] in message and "trainer" in message
