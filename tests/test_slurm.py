"""`cluster=slurm` and `python -m flodl_run.submit` against a real one-node Slurm on this host.

One session fixture writes a slurm.conf for this machine (CPUs from nproc, its own ports,
state and munge socket in a temp dir), starts munged, slurmctld and slurmd, and stops them at
the end. Jobs are real sbatch submissions running real ranks over Gloo. Skips (with the reason)
only where the daemons cannot run here: not root, or Debian's slurmctld/slurmd/munge missing.
The parsing and mapping pieces are unit-tested without a cluster.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ExperimentConfig, SlurmConfig, Topology
from flodl_run.config.validate import validate
from flodl_run.launch.slurm import (
    Allocation,
    SlurmLayout,
    SrunStep,
    TaskHandle,
    gpu_count,
    plan_slurm,
    srun_argv,
    step_environment,
    task_ends,
)
from flodl_run.launch.slurm_task import expand_counts, task_environ
from flodl_run.submit import sbatch_script
from tests.support import _free_port, run_cli, start_cli, text_of, wait_for, world_rules

REPO = Path(__file__).resolve().parents[1]
SBIN = "/usr/sbin:/usr/local/sbin:/sbin"
JOB_TIMEOUT_S = 240


# ---- pure pieces -----------------------------------------------------------------------------


def test_per_node_counts_expand_slurms_compressed_form():
    """Pins SLURM_TASKS_PER_NODE parsing: `2(x3),1` is three nodes of 2 then one of 1."""
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(ValueError):
        expand_counts("two")


def test_gpu_counts_read_plain_and_typed_forms():
    """Pins GPUs per node from SLURM_GPUS_ON_NODE (`4`) or SLURM_GPUS_PER_NODE (`a100:4`)."""
    assert [gpu_count(v) for v in ("4", "gpu:8", "a100:2", None, "")] == [4, 8, 2, 0, 0]


def test_srun_task_reports_become_per_task_exit_codes():
    """Pins the death report: srun's `task 2: Killed` is rank 2 killed by SIGKILL (137, as a
    shell says it), ranges name every task, exit codes are kept, other lines are not ends."""
    assert task_ends("srun: error: vm: task 2: Killed\n") == {2: ("vm", 137)}
    assert task_ends("srun: error: n1: tasks 0-1,3: Exited with exit code 3") == {
        0: ("n1", 3), 1: ("n1", 3), 3: ("n1", 3)}
    assert task_ends("srun: error: n2: task 5: Terminated") == {5: ("n2", 143)}
    assert task_ends("srun: Job step aborted: Waiting up to 32 seconds") == {}


def test_a_task_gets_the_torchrun_contract_from_slurms_variables():
    """Pins the per-task mapping: PROCID -> RANK, LOCALID -> LOCAL_RANK, the step's task count
    -> WORLD_SIZE, this node's share -> LOCAL_WORLD_SIZE; the secret file's path is dropped."""
    env = task_environ({"SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                        "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "3,2",
                        "SLURMD_NODENAME": "n2", "FLODL_RUN_SECRET_FILE": "/x/secret"}, "ab12")
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
        ("4", "1", "5", "2")
    assert env["FLODL_RUN_SECRET"] == "ab12" and "FLODL_RUN_SECRET_FILE" not in env
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        task_environ({}, "ab12")


def _plan(config: ExperimentConfig, allocation: Allocation) -> SlurmLayout:
    """The launcher's plan of an srun step for `config` in `allocation`."""
    return plan_slurm(config.cluster, allocation, world_rules(config))


def _slurm_config(**slurm) -> ExperimentConfig:
    config = ExperimentConfig()
    config.cluster.topology = Topology.slurm
    config.cluster.num_ranks = 2
    config.cluster.slurm = SlurmConfig(**slurm)
    return config


@pytest.mark.parametrize("slurm,key", [
    ({"time": "ten minutes"}, "cluster.slurm.time"),
    ({"nodes": 0}, "cluster.slurm.nodes"),
    ({"partition": "gpu big"}, "cluster.slurm.partition"),
    ({"sbatch_args": ["-A ml"]}, "cluster.slurm.sbatch_args.0"),
])
def test_a_bad_slurm_block_names_its_key(slurm, key):
    """Pins the slurm block's rules: what sbatch would refuse is a problem naming the key."""
    assert [p.key for p in validate(_slurm_config(**slurm)).problems] == [key]


def test_the_gpu_script_asks_one_task_per_gpu_on_every_node():
    """Pins the GPU allocation: nodes x gpus_per_node tasks, the GPUs asked per node, the
    partition and extra options as given, a node failure not ending the job (--no-kill), and
    the run itself as the last line."""
    config = _slurm_config(nodes=2, gpus_per_node=4, time="2:00:00", partition="a100",
                           sbatch_args=["--account=ml"])
    text = sbatch_script(config.cluster, ["cluster=slurm", "elche=nccl_sync"], Path("/o/x-%j.out"),
                         Path("/srv/p"), "/srv/p/.venv/bin/python")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=2:00:00", "#SBATCH --no-kill", "#SBATCH --partition=a100",
                 "#SBATCH --account=ml",
                 "cd /srv/p",
                 "exec /srv/p/.venv/bin/python -m flodl_run cluster=slurm elche=nccl_sync"):
        assert line in text.splitlines()


def test_the_step_keeps_its_tasks_and_never_carries_the_secret(tmp_path, monkeypatch):
    """Pins the srun line: a task's or a node's end does not end the step
    (--kill-on-bad-exit=0, --no-kill), output is labelled per task, one GPU per task on GPUs
    and the node's cores shared on CPU; the secret is neither in argv nor in srun's
    environment (only the 0600 file's path is)."""
    monkeypatch.setenv("FLODL_RUN_SECRET", "deadbeef")
    alloc = Allocation("7", ["n1", "n2"], [4, 4], 4, 16, "n1")
    gpu = srun_argv(_slurm_config(gpus_per_node=4).cluster, SlurmLayout(alloc, 8, True, "gpu-a.test"))
    for option in ("--ntasks=8", "--nodes=2", "--kill-on-bad-exit=0", "--no-kill", "--label",
                   "--ntasks-per-node=4", "--gpus-per-task=1"):
        assert option in gpu
    assert gpu[-3:] == [sys.executable, "-m", "flodl_run.launch.slurm_task"]
    cpu_plan = SlurmLayout(Allocation("7", ["n1"], [2], 0, 4, "n1"), 2, False, "gpu-a.test")
    assert "--cpus-per-task=2" in srun_argv(_slurm_config().cluster, cpu_plan)
    env = step_environment(_slurm_config().cluster, cpu_plan, "tcp://gpu-a.test:1", 2, tmp_path / "secret",
                           tmp_path / "run.yaml")
    assert "FLODL_RUN_SECRET" not in env and env["FLODL_RUN_SECRET_FILE"] == str(tmp_path / "secret")
    assert (env["MASTER_ADDR"], env["OMP_NUM_THREADS"], env["FLODL_RUN_STORE_HOSTED"]) == \
        ("gpu-a.test", "2", "1")
    assert env["FLODL_RUN_LAUNCHER_NODE"] == "n1"  # the batch host's tasks leave it to MLflow's monitor
    assert not any("deadbeef" in word for word in gpu)


def test_an_allocation_that_cannot_serve_the_config_names_the_key():
    """Pins the allocation check: GPUs asked of a job that has none, and a batch host that
    resolves to loopback while ranks run on other nodes, are config errors naming the key;
    a GPU allocation gives one rank per GPU of every node."""
    with pytest.raises(ConfigError, match="cluster.slurm.gpus_per_node: must be GPUs the allocation"):
        _plan(_slurm_config(gpus_per_node=2), Allocation("7", ["n1"], [2], 0, 4, "n1"))
    with pytest.raises(ConfigError, match="cluster.controller.host: must be an address the other"):
        _plan(_slurm_config(), Allocation("7", ["localhost", "n2"], [1, 1], 0, 4, "localhost"))
    named = _slurm_config(gpus_per_node=4)
    named.cluster.controller.host = "gpu-a.test"  # a name the nodes reach: taken as given, no look-up
    plan = _plan(named, Allocation("7", ["n1", "n2"], [4, 4], 4, 16, "n1"))
    assert (plan.world_size, plan.gpus, plan.addr) == (8, True, "gpu-a.test")


def test_a_step_reports_only_the_task_srun_named_and_the_rest_as_ended_with_srun(tmp_path):
    """Pins the per-task exit read from one srun: a process speaking srun's --label format
    that reports task 1 killed gives rank 1 code 137 at once, and ranks 0 and 2 end 0 when it
    ends (srun names every task that ended badly); each task's lines land in its own log."""
    fake = ("echo '0: hello from 0'; echo '2: hello from 2';"
            "echo 'srun: error: vm: task 1: Killed' >&2; read _; exit 137")
    process = subprocess.Popen(["bash", "-c", fake], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=1)
    from rich.console import Console

    logs = [open(tmp_path / f"rank{k}.log", "w") for k in range(3)]
    step = SrunStep(process, logs, Console(file=open(os.devnull, "w")), ["vm"], "1")
    tasks = [TaskHandle(step, k, 3) for k in range(3)]
    deadline = time.monotonic() + 30
    while tasks[1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [t.poll() for t in tasks] == [None, 137, None]
    process.stdin.close()
    process.wait(timeout=30)
    deadline = time.monotonic() + 30  # a bound on a failure: ends come once both streams are read
    while None in [t.poll() for t in tasks] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [t.poll() for t in tasks] == [0, 137, 0]
    # an end srun's own end tells waits for both of its streams, so rank 2's line is in its log
    # (this test joined the stderr reader only, and once read the log before stdout was done)
    for log in logs:
        log.close()
    assert (tmp_path / "rank2.log").read_text() == "hello from 2\n"


@pytest.mark.e2e
def test_cluster_slurm_outside_an_allocation_exits_2_naming_the_key(tmp_path):
    """Pins the launcher's allocation check: no SLURM_JOB_ID is a config error (exit 2, no
    traceback) that says where to run it, and no run dir is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = run_cli("cluster=slurm", "tracking=off", f"hydra.run.dir={tmp_path / 'run'}", env=env,
                   timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.topology: must run inside a Slurm allocation" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_submit_refuses_a_config_that_is_not_slurm():
    """Pins submit's own rule: a topology other than slurm exits 2 naming cluster.topology."""
    proc = subprocess.run([sys.executable, "-m", "flodl_run.submit", "--dry-run", "cluster=cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cluster.topology: must be slurm to submit (add cluster=slurm), got 'cpu'" in proc.stderr


def test_submit_dry_run_of_a_sweep_prints_each_job_and_the_job_array(tmp_path, capsys):
    """Pins `flodl_run.submit --dry-run -m`: every sweep point is a job of one array (`--array`
    of as many tasks, the stop notice `--signal=USR2@<signal_delay_s>` of the preset), the
    jobs' overrides are listed in order, nothing is written; a bad point exits 2 naming its job."""
    from flodl_run.submit import main

    sweep_dir = tmp_path / "multirun"
    code = main(["--dry-run", "-m", "hydra/launcher=slurm", "elche=nccl_sync,nccl_cadence", "cluster=slurm",
                 f"hydra.sweep.dir={sweep_dir}"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --array=0-1%2", "#SBATCH --signal=USR2@120", "#SBATCH --cpus-per-task=2",
                 "# job 0: elche=nccl_sync cluster=slurm", "# job 1: elche=nccl_cadence cluster=slurm"):
        assert line in out.splitlines()
    assert f"{sweep_dir}/.submitit/" in out and not sweep_dir.exists()
    code = main(["--dry-run", "-m", "hydra/launcher=slurm", "cluster=slurm", "elche.min_anchor=5,50",
                 "elche.max_anchor=20"])
    assert code == 2
    assert "job 1: elche.min_anchor: must be <= elche.max_anchor (20), got 50" in capsys.readouterr().err


# ---- a real Slurm on this host ---------------------------------------------------------------


def _binary(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def _slurm_conf(root: Path) -> str:
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    ctld, slurmd = _free_port(), _free_port()
    return "\n".join([
        "ClusterName=flodltest", f"SlurmctldHost={host}", f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        "CredType=cred/munge", f"AuthInfo=socket={root / 'munge.sock'}",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        f"NodeName={host} CPUs={os.cpu_count() or 1} RealMemory=1024 State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
    ]) + "\n"


def _wait_idle(env: dict, daemons: list) -> str | None:
    """Until sinfo says the node is idle (the daemons register asynchronously); else why not."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(d.poll() is not None for d in daemons):
            return "a Slurm daemon exited at start"
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if state.stdout.strip() in ("idle", "mix", "alloc"):
            return None
        time.sleep(0.2)
    return "the node did not become idle within 60 s"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm (munged, slurmctld, slurmd) private to this session: the environment
    that points Slurm's commands at it (SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("the test Slurm runs its daemons as root (SlurmUser=root); not root here")
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
               if _binary(b) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (Debian: apt-get install slurmctld "
                    "slurmd munge slurm-client; .ci/run does)")
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(_slurm_conf(root))
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    env["PATH"] = env.get("PATH", "") + ":" + SBIN
    munge = subprocess.run([_binary("munged"), "--force", f"--socket={root / 'munge.sock'}",
                            f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
                            f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"],
                           capture_output=True, text=True)
    if munge.returncode != 0:
        pytest.skip(f"munged cannot start here: {munge.stderr.strip()}")
    daemons = [subprocess.Popen([_binary(d), "-D", *extra], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(root / f"{d}.err", "w"))
               for d, extra in (("slurmctld", ["-i"]), ("slurmd", []))]
    try:
        why = _wait_idle(env, daemons)
        if why:
            tail = (root / "slurmctld.err").read_text()[-300:] + (root / "slurmd.err").read_text()[-300:]
            pytest.skip(f"Slurm cannot run here: {why} ({tail.strip()})")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        subprocess.run([_binary("munged"), "--stop", f"--socket={root / 'munge.sock'}"],
                       capture_output=True)


def _submit(env: dict, tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    """Submit through `python -m flodl_run.submit`; (job id, output file)."""
    done = subprocess.run([sys.executable, "-m", "flodl_run.submit", "cluster=slurm", "tracking=off",
                           f"hydra.run.dir={tmp_path / 'run'}",
                           f"cluster.slurm.output_dir={tmp_path / 'slurm'}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.fullmatch(r"submitted job (\d+) \| script (\S+) \| output (\S+)", done.stdout.strip())
    assert match, done.stdout
    return match.group(1), Path(match.group(3))


def _wait_job(env: dict, job: str) -> None:
    """Until the job has left the queue (it ended, however it ended)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env,
                               capture_output=True, text=True)
        if queue.returncode == 0 and not queue.stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} still queued or running after {JOB_TIMEOUT_S} s")


@pytest.mark.e2e
@pytest.mark.xdist_group("slurm")
def test_cpu_ranks_under_sbatch_complete_and_survive_a_killed_task(slurm, tmp_path):
    """Pins `cluster=slurm` end to end: a job submitted by `flodl_run.submit` runs the launcher
    on the batch host, which starts 2 CPU ranks as one srun step, each task's output in its
    rank's log; SIGKILL rank 1 after its 8th batch: srun keeps the other task
    (--kill-on-bad-exit=0), the launcher reads srun's report as rank 1's death, the run
    completes with rank 0, and the secret file is gone afterwards. Two ranks, not three: one
    survivor is what the step's survival needs, and each srun rank is a fresh interpreter
    (~4 CPU-s); the survivors' regroup is the fault tests'."""
    env = dict(slurm, FLODL_RUN_FAULT="1:8:SIGKILL")
    job, output = _submit(env, tmp_path, "cluster.num_ranks=2", "cluster.threads_per_rank=1",
                          "num_epochs=2", "cluster.slurm.sbatch_args=[--overcommit]")
    _wait_job(slurm, job)
    text = output.read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, text[-3000:]
    assert summary["dead_ranks"] == [1], text[-3000:]
    assert f"ddp: 2 ranks as one srun step on 1 node (job {job}:" in text
    assert "rank 1 lost" in text and "rank 1 exited with code 137" in text
    for rank in (0, 1):
        assert (tmp_path / "run" / "ranks" / f"rank{rank}.log").read_text().startswith(
            f"# rank {rank} of 2: task {rank} of srun step")
    assert not (tmp_path / "run" / "secret").exists()


@pytest.mark.e2e
@pytest.mark.xdist_group("slurm")
def test_submit_dry_run_prints_a_script_sbatch_accepts(slurm, tmp_path):
    """Pins `--dry-run`: the printed script is what sbatch takes (`sbatch --test-only` accepts
    it on this cluster) and nothing is submitted or written."""
    done = subprocess.run([sys.executable, "-m", "flodl_run.submit", "--dry-run", "cluster=slurm",
                           f"cluster.slurm.output_dir={tmp_path / 'slurm'}", "cluster.slurm.time=5"],
                          cwd=REPO, env=slurm, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=flodl_run\n")
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)
    test = subprocess.run(["sbatch", "--test-only", str(script)], env=slurm, capture_output=True,
                          text=True, timeout=60)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr
    assert not (tmp_path / "slurm").exists()


@pytest.mark.e2e
@pytest.mark.xdist_group("slurm")
def test_probe_inside_an_allocation_asks_every_node_through_srun(slurm):
    """Pins `probe` under Slurm: inside an allocation (salloc here) it runs the inventory on
    each allocated node as an srun step, not on the login machine alone, and says ready."""
    done = subprocess.run(["salloc", "--ntasks=1", sys.executable, "-m", "flodl_run.launch.probe",
                           "cluster=slurm"], cwd=REPO, env=slurm, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    row = next(line for line in done.stdout.splitlines() if f" {host} " in line)
    assert " srun " in row and "yes" in row
    assert "1 host: ready" in done.stdout


# ---- sweeps: one allocation per job (hydra/launcher=slurm) -----------------------------------

SWEEP_EPOCHS = 10
"""Epochs of each sweep job: enough that job 0 is still training when the notice sent after
its first epoch lands (the test's docstring says how much that leaves)."""


def _array_task(env: dict, task: int) -> tuple:
    """(queue id `123_0`, state) of the sweep's array task `task`; (None, None) once it left."""
    queue = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T"], env=env, capture_output=True,
                           text=True)
    found = [line.split() for line in queue.stdout.splitlines() if line.split()[0].endswith(f"_{task}")]
    return tuple(found[0]) if found else (None, None)


def _start_if_pending(env: dict, task: str, seen: list, pending_since: dict) -> bool:
    """Let array task 0 start now once it has been pending for 2 s: Slurm holds a requeued job
    for minutes (its begin time), and the requeue may set that time after an earlier update, so
    a waiting test asks again each time it looks (and releases a hold, harmless when there is
    none). Not sooner: slurmd refuses a job whose credential was made in the second the last
    instance's was revoked ("Job credential revoked", and the job ends with no further requeue).
    Notes each state seen in `seen`, for the failure message. False, so the wait goes on."""
    state = _array_task(env, 0)[1]
    if not seen or seen[-1] != state:
        seen.append(state)
    if state != "PENDING":
        pending_since.clear()
        return False
    began = pending_since.setdefault("at", time.monotonic())
    if time.monotonic() - began >= 2:
        for change in (["update", f"JobId={task}", "StartTime=now"], ["release", task]):
            subprocess.run(["scontrol", *change], env=env, capture_output=True, timeout=30)
    return False


@pytest.mark.e2e
@pytest.mark.xdist_group("slurm")
def test_a_slurm_sweep_gives_each_job_its_allocation_and_a_requeued_job_resumes(slurm, tmp_path,
                                                                                   mlflow_db):
    """Pins `-m hydra/launcher=slurm`: each sweep point is a task of one job array, running its
    CPU rank as its own srun step; the MLflow parent is made before submitting and every job's
    run is its child; the scheduler's notice (USR2, as before a timeout) stops job 0 with a save,
    submitit requeues it and the requeued job resumes from that bundle; the comparison, written
    once both jobs ended, has both jobs completed and job 0's overrides without the resume. One
    rank a job: a step of several tasks is the sbatch test's (above), and each srun rank is a
    fresh interpreter (~4 CPU-s of imports). SWEEP_EPOCHS is what keeps job 0 running until the
    notice lands: an epoch here takes 0.1-0.3 s, and job 0 stopped after epoch 4 of 10 in
    both runs whose logs were read, one beside two CPU hogs on a machine loaded 6 times over;
    30 epochs cost ~8 CPU-s more for nothing the assertions read."""
    import mlflow

    sweep_dir = tmp_path / "multirun"
    launcher = start_cli("-m", "hydra/launcher=slurm", "elche=nccl_sync,nccl_cadence", "cluster=slurm",
                         "cluster.num_ranks=1", "cluster.threads_per_rank=1", f"num_epochs={SWEEP_EPOCHS}",
                         f"tracking.uri=sqlite:///{mlflow_db}", f"hydra.sweep.dir={sweep_dir}",
                         env=slurm)
    wait_for("job 0 trained an epoch",
             lambda: f"epoch 1/{SWEEP_EPOCHS}" in text_of(sweep_dir / "0" / "cli.log"))
    task, _ = _array_task(slurm, 0)
    assert task is not None
    subprocess.run(["scancel", "--signal=USR2", task], env=slurm, check=True, timeout=30)
    seen: list = []
    pending_since: dict = {}
    try:  # once a second: each look is an squeue, and the requeue takes 10-20 s
        wait_for("job 0 requeued and resumed", lambda: _start_if_pending(slurm, task, seen, pending_since)
                 or "resumed from" in text_of(sweep_dir / "0" / "cli.log"), interval_s=1.0)
    except AssertionError as failed:
        raise AssertionError(f"{failed}; job 0's states: {seen}") from None
    out, _ = launcher.communicate(timeout=JOB_TIMEOUT_S)
    assert launcher.returncode == 0, out[-3000:]
    cli = text_of(sweep_dir / "0" / "cli.log")
    assert "stopping (SIGUSR2)" in cli and f"resumed from {sweep_dir / '0' / 'checkpoint'}" in cli
    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("mode") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.info.status for c in children) == ["FINISHED", "FINISHED", "KILLED"]
    resumed = next(c for c in children if "resumed_from_run_id" in c.data.tags)
    assert resumed.data.tags["resumed_from_run_id"] == next(
        c.info.run_id for c in children if c.info.status == "KILLED")
    assert parent.info.status == "FINISHED"
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [(r["overrides"], r["status"]) for r in table] == [
        ("elche=nccl_sync", "completed"), ("elche=nccl_cadence", "completed")]
    assert table[0]["mlflow_run_id"] == resumed.info.run_id
    for job in ("0", "1"):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        assert summary["world_size"] == 1 and len(summary["epochs"]) >= 1
        assert "task 0 of srun step" in text_of(sweep_dir / job / "ranks" / "rank0.log")
