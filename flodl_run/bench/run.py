"""`python -m flodl_run.bench [overrides]`: every mode against bare solo loops, torch DDP and
torch local SGD on one rig, with the same recipe, data, per-rank batch size, epochs and seed.

Owns the bench's Hydra app (conf/bench.yaml over the registered BenchRunConfig, the `bench`
group), its config checks (exit 2 naming the dotted key), the plan of runs and running them as
subprocesses with their run dirs inside the bench's. Figures and files are `benchreport`'s,
MLflow is `benchtrack`'s; the peers (bare solo loop, torch DDP, torch local SGD) are `peers`'.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.markup import escape

from flodl_run.bench.report import (
    RecipeBench,
    RunOutcome,
    bench_document,
    median_run,
    plot,
    solo_name,
    tables,
    to_markdown,
)
from flodl_run.config.app import fail_config, run_hydra_app, typed_or_exit
from flodl_run.config.compose import compose, experiment_to_yaml
from flodl_run.config.schema import (
    ClusterConfig,
    ExperimentConfig,
    Mode,
    OuterKind,
    Topology,
    TrackingConfig,
)
from flodl_run.config.validate import Problem, resolve, resolve_tracking
from flodl_run.hardware.devices import GpuInfo, visible_gpus
from flodl_run.launch import launchserver
from flodl_run.report.say import say, say_markup, say_table

PROG = "flodl_run.bench"
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
STOPPED_RUN_WAIT_S = 20.0  # a run told to stop (SIGINT) saves and stops its ranks well within this


@dataclass
class BenchRecipe:
    """One recipe of the bench: an option of the `recipe` group plus overrides."""

    name: str = "synthetic_mlp"
    """Option of the recipe group (conf/recipe/<name>.yaml)."""
    overrides: List[str] = field(default_factory=list)
    """flodl_run overrides for every run of this recipe, e.g. recipe.params.hidden=640."""
    target_eval: Optional[float] = None
    """Eval that counts as reached for time-to-target; null = the recipe's recipe.target_eval."""


@dataclass
class BenchConfig:
    """What the bench runs on the rig (the `cluster` group)."""

    recipes: List[BenchRecipe] = field(default_factory=lambda: [BenchRecipe()])
    modes: List[Mode] = field(default_factory=lambda: list(Mode))
    """flodl_run modes to run (default: all five)."""
    outers: List[OuterKind] = field(default_factory=lambda: [OuterKind.none])
    """Outer optimizers; each mode runs once per outer."""
    timeline: List[Mode] = field(default_factory=list)
    """Modes run once more with timeline=true (entry `<mode>+timeline`): the timeline's cost,
    as its samples/s over the plain run's and as recording time per batch in its trace."""
    deadline: List[Mode] = field(default_factory=list)
    """Modes run once more with elche.window_end=deadline (entry `<mode>+deadline`), next to the
    count windows of the mode's own entry (cadence and async modes; a sync mode ignores it)."""
    epochs: int = 5
    """Epochs of every run; >= 1."""
    evals_per_epoch: int = 1
    """Evals per epoch of every run, for time to quality: > 1 cuts each epoch (pass over the
    data) into that many run epochs (data.epoch_splits), each scored; >= 1 (and, as
    data.epoch_splits, at most the batches of a pass; keep it well under a rank's)."""
    batch_size: int = 32
    """Samples per batch per rank (solo: per step); >= 1."""
    seed: int = 0
    solo: bool = True
    """Run a bare solo loop at each distinct rank speed (their sum is the ideal)."""
    runner_solo: bool = True
    """Also run flodl_run's own in-process path at speed 1.0 (its ratio is to the bare loop)."""
    torch_ddp: bool = True
    """Run torch DDP on the rig as a careful user writes it (flodl_run.bench.peers)."""
    torch_localsgd: bool = True
    """Run torch's local SGD (PeriodicModelAverager) on the rig (flodl_run.bench.peers)."""
    localsgd_period: Optional[int] = None
    """torch_localsgd's local steps between averages; null = nccl_cadence's mean local steps per
    reduce in the same bench round (8 when nccl_cadence is not run); >= 1."""
    overrides: List[str] = field(default_factory=list)
    """flodl_run overrides for every run, e.g. elche.overhead_target=0.1."""
    timeout_s: float = 900.0
    """Per run, in seconds; a run past it is stopped and reported failed; > 0."""
    repeats: int = 1
    """Runs of every entry, round by round; an entry reports its median run by samples/s; >= 1."""


@dataclass
class BenchRunConfig:
    """Root of conf/bench.yaml: the bench, the rig and where to log."""

    bench: BenchConfig = field(default_factory=BenchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SCHEMAS = ((None, "base_bench_run", BenchRunConfig), ("bench", "base_bench", BenchConfig))


@dataclass(frozen=True)
class Rig:
    """The cluster the bench measures, as the user picked it and as it resolves."""

    choice: str
    """Option of the cluster group."""
    overrides: Tuple[str, ...]
    """The `cluster.*` overrides of the bench's command line, passed on to every rig run."""
    cluster: ClusterConfig
    """Resolved (threads per rank filled in)."""
    world_size: int
    gpu_uuids: Tuple[str, ...] = ()
    in_process: bool = False
    """Its runs train in the launcher's process (`solo`, or `auto` on a host with 0-1 GPUs)."""

    @property
    def speeds(self) -> List[float]:
        return list(self.cluster.emulate_slowdown or [1.0] * self.world_size)

    def describe(self) -> str:
        c = self.cluster
        where = f"{len(self.gpu_uuids)} GPU ranks" if self.gpu_uuids else \
            f"{self.world_size} CPU ranks x {c.threads_per_rank or 1} thread(s)"
        return (f"cluster={self.choice} {' '.join(self.overrides)}".rstrip()
                + f" ({where}, emulate_slowdown {self.speeds})")


@dataclass(frozen=True)
class Job:
    """One run of the bench."""

    name: str
    recipe: str
    kind: str
    """solo | torch_ddp | torch_localsgd (the peers) | runner_solo | flodl_run."""
    mode: str
    outer: str
    overrides: Tuple[str, ...]
    env: Tuple[Tuple[str, str], ...] = ()
    period: Optional[int] = None
    """torch_localsgd: local steps between averages (resolved before the run)."""

    @property
    def is_peer(self) -> bool:
        return self.kind in PEER_KINDS

    def command(self, run_dir: Path) -> List[str]:
        if self.is_peer:
            period = ["--period", str(self.period)] if self.period else []
            return [sys.executable, "-m", "flodl_run.bench.peers", "--peer", self.kind, "--run",
                    str(run_dir / "run.yaml"), "--out", str(run_dir), *period]
        return [sys.executable, "-m", "flodl_run", *self.overrides, f"hydra.run.dir={run_dir}"]


PRELOAD = ["hydra", "flodl_run.cli", "flodl_run.launch.launcher", "flodl_run.launch.supervisor",
           "flodl_run.bench.peers", "flodl_run.config.compose:register_schemas"]
"""What the bench's launch server imports before it forks the runs: the coordinator zmq and the
averaging; the peers their own module; the config schemas stored in Hydra's ConfigStore, which
every run's composition does first (37 ms a launcher). Not MLflow (1.5 CPU-s) nor matplotlib (0.5): every run
is given tracking=off (the bench logs them from its own process) and none is a sweep, so no
run draws a comparison; a run whose bench.overrides turn tracking back on imports MLflow itself."""

PEER_KINDS = ("solo", "torch_ddp", "torch_localsgd")


# ---- checks and the plan -----------------------------------------------------------------------

def check(cfg: BenchRunConfig, rig: Optional[Rig]) -> List[Problem]:
    b = cfg.bench
    problems = []
    for key, value in (("bench.epochs", b.epochs), ("bench.evals_per_epoch", b.evals_per_epoch),
                       ("bench.batch_size", b.batch_size), ("bench.repeats", b.repeats)):
        if value < 1:
            problems.append(Problem(key, value, "must be >= 1"))
    if not b.timeout_s > 0:
        problems.append(Problem("bench.timeout_s", b.timeout_s, "must be > 0"))
    if not b.recipes:
        problems.append(Problem("bench.recipes", [], "must list at least one recipe"))
    if b.modes and not b.outers:
        problems.append(Problem("bench.outers", [],
                                "must list at least one outer (none = plain averaging)"))
    if b.localsgd_period is not None and b.localsgd_period < 1:
        problems.append(Problem("bench.localsgd_period", b.localsgd_period, "must be >= 1"))
    if rig is not None and (rig.in_process or rig.cluster.topology is Topology.solo) and b.modes:
        problems.append(Problem("cluster", rig.choice,
                                "must start rank processes for modes (e.g. cluster=cpu_pair, or "
                                "cluster=local_gpus 'cluster.devices=[0]' for one GPU rank); it "
                                "runs in-process here"))
    elif rig is not None and rig.world_size < 2 and (b.torch_ddp or b.torch_localsgd):
        problems.append(Problem("cluster", rig.choice,
                                "must give 2+ ranks for the torch peers (e.g. cluster=cpu_pair), "
                                "or set bench.torch_ddp=false bench.torch_localsgd=false"))
    for key, on in (("bench.torch_ddp", b.torch_ddp), ("bench.torch_localsgd", b.torch_localsgd)):
        if rig is not None and rig.cluster.topology is Topology.hosts and on:
            problems.append(Problem(key, True, "must be false on a multi-host rig (the peers "
                                               "start local processes)"))
    return problems


def recipe_labels(recipes: Sequence[BenchRecipe]) -> List[str]:
    """The recipe's option name, numbered when one recipe appears twice with other overrides."""
    names = [r.name for r in recipes]
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]


def _common(b: BenchConfig, recipe: BenchRecipe) -> List[str]:
    splits = [f"data.epoch_splits={b.evals_per_epoch}"] if b.evals_per_epoch > 1 else []
    return [f"recipe={recipe.name}", f"num_epochs={b.epochs}", f"batch_size={b.batch_size}",
            f"seed={b.seed}", "tracking=off", *splits, *b.overrides, *recipe.overrides]


def _last_wins(overrides: Sequence[str]) -> Tuple[str, ...]:
    """One value per key (Hydra refuses a key given twice); the later override wins."""
    by_key: Dict[str, str] = {}
    for item in overrides:
        by_key.pop(item.partition("=")[0].lstrip("+~"), None)
        by_key[item.partition("=")[0].lstrip("+~")] = item
    return tuple(by_key.values())


def _solo_job(rig: Rig, b: BenchConfig, recipe: BenchRecipe, label: str, factor: float,
              kind: str = "solo") -> Job:
    """Solo at one rank speed, on that rank's device (its GPU, or its CPU threads): the bare
    loop (kind solo) or flodl_run's own in-process path (runner_solo)."""
    rank = rig.speeds.index(factor)
    placement = [f"cluster.emulate_slowdown=[{factor!r}]"]
    env: Tuple[Tuple[str, str], ...] = ()
    if rig.gpu_uuids:
        placement.append("device=cuda:0")
        env = (("CUDA_VISIBLE_DEVICES", rig.gpu_uuids[rank]), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
    else:
        placement += ["device=cpu", f"cluster.threads_per_rank={rig.cluster.threads_per_rank or 1}"]
    overrides = _last_wins(["cluster=solo", *_common(b, recipe), *placement])
    name = solo_name(factor) if kind == "solo" else f"runner_{solo_name(factor)}"
    return Job(name, label, kind, "solo", "none", overrides, env)


def plan(cfg: BenchRunConfig, rig: Rig) -> List[Job]:
    """Per recipe: the bare solo loop at each distinct speed, flodl_run's solo path, torch DDP,
    every mode x outer, then torch local SGD (its period may come from nccl_cadence's run)."""
    b, jobs = cfg.bench, []
    rig_overrides = [f"cluster={rig.choice}", *rig.overrides]
    for recipe, label in zip(b.recipes, recipe_labels(b.recipes)):
        if b.solo:
            jobs += [_solo_job(rig, b, recipe, label, f) for f in sorted(set(rig.speeds))]
        if b.runner_solo:
            jobs.append(_solo_job(rig, b, recipe, label, min(rig.speeds), "runner_solo"))
        if b.torch_ddp:
            jobs.append(Job("torch_ddp", label, "torch_ddp", "torch_ddp", "none",
                            _last_wins([*rig_overrides, *_common(b, recipe)])))
        for mode in dict.fromkeys(b.modes):
            for outer in dict.fromkeys(b.outers):
                name = mode.value if outer is OuterKind.none else f"{mode.value}+{outer.value}"
                jobs.append(Job(name, label, "flodl_run", mode.value, outer.value, _last_wins(
                    [*rig_overrides, f"elche={mode.value}", f"outer={outer.value}",
                     *_common(b, recipe)])))
        for variant, modes, override in (("timeline", b.timeline, "timeline=true"),
                                         ("deadline", b.deadline, "elche.window_end=deadline")):
            for mode in dict.fromkeys(modes):
                jobs.append(Job(f"{mode.value}+{variant}", label, "flodl_run", mode.value, "none",
                                _last_wins([*rig_overrides, f"elche={mode.value}",
                                            *_common(b, recipe), override])))
        if b.torch_localsgd:
            jobs.append(Job("torch_localsgd", label, "torch_localsgd", "torch_localsgd", "none",
                            _last_wins([*rig_overrides, *_common(b, recipe)]),
                            period=b.localsgd_period))
    return jobs


def localsgd_period(cadence: Optional[Dict[str, Any]], batch_size: int) -> int:
    """nccl_cadence's mean local steps per reduce (batches per rank per sync, rounded), from its
    summary.json; DEFAULT_PERIOD without a completed run to copy."""
    from flodl_run.bench.peers import DEFAULT_PERIOD

    if not cadence or cadence.get("status") != "completed" or not cadence.get("syncs"):
        return DEFAULT_PERIOD
    samples = sum(e.get("samples", 0) for e in cadence.get("epochs", []))
    batches_per_rank = samples / batch_size / max(cadence.get("world_size", 1), 1)
    return max(1, round(batches_per_rank / cadence["syncs"]))


def resolve_rig(cfg: BenchRunConfig, choice: str, overrides: Sequence[str],
                gpus: Optional[List[GpuInfo]] = None) -> Rig:
    """The rig `cluster=<choice>` resolves to on this host (`gpus`: the visible ones, probed
    when None). An in-process rig (`solo`, or `auto` with one GPU) trains on the GPU when one
    is visible, as the runner's own in-process run does: so do its solo loops."""
    from flodl_run.launch.launcher import plan_topology

    config = resolve(ExperimentConfig(cluster=cfg.cluster))
    topology = plan_topology(config, gpus) if config.cluster.topology is not Topology.hosts else None
    world_size = topology.world_size if topology else len(cfg.cluster.emulate_slowdown or []) or 2
    uuids = tuple(g.uuid for g in topology.gpus) if topology and topology.gpus else ()
    if topology and topology.in_process:
        visible = topology.gpus or (visible_gpus() if gpus is None else gpus)
        uuids = tuple(g.uuid for g in visible[:1])
    return Rig(choice, tuple(overrides), config.cluster, world_size, uuids,
               in_process=bool(topology and topology.in_process))


# ---- running ----------------------------------------------------------------------------------

def materialize_job(job: Job, run_dir: Path) -> ExperimentConfig:
    """The job's config as its run will resolve it; ConfigError names a bad override."""
    from flodl_run.config.materialize import materialize

    return materialize(compose(list(job.overrides)), run_dir=str(run_dir),
                       outputs_dir=str(Path.cwd() / "outputs")).config


def run_job(job: Job, run_dir: Path, timeout_s: float, console: Console) -> Tuple[RunOutcome, bool]:
    """Run one job as a process of its own: forked from the bench's launch server when there
    is one (a CPU rig), else a fresh interpreter. Returns its outcome and whether Ctrl-C
    stopped it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = job.command(run_dir)
    env = dict(os.environ, **dict(job.env))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    interrupted = False
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    server, proc = launchserver.preforked(), None
    with open(run_dir / "output.log", "w") as log:
        try:
            if server is not None:  # argv: python -m <module> *args
                try:
                    proc = server.start(argv[3:], os.getcwd(), env, module=argv[2], output=log.fileno())
                except (OSError, RuntimeError) as exc:
                    say_markup(console, f"[yellow]{job.name}: the launch server is gone ({exc}); "
                                        "this run and the rest start as fresh interpreters[/]")
                    launchserver.dismiss()
            if proc is None:
                proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            say_markup(console, f"[red]{job.name}: past bench.timeout_s={timeout_s:g}, stopping it[/]")
            _stop(proc)
        except launchserver.StartInterrupted as stopped:  # it may have missed the SIGINT
            interrupted, proc = True, stopped.launched
            _stop(proc)
        except KeyboardInterrupt:  # the child got the SIGINT too: let it save and stop its ranks
            interrupted = True
            if proc is not None:  # else Ctrl-C came before it started
                _stop(proc, already_signalled=True)
    wall_s = time.perf_counter() - began
    summary = _read_summary(run_dir / "summary.json")
    if proc is None:
        summary = {"status": "interrupted", "message": "Ctrl-C before the run started"}
    elif proc.returncode != 0 and summary.get("status") == "completed":
        summary["status"] = "failed"
    shown = " ".join(shlex.quote(a) for a in ["python", *argv[1:]])
    return RunOutcome(job.name, job.recipe, job.kind, job.mode, job.outer, wall_s, summary,
                      str(run_dir), shown, [load_start, os.getloadavg()[0]]), interrupted


def _stop(proc: subprocess.Popen, already_signalled: bool = False) -> None:
    if not already_signalled:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOPPED_RUN_WAIT_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        proc.wait()


def _read_summary(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _outcome_line(o: RunOutcome) -> str:
    s = o.summary
    if s.get("status") != "completed":
        return (f"[red]{s.get('status', 'failed')}[/] {escape(s.get('message') or '')} "
                f"(see {escape(o.run_dir)}/output.log)")  # a rank's error may hold [...]
    final = s.get("final_eval")
    return (f"eval {final:.4f} | " if final is not None else "") + \
        f"{s.get('samples_per_s', 0):,.0f} samples/s | wall {o.wall_s:.1f}s | load " \
        f"{o.load_average[0]:.2f} -> {o.load_average[1]:.2f}"


def run_all(jobs: Sequence[Job], bench_dir: Path, timeout_s: float, repeats: int,
            console: Console, batch_size: int = 1) -> Tuple[List[RunOutcome], bool]:
    """Every job `repeats` times, round by round (so a load that comes and goes touches every
    entry alike); each entry is then its median run by samples/s."""
    runs: Dict[Job, List[RunOutcome]] = {job: [] for job in jobs}
    total, interrupted = len(jobs) * repeats, False
    try:
        for rep, (i, planned) in itertools.product(range(repeats), list(enumerate(jobs, 1))):
            job = planned
            say_markup(console, f"[bold]\\[{rep * len(jobs) + i}/{total}][/] {job.recipe} {job.name} ...")
            run_dir = bench_dir / job.recipe / job.name
            run_dir = run_dir / f"rep{rep}" if repeats > 1 else run_dir
            if job.kind == "torch_localsgd" and job.period is None:
                cadence = next((runs[j][-1].summary for j in jobs if j.recipe == job.recipe
                                and j.name == "nccl_cadence" and len(runs[j]) > rep), None)
                job = replace(job, period=localsgd_period(cadence, batch_size))
                say(console, f"      period {job.period} local steps")
            if job.is_peer:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "run.yaml").write_text(experiment_to_yaml(materialize_job(job, run_dir)))
            outcome, interrupted = run_job(job, run_dir, timeout_s, console)
            runs[planned].append(outcome)
            say_markup(console, f"      {_outcome_line(outcome)}")
            if interrupted:
                break
    except KeyboardInterrupt:  # between two runs: the bench ends with the runs it has
        interrupted = True
    return [median_run(r) for r in runs.values() if r], interrupted


# ---- the app ----------------------------------------------------------------------------------

def machine() -> str:
    from flodl_run.hardware.hostinfo import this_host

    host = this_host()
    model = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    gpus = "; GPUs: " + ", ".join(g.label for g in host.gpus) if host.gpus else ""
    return (f"{host.host}: {model}, {host.cpu_count} cores, "
            f"{(host.ram_bytes or 0) / 2**30:.0f} GiB RAM{gpus}; "
            f"Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def _problems_text(problems: Sequence[Problem]) -> str:
    count = len(problems)
    lines = [f"invalid config ({count} problem{'s' if count != 1 else ''}):"]
    return "\n".join(lines + [f"  {p}" for p in problems])


def _validate_jobs(jobs: Sequence[Job], bench_dir: Path) -> Iterator[Problem]:
    """Compose and validate every distinct run before any starts (a typo fails in seconds)."""
    from flodl_run.config.compose import ComposeError
    from flodl_run.config.materialize import ConfigError

    for job in jobs:
        try:
            materialize_job(job, bench_dir / job.recipe / job.name)
        except ComposeError as exc:
            yield Problem(f"{job.recipe}/{job.name}", " ".join(job.overrides),
                          str(exc).splitlines()[0])
        except ConfigError as exc:
            for p in exc.problems:
                yield Problem(f"{job.recipe}/{job.name}: {p.key}", p.value, p.rule)


def bench_main(cfg: Any) -> int:
    """The body of the Hydra job; returns the exit status."""
    from hydra.core.hydra_config import HydraConfig

    err, out = Console(stderr=True), Console()
    if not out.is_terminal:
        out = Console(width=200)  # piped or captured: do not squeeze the table to 80 columns
    hydra_cfg = HydraConfig.get()
    bench_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    task = [str(o) for o in hydra_cfg.overrides.task]
    choice = str(hydra_cfg.runtime.choices.get("cluster"))
    typed = typed_or_exit(cfg, PROG)
    from flodl_run.config.materialize import ConfigError

    try:  # what only the hardware can tell (a GPU that is not there) is a config error too
        rig = resolve_rig(typed, choice, [o for o in task if o.lstrip("+~").startswith("cluster.")])
    except ConfigError as exc:
        fail_config(str(exc), err, PROG)
    problems = check(typed, rig)
    jobs = plan(typed, rig) if not problems else []
    problems += list(_validate_jobs(jobs, bench_dir))
    if problems:
        fail_config(_problems_text(problems), err, PROG)
    if rig.gpu_uuids:  # runs on GPUs start as fresh interpreters, as ranks on GPUs do
        launchserver.dismiss()
    elif launchserver.preforked() is not None:
        launchserver.preforked().warm(PRELOAD)
    try:
        return _run_bench(typed, rig, jobs, bench_dir, task, out)
    finally:
        launchserver.dismiss()  # the server exits, and the bench waits for it


def _run_bench(cfg: BenchRunConfig, rig: Rig, jobs: Sequence[Job], bench_dir: Path,
               task: Sequence[str], out: Console) -> int:
    from flodl_run.bench.track import make_bench_tracker

    b = cfg.bench
    command = " ".join(["python -m flodl_run.bench", *(shlex.quote(t) for t in task)])
    load_start = os.getloadavg()[0]
    say(out, f"bench: {len(jobs)} runs x {b.repeats} | rig {rig.describe()} | load {load_start:.2f}")
    outputs = str(Path.cwd() / "outputs")
    tracking = resolve_tracking(cfg.tracking, outputs_dir=outputs)
    tracker = make_bench_tracker(tracking)
    tracker.start({"command": command, "rig": rig.describe(), "epochs": b.epochs,
                   "batch_size": b.batch_size, "seed": b.seed,
                   "modes": ",".join(m.value for m in b.modes),
                   "outers": ",".join(o.value for o in b.outers),
                   "recipes": ";".join(f"{r.name} {' '.join(r.overrides)}" for r in b.recipes)},
                  {"name": f"bench {' '.join(task)}".strip(), "bench_dir": str(bench_dir)})
    outcomes, interrupted = run_all(jobs, bench_dir, b.timeout_s, b.repeats, out, b.batch_size)
    recipes = []
    for recipe, label in zip(b.recipes, recipe_labels(b.recipes)):
        job = next(j for j in jobs if j.recipe == label)
        declared = materialize_job(job, bench_dir / label / job.name).recipe
        target = declared.target_eval if recipe.target_eval is None else recipe.target_eval
        recipes.append(RecipeBench(label, target, rig.speeds, overrides=list(recipe.overrides),
                                   eval_direction=declared.eval_direction.value))
    meta = {"command": command, "machine": machine(), "rig": rig.describe(),
            "runs": f"batch_size {b.batch_size} per rank, {b.epochs} epochs, seed {b.seed}"
                    + (f", {b.repeats} repeats round by round (each entry: its median run by "
                       f"samples/s)" if b.repeats > 1 else ""),
            "load_average": [load_start, os.getloadavg()[0]],
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    doc = bench_document(recipes, outcomes, meta)
    files = _write(doc, bench_dir)
    for table in tables(doc):
        say_table(out, table)
    say(out, f"wrote {', '.join(str(f) for f in files)}")
    failed = any(e["status"] != "completed" for e in doc["entries"])
    tracker.log_entries(doc["entries"], [o.summary for o in outcomes])
    tracker.finish(files, "KILLED" if interrupted else "FAILED" if failed else "FINISHED")
    return EXIT_INTERRUPTED if interrupted else EXIT_FAILED if failed else 0


def _write(doc: Dict[str, Any], bench_dir: Path) -> List[Path]:
    bench_dir.mkdir(parents=True, exist_ok=True)
    files = [bench_dir / "bench.json", bench_dir / "bench.md"]
    files[0].write_text(json.dumps(doc, indent=2) + "\n")
    files[1].write_text(to_markdown(doc))
    png = plot(doc, bench_dir / "bench.png")
    return files + ([png] if png is not None else [])


def main() -> None:
    """Entry point; Hydra's flags (--cfg, --help) work as usual."""
    sys.exit(run_hydra_app("bench", bench_main, extra_schemas=SCHEMAS))


if __name__ == "__main__":
    main()
