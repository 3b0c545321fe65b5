"""`cluster=slurm`: the ranks of a run inside a Slurm allocation, started as one srun step.

Owns reading the allocation (nodes through `scontrol show hostnames`, tasks and GPUs per node,
the batch host's address that the coordinator binds), the srun command line and the tasks'
environment (the secret by a 0600 file, never argv), and the step's output: each line labelled
by its task goes to that rank's log and the terminal, and srun's own report of a task that
ended (`srun: error: node: task 2: Killed`) becomes that rank's exit, so the supervisor sees one
death per task while the rest of the step carries on (`--kill-on-bad-exit=0`, `--no-kill`).
Watching and stopping is `supervisor`'s, as for local ranks; what a death means is the
coordinator's. Never touches CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Set

from rich.console import Console
from rich.markup import escape

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ClusterConfig
from flodl_run.config.validate import Problem
from flodl_run.contracts.rankenv import SECRET_ENV, RankEnvironment
from flodl_run.launch.rankproc import RankProcess, host_store, is_loopback
from flodl_run.launch.slurm_task import expand_counts

STEP_NAME = "flodl_run-ranks"
_TASK_LINE = re.compile(r"(\d+): ?(.*)")
_TASK_END = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.*)")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")


@dataclass(frozen=True)
class Allocation:
    """What Slurm granted the job this process runs in."""

    job_id: str
    nodes: List[str]
    tasks_per_node: List[int]
    gpus_per_node: int
    cpus_on_node: int
    batch_host: str


@dataclass(frozen=True)
class SlurmLayout:
    """The step to start: how many ranks, on GPUs or CPU, and where the coordinator listens."""

    allocation: Allocation
    world_size: int
    gpus: bool
    addr: str
    """The batch host's address as the other nodes reach it: coordinator and store bind it."""


def gpu_count(value: Optional[str]) -> int:
    """GPUs per node from SLURM_GPUS_ON_NODE (`4`) or SLURM_GPUS_PER_NODE (`a100:4`)."""
    if not value:
        return 0
    last = value.split(",")[0].split(":")[-1]
    return int(last) if last.isdigit() else 0


def read_allocation(environ: Mapping[str, str] = os.environ) -> Allocation:
    """The allocation around this process; ConfigError outside one (no SLURM_JOB_ID)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        raise ConfigError([Problem("cluster.topology", "slurm", "must run inside a Slurm allocation "
                                   "(sbatch, salloc, or `python -m flodl_run.submit`): "
                                   "SLURM_JOB_ID is not set")])
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=30)
        nodes = done.stdout.split() if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        nodes = []
    if not nodes:
        raise ConfigError([Problem("cluster.topology", "slurm", "must see the allocation's nodes: "
                                   f"`scontrol show hostnames {nodelist}` gave none")])
    tasks = expand_counts(environ.get("SLURM_TASKS_PER_NODE") or "1")
    gpus = gpu_count(environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS_PER_NODE"))
    cpus = expand_counts(environ.get("SLURM_JOB_CPUS_PER_NODE") or environ.get("SLURM_CPUS_ON_NODE")
                         or str(os.cpu_count() or 1))[0]
    host = environ.get("SLURMD_NODENAME") or socket.gethostname()
    return Allocation(job, nodes, tasks, gpus, cpus, host)


def batch_address(cluster: ClusterConfig, allocation: Allocation) -> str:
    """cluster.controller.host when it names an address; else the batch host's, looked up."""
    host = cluster.controller.host
    if not is_loopback(host):
        return host
    try:
        return socket.gethostbyname(allocation.batch_host)
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def plan_slurm(cluster: ClusterConfig, allocation: Allocation,
               world_problems: Callable[[Optional[int]], List[Problem]]) -> SlurmLayout:
    """One rank per allocated GPU, or cluster.num_ranks CPU ranks; ConfigError naming the key
    when the allocation cannot serve the config. `world_problems(world_size)` is the run's
    rules that needed the world size (the launcher's validation; None: no ranks)."""
    wanted = cluster.slurm.gpus_per_node
    problems: List[Problem] = []
    if wanted > 0 and allocation.gpus_per_node == 0:
        problems.append(Problem("cluster.slurm.gpus_per_node", wanted,
                                f"must be GPUs the allocation has (job {allocation.job_id} has none)"))
    gpus = allocation.gpus_per_node > 0 and wanted > 0
    world = allocation.gpus_per_node * len(allocation.nodes) if gpus else cluster.num_ranks or 0
    addr = batch_address(cluster, allocation)
    if len(allocation.nodes) > 1 and is_loopback(addr):
        problems.append(Problem("cluster.controller.host", cluster.controller.host,
                                f"must be an address the other nodes reach ({allocation.batch_host} "
                                f"resolves to {addr})"))
    if world < 1:
        problems.append(Problem("cluster.num_ranks", cluster.num_ranks, "must be >= 1"))
    problems += world_problems(world or None)
    if problems:
        raise ConfigError(problems)
    return SlurmLayout(allocation, world, gpus, addr)


def slurm_line(layout: SlurmLayout) -> str:
    """e.g. `ddp: 3 ranks as one srun step on 1 node (job 12: vm) | cpu x3`."""
    alloc = layout.allocation
    nodes = len(alloc.nodes)
    shown = ",".join(alloc.nodes[:4]) + (",..." if nodes > 4 else "")
    kind = f"{alloc.gpus_per_node} GPUs per node" if layout.gpus else f"cpu x{layout.world_size}"
    return (f"ddp: {layout.world_size} rank{'s' if layout.world_size != 1 else ''} as one srun step "
            f"on {nodes} node{'s' if nodes != 1 else ''} (job {alloc.job_id}: {shown}) | {kind}")


def cpu_threads(cluster: ClusterConfig, layout: SlurmLayout) -> int:
    """Cores per CPU rank: cluster.threads_per_rank, else the node's CPUs shared by its ranks."""
    per_node = max(1, -(-layout.world_size // len(layout.allocation.nodes)))
    return cluster.threads_per_rank or max(1, layout.allocation.cpus_on_node // per_node)


def srun_argv(cluster: ClusterConfig, layout: SlurmLayout, python: str = sys.executable) -> List[str]:
    """The step: every rank a task, a task's end never ending the others."""
    nodes = len(layout.allocation.nodes)
    argv = ["srun", f"--job-name={STEP_NAME}", f"--ntasks={layout.world_size}",
            f"--nodes={nodes if layout.gpus else f'1-{nodes}'}",
            "--kill-on-bad-exit=0",  # a rank that dies is a death the others carry on through
            "--no-kill",             # so is a node that fails: the step keeps the other nodes
            "--label", "--unbuffered", "--input=none", "--export=ALL", f"--chdir={os.getcwd()}"]
    if "SLURM_STEP_ID" in os.environ:  # a sweep's job runs the launcher as a task of its own
        argv.append("--overlap")        # step (submitit's srun), which holds every resource
    if layout.gpus:
        argv += [f"--ntasks-per-node={layout.allocation.gpus_per_node}", "--gpus-per-task=1"]
    else:  # srun does not inherit the batch script's --cpus-per-task: ask for the rank's cores
        argv.append(f"--cpus-per-task={cpu_threads(cluster, layout)}")
    return argv + [python, "-m", "flodl_run.launch.slurm_task"]


def step_environment(cluster: ClusterConfig, layout: SlurmLayout, coord: str, master_port: int,
                     secret_file: Path, run_file: Path) -> Dict[str, str]:
    """srun's environment, passed to every task: ours, without the secret itself."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if "SLURM_STEP_ID" in env:  # the launcher's own step (a sweep's job): its layout is not ours
        env.pop("SLURM_NTASKS_PER_NODE", None)
    contract = RankEnvironment(
        master_addr=layout.addr, master_port=master_port, coord=coord, run_file=run_file,
        secret_file=secret_file, store_hosted=True, unbuffered=True, project=os.getcwd(),
        # the launcher's node as Slurm names it (a task's node): the launcher's MLflow monitor
        # samples it, the lowest task of every other node samples its own
        launcher_node=layout.allocation.batch_host)
    if layout.gpus:  # each task sees its own GPU (--gpus-per-task=1), so cuda:0 is its own
        contract = dataclasses.replace(contract, device="cuda:0")
    else:
        contract = dataclasses.replace(contract, device="cpu", threads=cpu_threads(cluster, layout))
    return contract.over(env)


def write_secret(path: Path, secret: bytes) -> Path:
    """The secret in a file only this user can read (the run dir is on storage every node sees)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret.hex())
    return path


def task_ends(line: str) -> Dict[int, tuple]:
    """srun's report of tasks that ended badly -> {task: (node, exit code as a shell says it)}."""
    match = _TASK_END.fullmatch(line.strip())
    if match is None:
        return {}
    node, tasks, how = match.groups()
    code = _EXIT_CODE.search(how)
    if code is not None:
        value = int(code.group(1))
    else:
        named = [s for s in signal.Signals if (signal.strsignal(s) or "").lower() == how.strip().lower()]
        value = 128 + (named[0].value if named else signal.SIGKILL.value)
    ends: Dict[int, tuple] = {}
    for part in tasks.split(","):
        low, _, high = part.partition("-")
        for task in range(int(low), int(high or low) + 1):
            ends[task] = (node, value)
    return ends


class SrunStep:
    """The running srun: routes each task's lines and records each task's end.

    A task's exit code is known when srun reports it (a bad end) or when srun itself ends: then
    a task srun named nothing about ended 0, unless srun failed without naming any task (it
    could not start the step, or was killed), which every unfinished task shares."""

    def __init__(self, process: subprocess.Popen, logs: List, console: Console,
                 nodes: List[str], job_id: str, secret_file: Optional[Path] = None):
        self.process, self.logs, self.console = process, logs, console
        self.secret_file = secret_file
        self.nodes, self.job_id = nodes, job_id
        self.ends: Dict[int, tuple] = {}
        self.stdout_done, self.stderr_done = threading.Event(), threading.Event()
        self.asked: Dict[int, Set[int]] = {}
        self.lock = threading.Lock()
        self.readers = [threading.Thread(target=self._stdout, daemon=True),
                        threading.Thread(target=self._stderr, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _stdout(self) -> None:
        for line in self.process.stdout:
            self._route(line)
        self.stdout_done.set()
        if self.secret_file is not None:  # every task has ended: none reads it again
            self.secret_file.unlink(missing_ok=True)

    def _stderr(self) -> None:
        for line in self.process.stderr:
            ends = task_ends(line)
            with self.lock:
                self.ends.update({t: e for t, e in ends.items() if t not in self.ends})
            if not ends:
                self._route(line)
        self.stderr_done.set()

    def _route(self, line: str) -> None:
        """`<task>: text` (srun's --label) to that rank's log and the terminal as `[rank k]`;
        srun's own lines to the terminal as `[srun]`."""
        match = _TASK_LINE.fullmatch(line.rstrip("\n"))
        task, text = (int(match.group(1)), match.group(2)) if match else (None, line.rstrip())
        if task is not None and task < len(self.logs) and not self.logs[task].closed:
            self.logs[task].write(text + "\n")
            self.logs[task].flush()
        label = "srun" if task is None else f"rank {task}"
        self.console.print(f"[dim]\\[{escape(label)}][/] " + escape(text), highlight=False,
                           soft_wrap=True)

    def code(self, task: int) -> Optional[int]:
        """The task's exit code, or None while it may still run. An end that srun's own end
        tells is known once both of srun's streams are read: every line of the task is then
        in its log (the log is closed after the end is seen)."""
        with self.lock:
            if task in self.ends:
                return self.ends[task][1]
        code = self.process.poll()
        if code is None or not (self.stderr_done.is_set() and self.stdout_done.is_set()):
            return None
        return 0 if code == 0 or self.ends else code

    def node(self, task: int) -> str:
        found = self.ends.get(task)
        return found[0] if found else ",".join(self.nodes)

    def ask(self, task: int, sig: int, tasks: int) -> None:
        """Signal the step once every task still running was asked for `sig` (stopping all):
        one task's end alone is left to that task, srun cannot signal a single one."""
        with self.lock:
            asked = self.asked.setdefault(sig, set())
            asked.add(task)
            running = {t for t in range(tasks) if t not in self.ends}
            if not running <= asked or self.process.poll() is not None:
                return
        if sig == signal.SIGKILL:  # the step's tasks, not only the srun client
            subprocess.run(["scancel", "--signal=KILL", f"{self.job_id}.{self._step_id()}"],
                           capture_output=True, timeout=30)
            self.process.kill()
        else:
            self.process.send_signal(sig)  # srun forwards it to every task

    def _step_id(self) -> str:
        done = subprocess.run(["squeue", "--steps", f"--jobs={self.job_id}", "--noheader",
                               "--format=%i %j"], capture_output=True, text=True, timeout=30)
        for line in done.stdout.splitlines():
            step, _, name = line.strip().partition(" ")
            if name == STEP_NAME:
                return step.rpartition(".")[2]
        return "0"


class TaskHandle:
    """One rank of the step, shaped like the Popen the supervisor watches for a local rank."""

    def __init__(self, step: SrunStep, task: int, tasks: int):
        self.step, self.task, self.tasks = step, task, tasks
        self.pid = step.process.pid

    def poll(self) -> Optional[int]:
        return self.step.code(self.task)

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def signal_rank(self, sig: int) -> None:
        self.step.ask(self.task, sig, self.tasks)


def start_step(cluster: ClusterConfig, layout: SlurmLayout, coord: str, secret: bytes,
               run_dir: Path, console: Console, *, save_path: Optional[str]) -> List[RankProcess]:
    """Host the rendezvous store on the batch host, write the secret file, start the step."""
    if len(layout.allocation.nodes) > 1:
        console.print(f"note: multi-node run: the run dir {run_dir} and save_path "
                      f"{save_path} must be on storage every node sees",
                      markup=False, highlight=False, soft_wrap=True)
    log_dir = run_dir / "ranks"
    log_dir.mkdir(parents=True, exist_ok=True)
    store = host_store(layout.addr, cluster.master_port)
    secret_file = write_secret(run_dir / "secret", secret)
    env = step_environment(cluster, layout, coord, store.port, secret_file, run_dir / "run.yaml")
    process = subprocess.Popen(srun_argv(cluster, layout), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=1,
                               start_new_session=True)  # Ctrl-C reaches the launcher only
    logs = [open(log_dir / f"rank{k}.log", "w") for k in range(layout.world_size)]
    for k, log in enumerate(logs):
        log.write(f"# rank {k} of {layout.world_size}: task {k} of srun step {STEP_NAME} "
                  f"(job {layout.allocation.job_id}, srun pid {process.pid})\n")
        log.flush()
    step = SrunStep(process, logs, console, layout.allocation.nodes, layout.allocation.job_id,
                    secret_file)
    procs = []
    for k in range(layout.world_size):
        proc = RankProcess(k, TaskHandle(step, k, layout.world_size), logs[k],  # type: ignore[arg-type]
                           forwarder=step.readers[0], host=None, store=store)
        procs.append(proc)
    return procs
