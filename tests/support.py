"""Helpers shared by test modules (not a test module: pytest collects nothing here).

Test modules import helpers from here and fixtures come from conftest.py, so no test module
imports another one.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Set

import pytest
import torch
from torch import nn

from flodl_run.bench.run import PRELOAD, BenchConfig, BenchRunConfig, Rig, plan
from flodl_run.config.schema import ClusterConfig, ExperimentConfig, Mode, Topology, WorkerConfig
from flodl_run.launch.launchserver import LaunchServer
from flodl_run.launch.probe import HostReport

REPO = Path(__file__).resolve().parents[1]

PAIR = ("cluster=cpu", "cluster.num_ranks=2", "cluster.threads_per_rank=1")
"""Two equal CPU ranks of one thread each."""
LOCKSTEP = (*PAIR, "elche=nccl_sync", "elche.max_batch_diff=0")
"""An equal pair in lockstep: every step is a reduce, so counts and weights are exact. (Without
elche.max_batch_diff=0 a rank that a loaded machine slows for a moment lets the other keep
stepping: sync is not lockstep.)"""


def _free_port() -> int:
    """A TCP port free on loopback right now (for a Gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs)` for a test's ranks, forked from
    multiprocessing's forkserver: it imports torch, torch.distributed and these helpers once per
    pytest worker, where a spawned rank spends about two CPU-seconds importing them."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "tests.support"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _model(seed: int) -> nn.Module:
    """A small model with BatchNorm buffers set off their defaults (so averaging them shows)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    bn = model[1]
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.num_batches_tracked.fill_(10 + seed)
    return model


def user_recipe(tmp_path: Path, module: str, source: str, **env: str) -> Dict[str, str]:
    """A user's recipe outside the repo: `source` written as `<tmp>/userpkg/<module>.py`; the
    environment a run of `recipe=custom recipe.module=<module>` needs to import it (this
    process's, its package and the repo on PYTHONPATH, and `env`)."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir(exist_ok=True)
    (pkg / f"{module}.py").write_text(source)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(REPO)]), **env)


SLOW_STEPS = (
    "import time\n"
    "from recipes import digits_mlp\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def train_step(model, batch):\n"
    "    time.sleep(0.02)\n"
    "    return digits_mlp.train_step(model, batch)\n"
)
"""A user recipe (`user_recipe`) whose step mostly waits: a run that lasts without spending
the machine's CPU."""


def _run(tmp_path: Path, *overrides: str, timeout: int = 180, env=None,
         tracking: str = "off") -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m flodl_run` with its run dir at `<tmp_path>/run` (`run_cli`): the finished
    process (with the launcher's `pid`, to look for what it left behind) and the parsed
    summary.json ({} when none was written)."""
    run_dir = tmp_path / "run"
    proc = run_cli(f"tracking={tracking}", f"hydra.run.dir={run_dir}", *overrides, timeout=timeout,
                   env=env)
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return proc, summary


_server: Optional[LaunchServer] = None

TRACKED_PRELOAD = ["mlflow", "mlflow.store.tracking.sqlalchemy_store",
                   "mlflow.system_metrics.system_metrics_monitor", "matplotlib.figure"]
"""What the suite's runs import beyond a bench's (bench.run.PRELOAD): a tracked run's launcher
MLflow, and the SQL store behind every `sqlite:` URI, which `import mlflow` leaves for the first
client to import (SQLAlchemy, alembic, the table models: 1.26 CPU-s; a forked 2-rank launcher
tracking to a migrated store took 1.58-1.70 CPU-s without it, 0.70-0.78 with it); a sweep's
comparison matplotlib."""


def launch_server() -> LaunchServer:
    """This worker's launch server (flodl_run/launch/launchserver.py), started on first use."""
    global _server
    if _server is None or not _server.alive():
        _server = LaunchServer.spawn(str(REPO), [*PRELOAD, *TRACKED_PRELOAD, "flodl_run.bench.run"])
    return _server


def running_launchers() -> Set[int]:
    """The pids of this worker's launchers now running (held by a fixture of a wider scope, when
    read before a test)."""
    if _server is None or not _server.alive():
        return set()
    return {pid for pid, launched in list(_server.running.items()) if launched.poll() is None}


def kill_leftover_launchers(keep: Set[int] = frozenset()) -> None:
    """After a test: a launcher it started and never waited for (it failed first) is killed,
    so a sweep waiting on a queue does not outlive the suite; those in `keep` (a module
    fixture's run, started before the test) carry on."""
    if _server is not None and _server.alive():
        _server.kill_running(keep)


def run_module(module: str, *args: str, timeout: float = 180, env=None,
               cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m <module> *args` (another entry point of the package: flodl_run.review,
    .bench, .sim, .submit) run to its end as `run_cli` runs the CLI, forked from the launch
    server; FLODL_TESTS_FRESH=1 starts a fresh interpreter instead."""
    if os.environ.get("FLODL_TESTS_FRESH") == "1":
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    pid, code, out, err = launch_server().run(
        list(args), str(cwd), dict(os.environ if env is None else env), timeout, module=module)
    proc = subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out, err)
    proc.pid = pid
    return proc


def run_cli(*args: str, timeout: float = 180, env=None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m flodl_run *args` run to its end in `cwd` (the repo unless given), as
    `subprocess.run(..., capture_output=True, text=True)` would, with the launcher's `pid`
    added. The launcher is
    forked from this worker's launch server (flodl_run/launch/launchserver.py says what that changes:
    nothing the run can see); FLODL_TESTS_FRESH=1 in the environment of pytest starts a fresh
    interpreter instead."""
    argv = [sys.executable, "-m", "flodl_run", *args]
    if os.environ.get("FLODL_TESTS_FRESH") == "1":
        with subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) as launcher:
            try:
                out, err = launcher.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.communicate()
                raise
        pid, code = launcher.pid, launcher.returncode
    else:
        pid, code, out, err = launch_server().run(
            list(args), str(cwd), dict(os.environ if env is None else env), timeout)
    proc = subprocess.CompletedProcess(argv, code, out, err)
    proc.pid = pid
    return proc


def start_cli(*args: str, env=None):
    """`python -m flodl_run *args`, running in the repo with its stdout and stderr merged into
    `.stdout` (text): for tests that read its output as it comes or send it signals. Forked
    from this worker's launch server, like `_run`'s, and Popen-like (`pid`, `poll`, `wait`,
    `communicate`, `send_signal`); FLODL_TESTS_FRESH=1 makes it a real `subprocess.Popen` of a
    fresh interpreter."""
    if os.environ.get("FLODL_TESTS_FRESH") == "1":
        return subprocess.Popen([sys.executable, "-m", "flodl_run", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return launch_server().start(list(args), str(REPO),
                                             dict(os.environ if env is None else env))


def wait_for(what: str, condition, timeout_s: float = 240, interval_s: float = 0.2) -> None:
    """Until `condition()` holds, asked every `interval_s` (polling a file or a queue); the
    bound is for a failure."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(interval_s)


def text_of(path: Path) -> str:
    """A file's text, or "" while it does not exist yet."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _live_ranks(run_dir: Path) -> list[int]:
    """PIDs of the run's rank processes still alive (zombies aside), from the pid each
    ranks/rankN.log names in its first line, written when the supervisor started it. Forked
    ranks carry no trace of their launcher in /proc (they show the command line and environ
    of the process they were forked from), so the run's own record is what finds them; a pid
    taken since by another program is told apart by name (`flodl_rankN`) or command line."""
    found = []
    for log in sorted((run_dir / "ranks").glob("rank*.log")):
        first = log.read_text().split("\n", 1)[0]
        match = re.search(r"pid (\d+)", first)
        if match is None:
            continue
        pid = int(match[1])
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        ours = stat.split(" (", 1)[-1].startswith("flodl_rank") or b"flodl_run.rank" in cmdline
        if ours and ") Z " not in stat:
            found.append(pid)
    return found


def pooled_share(epochs, rank: int = 0) -> float:
    """`rank`'s share of the batches over `epochs` (EpochRecords or summary.json's dicts),
    each epoch weighted by its samples: the balance over several epochs. One epoch's share is
    not the balance under cpu_async, whose whole chunks move batches between epochs."""
    rows = [e if isinstance(e, dict) else vars(e) for e in epochs]
    return sum(r["per_rank_batch_share"][rank] * r["samples"] for r in rows) / sum(r["samples"] for r in rows)


def make(**dotted) -> ExperimentConfig:
    """A default config with `a__b=v` meaning `cfg.a.b = v` (nested dataclasses are mutable)."""
    cfg = ExperimentConfig()
    for key, value in dotted.items():
        *path, leaf = key.split("__")
        target = cfg
        for name in path:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return cfg


def world_rules(config: ExperimentConfig):
    """The config's rules that need the world size, as the launcher hands them to the hosts and
    slurm planners."""
    from flodl_run.config.validate import validate

    return lambda world_size: validate(config, world_size).problems


def plan_layout(config: ExperimentConfig, ask=None):
    """`hosts.plan_hosts` as the launcher calls it for `config` (`ask`: a stand-in for the
    inventory over ssh; None asks the real hosts)."""
    from flodl_run.launch.hosts import plan_hosts

    extra = {} if ask is None else {"ask": ask}
    return plan_hosts(config.cluster, config.elche.mode, world_rules(config), **extra)


# The shell: clocks, sockets, files, logging, tracking, tensors, Hydra.
FORBIDDEN_ROOTS = {"time", "socket", "zmq", "logging", "mlflow", "torch", "hydra", "omegaconf",
                   "os", "pathlib", "subprocess", "threading", "asyncio", "rich",
                   "datetime", "io", "shutil", "tempfile", "sys"}


def _imports(path: Path) -> list[str]:
    """Every module a file imports, absolute (`from flodl_run import guard` -> flodl_run.elche.guard)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["flodl_run"] + ([base] if base else []))
            names.append(base)
            if base == "flodl_run":
                names += [f"flodl_run.{alias.name}" for alias in node.names]
    return names


def start_controller(run_dir: Path, num_ranks: int, *overrides: str) -> tuple:
    """A controller-only launcher (`cluster.launch_ranks=false`) for `num_ranks` CPU ranks, read
    up to its announcement; (the launcher process, the environment its ranks need)."""
    launcher = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "cluster=cpu",
                         f"cluster.num_ranks={num_ranks}", "cluster.launch_ranks=false", *overrides)
    for line in launcher.stdout:
        if "controller-only" in line:
            break
    info = json.loads((run_dir / "controller.json").read_text())
    env = dict(os.environ, FLODL_RUN_COORD=info["coord"], FLODL_RUN_FILE=info["run_file"],
               FLODL_RUN_SECRET=Path(info["secret_file"]).read_text(), PYTHONPATH=str(REPO))
    return launcher, env


def external_imports(path: Path) -> list[str]:
    """The absolute imports of a file that leave the package (`import time`, `from torch import
    nn`), in order, lazy ones included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if not a.name.startswith("flodl_run")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and not node.module.startswith("flodl_run"):
            names.append(node.module)
    return names


def module_name(path: Path, root: Path) -> str:
    """`flodl_run/config/schema.py` -> `flodl_run.config.schema` (`__init__.py` names its
    package); `root` is the folder that holds the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every .py under `package`, read with
    ast (so imports inside functions count too; a lazy import is still a dependency).

    `from flodl_run import x` and `from flodl_run.config import schema` name the submodule
    when there is one, else the package; relative imports are resolved against the module."""
    root = package.parent
    paths = {module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in paths else base)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle as a module chain that ends where it starts (`a -> b -> a`), one per
    strongly connected group of modules, shortest chain through its first module."""
    cycles = []
    for group in _strongly_connected(graph):
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        chain = None
        while frontier and chain is None:  # breadth first: the shortest way back to start
            step = []
            for module in frontier:
                for target in sorted(graph[module] & group):
                    if target == start:
                        chain = paths[module] + [start]
                        break
                    if target not in paths:
                        paths[target] = paths[module] + [target]
                        step.append(target)
                if chain:
                    break
            frontier = step
        cycles.append(chain)
    return cycles


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that all reach each other (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            target = next(edges, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


# ---- two "hosts" on loopback (the `sshd` fixture of conftest.py serves them) ----------------

HOSTS = ("127.0.0.2", "127.0.0.3")
"""The loopback addresses the test sshd listens on, one "host" each."""


def free_common_port(hosts) -> int:
    """A port free on every address in `hosts` (sshd listens on all of them with one port)."""
    for _ in range(20):
        with socket.socket() as probe_sock:
            probe_sock.bind((hosts[0], 0))
            port = probe_sock.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise OSError("no common free port")


# ---- chromium, headless ------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium; .ci/run does)")


def _chromium(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True, text=True, timeout=60)


# ---- host inventories without hosts (facts and configs as the probe would see them) ------

GPUS = [[0, "GPU-aaaa-0", "NVIDIA H200", 141 * 2**30], [1, "GPU-bbbb-1", "NVIDIA A100", 80 * 2**30]]


def facts(gpus=(), **more) -> dict:
    base = {"python": "3.11.7", "flodl_run": "0.1.0", "path": "/srv/x", "cpu_count": 8,
            "free_port": 29511, "gpus": list(gpus)}
    base.update(more)
    return base


def config(*workers: WorkerConfig, mode: Mode = Mode.nccl_cadence, **cluster) -> ExperimentConfig:
    cfg = ExperimentConfig(cluster=ClusterConfig(topology=Topology.hosts, workers=list(workers),
                                                 **cluster))
    cfg.elche.mode = mode
    return cfg


def fake_ask(by_host: dict):
    """An inventory that answers from a table (host -> facts, or an error string)."""
    def ask(worker, path, full):
        answer = by_host[worker.host]
        if isinstance(answer, str):
            return HostReport(worker.host, answer)
        return HostReport(worker.host, None, answer)
    return ask


# ---- bench documents without bench runs -------------------------------------------------

def _summary(evals, epoch_ms=1000.0, status="completed", samples_per_s=100.0):
    return {"status": status, "samples_per_s": samples_per_s, "final_eval": evals[-1],
            "epochs": [{"epoch": i, "avg_loss": 1.0 / (i + 1), "eval": e, "epoch_ms": epoch_ms,
                        "per_rank_throughput": [samples_per_s], "per_rank_batch_share": [1.0]}
                       for i, e in enumerate(evals)]}


def _pair_rig() -> Rig:
    cluster = ClusterConfig(topology=Topology.cpu, num_ranks=2, threads_per_rank=1,
                            emulate_slowdown=[1.0, 2.5])
    return Rig("cpu_pair", ("cluster.emulate_slowdown=[1.0,2.5]",), cluster, 2)


def cadence_bench_jobs(**variants) -> list:
    """The bench's plan for nccl_cadence alone on the CPU pair (no solo, peers or DDP runs),
    with `variants` (e.g. timeline=[Mode.nccl_cadence]) adding its extra entries."""
    cfg = BenchRunConfig(bench=BenchConfig(modes=[Mode.nccl_cadence], solo=False, runner_solo=False,
                                           torch_ddp=False, torch_localsgd=False, **variants),
                         cluster=ClusterConfig(topology=Topology.cpu, num_ranks=2))
    return plan(cfg, _pair_rig())


REOPEN = 20  # connections a Flood re-opens a port every 10 ms (2,000 a second)


class Flood:
    """Keeps `count` idle TCP connections open to each port of `targets` from a thread of its
    own, re-opening each one the far side closes (`dropped` counts those). `stop()` closes them
    all."""

    def __init__(self) -> None:
        self.targets: Dict[int, int] = {}
        self.live: Dict[int, int] = {}
        self.dropped: Dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def aim(self, port: int, count: int) -> None:
        with self._lock:
            self.targets[port] = count
            self.live.setdefault(port, 0)
            self.dropped.setdefault(port, 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _open(self, port: int) -> bool:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            sock.close()
            return False
        self._selector.register(sock, selectors.EVENT_READ, port)
        self.live[port] += 1
        return True

    def _run(self) -> None:
        """Open each port's connections at once, then re-open what was closed, at most
        REOPEN a port every 10 ms: a flood kept up, not a busy loop on two cores."""
        full: Set[int] = set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    targets = dict(self.targets)
                for port, count in targets.items():
                    missing = count - self.live[port]
                    for _ in range(min(REOPEN, missing) if port in full else missing):
                        if not self._open(port):
                            break
                    full.add(port)
                began = time.monotonic()
                while time.monotonic() - began < 0.01:
                    for key, _ in self._selector.select(0.01 - (time.monotonic() - began)):
                        self._read(key)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        try:
            if key.fileobj.recv(4096):
                return  # a greeting: the connection stays idle from our side
        except BlockingIOError:
            return
        except OSError:
            pass
        self._selector.unregister(key.fileobj)
        key.fileobj.close()
        self.live[key.data] -= 1
        self.dropped[key.data] += 1
