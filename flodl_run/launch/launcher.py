"""The launcher: decides the topology of a materialized run and carries it out.

Owns the choice in-process vs one process per rank, the hardware line and the one-device
notice, the tracker's lifetime, the run dir's summary.json and the final line naming what the
run wrote. Training itself lives in `solo` (in-process) and in the rank runtime (`supervisor`,
`coordinator`, `rank`). Never touches CUDA.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

from rich.console import Console

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ClusterConfig, DashboardConfig, ExperimentConfig, Topology
from flodl_run.config.validate import Problem, validate
from flodl_run.contracts.signals import stop_signal
from flodl_run.contracts.summary import Summary, write_outcome, write_summary
from flodl_run.control.runstate import STOP_GRACE_S
from flodl_run.hardware.devices import GpuInfo, hardware_line, pick_gpus, visible_gpus
from flodl_run.launch.notices import say_what_differs
from flodl_run.launch.zygote import fork_ranks, ready_spare
from flodl_run.observe.observer import Observer, Observers, OutputErrors
from flodl_run.observe.timeline import FILE_NAME as TIMELINE_FILE
from flodl_run.observe.timeline import TimelineFile
from flodl_run.report import sweep
from flodl_run.report.dashboard import Dashboard
from flodl_run.report.progress import TerminalProgress
from flodl_run.report.records import RecordLog
from flodl_run.report.rundir import EventFile, link_latest, written
from flodl_run.report.say import say, say_labelled
from flodl_run.report.tracking import NullTracker, make_tracker, unreachable_server

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from flodl_run.contracts.checkpoint import BundleMeta, SaveLock
    from flodl_run.contracts.recipe import Recipe
    from flodl_run.launch.hosts import HostLayout
    from flodl_run.launch.slurm import SlurmLayout
    from flodl_run.rank.solo import SoloTrainer
    from flodl_run.report.liveserver import LiveServer


@dataclass(frozen=True)
class LaunchPlan:
    """Where the ranks of a run go: in-process (world size 1) or one process each; the one
    launch plan, whatever the topology (its hosts or Slurm layout, when it has one)."""

    world_size: int
    in_process: bool
    gpus: List[GpuInfo]
    hosts: Optional["HostLayout"] = None
    """Ranks per worker host for topology hosts."""
    slurm: Optional["SlurmLayout"] = None
    """The srun step for topology slurm (read from the allocation)."""


def plan_topology(config: ExperimentConfig, gpus: Optional[List[GpuInfo]] = None) -> LaunchPlan:
    """auto: 2+ visible GPUs -> one rank per GPU; 0-1 -> in-process."""
    cluster = config.cluster
    if cluster.topology is Topology.solo:
        return LaunchPlan(world_size=1, in_process=True, gpus=[])
    if cluster.topology is Topology.cpu:
        return LaunchPlan(world_size=cluster.num_ranks or 1, in_process=False, gpus=[])
    if cluster.topology is Topology.local_gpus:
        try:
            picked = pick_gpus(list(cluster.devices)) if gpus is None else gpus
        except LookupError as exc:
            raise ConfigError([Problem("cluster.devices", list(cluster.devices), str(exc))]) from None
        return LaunchPlan(world_size=len(picked), in_process=False, gpus=picked)
    if cluster.topology is Topology.hosts:
        from flodl_run.launch.hosts import plan_hosts

        # Asks each host over ssh; ConfigError when one cannot serve.
        layout = plan_hosts(cluster, config.elche.mode, _world_problems(config))
        return LaunchPlan(world_size=layout.world_size, in_process=False, gpus=layout.gpus,
                          hosts=layout)
    if cluster.topology is Topology.slurm:
        from flodl_run.launch.slurm import plan_slurm, read_allocation

        # ConfigError outside an allocation.
        step = plan_slurm(cluster, read_allocation(), _world_problems(config))
        return LaunchPlan(world_size=step.world_size, in_process=False, gpus=[], slurm=step)
    gpus = visible_gpus() if gpus is None else gpus
    if len(gpus) >= 2:
        return LaunchPlan(world_size=len(gpus), in_process=False, gpus=gpus)
    return LaunchPlan(world_size=1, in_process=True, gpus=gpus)


def _world_problems(config: ExperimentConfig) -> Callable[[Optional[int]], List[Problem]]:
    """The config's rules that need the world size (partition_ratios, emulate_slowdown,
    rank:<n>), for the planners that find it out (hosts, slurm)."""
    return lambda world_size: validate(config, world_size).problems


ONE_DEVICE_NOTICE = ("one device: solo in-process run; elche/outer apply with 2+ ranks, "
                     "e.g. cluster=cpu_pair")


def one_device_notice(topology: Topology, plan: LaunchPlan) -> Optional[str]:
    """The line that says a `cluster=auto` run fell back to one in-process replica, where the
    mode and outer optimizer have nothing to act on; None otherwise (`cluster=solo` asked)."""
    if plan.in_process and topology is Topology.auto:
        return ONE_DEVICE_NOTICE
    return None


def one_device_warning(config: ExperimentConfig) -> Optional[str]:
    """The one-device notice for a config not yet launched (review): only `cluster=auto` falls
    back to in-process, and only this host's GPU count decides it."""
    if config.cluster.topology is not Topology.auto:
        return None
    return one_device_notice(config.cluster.topology, plan_topology(config))


@dataclass
class RunResult:
    """What a run hands back: its summary and where it wrote things; `model` only in-process
    (a run of several ranks leaves its model in the bundle)."""

    summary: Summary
    run_dir: Path
    summary_path: Path
    checkpoint: Optional[str]
    mlflow_run_id: Optional[str]
    model: Optional["torch.nn.Module"] = None


def launch(config: ExperimentConfig, run_dir: Path, console: Console) -> str:
    """Run the job; returns the summary status (completed, interrupted, failed, ...). What the
    recipe raised in this process was printed as a rank prints it (the `failed:` line, the
    recipe's frames): the run is `failed`, nothing is raised."""
    return _run(config, run_dir, console)[0].summary.status


def run(config: ExperimentConfig, run_dir: Path, console: Console, recipe: Optional["Recipe"] = None,
        observer: Optional[Observer] = None, show_progress: bool = True) -> RunResult:
    """Plan, train, and write summary.json, events.jsonl, the bundle and the tracked run.

    `recipe` replaces loading `config.recipe.module` (in-process runs only); `observer` sees
    every hook besides the launcher's own. Raises ConfigError for what only the hardware can
    tell, and re-raises what the recipe raised once the run's records are closed."""
    result, error = _run(config, run_dir, console, recipe, observer, show_progress)
    if error is not None:
        raise error
    return result


def _run(config: ExperimentConfig, run_dir: Path, console: Console, recipe: Optional["Recipe"] = None,
         observer: Optional[Observer] = None, show_progress: bool = True) -> tuple:
    """`run`'s body: (the result, what the recipe raised in this process or None)."""
    plan = plan_topology(config)
    _check_run(config, plan, recipe)
    _open_files_up_to_the_hard_limit()
    with _holding(config.save_path, run_dir):
        ready_spare(_zygote_log(config.cluster, plan, run_dir))  # it imports while we set up
        live = serve_dashboard(config.dashboard)  # before anything starts: a port in use: config error
        _say_plan(config.cluster.topology, plan, console)
        say_what_differs(config, plan, console)
        tracker = make_tracker(config.tracking, _uploads(config), parent_of=sweep.parent_run_id)
        mode, outer = ("solo", "none") if plan.in_process else (None, None)
        tracker.start(config, run_dir, mode=mode, outer=outer)
        progress = TerminalProgress(console) if show_progress else None
        # Teardown outputs (events, record log, dashboard, timeline) finish before the tracker,
        # which uploads them; the live dashboard's server stops after the dashboard took the summary.
        board = _dashboard(config, run_dir)
        timeline = None if plan.in_process else TimelineFile.for_run(config.timeline, run_dir)
        outputs = [o for o in (EventFile(run_dir), _record_log(config, run_dir), board,
                               live and live.start(board, console), timeline) if o is not None]
        observers = Observers(*[o for o in (progress, *outputs, observer, tracker) if o is not None])
        try:
            summary, model, error = _train(config, plan, run_dir, console, observers, recipe,
                                           tracker.run_id, timeline)
        finally:
            if progress is not None:
                progress.close()
        _drop_uncommitted(config.save_path, observers)
        summary.mlflow_run_id = tracker.run_id
        latest = _close_records(summary, run_dir, outputs, tracker, observers.errors, console)
        _report(summary, console, written(run_dir, summary, latest, config.tracking.uri), error)
        say_unwritten(console, observers.errors)
        return RunResult(summary, run_dir, run_dir / "summary.json", summary.checkpoint,
                         tracker.run_id, model), error


def _drop_uncommitted(save_path: Optional[str], observer: Observer) -> None:
    """The ranks are gone: remove the generations of saves that never committed (a writer
    lost mid-save starts another generation; a run that lost every rank in a save left up to
    three behind), saying so. The bundle the meta names stays."""
    if not save_path:
        return
    from flodl_run.contracts.checkpoint import drop_uncommitted

    dropped = drop_uncommitted(save_path)
    if dropped:
        names = ", ".join(f"g{g}" for g in dropped)
        observer.on_event("checkpoint_discarded", f"removed generation(s) {names} of {save_path}: "
                                                  "saves that never completed")


def _open_files_up_to_the_hard_limit() -> None:
    """Raise this process's soft limit on open files to the hard one: the common soft limit,
    1024, is what a flood of idle connections to the coordinator used up before their
    handshake deadline closed them (the run then failed on its next file). Ranks, started
    from here, inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard != resource.RLIM_INFINITY:  # an infinite hard limit: the kernel caps it lower
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def _holding(save_path: Optional[str], run_dir: Path) -> Iterator[None]:
    """The run's hold on its save_path, from before anything starts to its end."""
    lock = _lock_save_path(save_path, run_dir)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _lock_save_path(save_path: Optional[str], run_dir: Path) -> Optional["SaveLock"]:
    """This run's hold on its save_path (ConfigError naming the run that holds it)."""
    if not save_path:
        return None
    from flodl_run.contracts.checkpoint import SaveLock, SavePathTaken

    try:
        return SaveLock.take(save_path, run_dir)
    except SavePathTaken as exc:
        raise ConfigError([Problem("save_path", save_path,
                                   f"{exc}: give each run its own save_path")]) from None


def _close_records(summary: Summary, run_dir: Path, outputs: List[Observer], tracker: NullTracker,
                   errors: OutputErrors, console: Console) -> Optional[Path]:
    """summary.json (its outcome first, then the whole record), each output's end (the `end`
    line of events.jsonl, ...), the tracked run, and the `outputs/latest` link. What does not
    fit on the disk is noted in `errors` and the rest still goes: an output error never fails a
    run by itself. Returns the latest link, or None."""
    path = run_dir / "summary.json"
    with _signals_held():  # a Ctrl-C now would lose the summary and the end event
        if errors.attempt("summary.json", write_outcome, path, summary):
            errors.attempt("summary.json in full (its outcome is there)", write_summary, path, summary)
        for output in outputs:
            errors.attempt(f"the end of {output.output or type(output).__name__}", output.finish,
                           summary, run_dir)
    try:
        errors.attempt(f"the end of {tracker.output or type(tracker).__name__}", tracker.finish,
                       summary, run_dir)
    except KeyboardInterrupt:  # Ctrl-C during the upload skips what is left of it
        say_labelled(console, "warning", "tracking: interrupted, the MLflow run is not complete", "yellow")
    lost = tracker.unwritten()  # an outage of the store that outlasted the run's end
    if lost:
        errors.note(tracker.output or type(tracker).__name__, lost)
    latest: List[Optional[Path]] = [None]

    def link() -> None:
        latest[0] = link_latest(run_dir, Path.cwd() / "outputs")

    errors.attempt("outputs/latest", link)
    return latest[0]


def say_unwritten(console: Console, errors: OutputErrors) -> None:
    """The outcome stands; say what of its record is missing (nothing when all was written)."""
    if errors.failed:
        say_labelled(console, "not written", "; ".join(f"{what} ({why})" for what, why
                                                       in errors.failed.items()), "yellow")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM do nothing while the block runs (in the main thread): the run is
    ending anyway, and its own records are written in well under a second."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_dashboard(dashboard: DashboardConfig) -> Optional["LiveServer"]:
    """The live dashboard's server, bound but not started, when `dashboard.serve` is set
    (ConfigError when its address cannot be had); the web stack loads only then."""
    if dashboard.serve is None:
        return None
    from flodl_run.report.liveserver import LiveServer

    return LiveServer.bind(dashboard)


def _dashboard(config: ExperimentConfig, run_dir: Path) -> Optional[Dashboard]:
    """The run's dashboard, or None when neither `dashboard_html` (relative to the run dir)
    nor `dashboard.serve` asks for one."""
    if not config.dashboard_html and config.dashboard.serve is None:
        return None
    details = {"mode": config.elche.mode.value, "outer": config.outer.kind.value,
               "recipe": config.recipe.module, "run dir": str(run_dir)}
    path = Path(run_dir) / config.dashboard_html if config.dashboard_html else None
    return Dashboard(path, config.dashboard_theme.value, config.run_name or "flodl_run", details,
                     config.cluster)


def _record_log(config: ExperimentConfig, run_dir: Path) -> Optional[RecordLog]:
    """The run's record log, or None when `record_log_dir` is unset (relative to the run dir)."""
    if not config.record_log_dir:
        return None
    return RecordLog(Path(run_dir) / config.record_log_dir, config.max_log_size, config.cluster)


def _uploads(config: ExperimentConfig) -> List[str]:
    """Files of the run dir the tracker uploads at the end, when the run wrote them: the
    dashboard page and the timeline."""
    return [name for name in (config.dashboard_html, config.timeline and TIMELINE_FILE) if name]


def _train(config: ExperimentConfig, plan: LaunchPlan, run_dir: Path, console: Console, observers: Observers,
           recipe: Optional["Recipe"], mlflow_run_id: Optional[str],
           timeline: Optional[TimelineFile] = None) -> tuple:
    """(summary, model or None, the exception the recipe raised or None)."""
    try:
        if plan.in_process:
            return _train_in_process(config, observers, recipe, mlflow_run_id, console)
        from flodl_run.launch.supervisor import launch_ranks

        _leave_cores_to_ranks(config.cluster, plan)
        return launch_ranks(config, plan, run_dir, console, observers, mlflow_run_id,
                            timeline), None, None
    except Exception as exc:  # the recipe raised in this process: still close the run's records
        in_process = plan.in_process
        summary = Summary(status="failed", message=f"{type(exc).__name__}: {exc}",
                          mode="solo" if in_process else config.elche.mode.value,
                          outer="none" if in_process else config.outer.kind.value,
                          world_size=plan.world_size)
        return summary, None, exc


def _say_plan(topology: Topology, plan: LaunchPlan, console: Console) -> None:
    """The hardware (or hosts) line, and the one-device notice when it applies."""
    if plan.hosts is not None:
        from flodl_run.launch.hosts import hosts_line

        say(console, hosts_line(plan.hosts))
    elif plan.slurm is not None:
        from flodl_run.launch.slurm import slurm_line

        say(console, slurm_line(plan.slurm))
    else:
        say(console, hardware_line(plan.gpus, plan.world_size))
    notice = one_device_notice(topology, plan)
    if notice:
        say_labelled(console, "note", notice, "cyan")


def _check_run(config: ExperimentConfig, plan: LaunchPlan, recipe: Optional["Recipe"]) -> None:
    """What only the plan can tell: a Recipe object cannot reach rank processes, a tracking
    server must answer before anything starts, and a bundle saved by another world size cannot
    be resumed (before a probe only a fixed cluster could be checked; here `cluster=auto` is
    too)."""
    if recipe is not None and not plan.in_process:
        raise ConfigError([Problem("cluster.topology", config.cluster.topology.value,
                                   "must train in-process (one device) when the recipe is a Recipe "
                                   "object; ranks import recipe.module instead")])
    unreachable = unreachable_server(config.tracking)
    if unreachable:  # found now, in seconds, rather than after minutes of MLflow's retries
        raise ConfigError([Problem("tracking.uri", config.tracking.uri, unreachable)])
    if not config.resume_from:
        return
    from flodl_run.contracts.checkpoint import BundleError, check_resume, read_meta

    try:
        meta = read_meta(config.resume_from)
        reasons = check_resume(meta, plan.world_size, config.seed, config.resume_from)
        reasons += _trajectory_problems(config, plan, meta)
    except BundleError as exc:
        reasons = [str(exc)]
    if reasons:
        raise ConfigError([Problem("resume_from", config.resume_from, f"cannot be resumed here: {r}")
                           for r in reasons])


def _trajectory_problems(config: ExperimentConfig, plan: LaunchPlan, meta: "BundleMeta") -> List[str]:
    """What of a valid meta this run cannot continue: an epoch at or past the run's end (it
    used to "complete" with 0 samples and save a bundle labelled with fewer epochs than it
    holds), or an elche_state that ElChe cannot restore (it failed with a KeyError after the
    ranks started)."""
    splits = config.data.epoch_splits
    problems = []
    if meta.epoch >= config.num_epochs * splits:
        done = -(-meta.epoch // splits)
        problems.append(f"the bundle has trained {done} epoch{'s' if done != 1 else ''} and this run "
                        f"ends at num_epochs={config.num_epochs}: to train on, resume with "
                        f"num_epochs=<larger than {done}>")
    if not plan.in_process:
        from flodl_run.elche.balancer import ElChe

        try:
            ElChe.from_state(config.elche, meta.elche_state, world_size=meta.world_size_at_save)
        except KeyError as exc:
            problems.append(f"elche_state.{exc.args[0]} is missing")
        except (TypeError, ValueError, AttributeError) as exc:
            problems.append(f"elche_state cannot be restored ({type(exc).__name__}: {exc})")
    return problems


def _zygote_log(cluster: ClusterConfig, plan: LaunchPlan, run_dir: Path) -> Optional[Path]:
    """Where the zygote of this run logs when its ranks fork on this host; None otherwise."""
    local = not plan.in_process and plan.hosts is None and plan.slurm is None
    if local and cluster.launch_ranks and fork_ranks(os.environ, on_gpus=bool(plan.gpus)):
        return run_dir / "ranks" / "zygote.log"
    return None


def _leave_cores_to_ranks(cluster: ClusterConfig, plan: LaunchPlan) -> None:
    """CPU ranks on this host own its cores: the coordinator's CPU averaging (cpu_* modes) gets
    what they leave, at least one thread. With torch's default of one thread per core its
    intra-op threads queue behind busy ranks: on 2 cores a 2.25 MB consensus took ~80 ms instead
    of ~6 while cpu_async ranks kept training."""
    if plan.gpus or plan.hosts is not None or plan.slurm is not None or not cluster.launch_ranks:
        return
    import torch

    busy = plan.world_size * (cluster.threads_per_rank or 1)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - busy))


def _train_in_process(config: ExperimentConfig, observer: Observers, recipe: Optional["Recipe"],
                      mlflow_run_id: Optional[str], console: Console) -> tuple:
    """(summary, model, the exception the recipe raised or None) of the in-process replica. A
    first SIGINT/SIGTERM stops it after the batch in hand with a save (summary interrupted); a
    second one stops it at once, unsaved. An exception once training began fails the summary
    the trainer kept (its epochs, its bundle, its wall time), not an empty one."""
    from flodl_run.contracts.recipe import load_recipe
    from flodl_run.rank.solo import SoloTrainer

    if recipe is None:
        recipe = load_recipe(config)
    trainer = SoloTrainer(config, recipe, observer)
    grace = threading.Timer(STOP_GRACE_S, _let_go, [trainer])
    grace.daemon = True

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if trainer.stop_reason is not None:  # a second signal, or the grace ran out: at once
            if trainer.let_go is None:
                trainer.stop_reason = f"{trainer.stop_reason}; then {name}"
            trainer.stop_at_once()  # in an epoch's close: the epochs trained are saved first
            raise KeyboardInterrupt
        trainer.request_stop(f"interrupted by {name}")
        say(console, f"stopping ({name}): after the batch in hand, saving what was trained; "
                     "Ctrl-C again stops at once")
        grace.start()

    main = threading.current_thread() is threading.main_thread()
    # a scheduler's notice before the job's end (contracts.signals) stops the run as SIGTERM does
    signals = [s for s in (signal.SIGINT, signal.SIGTERM, stop_signal(os.environ)) if s is not None]
    previous = {sig: signal.signal(sig, on_signal) for sig in signals} if main else {}
    trainer.mlflow_run_id = mlflow_run_id
    error: Optional[Exception] = None
    try:
        trainer.run()
    except KeyboardInterrupt:  # the trainer marked its summary interrupted; the caller writes it
        pass
    except Exception as exc:  # the recipe raised mid-run: what trained so far stays on record
        error = exc
        trainer.summary.status, trainer.summary.message = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        grace.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return trainer.summary, trainer.replica.model, error


def _let_go(trainer: "SoloTrainer") -> None:
    """The stop's grace ran out (a timer's thread): a trainer still in an epoch's close (an
    eval, a callback: they may hang) is stopped at once, as by a second signal, saving the
    epochs it holds; one in a batch finishes it first (a batch is never cut)."""
    if trainer.closing is not None:
        trainer.let_go = f"{trainer.closing} outlasted the stop's {STOP_GRACE_S:g}s grace"
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs in the trainer's thread


def _report(summary: Summary, console: Console, artifacts: List[str],
            error: Optional[BaseException] = None) -> None:
    """The outcome line (with the recipe's frames of what it raised in this process, as a rank
    prints them), then one line naming everything the run wrote."""
    from flodl_run.contracts.recipe import user_traceback

    if summary.status == "completed":
        final = "-" if summary.final_eval is None else f"{summary.final_eval:.4f}"
        syncs = ""
        if summary.world_size > 1:
            syncs = f" | {summary.syncs} syncs ({summary.avg_sync_ms:.2f} ms avg)"
        lost = ""
        if summary.dead_ranks:  # the survivors finished the run; the last line still says who did not
            ranks = ", ".join(str(r) for r in summary.dead_ranks)
            lost = f" | rank{'s' if len(summary.dead_ranks) > 1 else ''} {ranks} lost (events.jsonl says why)"
        if summary.message:  # ranks that failed (a recipe error) while the survivors carried on
            lost += f" | {summary.message}"
        if summary.compiled_graphs:
            lost += f" | graphs compiled {' '.join(str(n) for n in summary.compiled_graphs)}"
            if any(summary.eager_frames):
                lost += f" ({sum(summary.eager_frames)} frame(s) past the recompile limit ran eagerly)"
        train_s = sum(e.epoch_ms for e in summary.epochs) / 1000.0  # what samples/s divides by
        say(console, f"done: final eval {final} | {summary.wall_s:.1f}s wall, {train_s:.1f}s "
                     f"training | {summary.samples_per_s:,.0f} samples/s in training{syncs}{lost}")
    else:
        say_labelled(console, summary.status, summary.message or summary.status, "bold red")
    trace = user_traceback(error).rstrip("\n") if error is not None else ""
    if trace:
        say(console, trace)
    say(console, "wrote: " + " | ".join(artifacts))
