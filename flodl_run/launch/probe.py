"""`python -m flodl_run.launch.probe [overrides]`: is every host of the cluster ready to train?

Owns the host inventory (a small Python program run by the worker's own interpreter over SSH,
or locally without a multi-host cluster: Python/flodl_run/torch/CUDA/NCCL versions, GPUs
through NVML, free disk at the project path), the match of `local_devices` against it, and
the readiness verdict (missing pieces fail, version skew across hosts is flagged). The launcher
uses the same inventory to lay out ranks (`hosts`). Exit 0 ready, 1 not ready, 2 bad config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from flodl_run.config.schema import ClusterConfig, Topology, WorkerConfig
from flodl_run.hardware.devices import GpuInfo
from flodl_run.launch.ssh import remote_command, ssh_argv

EXIT_NOT_READY = 1
EXIT_CONFIG = 2
PROBE_TIMEOUT_S = 90.0  # a first `import torch` on a cold network filesystem can take a minute
MIN_PYTHON = (3, 10)
LOW_DISK_BYTES = 2**30
MARKER = "FLODL_RUN_PROBE "

# Run as `python - [full]` with this text on stdin, in the project path of the host. Plain
# Python 3 so that an old interpreter still reports itself; never creates a CUDA context.
SNIPPET = r'''
import json, os, shutil, socket, subprocess, sys
r = {"hostname": socket.gethostname(), "python": "%d.%d.%d" % tuple(sys.version_info[:3]),
     "executable": sys.executable, "path": os.getcwd(), "cpu_count": os.cpu_count()}
def err(e):
    return "%s: %s" % (type(e).__name__, e)
try:
    r["disk_free_bytes"] = shutil.disk_usage(".").free
except OSError as e:
    r["disk_error"] = err(e)
try:
    import flodl_run
    r["flodl_run"] = flodl_run.__version__
except Exception as e:
    r["flodl_run_error"] = err(e)
def nvml():
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # no driver: a host without NVIDIA GPUs
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            text = lambda v: v.decode() if isinstance(v, bytes) else str(v)
            out.append([i, text(pynvml.nvmlDeviceGetUUID(h)), text(pynvml.nvmlDeviceGetName(h)),
                        int(pynvml.nvmlDeviceGetMemoryInfo(h).total)])
        return out
    finally:
        pynvml.nvmlShutdown()
def smi():
    text = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          check=True, timeout=30).stdout
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]
    return [[int(i), u, n, int(float(m)) * 2**20] for i, u, n, m in rows]
try:
    r["gpus"], r["gpu_source"] = nvml(), "nvml"
except ImportError:
    try:
        r["gpus"], r["gpu_source"] = smi(), "nvidia-smi"
    except FileNotFoundError:
        r["gpus"], r["gpu_source"] = [], "none (no pynvml, no nvidia-smi)"
    except Exception as e:
        r["gpus"], r["gpu_error"] = [], "nvidia-smi: " + err(e)
except Exception as e:
    r["gpus"], r["gpu_error"] = [], "NVML: " + err(e)
s = socket.socket()
s.bind(("", 0))
r["free_port"] = s.getsockname()[1]
s.close()
if "full" in sys.argv[1:]:
    try:
        import torch
        r["torch"], r["cuda"] = torch.__version__, torch.version.cuda
        try:
            v = torch.cuda.nccl.version()
            r["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            r["nccl"] = None
    except Exception as e:
        r["torch_error"] = err(e)
print("FLODL_RUN_PROBE " + json.dumps(r))
'''


@dataclass(frozen=True)
class HostReport:
    """What one host said about itself; `error` is set when it could not be asked."""

    host: str
    error: Optional[str] = None
    facts: Dict[str, Any] = field(default_factory=dict)
    via: str = "ssh"
    """How it was asked: ssh, or local (this host, no SSH)."""

    @property
    def reachable(self) -> bool:
        return self.error is None

    @property
    def gpus(self) -> List[GpuInfo]:
        return [GpuInfo(i, u, n, m) for i, u, n, m in self.facts.get("gpus", [])]

    def get(self, key: str) -> Any:
        return self.facts.get(key)


def worker_path(cluster: ClusterConfig, worker: WorkerConfig) -> str:
    """The project checkout on a worker: its own path, else the controller's, else ours."""
    return worker.path or cluster.controller.path or os.getcwd()


def inventory(worker: WorkerConfig, path: str, full: bool = True) -> HostReport:
    """Ask a worker about itself over SSH with its interpreter, in its project path; for a
    `docker` worker, inside its compose service, once the service is seen running."""
    args = ["-", "full"] if full else ["-"]
    if not worker.docker:
        argv = ssh_argv(worker.host, worker.ssh, remote_command(path, worker.python, args))
        return _ask(worker.host, argv, None)
    from flodl_run.launch.dockerhost import docker_command, docker_reason

    command = docker_command(path, worker.docker, worker.python, args)
    report = _ask(worker.host, ssh_argv(worker.host, worker.ssh, command), None)
    reason = docker_reason(report.error)
    if reason is not None:
        report = dataclasses.replace(report, error=f"docker compose on {worker.host} in {path}: {reason}",
                                     facts={"docker_error": reason})
    return dataclasses.replace(report, via=f"ssh+docker {worker.docker}")


def inventory_local(full: bool = True) -> HostReport:
    """The same inventory of this host, with this interpreter (no SSH)."""
    report = _ask(socket.gethostname(), [sys.executable, "-", *(["full"] if full else [])], os.getcwd())
    return dataclasses.replace(report, via="local")


def _ask(host: str, argv: List[str], cwd: Optional[str]) -> HostReport:
    try:
        done = subprocess.run(argv, input=SNIPPET, capture_output=True, text=True, cwd=cwd,
                              timeout=PROBE_TIMEOUT_S)
    except FileNotFoundError as exc:
        return HostReport(host, f"cannot run {argv[0]}: {exc.strerror}")
    except subprocess.TimeoutExpired:
        return HostReport(host, f"no answer within {PROBE_TIMEOUT_S:.0f} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER):
            return HostReport(host, None, json.loads(line[len(MARKER):]))
    tail = [ln for ln in done.stderr.strip().splitlines() if ln.strip()][-2:]
    why = " / ".join(tail) or f"exit code {done.returncode}"
    if done.returncode == 255 and argv[0] == "ssh":
        return HostReport(host, f"ssh failed: {why}")
    return HostReport(host, f"the inventory did not run (exit {done.returncode}): {why}")


def inventory_slurm(node: str, full: bool = True) -> HostReport:
    """The same inventory of one node of the allocation around us, as a one-task srun step
    there (`--overlap`: it runs beside a training step that holds the node's CPUs)."""
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--quiet",
            f"--chdir={os.getcwd()}", sys.executable, "-", *(["full"] if full else [])]
    return dataclasses.replace(_ask(node, argv, None), via="srun")


def inventories(workers: Sequence[WorkerConfig], paths: Sequence[str], full: bool = True,
                ask: Callable[..., HostReport] = inventory) -> List[HostReport]:
    """All workers at once (one ssh each, in parallel), in worker order."""
    if not workers:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(workers))) as pool:
        return list(pool.map(lambda wp: ask(wp[0], wp[1], full), zip(workers, paths)))


# ---- readiness (pure) ----------------------------------------------------------------------


def resolve_devices(local_devices: Any, gpus: List[GpuInfo]) -> Tuple[List[str], List[str]]:
    """Per-rank devices of a worker ("cpu" or a GPU UUID) and what is wrong with the list.

    `all` is every GPU the host has; it never makes CPU ranks (those come only from an explicit
    list such as [cpu, cpu]). Indices are NVML's, i.e. PCI bus order.
    """
    if local_devices == "all":
        if not gpus:
            return [], ["local_devices 'all' found no NVIDIA GPU (for CPU ranks list them: [cpu, cpu])"]
        return [g.uuid for g in gpus], []
    devices, errors = [], []
    for entry in local_devices:
        text = str(entry).strip()
        if text == "cpu":
            devices.append("cpu")
        elif text.isdigit():
            if int(text) < len(gpus):
                devices.append(gpus[int(text)].uuid)
            else:
                errors.append(f"GPU index {text} does not exist (the host has {len(gpus)} GPUs)")
        elif text.startswith(("GPU-", "MIG-")):
            hits = [g for g in gpus if g.uuid.startswith(text)]
            if len(hits) == 1:
                devices.append(hits[0].uuid)
            else:
                errors.append(f"no single GPU has UUID {text}")
        else:
            errors.append(f"device {text!r} must be a GPU index, a GPU UUID or 'cpu'")
    return devices, errors


def host_problems(report: HostReport, local_devices: Any = None, full: bool = True) -> List[str]:
    """What keeps this host from training; empty means ready."""
    if not report.reachable:
        return [report.error or "unreachable"]
    problems = []
    version = tuple(int(p) for p in str(report.get("python")).split(".")[:2])
    if version < MIN_PYTHON:
        problems.append(f"Python {report.get('python')} < {'.'.join(map(str, MIN_PYTHON))}")
    if report.get("flodl_run") is None:
        problems.append(f"flodl_run does not import in {report.get('path')} "
                        f"({report.get('flodl_run_error')})")
    if full and report.get("torch") is None:
        problems.append(f"torch does not import ({report.get('torch_error')})")
    if report.get("gpu_error"):
        problems.append(f"GPU inventory failed: {report.get('gpu_error')}")
    if local_devices is not None:
        problems += resolve_devices(local_devices, report.gpus)[1]
    return problems


def skew_flags(reports: Sequence[HostReport]) -> List[str]:
    """Versions that differ across hosts (NCCL skew can break the NCCL handshake)."""
    flags = []
    for key, why in (("torch", ""), ("nccl", " (mixed NCCL versions can fail to connect)"),
                     ("cuda", ""), ("flodl_run", ""), ("python", "")):
        seen: Dict[str, List[str]] = {}
        for r in reports:
            value = r.get(key) if r.reachable else None
            if value is not None:
                seen.setdefault(str(value), []).append(r.host)
        if len(seen) > 1:
            parts = "; ".join(f"{v} on {', '.join(hosts)}" for v, hosts in sorted(seen.items()))
            flags.append(f"{key} version skew: {parts}{why}")
    for r in reports:
        free = r.get("disk_free_bytes")
        if r.reachable and free is not None and free < LOW_DISK_BYTES:
            flags.append(f"{r.host}: only {free / 2**20:.0f} MiB free at {r.get('path')}")
    return flags


# ---- CLI -----------------------------------------------------------------------------------


def _gpu_cell(report: HostReport) -> str:
    if not report.reachable:
        return "-"
    gpus = report.gpus
    if not gpus:
        return "none"
    return "\n".join(f"{g.index}: {g.label} {g.uuid}" for g in gpus)


def _table(reports: Sequence[HostReport], problems: Sequence[List[str]]):
    from rich.table import Table

    table = Table(title="flodl_run probe", show_lines=True)
    for column in ("host", "via", "python", "flodl_run", "torch", "CUDA", "NCCL", "GPUs",
                   "free disk", "ready"):
        table.add_column(column, overflow="fold")
    for report, issues in zip(reports, problems):
        free = report.get("disk_free_bytes")
        table.add_row(
            report.host, report.via if report.reachable else "[red]unreachable[/]",
            *(str(report.get(k) or "-") for k in ("python", "flodl_run", "torch", "cuda", "nccl")),
            _gpu_cell(report), "-" if free is None else f"{free / 2**30:.1f} GiB",
            "[green]yes[/]" if not issues else "[red]no[/]")
    return table


def _controller_problem(cluster: ClusterConfig) -> Optional[str]:
    """The coordinator's address must be bindable here (the launcher runs on this machine)."""
    ctl = cluster.controller
    try:
        with socket.socket() as sock:
            sock.bind((ctl.host, ctl.port))
    except OSError as exc:
        return f"controller {ctl.host}:{ctl.port} cannot be bound on this machine: {exc.strerror}"
    return None


def probe(cluster: ClusterConfig) -> Tuple[List[HostReport], List[List[str]], List[str]]:
    """Reports, per-host problems and cluster-wide flags for this cluster config."""
    if cluster.topology is Topology.slurm and os.environ.get("SLURM_JOB_ID"):
        return _probe_allocation()
    if cluster.topology is not Topology.hosts:
        reports = [inventory_local()]
        return reports, [host_problems(reports[0])], []
    paths = [worker_path(cluster, w) for w in cluster.workers]
    reports = inventories(cluster.workers, paths)
    problems = [host_problems(r, w.local_devices) for r, w in zip(reports, cluster.workers)]
    flags = skew_flags(reports)
    controller = _controller_problem(cluster)
    if controller:
        flags.append(controller)
    return reports, problems, flags


def _probe_allocation() -> Tuple[List[HostReport], List[List[str]], List[str]]:
    """Every node of the Slurm allocation this runs in (inside sbatch or salloc), in parallel."""
    from flodl_run.launch.slurm import read_allocation

    nodes = read_allocation().nodes
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        reports = list(pool.map(inventory_slurm, nodes))
    return reports, [host_problems(r) for r in reports], skew_flags(reports)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m flodl_run.launch.probe [cluster=my_hosts ...]`: a table, then problems and flags."""
    from rich.console import Console
    from rich.markup import escape

    from flodl_run.config.compose import ComposeError, compose, to_experiment
    from flodl_run.config.materialize import ConfigError, materialize

    out, err = Console(), Console(stderr=True)
    if not out.is_terminal:
        out = Console(width=160)  # piped or captured: do not squeeze the table to 80 columns
    try:
        typed, problems = to_experiment(compose(list(sys.argv[1:] if argv is None else argv)))
        if typed is None:
            raise ConfigError(problems)
        config = materialize(typed, check_recipe=False).config
    except (ComposeError, ConfigError) as exc:
        err.print(f"[bold red]flodl_run.launch.probe:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    reports, problems, flags = probe(config.cluster)
    out.print(_table(reports, problems))
    for report, issues in zip(reports, problems):
        for issue in issues:
            out.print(f"[red]not ready[/] {escape(report.host)}: {escape(issue)}", highlight=False,
                      soft_wrap=True)
    for flag in flags:
        out.print(f"[yellow]warning:[/] {escape(flag)}", highlight=False, soft_wrap=True)
    ready = not any(problems)
    out.print(f"{len(reports)} host{'s' if len(reports) != 1 else ''}: "
              + ("[green]ready[/]" if ready else "[red]not ready[/]"), highlight=False)
    return 0 if ready else EXIT_NOT_READY


if __name__ == "__main__":
    sys.exit(main())
