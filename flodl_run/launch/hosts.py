"""Multi-host fan-out: global ranks over `cluster.workers`, started over OpenSSH.

Owns the layout (ranks in worker order; `local_devices: all` and every other list checked
against the host's inventory), each remote rank's torchrun environment, starting one `ssh`
per rank into `python -m flodl_run.launch.ssh` with the secret and run.yaml on its stdin, and
forwarding output with host and rank prefixes. Watching and stopping the ssh processes is
`supervisor`'s, as for local ranks (the `RankProcess` record is `rankproc`'s); what a lost
host means is the coordinator's.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from rich.console import Console

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ClusterConfig, Mode, WorkerConfig
from flodl_run.config.validate import Problem
from flodl_run.contracts.rankenv import RankEnvironment
from flodl_run.hardware.devices import GpuInfo
from flodl_run.launch.dockerhost import docker_command
from flodl_run.launch.probe import (
    HostReport,
    host_problems,
    inventories,
    inventory,
    resolve_devices,
    worker_path,
)
from flodl_run.launch.rankproc import RankProcess, forward, host_store, is_loopback
from flodl_run.launch.ssh import encode_handshake, remote_command, ssh_argv

DEFAULT_MASTER_PORT = 29500  # torchrun's default, for controller-only layouts (never probed)


@dataclass(frozen=True)
class WorkerSlots:
    """One worker's share of the world: its global ranks and the device of each."""

    index: int
    worker: WorkerConfig
    path: str
    ranks: List[int]
    devices: List[str]
    """Per rank: "cpu" or a GPU UUID (as given, when the host was not probed)."""
    gpus: List[GpuInfo]
    cpu_count: int


@dataclass(frozen=True)
class HostLayout:
    workers: List[WorkerSlots]
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return sum(len(w.ranks) for w in self.workers)

    @property
    def gpus(self) -> List[GpuInfo]:
        return [g for w in self.workers for g in w.gpus]


def plan_hosts(cluster: ClusterConfig, mode: Mode, world_problems: Callable[[int], List[Problem]],
               ask: Callable[..., HostReport] = inventory) -> HostLayout:
    """Lay out the ranks; raises ConfigError naming each worker that cannot take its ranks.

    `mode` decides whether CPU and GPU ranks may mix; `world_problems(world_size)` is the run's
    rules that needed the world size (the launcher's validation), reported with the layout's.

    Every worker is asked (one ssh each, in parallel) before anything starts, so an unreachable
    host or a missing GPU is a config-style error (exit 2), not a half-started run. In
    controller-only mode nothing is started here, so nothing is asked.
    """
    paths = [worker_path(cluster, w) for w in cluster.workers]
    reports: List[Optional[HostReport]] = [None] * len(paths)
    if cluster.launch_ranks:
        reports = list(inventories(cluster.workers, paths, full=False, ask=ask))
    problems: List[Problem] = []
    slots: List[WorkerSlots] = []
    for index, (worker, path, report) in enumerate(zip(cluster.workers, paths, reports)):
        found = _worker_slots(index, worker, path, report, sum(len(s.ranks) for s in slots))
        if isinstance(found, WorkerSlots):
            slots.append(found)
        else:
            problems += found
    if problems:
        raise ConfigError(problems)
    if cluster.launch_ranks:  # the launcher hosts the rendezvous store, so it outlives any
        # worker; port 0 is picked when the store starts (start_hosts)
        layout = HostLayout(slots, cluster.controller.host, cluster.master_port)
    else:  # controller-only: torchrun/srun's ranks keep their own store, with rank 0
        master_addr = cluster.master_addr
        if is_loopback(master_addr):
            master_addr = slots[0].worker.host
        layout = HostLayout(slots, master_addr, cluster.master_port or DEFAULT_MASTER_PORT)
    problems = _layout_problems(cluster, mode, layout) + world_problems(layout.world_size)
    if problems:
        raise ConfigError(problems)
    return layout


def _worker_slots(index: int, worker: WorkerConfig, path: str, report: Optional[HostReport],
                  first_rank: int) -> WorkerSlots | List[Problem]:
    key = f"cluster.workers.{index}"
    if report is None:  # controller-only: ranks come from torchrun/srun, take the list as given
        if worker.local_devices == "all":
            return [Problem(f"{key}.local_devices", "all",
                            "needs the launcher to probe the host; list the devices when "
                            "cluster.launch_ranks=false")]
        devices, gpus, cpu_count = [str(d) for d in worker.local_devices], [], 1
    else:
        issues = host_problems(report, full=False)
        if issues and report.get("docker_error"):
            return [Problem(f"{key}.docker", worker.docker,
                            f"must be a running compose service ({report.error})")]
        if issues:
            return [Problem(f"{key}.host", worker.host,
                            f"must be reachable over ssh and ready ({'; '.join(issues)})")]
        devices, errors = resolve_devices(worker.local_devices, report.gpus)
        if errors:
            return [Problem(f"{key}.local_devices", worker.local_devices, f"{e} on {worker.host}")
                    for e in errors]
        by_uuid = {g.uuid: g for g in report.gpus}
        gpus = [by_uuid[d] for d in devices if d in by_uuid]
        cpu_count = int(report.get("cpu_count") or 1)
    ranks = list(range(first_rank, first_rank + len(devices)))
    return WorkerSlots(index, worker, path, ranks, devices, gpus, cpu_count)


def _layout_problems(cluster: ClusterConfig, mode: Mode, layout: HostLayout) -> List[Problem]:
    problems: List[Problem] = []
    if layout.world_size == 0:
        problems.append(Problem("cluster.workers", [], "must give at least one rank"))
    kinds = {"cpu" if d == "cpu" else "cuda" for w in layout.workers for d in w.devices}
    if len(kinds) > 1 and mode.is_collective:
        problems.append(Problem(
            "cluster.workers", [w.worker.local_devices for w in layout.workers],
            f"must not mix CPU and GPU ranks in mode {mode.value} "
            "(one collective backend for all ranks; use a cpu_* mode)"))
    remote = [w.worker.host for w in layout.workers if not is_loopback(w.worker.host)]
    if remote and is_loopback(cluster.controller.host):
        problems.append(Problem("cluster.controller.host", cluster.controller.host,
                                f"must be an address the workers can reach ({remote[0]} is "
                                "another machine), not loopback"))
    if remote and not cluster.launch_ranks and is_loopback(layout.master_addr):
        problems.append(Problem("cluster.master_addr", layout.master_addr,
                                "must be rank 0's address as the other workers reach it"))
    return problems


def hosts_line(layout: HostLayout) -> str:
    """e.g. `ddp: 3 ranks on 2 hosts | gpu-a.invalid: H200 (141 GB) x2 | gpu-b.invalid: cpu`."""
    parts = []
    for w in layout.workers:
        labels: Dict[str, int] = {}
        by_uuid = {g.uuid: g.label for g in w.gpus}
        for device in w.devices:
            label = by_uuid.get(device, "cpu" if device == "cpu" else f"cuda {device}")
            labels[label] = labels.get(label, 0) + 1
        kinds = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in labels.items())
        parts.append(f"{w.worker.host}: {kinds or 'no ranks'}")
    hosts = len({w.worker.host for w in layout.workers})
    return (f"ddp: {layout.world_size} rank{'s' if layout.world_size != 1 else ''} on "
            f"{hosts} host{'s' if hosts != 1 else ''} | " + " | ".join(parts))


def rank_environment(cluster: ClusterConfig, layout: HostLayout, slots: WorkerSlots,
                     local_rank: int, coord: str) -> Dict[str, str]:
    """The torchrun contract and our variables for one remote rank over the worker's env block
    (the secret is added later; the run file, the parent pid and PYTHONPATH by the remote end)."""
    device = slots.devices[local_rank]
    contract = RankEnvironment(
        rank=slots.ranks[local_rank], local_rank=local_rank, world_size=layout.world_size,
        local_world_size=len(slots.ranks), master_addr=layout.master_addr,
        master_port=layout.master_port, coord=coord, node=slots.worker.host, unbuffered=True,
        store_hosted=True, socket_ifname=slots.worker.nccl_socket_ifname or None,
        # the node the launcher's MLflow monitor samples: a worker named so samples nothing itself
        launcher_node=socket.gethostname())
    if device == "cpu":
        threads = cluster.threads_per_rank or max(1, slots.cpu_count // slots.devices.count("cpu"))
        contract = dataclasses.replace(contract, device="cpu", threads=threads)
    else:
        contract = dataclasses.replace(contract, device="cuda:0", gpu=device)
    return contract.over(slots.worker.env)


def rank_command(slots: WorkerSlots, env: Dict[str, str], rank: int, run_name: str) -> str:
    """The remote shell command of one rank: the ssh entry in the worker's path, or inside its
    compose service for a `docker` worker (`env` without the secret: -e words are argv)."""
    args = ["-m", "flodl_run.launch.ssh", "--rank", str(rank), "--run", run_name]
    if slots.worker.docker:
        return docker_command(slots.path, slots.worker.docker, slots.worker.python, args, env)
    return remote_command(slots.path, slots.worker.python, args)


def start_hosts(cluster: ClusterConfig, layout: HostLayout, coord: str, secret: bytes,
                run_dir: Path, console: Console, *, save_path: Optional[str]) -> List[RankProcess]:
    """One `ssh` per rank; each keeps its stdin open, whose EOF stops the remote rank."""
    console.print(f"note: multi-host run: save_path {save_path} must be on storage "
                  "every host sees", markup=False, highlight=False, soft_wrap=True)
    log_dir = run_dir / "ranks"
    log_dir.mkdir(parents=True, exist_ok=True)
    run_yaml = (run_dir / "run.yaml").read_text()
    store = host_store(layout.master_addr, layout.master_port)  # on controller.host
    layout = dataclasses.replace(layout, master_port=store.port)
    procs: List[RankProcess] = []
    for slots in layout.workers:
        for local_rank, rank in enumerate(slots.ranks):
            env = rank_environment(cluster, layout, slots, local_rank, coord)
            command = rank_command(slots, env, rank, run_dir.name)
            env.update(RankEnvironment(secret=secret).to_environ())  # stdin only: never argv
            process = subprocess.Popen(
                ssh_argv(slots.worker.host, slots.worker.ssh, command), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                start_new_session=True)  # Ctrl-C reaches the launcher only, as for local ranks
            try:
                process.stdin.write(encode_handshake(env, run_yaml))
                process.stdin.flush()
            except BrokenPipeError:
                pass  # ssh already gave up; its exit is reported like any rank's
            proc = RankProcess(rank, process, open(log_dir / f"rank{rank}.log", "w"),
                               host=slots.worker.host, store=store)
            proc.forwarder = threading.Thread(
                target=forward, args=(proc, console, f"{slots.worker.host} rank {rank}"), daemon=True)
            proc.forwarder.start()
            procs.append(proc)
    return procs
