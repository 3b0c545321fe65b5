"""One validation pass over a typed ExperimentConfig, and the resolution of its auto values.

Owns every value and cross-field rule of the config: each problem names the dotted key as a
user types it, the bad value and the rule, and all problems are reported together. A key's own
range is not written here: each section checks the bounds its schema fields declare
(`config.bounds`), after its explicit rules. Pure: no Hydra, no imports of recipes (see
`config.materialize` for the recipe check).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

from flodl_run.config.bounds import allows_none, bound_of
from flodl_run.config.schema import (
    Backend,
    EvalDirection,
    ExperimentConfig,
    Mode,
    OuterKind,
    SyncAverage,
    Topology,
    TrackingConfig,
    TrackingKind,
    WindowEnd,
)

# Keys whose cross-rank roll-up the runtime fixes: users may not redeclare them.
CORE_METRIC_KEYS = ("loss", "throughput", "batch_share", "data_starve", "compute_only_ms")

# torchrun contract and our own control-plane variables: a worker env block may not set them.
RESERVED_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
)
RESERVED_ENV_PREFIX = "FLODL_RUN_"

_POLICY = re.compile(r"^(fastest|rank:(\d+))$")
_SERVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Problem:
    """One broken rule: `key: rule, got value`."""

    key: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.key}: {self.rule}, got {_show(self.value)}"


def _show(value: Any) -> str:
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        value = value.value
    if isinstance(value, str):
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class Report:
    """Outcome of validation: problems make the config invalid, warnings do not."""

    problems: List[Problem]
    warnings: List[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def planned_world_size(cfg: ExperimentConfig) -> Optional[int]:
    """World size the cluster config fixes without probing hardware; None when only a probe knows."""
    cluster = cfg.cluster
    if cluster.topology is Topology.solo:
        return 1
    if cluster.topology is Topology.cpu:
        return cluster.num_ranks
    if cluster.topology is Topology.local_gpus:
        return len(cluster.devices)
    if cluster.topology is Topology.slurm:
        gpus = cluster.slurm.gpus_per_node
        return cluster.slurm.nodes * gpus if gpus > 0 else cluster.num_ranks
    if cluster.topology is Topology.hosts:
        counts = [w.local_devices for w in cluster.workers]
        if any(not isinstance(c, (list, tuple)) for c in counts):
            return None
        return sum(len(c) for c in counts)
    return None


def validate(cfg: ExperimentConfig, world_size: Optional[int] = None) -> Report:
    """Check every rule; `world_size` (when known from a probe) sharpens the cross-field checks."""
    if world_size is None:
        world_size = planned_world_size(cfg)
    problems: List[Problem] = []
    warnings: List[str] = []
    for check in _CHECKS:
        for item in check(cfg, world_size):
            (problems if isinstance(item, Problem) else warnings).append(item)
    return Report(problems, warnings)


Check = Callable[[ExperimentConfig, Optional[int]], Iterator[Any]]
_CHECKS: List[Check] = []


def _check(fn: Check) -> Check:
    _CHECKS.append(fn)
    return fn


def bound_problems(section: Any, prefix: str = "") -> Iterator[Problem]:
    """Each field of one config object (not of the objects nested in it) against the bound its
    schema declares, in declaration order: `<prefix>.<field>: must be >= 1, got 0`. None
    passes where the field is Optional."""
    for f in dataclasses.fields(section):
        bound = bound_of(f)
        value = getattr(section, f.name)
        if bound is None or (value is None and allows_none(f)):
            continue
        if value is None or not bound.admits(value):
            yield Problem(f"{prefix}.{f.name}" if prefix else f.name, value, bound.rule)


@_check
def _top_level(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    if not _DEVICE.match(cfg.device):
        yield Problem("device", cfg.device, "must be auto, cpu, cuda or cuda:<index>")
    yield from bound_problems(cfg)  # seed, batch_size, num_epochs and the run-scope numbers


@_check
def _elche(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    e = cfg.elche
    floor = e.anchor if e.min_anchor is None else e.min_anchor
    if floor is not None and e.max_anchor is not None and floor > e.max_anchor:
        key = "elche.anchor" if e.min_anchor is None else "elche.min_anchor"
        yield Problem(key, floor, f"must be <= elche.max_anchor ({e.max_anchor})")
    yield from _partition_ratios(e.partition_ratios, world_size)
    if e.reduce_optimizer_state and not e.mode.is_collective:
        yield Problem("elche.reduce_optimizer_state", True,
                      "must be false in mode " + e.mode.value + ": only the collective modes "
                      "(nccl_cadence, nccl_sync with sync_average=params) average the optimizer state")
    yield from bound_problems(e, "elche")
    yield from _elche_warnings(cfg)


def _partition_ratios(ratios: Optional[List[float]], world_size: Optional[int]) -> Iterator[Any]:
    if ratios is None:
        return
    if any(r <= 0 for r in ratios):
        yield Problem("elche.partition_ratios", list(ratios), "every share must be > 0")
    if world_size is not None and len(ratios) != world_size:
        yield Problem(
            "elche.partition_ratios", list(ratios),
            f"must have one share per rank (world size {world_size})",
        )


def _elche_warnings(cfg: ExperimentConfig) -> Iterator[str]:
    e = cfg.elche
    if e.easgd_alpha is not None and e.mode is not Mode.cpu_async:
        yield f"elche.easgd_alpha={e.easgd_alpha} has no effect in mode {e.mode.value} (cpu_async only)"
    if e.max_overshoot is not None and e.mode is not Mode.cpu_async:
        yield f"elche.max_overshoot={e.max_overshoot} has no effect in mode {e.mode.value} (cpu_async only)"
    if e.max_batch_diff is not None and e.mode is Mode.nccl_cadence:
        yield (f"elche.max_batch_diff={e.max_batch_diff} has no effect in mode {e.mode.value}: "
               "the collective paces the ranks")
    if e.mode is not Mode.nccl_sync and e.sync_average is not SyncAverage.grads:
        yield (f"elche.sync_average={e.sync_average.value} has no effect in mode {e.mode.value} "
               "(nccl_sync only)")
    if e.micro_batch_size is not None and not e.averages_gradients:
        yield (f"elche.micro_batch_size={e.micro_batch_size} has no effect in mode {e.mode.value}"
               " (nccl_sync with sync_average=grads only)")
    if e.window_end is not WindowEnd.count and e.mode.is_sync:
        yield (f"elche.window_end={e.window_end.value} has no effect in mode {e.mode.value}: "
               "sync modes reduce every step")
    if e.reduce_optimizer_state and e.averages_gradients:
        yield ("elche.reduce_optimizer_state has no effect in mode nccl_sync with "
               "sync_average=grads: every rank takes the same optimizer step")
    if e.relax_up and e.mode.is_sync:
        yield f"elche.relax_up has no effect in mode {e.mode.value}: sync modes reduce every step"


@_check
def _outer(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    o = cfg.outer
    yield from bound_problems(o, "outer")
    if o.kind is OuterKind.none and (o.momentum != 0 or o.lr != 1.0):
        yield "outer.lr/outer.momentum have no effect with outer=none (plain averaging)"
    if o.kind is OuterKind.none and o.reset_inner_state:
        yield "outer.reset_inner_state has no effect with outer=none (no outer step to reset after)"


@_check
def _data(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    d = cfg.data
    if d.transform is not None and not d.transform.isidentifier():
        yield Problem("data.transform", d.transform, "must name a function of the recipe module")
    yield from bound_problems(d, "data")


def epoch_splits_problem(num_samples: int, cfg: ExperimentConfig) -> Optional[Problem]:
    """data.epoch_splits may not exceed the batches of one pass (every epoch needs a batch),
    and the train set may not be empty. Needs the train set's size, so the materializer and
    the data plane call it, not validate()."""
    d = cfg.data
    if num_samples == 0:  # it was named as data.epoch_splits exceeding 0 batches
        return Problem("recipe.module", cfg.recipe.module, "must give a train_dataset with at "
                       "least one sample (its train_dataset(**recipe.params) returned an empty one)")
    batches = -(-num_samples * max(d.augment, 1) // max(cfg.batch_size, 1))
    if d.epoch_splits > batches:
        return Problem("data.epoch_splits", d.epoch_splits,
                       f"must be <= the batches of one pass, {batches} ({num_samples} samples x "
                       f"augment {d.augment} / batch_size {cfg.batch_size})")
    return None


def batch_size_warning(num_samples: int, cfg: ExperimentConfig, world_size: int) -> Optional[str]:
    """What a batch larger than the data does, said once the train set's size is known (rank 0,
    or the in-process run): ranks past the epoch's batches train nothing, and a batch past the
    epoch's samples is one short step an epoch. None when every rank gets a batch of its size.
    Said, not refused: the run is still right, only slower per sample than it could be."""
    d = cfg.data
    picks = num_samples * max(d.augment, 1) // max(d.epoch_splits, 1)  # an epoch's samples
    batches = -(-picks // max(cfg.batch_size, 1))
    if batches < world_size:
        idle = (f"ranks {batches}-{world_size - 1} train" if world_size - batches > 1
                else f"rank {batches} trains")
        return (f"batch_size={cfg.batch_size} makes {batches} batch{'es' if batches != 1 else ''} "
                f"of an epoch's {picks:,} samples for {world_size} ranks: {idle} nothing "
                f"(batch_size <= {max(picks // world_size, 1)} gives every rank a batch)")
    if cfg.batch_size > picks:
        return (f"batch_size={cfg.batch_size} is more than an epoch's {picks:,} samples: each "
                f"epoch is one step of {picks:,}")
    return None


@_check
def _run_scope(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    if cfg.progressive_dispatch is False and cfg.elche.mode is Mode.cpu_async:
        yield Problem("progressive_dispatch", False, "must be on (or null) in mode cpu_async: its "
                      "ranks stream chunks across epochs, with no fixed share to hand out up front")
    if not cfg.dashboard.host.strip():
        yield Problem("dashboard.host", cfg.dashboard.host, "must be an address to listen on")
    yield from bound_problems(cfg.dashboard, "dashboard")
    yield from _max_failure(cfg, world_size)
    yield from _callback_policy(cfg.epoch_callback_policy, world_size)
    for name in cfg.scalar_reductions:
        if name in CORE_METRIC_KEYS:
            yield Problem(f"scalar_reductions.{name}", cfg.scalar_reductions[name].value,
                          "is a core metric key whose reduction is fixed")
    yield from _checkpoint_at_epoch(cfg)
    if cfg.resume_from is not None:
        missing = [s for s in (".meta.json",) if not Path(cfg.resume_from + s).is_file()]
        if missing:
            yield Problem("resume_from", cfg.resume_from, _resume_hint(cfg.resume_from, missing))


def _resume_hint(given: str, missing: List[str]) -> str:
    """A bundle is named by its stem, `<run dir>/checkpoint`, not by its folder or a file."""
    path = Path(given)
    for stem in (path / "checkpoint", path.with_suffix("") if path.suffix == ".pt" else None,
                 Path(given.removesuffix(".meta.json"))):
        if stem is not None and str(stem) != given and Path(f"{stem}.meta.json").is_file():
            return f"must be the bundle's stem, the files' common prefix: type resume_from={stem}"
    return (f"must name a checkpoint bundle by its stem, e.g. resume_from=outputs/<date>/<time>/"
            f"checkpoint for the file checkpoint.meta.json and the files it names "
            f"(missing {', '.join(missing)})")


def _max_failure(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    mf = cfg.max_failure
    if mf.absolute is not None and mf.percent is not None:
        yield Problem("max_failure", f"absolute={mf.absolute}, percent={mf.percent}",
                      "set at most one of max_failure.absolute and max_failure.percent")
    yield from bound_problems(mf, "max_failure")
    if mf.absolute is not None and world_size is not None and mf.absolute > world_size:
        yield f"max_failure.absolute={mf.absolute} exceeds the world size {world_size}: it can never fire"


def _callback_policy(policy: str, world_size: Optional[int]) -> Iterator[Problem]:
    match = _POLICY.match(policy)
    if not match:
        yield Problem("epoch_callback_policy", policy, "must be 'fastest' or 'rank:<n>'")
    elif match.group(2) is not None and world_size is not None and int(match.group(2)) >= world_size:
        yield Problem("epoch_callback_policy", policy, f"rank must be < world size {world_size}")


def _checkpoint_at_epoch(cfg: ExperimentConfig) -> Iterator[Any]:
    epoch = cfg.checkpoint_at_epoch
    if epoch is None:
        return
    total = cfg.num_epochs * max(cfg.data.epoch_splits, 1)
    if not (0 <= epoch < total):
        yield Problem("checkpoint_at_epoch", epoch, f"must be in [0, {total - 1}] (the run's epochs)")
    if cfg.elche.mode.is_sync:
        yield f"checkpoint_at_epoch has no effect in mode {cfg.elche.mode.value} (progressive modes only)"


@_check
def _cluster(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    c = cfg.cluster
    if c.topology is Topology.cpu and c.num_ranks is None:
        yield Problem("cluster.num_ranks", None, "is required with cluster topology cpu")
    if c.topology is Topology.cpu and c.backend is Backend.nccl:
        yield Problem("cluster.backend", c.backend.value, "must be auto or gloo with cluster "
                      "topology cpu (NCCL runs on GPUs only)")
    if c.topology is Topology.local_gpus:
        if not c.devices:
            yield Problem("cluster.devices", [], "must list at least one device with topology local_gpus")
        if len(set(c.devices)) != len(c.devices) and cfg.elche.mode.is_collective \
                and c.backend is not Backend.gloo:
            yield Problem("cluster.devices", list(c.devices),
                          "must not repeat a device in collective modes over NCCL (NCCL needs one "
                          "GPU per rank): set cluster.backend=gloo to share one, or use a cpu_* mode")
    if c.emulate_slowdown is not None:
        if any(f < 1.0 for f in c.emulate_slowdown):
            yield Problem("cluster.emulate_slowdown", list(c.emulate_slowdown), "every factor must be >= 1.0")
        if world_size is not None and len(c.emulate_slowdown) != world_size:
            yield Problem("cluster.emulate_slowdown", list(c.emulate_slowdown),
                          f"must have one factor per rank (world size {world_size})")
    yield from bound_problems(c, "cluster")
    yield from bound_problems(c.controller, "cluster.controller")
    if c.topology is Topology.hosts:
        yield from _placeholders(cfg)
        yield from _workers(cfg)
    if c.topology is Topology.slurm:
        yield from _slurm(cfg)
    elif c.num_ranks is not None and c.topology is not Topology.cpu:
        yield f"cluster.num_ranks has no effect with topology {c.topology.value}"


SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}")
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _slurm(cfg: ExperimentConfig) -> Iterator[Any]:
    """The allocation block: what sbatch would refuse, said before anything is submitted."""
    c, s = cfg.cluster, cfg.cluster.slurm
    yield from bound_problems(s, "cluster.slurm")
    if not SLURM_TIME.fullmatch(str(s.time)):
        yield Problem("cluster.slurm.time", s.time,
                      "must be a Slurm time limit: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]")
    for key, name in (("cluster.slurm.partition", s.partition), ("cluster.slurm.job_name", s.job_name)):
        if name is not None and not SLURM_NAME.fullmatch(name):
            yield Problem(key, name, "must be letters, digits, '.', '_' or '-'")
    for i, arg in enumerate(s.sbatch_args):
        if not arg.startswith("--") or any(ch in arg for ch in "\n\r"):
            yield Problem(f"cluster.slurm.sbatch_args.{i}", arg, "must be one option starting with --")
    if s.gpus_per_node == 0 and c.num_ranks is None:
        yield Problem("cluster.num_ranks", None,
                      "is required with topology slurm on CPU (cluster.slurm.gpus_per_node=0)")
    if s.gpus_per_node > 0 and c.num_ranks is not None:
        yield "cluster.num_ranks has no effect with topology slurm on GPUs (one rank per GPU)"


PLACEHOLDER_DOMAIN = ".invalid"
"""RFC 6761's reserved domain: a name in it never resolves, so the two_hosts template names its
hosts there (gpu-a.invalid) and a run that still does was never edited for real machines."""


def _placeholders(cfg: ExperimentConfig) -> Iterator[Problem]:
    hosts = [("cluster.controller.host", cfg.cluster.controller.host)]
    hosts += [(f"cluster.workers.{i}.host", w.host) for i, w in enumerate(cfg.cluster.workers)]
    for key, host in hosts:
        if host.rstrip(".").lower().endswith(PLACEHOLDER_DOMAIN):
            yield Problem(key, host, "is a placeholder of the template (the .invalid domain never "
                                     "resolves): edit it to name your machine (docs/multi-host.md)")


def _workers(cfg: ExperimentConfig) -> Iterator[Any]:
    workers = cfg.cluster.workers
    if not workers:
        yield Problem("cluster.workers", [], "must list at least one host with topology hosts")
    hosts = {w.host for w in workers}
    for i, w in enumerate(workers):
        key = f"cluster.workers.{i}"
        devices = w.local_devices
        if isinstance(devices, (list, tuple)):
            gpus = [str(d) for d in devices if str(d) != "cpu"]  # "cpu" is a slot: repeat it per rank
            if len(set(gpus)) != len(gpus):
                yield Problem(f"{key}.local_devices", list(devices), "must not repeat a device")
        elif devices != "all":
            yield Problem(f"{key}.local_devices", devices, "must be a list of devices or 'all'")
        if len(hosts) > 1 and not w.nccl_socket_ifname:
            yield Problem(f"{key}.nccl_socket_ifname", w.nccl_socket_ifname,
                          "is required when the workers are on different hosts")
        yield from bound_problems(w.ssh, f"{key}.ssh")
        if w.docker is not None and not _SERVICE.match(w.docker):
            yield Problem(f"{key}.docker", w.docker, "must be a compose service name "
                          "(letters, digits, '.', '_', '-')")
        for name in w.env:
            if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
                yield Problem(f"{key}.env.{name}", w.env[name], "is reserved for the launcher")
    seen = [(w.host, str(d)) for w in workers if isinstance(w.local_devices, (list, tuple))
            for d in w.local_devices if str(d) != "cpu"]
    dupes = sorted({f"{h}:{d}" for h, d in seen if seen.count((h, d)) > 1})
    if dupes:
        yield Problem("cluster.workers", dupes, "must not give one device of a host to two ranks")


@_check
def _tracking(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    t = cfg.tracking
    if t.kind is TrackingKind.mlflow_server:
        if not (t.uri or "").startswith(("http://", "https://")):
            yield Problem("tracking.uri", t.uri, "must be an http(s):// URI with tracking=mlflow_server")
    elif t.kind is TrackingKind.mlflow and t.uri is not None:
        if not t.uri.startswith(("sqlite:///", "file:", "postgresql", "mysql")) and "://" in t.uri:
            yield Problem("tracking.uri", t.uri,
                          "must be a database or file URI with tracking=mlflow "
                          "(use tracking=mlflow_server for http)")
    if not t.experiment:
        yield Problem("tracking.experiment", t.experiment, "must not be empty")
    yield from bound_problems(t, "tracking")


@_check
def _save_path(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    """A bundle's stem names files beside it (`<stem>.meta.json`, `<stem>.g<n>.pt`): a directory
    put the generations inside it as hidden `.g1.pt` files while its lock went beside it, and
    `/dev/null` wrote `null.g1.pt` into /dev."""
    path = cfg.save_path
    if not path:
        return
    if path.endswith(("/", os.sep)) or Path(path).is_dir():
        yield Problem("save_path", path, "must name a bundle's stem, not a directory (the files "
                      "go beside it: e.g. save_path=<that directory>/checkpoint)")
    elif Path(path).exists() and not Path(path).is_file():
        yield Problem("save_path", path, "must name a bundle's stem in a directory of files, not "
                      "a device or another special file")


@_check
def _recipe(cfg: ExperimentConfig, world_size: Optional[int]) -> Iterator[Any]:
    direction = cfg.recipe.eval_direction  # Python callers may pass a plain "max" / "min"
    if direction not in {d.value for d in EvalDirection}:
        yield Problem("recipe.eval_direction", direction, "must be max or min")
    yield from bound_problems(cfg.recipe, "recipe")


def resolve(cfg: ExperimentConfig, run_dir: Optional[str] = None,
            outputs_dir: Optional[str] = None) -> ExperimentConfig:
    """Fill every auto value with what the run will use; returns a new object (input untouched)."""
    e = cfg.elche
    divergence = e.divergence_threshold
    if divergence is None:
        divergence = 0.3 if e.easgd_alpha is not None else 0.05
    elche = dataclasses.replace(
        e,
        min_anchor=e.anchor if e.min_anchor is None else e.min_anchor,
        divergence_threshold=divergence,
        partition_ratios=_normalized(e.partition_ratios),
    )
    progressive = cfg.progressive_dispatch
    if progressive is None:
        progressive = e.mode.is_progressive
    save_path = cfg.save_path
    if save_path is None and run_dir is not None:
        save_path = str(Path(run_dir) / "checkpoint")
    run_name = cfg.run_name or default_run_name(cfg, e.mode.value, cfg.outer.kind.value)
    cluster = cfg.cluster
    if cluster.topology is Topology.cpu and cluster.threads_per_rank is None and cluster.num_ranks:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, a sweep's group)
        cluster = dataclasses.replace(cluster, threads_per_rank=max(1, cores // cluster.num_ranks))
    return dataclasses.replace(
        cfg, elche=elche, progressive_dispatch=progressive, save_path=save_path,
        run_name=run_name, cluster=cluster, tracking=resolve_tracking(cfg.tracking, outputs_dir),
    )


def default_run_name(cfg: ExperimentConfig, mode: str, outer: str) -> str:
    """`<mode>[+<outer>]-<recipe>`: `nccl_cadence+diloco-digits_mlp`, `solo-digits_mlp` (an
    in-process run: its mode is `solo`, whatever `elche` says)."""
    trained = mode if outer == OuterKind.none.value else f"{mode}+{outer}"
    return f"{trained}-{cfg.recipe.module.rsplit('.', 1)[-1]}"


def resolve_tracking(tracking: TrackingConfig, outputs_dir: Optional[str] = None) -> TrackingConfig:
    """The store an mlflow run uses when `tracking.uri` is unset: `<outputs>/mlflow.db`."""
    if tracking.kind is TrackingKind.mlflow and tracking.uri is None:
        root = Path(outputs_dir or "outputs").resolve()
        return dataclasses.replace(tracking, uri=f"sqlite:///{root / 'mlflow.db'}")
    return tracking


def _normalized(ratios: Optional[List[float]]) -> Optional[List[float]]:
    if ratios is None:
        return None
    total = math.fsum(ratios)
    return [r / total for r in ratios] if total > 0 else list(ratios)
