"""Multi-host pieces without a network: ssh command lines, the stdin handshake, device
resolution against a host inventory, the rank layout and each remote rank's environment,
and the probe's readiness verdict. (Real sshd runs: tests/test_multi_host.py.)"""

from __future__ import annotations

import json

import pytest

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import (
    ControllerConfig,
    Mode,
    SshConfig,
    WorkerConfig,
)
from flodl_run.config.validate import validate
from flodl_run.hardware.devices import GpuInfo
from flodl_run.launch.hosts import hosts_line, rank_environment
from flodl_run.launch.probe import HostReport, host_problems, resolve_devices, skew_flags
from flodl_run.launch.ssh import decode_handshake, encode_handshake, remote_command, ssh_argv
from tests.support import GPUS, config, facts, fake_ask, plan_layout

# ---- ssh command line and handshake ---------------------------------------------------------


def test_ssh_argv_puts_user_options_first_and_never_prompts():
    """Pins the option order (ssh keeps the first value, so the worker's own options win) and
    BatchMode, no tty, the port/user/key flags and `--` before the host."""
    ssh = SshConfig(user="ml", port=2222, identity_file="~/.ssh/k", options=["ConnectTimeout=3"])
    argv = ssh_argv("node-b", ssh, "cd /x && exec python3 -m flodl_run.launch.ssh")
    assert argv[:2] == ["ssh", "-T"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts.index("ConnectTimeout=3") < opts.index("ConnectTimeout=10")
    assert "BatchMode=yes" in opts and "IdentitiesOnly=yes" in opts
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ml"
    assert not argv[argv.index("-i") + 1].startswith("~")
    assert argv[-3:] == ["--", "node-b", "cd /x && exec python3 -m flodl_run.launch.ssh"]
    assert "-p" not in ssh_argv("h", SshConfig(), "true")  # port 22: leave ~/.ssh/config's Port


def test_remote_command_quotes_every_word_and_expands_home():
    """Pins quoting for paths with spaces and the remote `~` expansion."""
    assert remote_command("/srv/my proj", "python3", ["-m", "flodl_run.launch.ssh"]) == \
        "cd '/srv/my proj' && exec python3 -m flodl_run.launch.ssh"
    assert remote_command("~/flodl run", "py", []).startswith("cd ~/'flodl run' && exec py")


def test_handshake_round_trips_and_refuses_another_version():
    """Pins the stdin handshake (env with the secret + run.yaml) and the version check that names
    a launcher/host flodl_run mismatch."""
    line = encode_handshake({"RANK": "2", "FLODL_RUN_SECRET": "ab" * 32}, "seed: 0\n")
    assert line.endswith("\n") and line.count("\n") == 1
    env, text = decode_handshake(line.encode())
    assert env["FLODL_RUN_SECRET"] == "ab" * 32 and text == "seed: 0\n"
    with pytest.raises(ValueError, match="no handshake"):
        decode_handshake(b"")
    with pytest.raises(ValueError, match="differs between the launcher"):
        decode_handshake(json.dumps({"version": 99, "env": {}, "run_yaml": ""}).encode())


# ---- devices and readiness ------------------------------------------------------------------


def test_all_never_makes_cpu_ranks_and_lists_resolve_to_uuids():
    """Pins the `all` decision (GPUs only; CPU ranks only from an explicit list) and that
    indices/UUID prefixes become full UUIDs for CUDA_VISIBLE_DEVICES."""
    gpus = [GpuInfo(*g) for g in GPUS]
    assert resolve_devices("all", gpus) == (["GPU-aaaa-0", "GPU-bbbb-1"], [])
    devices, errors = resolve_devices("all", [])
    assert devices == [] and "[cpu, cpu]" in errors[0]
    assert resolve_devices([1, "GPU-aaaa", "cpu", "cpu"], gpus) == \
        (["GPU-bbbb-1", "GPU-aaaa-0", "cpu", "cpu"], [])
    _, errors = resolve_devices([2, "GPU-zz", "tpu"], gpus)
    assert len(errors) == 3 and "has 2 GPUs" in errors[0]


def test_host_problems_name_missing_pieces():
    """Pins the not-ready reasons: unreachable, old Python, no flodl_run, no torch."""
    assert host_problems(HostReport("a", "ssh failed: refused")) == ["ssh failed: refused"]
    broken = HostReport("b", None, facts(python="3.8.10", flodl_run=None,
                                         flodl_run_error="ModuleNotFoundError"))
    problems = host_problems(broken, full=True)
    assert any("3.8.10" in p for p in problems)
    assert any("flodl_run does not import" in p for p in problems)
    assert any("torch does not import" in p for p in problems)
    assert host_problems(HostReport("c", None, facts(torch="2.11")), [0, "cpu"], full=True) \
        == ["GPU index 0 does not exist (the host has 0 GPUs)"]


def test_skew_flags_torch_and_nccl_across_hosts():
    """Pins the version-skew flags (a warning, not a failure) with the hosts on each side."""
    reports = [HostReport("a", None, facts(torch="2.11.0", nccl="2.27.5")),
               HostReport("b", None, facts(torch="2.11.0", nccl="2.26.2")),
               HostReport("c", None, facts(torch="2.10.0", nccl="2.27.5"))]
    flags = skew_flags(reports)
    assert any(f.startswith("torch version skew") and "2.10.0 on c" in f for f in flags)
    assert any(f.startswith("nccl version skew") and "2.26.2 on b" in f for f in flags)
    assert skew_flags(reports[:1]) == []


# ---- layout -------------------------------------------------------------------------------


def test_ranks_follow_worker_order_and_all_probes_the_host():
    """Pins global ranks in worker order, `all` = the probed GPUs, and the rendezvous store on
    the controller (MASTER_ADDR = controller.host; port 0 = picked when the launcher starts the
    store), whatever cluster.master_addr says."""
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices=[1], nccl_socket_ifname="eth0"),
                 WorkerConfig(host="gpu-b.test", local_devices="all", nccl_socket_ifname="eth0"),
                 controller=ControllerConfig(host="gpu-a.test", port=29400))
    layout = plan_layout(cfg, ask=fake_ask({"gpu-a.test": facts(GPUS), "gpu-b.test": facts(GPUS)}))
    assert [w.ranks for w in layout.workers] == [[0], [1, 2]]
    assert layout.workers[0].devices == ["GPU-bbbb-1"]
    assert (layout.world_size, layout.master_addr, layout.master_port) == (3, "gpu-a.test", 0)
    assert hosts_line(layout) == ("ddp: 3 ranks on 2 hosts | gpu-a.test: A100 (80 GB) | "
                                  "gpu-b.test: H200 (141 GB), A100 (80 GB)")


def test_layout_problems_are_config_errors_naming_the_worker():
    """Pins the exit-2 errors only the hosts can tell, all reported together: an unreachable
    host, `all` on a host without GPUs."""
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices="all", nccl_socket_ifname="eth0"),
                 WorkerConfig(host="gpu-b.test", local_devices=["cpu"], nccl_socket_ifname="eth0"),
                 controller=ControllerConfig(host="gpu-i.test"))
    ask = fake_ask({"gpu-a.test": facts(), "gpu-b.test": "ssh failed: Connection refused"})
    with pytest.raises(ConfigError) as info:
        plan_layout(cfg, ask=ask)
    text = str(info.value)
    assert "cluster.workers.0.local_devices" in text and "no NVIDIA GPU" in text
    assert "cluster.workers.1.host" in text and "Connection refused" in text


@pytest.mark.parametrize("case, changes, key", [
    ("mixed backends", dict(devices=([0], ["cpu"])), "cluster.workers"),
    ("loopback controller", dict(controller=ControllerConfig(host="127.0.0.1")),
     "cluster.controller.host"),
    ("ratios per rank", dict(ratios=[1.0]), "elche.partition_ratios"),
])
def test_layout_refuses_what_needs_the_world(case, changes, key):
    """Pins the rules checked once the layout is known: one collective backend, a controller
    the workers can reach, and world-size rules (partition_ratios) with the probed size."""
    devices = changes.get("devices", (["cpu"], ["cpu"]))
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices=devices[0], nccl_socket_ifname="e"),
                 WorkerConfig(host="gpu-b.test", local_devices=devices[1], nccl_socket_ifname="e"),
                 controller=changes.get("controller", ControllerConfig(host="gpu-a.test")))
    cfg.elche.partition_ratios = changes.get("ratios")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        plan_layout(cfg, ask=fake_ask({"gpu-a.test": facts(GPUS), "gpu-b.test": facts(GPUS)}))


def test_controller_only_takes_lists_as_given_and_refuses_all():
    """Pins controller-only hosts layouts: nothing is asked over ssh, `all` cannot be resolved."""
    def never(*_):
        raise AssertionError("controller-only must not ssh")
    cfg = config(WorkerConfig(host="a", local_devices=[0, 1], nccl_socket_ifname="e"),
                 WorkerConfig(host="b", local_devices=[0], nccl_socket_ifname="e"),
                 controller=ControllerConfig(host="gpu-a.test"), master_addr="gpu-e.test",
                 launch_ranks=False)
    layout = plan_layout(cfg, ask=never)
    assert (layout.world_size, layout.master_addr, layout.master_port) == (3, "gpu-e.test", 29500)
    cfg.cluster.workers[1].local_devices = "all"
    with pytest.raises(ConfigError, match=r"cluster\.workers\.1\.local_devices"):
        plan_layout(cfg, ask=never)


def test_remote_rank_environment_is_the_torchrun_contract_without_the_secret():
    """Pins what a remote rank is given: RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_*,
    the coordinator, NCCL/Gloo interface, the worker's env block, threads per CPU rank; the
    secret is not part of it (it is added to the stdin handshake only)."""
    cfg = config(WorkerConfig(host="gpu-a.test", local_devices=[0], nccl_socket_ifname="eth0"),
                 WorkerConfig(host="gpu-b.test", local_devices=["cpu", "cpu"], nccl_socket_ifname="ib0",
                              env={"LD_PRELOAD": "/opt/nccl.so"}),
                 controller=ControllerConfig(host="gpu-a.test"), mode=Mode.cpu_cadence,
                 master_port=29511)
    layout = plan_layout(cfg, ask=fake_ask({"gpu-a.test": facts(GPUS), "gpu-b.test": facts()}))
    env = rank_environment(cfg.cluster, layout, layout.workers[1], 1, "tcp://gpu-a.test:29400")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "2", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu-a.test", "MASTER_PORT": "29511"}
    assert env["FLODL_RUN_COORD"] == "tcp://gpu-a.test:29400"
    assert env["FLODL_RUN_STORE_HOSTED"] == "1" and env["FLODL_RUN_NODE"] == "gpu-b.test"
    # the launcher's node, which its own MLflow monitor samples (this rank's node is another)
    assert env["FLODL_RUN_LAUNCHER_NODE"] == __import__("socket").gethostname()
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["LD_PRELOAD"] == "/opt/nccl.so" and env["FLODL_RUN_DEVICE"] == "cpu"
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores / 2 CPU ranks
    assert "FLODL_RUN_SECRET" not in env
    gpu = rank_environment(cfg.cluster, layout, layout.workers[0], 0, "tcp://x:1")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa-0" and gpu["FLODL_RUN_DEVICE"] == "cuda:0"


def test_cpu_slots_may_repeat_in_local_devices():
    """Pins that [cpu, cpu] (two CPU ranks on one host) passes validation while a GPU repeated
    still fails."""
    ok = config(WorkerConfig(host="a", local_devices=["cpu", "cpu"]))
    assert validate(ok).ok and validate(ok).problems == []
    bad = config(WorkerConfig(host="a", local_devices=[0, 0, "cpu", "cpu"]))
    assert "cluster.workers.0.local_devices" in [p.key for p in validate(bad).problems]


# ---- the remote entry ----------------------------------------------------------------------


def test_remote_rank_environ_keeps_the_env_blocks_pythonpath_after_the_project(tmp_path, monkeypatch):
    """Pins the environment the remote entry gives its rank: the handshake over the login env,
    the project path first on PYTHONPATH then the worker env block's (e.g. extra site dirs), the
    run file it wrote, and itself as the parent the rank's orphan check watches."""
    import os

    from flodl_run.launch.ssh import _rank_environ

    monkeypatch.chdir(tmp_path)
    env = _rank_environ({"PYTHONPATH": "/login", "HOME": "/root"},
                        {"PYTHONPATH": "/opt/site", "RANK": "2"}, tmp_path / "run.yaml")
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/opt/site"])
    assert env["HOME"] == "/root" and env["RANK"] == "2"
    assert env["FLODL_RUN_FILE"] == str(tmp_path / "run.yaml")
    assert env["FLODL_RUN_PARENT_PID"] == str(os.getpid())


@pytest.mark.e2e
def test_remote_entry_stops_its_rank_when_the_session_stdin_closes():
    """Pins the orphan cleanup on a worker: when the ssh session's stdin closes (launcher killed,
    teardown, network loss) the entry SIGTERMs its rank's process group and reports 128 + 15."""
    import subprocess
    import sys
    import time

    script = ("import subprocess, sys\n"
              "from flodl_run.launch.ssh import _supervise\n"
              "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
              "print(child.pid, flush=True)\n"
              "sys.exit(_supervise(child, '7'))\n")
    entry = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(entry.stdout.readline())
    entry.stdin.close()
    assert entry.wait(timeout=10) == 128 + 15
    assert "rank 7: ssh session closed; stopping the rank" in entry.stderr.read()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return ") Z " not in stat.read()
    except OSError:
        return False


def test_the_unedited_two_host_template_exits_2_and_says_to_edit_it(capsys, monkeypatch):
    """Pins: `cluster=two_hosts` as shipped named two private addresses, so a
    new user's probe or launch sent SSH traffic to whatever owned them. The template now names
    hosts in the reserved .invalid domain, and probe and launch refuse them (exit 2, each key
    named) before any ssh."""
    from flodl_run.config.compose import compose
    from flodl_run.config.materialize import materialize
    from flodl_run.launch import probe

    monkeypatch.setattr(probe, "inventories", lambda *a, **k: pytest.fail("probe reached for a host"))
    assert probe.main(["cluster=two_hosts"]) == 2
    err = capsys.readouterr().err
    for key, host in (("cluster.controller.host", "gpu-a.invalid"),
                      ("cluster.workers.0.host", "gpu-a.invalid"),
                      ("cluster.workers.1.host", "gpu-b.invalid")):
        assert f"{key}: is a placeholder of the template" in err and f"'{host}'" in err, err
    with pytest.raises(ConfigError, match="cluster.workers.1.host: is a placeholder"):
        materialize(compose(["cluster=two_hosts"]), check_recipe=False)
