"""Local rank processes: spawn them with the torchrun environment, forward their output,
watch them, and stop them all.

Owns process lifetimes on this host. The coordinator (a thread here) decides what the run
does; this module only tells it when a child died or the user pressed Ctrl-C. Never touches CUDA.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

from rich.console import Console

from flodl_run.averaging.shm import remove_run, run_prefix
from flodl_run.config.schema import ClusterConfig, ExperimentConfig, Mode, RecipeConfig
from flodl_run.contracts.rankenv import COORD_ENV, RUN_FILE_ENV, SECRET_ENV, RankEnvironment
from flodl_run.contracts.signals import KILL_GRACE_S, stop_signal
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import ControlEndpoint, frame_limit, new_secret
from flodl_run.control.coordinator import Coordinator
from flodl_run.control.runstate import STOP_GRACE_S
from flodl_run.launch.rankproc import RankProcess, forward, host_store
from flodl_run.launch.zygote import Zygote, fork_ranks
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Timeline
from flodl_run.report.say import say

log = logging.getLogger(__name__)
LEAVE_S = 5.0
"""How long after a second signal's cut the coordinator may take to end itself (its Stop orders,
the ranks' last timeline shipments: 2 s, closing its socket) before the launcher leaves it."""


def local_environment(cluster: ClusterConfig, shared: RankEnvironment, rank: int,
                      gpu_uuids: Optional[List[str]] = None) -> Dict[str, str]:
    """One local rank's environment: this process's, with the contract every rank shares
    (`shared`), the rank's numbers and its device pin written over it."""
    contract = dataclasses.replace(shared, rank=rank, local_rank=rank,
                                   local_world_size=shared.world_size)
    if gpu_uuids:
        contract = dataclasses.replace(contract, gpu=gpu_uuids[rank], device="cuda:0")
    else:
        contract = dataclasses.replace(contract, device="cpu", threads=cluster.threads_per_rank or 1)
    return contract.over(os.environ)


def spawn_ranks(cluster: ClusterConfig, world_size: int, coord: str, secret: bytes,
                run_dir: Path, console: Console, gpu_uuids: Optional[List[str]] = None,
                shm_prefix: Optional[str] = None) -> List[RankProcess]:
    log_dir = run_dir / "ranks"
    log_dir.mkdir(parents=True, exist_ok=True)
    store = host_store(cluster.master_addr, cluster.master_port)
    master_port = store.port
    shared = RankEnvironment(
        world_size=world_size, master_addr=cluster.master_addr, master_port=master_port,
        coord=coord, secret=secret, run_file=run_dir / "run.yaml", parent_pid=os.getpid(),
        store_hosted=True, unbuffered=True, project=os.getcwd(),
        shm_prefix=shm_prefix)  # same host as the coordinator: parameters may go through /dev/shm
    procs = []
    zygote: Optional[Zygote] = None
    for rank in range(world_size):
        env = local_environment(cluster, shared, rank, gpu_uuids)
        # one torch import per host, not per rank
        if zygote is None and fork_ranks(os.environ, on_gpus=bool(gpu_uuids)):
            zygote = Zygote.start(env, log_dir / "zygote.log")
        process = zygote.spawn(env) if zygote is not None else subprocess.Popen(
            [sys.executable, "-m", "flodl_run.rank"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True)  # Ctrl-C reaches the launcher only; it stops ranks in order
        proc = RankProcess(rank, process, open(log_dir / f"rank{rank}.log", "w"), store=store)
        proc.log.write(f"# rank {rank} of {world_size}: pid {process.pid} on this host, cores "
                       f"{_cores_of(process.pid)}, store port {master_port}, coordinator {coord}, "
                       f"started {datetime.datetime.now().isoformat(timespec='seconds')}\n")
        proc.log.flush()  # a rank that prints nothing still leaves who it was and when it ran
        proc.forwarder = threading.Thread(target=forward, args=(proc, console, f"rank {rank}"),
                                          daemon=True)
        proc.forwarder.start()
        procs.append(proc)
    return procs


def _cores_of(pid: int) -> str:
    """The cores a process may run on, as the kernel says (`0-1`, `2,5`); `?` once it is gone."""
    try:
        cores = sorted(os.sched_getaffinity(pid))
    except OSError:
        return "?"
    spans: List[List[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def stop_ranks(procs: List[RankProcess], grace_s: float = KILL_GRACE_S,
               hurry: Callable[[], bool] = lambda: False) -> None:
    """Wait for ranks to leave on their own, then SIGTERM, then SIGKILL; then the same for what
    they started on this host (their process groups), and their rendezvous store: no orphan
    remains. `hurry()` true (a
    Ctrl-C came meanwhile) moves on to the next signal at once."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.process.poll() is None]
        if not alive:
            break
        for p in alive:
            if sig is not None:
                _signal_group(p.process, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.process.poll() is None for p in alive):
            if sig is not signal.SIGKILL and hurry():  # after SIGKILL: wait to reap them
                break
            time.sleep(0.05)
    end_leftovers([p.process.pid for p in procs if p.host is None and not _is_srun_task(p)], grace_s)
    for p in procs:
        if p.forwarder is not None:
            p.forwarder.join(timeout=2.0)
        p.log.write(f"# rank {p.rank} exited with code {p.process.poll()}\n")
        p.log.close()
    for store in {id(p.store): p.store for p in procs if p.store is not None}.values():
        store.close()  # nobody is left to rendezvous on it


def end_leftovers(groups: List[int], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to what is left in the ranks' process groups
    once the ranks are gone: a recipe's `sleep 3600` or os.fork child, re-parented to init,
    used to outlive the run. Each rank leads its own group (its own session), so the group id
    is the rank's pid; a group with no live member left is not signalled (its id may since be
    another process's)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = _groups_with_members(groups)
        if not live:
            return
        for group in live:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _groups_with_members(live):
            time.sleep(0.05)


def _groups_with_members(groups: List[int]) -> List[int]:
    """The groups among `groups` that a live process (not a zombie) is in, from /proc; with no
    file descriptor left to read /proc (a connection flood took them: reading it failed the
    run at its end), those the kernel still knows (zombies too: they are signalled in vain)."""
    wanted, found = set(groups), set()
    try:
        with os.scandir("/proc") as entries:
            for entry in entries:
                group = _live_group_of(entry.name)
                if group in wanted:
                    found.add(group)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        return [g for g in groups if _group_exists(g)]
    return sorted(found)


def _live_group_of(name: str) -> Optional[int]:
    """The process group of /proc entry `name`, None for a zombie, a non-process entry or one
    gone meanwhile. Raises OSError EMFILE/ENFILE when no file can be opened."""
    if not name.isdigit():
        return None
    try:
        with open(f"/proc/{name}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return None
    return None if fields[0] == "Z" else int(fields[2])  # state, ppid, pgrp, ...


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the id: not ours
        return False
    return True


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    signal_rank = getattr(process, "signal_rank", None)  # a task of an srun step (slurm.TaskHandle)
    if signal_rank is not None:
        signal_rank(sig)
        return
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _watch(coordinator: Coordinator, thread: threading.Thread, procs: List[RankProcess],
           console: Console) -> None:
    """Until the coordinator ends: report a rank that exited early, turn each SIGINT/SIGTERM
    noted meanwhile into a stop request, and say what happens next (the screen would not
    change while the ranks finish their batch in hand, then for up to STOP_GRACE_S)."""
    reported = set()
    zygotes = _zygotes(procs)
    while thread.is_alive():
        time.sleep(0.2)  # signals are noted, never raised: nothing here can be cut short
        zygotes = [z for z in zygotes if not _said_lost(z)]
        _report_exits(coordinator, procs, reported)
        if time.monotonic() > coordinator.stop.cut_at + LEAVE_S:  # a second signal wins over anything
            coordinator.left_behind(_where(thread), LEAVE_S)
            return
        while _signal_names:
            name, again = _signal_names.pop(0), coordinator.stop.is_set()
            coordinator.request_stop(f"interrupted by {name}")
            say(console, f"stopping ({name}): " + (_AT_ONCE if again else _AFTER_THE_BATCH))


_AFTER_THE_BATCH = ("the ranks finish the batch in hand, then the run saves what they trained "
                    f"(within {STOP_GRACE_S:.0f} s of the last batch); Ctrl-C again stops at once "
                    "without saving")
_AT_ONCE = f"at once (a save under way gets until {STOP_GRACE_S:.0f} s after the first signal)"


def _where(thread: threading.Thread) -> str:
    """The innermost function `thread` is in now outside Python's standard library (a lock's
    or a socket's wait says little), and its place: `metrics_fn (my_recipe.py:12)`."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if not _in_stdlib(f.filename)] or stack
    return f"{ours[-1].name} ({Path(ours[-1].filename).name}:{ours[-1].lineno})"


def _in_stdlib(filename: str) -> bool:
    """In Python's standard library (site-packages may lie inside its folder: not counted)."""
    paths = sysconfig.get_paths()
    parents = set(Path(filename).resolve().parents)
    site = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    return Path(paths["stdlib"]).resolve() in parents and not parents & site


def _report_exits(coordinator: Coordinator, procs: List[RankProcess], reported: set) -> None:
    """A rank that exited before it was told to stop: a recipe's own exit (sys.exit, os._exit)
    fails it as a recipe error, anything else is a death."""
    for p in procs:
        code = p.process.poll()
        if code is not None and p.rank not in reported and not coordinator.stopped(p.rank):
            reported.add(p.rank)
            if ended_itself(code) and not _is_srun_task(p):  # srun's code may be its own
                coordinator.report_recipe_exit(p.rank, _self_exit(p, code))
            else:
                coordinator.report_death(p.rank, _exit_reason(p, code, procs))


def _zygotes(procs: List[RankProcess]) -> List[Zygote]:
    """The zygotes the ranks were forked from (one per host, here at most one)."""
    return list({id(z): z for z in (getattr(p.process, "zygote", None) for p in procs) if z}.values())


def _said_lost(zygote: Zygote) -> bool:
    """Say so when the rank zygote was killed by itself: its ranks watch the launcher, not it,
    and train on; only their exit codes are gone (a rank's exit is then seen as code 1)."""
    code = zygote.lost()
    if code is not None:
        log.warning("the rank zygote (pid %d) is gone (exit code %d); the ranks it forked keep "
                    "training", zygote.process.pid, code)
    return code is not None


def _killer(procs: List[RankProcess]) -> Callable[[int], None]:
    """What the coordinator calls on a rank it declared dead: make sure the process is gone
    (a stopped or hung rank must not wake up into a group that moved on)."""
    def kill(rank: int) -> None:
        for p in procs:
            if p.rank == rank and p.process.poll() is None:
                _signal_group(p.process, signal.SIGKILL)
    return kill


def ended_itself(code: int) -> bool:
    """An exit code only the rank's own code gives: 0, or one below 128 other than 1 (a rank
    that reported its failure exits 1; a signal, or ssh losing the host, gives a negative code,
    128 + n or 255). Before the rank was told to stop, that is the recipe's os._exit (or
    sys.exit outside the rank's guard): a recipe error, not a lost rank."""
    return 0 <= code < 128 and code != 1


def _is_srun_task(proc: RankProcess) -> bool:
    return getattr(proc.process, "signal_rank", None) is not None


def _self_exit(proc: RankProcess, code: int) -> str:
    where = "" if proc.host is None else f" on host {proc.host}"
    return f"exited{where} with code {code} before it was told to stop (the recipe called os._exit?)"


def _exit_reason(proc: RankProcess, code: int, procs: List[RankProcess]) -> str:
    """`rank 1 exited ...`; for ssh ranks also the host, and whether the whole host is gone."""
    if proc.host is None:
        return f"rank {proc.rank} exited with code {code}"
    how = "ssh connection lost" if code == 255 else f"exit code {code}"
    if code - 128 in {s.value for s in signal.Signals}:  # how a remote shell says "killed by n"
        how = f"killed by {signal.Signals(code - 128).name}"
    mates = [p for p in procs if p.host == proc.host]
    if all(_died(p) for p in mates):
        ranks = ", ".join(str(p.rank) for p in mates)
        return f"host {proc.host} lost: rank{'s' if len(mates) > 1 else ''} {ranks} gone ({how})"
    return f"rank {proc.rank} on host {proc.host} exited ({how})"


def _died(proc: RankProcess) -> bool:
    """An ssh rank ended from outside: its connection dropped (255) or a signal killed it.

    Our own teardown never causes these codes: it kills the local ssh client (a negative code).
    """
    code = proc.process.poll()
    return proc.host is not None and code is not None and (
        code == 255 or code - 128 in {s.value for s in signal.Signals})


def _name_the_cause(summary: Summary, procs: List[RankProcess]) -> None:
    """Put a lost host first in a failed run's message: survivors' collectives break when it
    goes, and one of their errors may have reached the coordinator before the exit was seen."""
    dead = [p for p in procs if _died(p)]
    if summary.status != "failed" or not dead:
        return
    cause = _exit_reason(dead[0], dead[0].process.returncode, procs)
    if cause not in (summary.message or ""):
        summary.message = f"{cause} (then: {summary.message})"


def launch_ranks(config: ExperimentConfig, plan, run_dir: Path, console: Console,
                 observer: Optional[Observer] = None, mlflow_run_id: Optional[str] = None,
                 timeline: Optional[Timeline] = None) -> Summary:
    """Run a distributed job on this host: coordinator thread plus one process per rank."""
    secret = new_secret()
    slurm = getattr(plan, "slurm", None)
    local = config.cluster.launch_ranks and plan.hosts is None and slurm is None
    shm_prefix = run_prefix() if local else None  # ranks on this host: parameters via /dev/shm
    param_bytes = _param_bytes(config.elche.mode, config.recipe, config.data.transform)
    endpoint = ControlEndpoint(*_control_address(config.cluster, plan),
                               max_frame_bytes=frame_limit(param_bytes))
    coordinator = Coordinator(config, plan.world_size, secret, endpoint, observer=observer,
                              shm_prefix=shm_prefix, timeline=timeline)
    coordinator.mlflow_run_id = mlflow_run_id
    summary_box: List[Summary] = []
    thread = threading.Thread(target=lambda: summary_box.append(coordinator.run()),
                              name="coordinator", daemon=True)
    _signal_names.clear()
    previous, previous_int = signal.signal(signal.SIGTERM, _raise_interrupt), None
    stop, previous_stop = stop_signal(os.environ), None
    procs: List[RankProcess] = []
    secret_file: Optional[Path] = None
    try:
        thread.start()
        if slurm is not None:
            from flodl_run.launch.slurm import start_step

            procs = start_step(config.cluster, slurm, coordinator.address, secret, run_dir, console,
                               save_path=config.save_path)
        elif config.cluster.launch_ranks and plan.hosts is not None:
            from flodl_run.launch.hosts import start_hosts

            procs = start_hosts(config.cluster, plan.hosts, coordinator.address, secret, run_dir,
                                console, save_path=config.save_path)
        elif config.cluster.launch_ranks:
            uuids = [g.uuid for g in plan.gpus] if plan.gpus else None
            procs = spawn_ranks(config.cluster, plan.world_size, coordinator.address, secret, run_dir,
                                console, uuids, shm_prefix)
        else:
            secret_file = _announce_controller_only(plan.world_size, coordinator.address, secret,
                                                    run_dir, console)
        coordinator.on_rank_dead = _killer(procs)
        previous_int = signal.signal(signal.SIGINT, _note_signal)  # from here on, signals are noted
        signal.signal(signal.SIGTERM, _note_signal)
        if stop is not None:  # a scheduler's notice before the job's end: as SIGTERM
            previous_stop = signal.signal(stop, _note_signal)
        _watch(coordinator, thread, procs, console)
    finally:
        stop_ranks(procs, hurry=_took_signal)
        for zygote in _zygotes(procs):
            zygote.park()  # the process's next run forks from it
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        if previous_stop is not None:  # the sweep launcher's handler again (it requeues)
            signal.signal(stop, previous_stop)
        remove_run(shm_prefix)  # also what a killed rank left behind
        if secret_file is not None:  # the run is over: no rank may join with it any more
            secret_file.unlink(missing_ok=True)
    summary = summary_box[0] if summary_box else coordinator.summary
    _name_the_cause(summary, procs)
    return summary


def _param_bytes(mode: Mode, recipe: RecipeConfig, transform: Optional[str]) -> Optional[int]:
    """What the model's parameters and float buffers take as flat frames (the largest tensor
    message a rank sends the coordinator), from a build on the meta device: no memory, no
    CUDA. Collective modes send the coordinator no tensors (0). None when the recipe cannot
    build there (the coordinator then sets no frame limit, and says so). The recipe loads as
    the ranks load it (`recipe`, with the data's `transform`)."""
    if mode.is_collective:
        return 0
    import torch

    from flodl_run.contracts.recipe import import_recipe

    try:
        loaded = import_recipe(recipe.module, recipe.params, transform, recipe.loop)
        with torch.device("meta"):
            model = loaded.call("build_model", torch.device("meta"))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return params + sum(b.numel() * 4 for b in model.buffers() if b.is_floating_point())
    except Exception as exc:  # a recipe that loads weights or needs a real device
        log.warning("no frame size limit on the control plane: the model could not be built on "
                    "the meta device (%s: %s)", type(exc).__name__, exc)
        return None


def _control_address(cluster: ClusterConfig, plan) -> tuple[str, int]:
    """Loopback for ranks on this host; cluster.controller when ranks come from
    other hosts (hosts topology, or controller-only for torchrun/srun); the batch host's
    address for an srun step."""
    if getattr(plan, "slurm", None) is not None:
        return plan.slurm.addr, cluster.controller.port
    if plan.hosts is not None or not cluster.launch_ranks:
        return cluster.controller.host, cluster.controller.port
    return "127.0.0.1", 0


_signal_names: List[str] = []
"""Signals not yet acted on, oldest first: noted ones (SIGINT, SIGTERM) while ranks run, and
a SIGTERM turned into a KeyboardInterrupt while they start."""


def _note_signal(signum: int, frame: object) -> None:
    """While ranks run, SIGINT and SIGTERM are noted for `_watch` and `stop_ranks`, never raised:
    one raised inside the launcher's own stop lost the summary."""
    _signal_names.append(signal.Signals(signum).name)


def _took_signal() -> bool:
    """Whether a signal was noted since the last call (each one is taken once)."""
    return bool(_signal_names) and bool(_signal_names.pop(0))


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the run like Ctrl-C does, and is named as itself."""
    _signal_names.append(signal.Signals(signum).name)
    raise KeyboardInterrupt


def _announce_controller_only(world_size: int, coord: str,
                              secret: bytes, run_dir: Path, console: Console) -> Path:
    """Write the secret (0600) and controller.json for the ranks to come, say how to start
    them; returns the secret's file, which the run removes when it ends."""
    secret_file = run_dir / "secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secret.hex())
    (run_dir / "controller.json").write_text(json.dumps(
        {"coord": coord, "world_size": world_size, "run_file": str(run_dir / "run.yaml"),
         "secret_file": str(secret_file)}))
    console.print(
        f"controller-only: waiting for {world_size} ranks. On each node run:\n"
        f"  {COORD_ENV}={coord} {RUN_FILE_ENV}={run_dir / 'run.yaml'} "
        f"{SECRET_ENV}=$(cat {secret_file}) torchrun --nproc-per-node=N -m flodl_run.rank",
        markup=False, highlight=False, soft_wrap=True)
    return secret_file
