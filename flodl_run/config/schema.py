"""Typed configuration: the dataclass schemas behind every `conf/` group.

Owns the shape, types, defaults, units and single-key ranges (`bounded(...)`, see
`config.bounds`) of every config key; a docstring never restates a range. It does not
validate values (see `config.validate`) or talk to Hydra (see `config.compose`);
plain Python users build these objects directly (`ElCheConfig.cpu_async()`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from flodl_run.config.bounds import bounded


class Mode(str, enum.Enum):
    """The five sync/cadence/async modes. Member names are the YAML spelling."""

    nccl_sync = "nccl_sync"
    nccl_cadence = "nccl_cadence"
    cpu_sync = "cpu_sync"
    cpu_cadence = "cpu_cadence"
    cpu_async = "cpu_async"

    @property
    def is_collective(self) -> bool:
        """Ranks average among themselves (NCCL on CUDA, Gloo on CPU)."""
        return self.name.startswith("nccl_")

    @property
    def is_sync(self) -> bool:
        return self.name.endswith("_sync")

    @property
    def is_progressive(self) -> bool:
        """Cadence and async stream throughput-proportional chunks."""
        return not self.is_sync


class GuardKind(str, enum.Enum):
    """Convergence guard."""

    none = "none"
    trend = "trend"
    rate = "rate"


class SyncAverage(str, enum.Enum):
    """What nccl_sync averages: the gradients inside backward (exact: torch DDP's trajectory at
    the global batch) or, floDl's variant, the parameters after each rank's own step."""

    grads = "grads"
    params = "params"


class WindowEnd(str, enum.Enum):
    """When a cadence window ends: every rank has run its planned count, or a deadline has
    passed (the anchor rank's planned count at its measured speed; counts become what fit)."""

    count = "count"
    deadline = "deadline"


class OuterKind(str, enum.Enum):
    """Outer optimizer applied to the consensus."""

    none = "none"
    slowmo = "slowmo"
    diloco = "diloco"


class Topology(str, enum.Enum):
    """How ranks are laid out."""

    auto = "auto"
    solo = "solo"
    cpu = "cpu"
    local_gpus = "local_gpus"
    hosts = "hosts"
    slurm = "slurm"


class TrackingKind(str, enum.Enum):
    mlflow = "mlflow"
    mlflow_server = "mlflow_server"
    off = "off"


class Reduction(str, enum.Enum):
    """How a user scalar rolls up across ranks."""

    mean = "mean"
    sum = "sum"
    min = "min"
    max = "max"
    last = "last"


class EvalDirection(str, enum.Enum):
    """Which way a recipe's eval improves: accuracy-like (max) or loss-like (min)."""

    max = "max"
    min = "min"

    def reached(self, score: float, target: float) -> bool:
        """`score` meets `target`: >= for max, <= for min."""
        return score >= target if self is EvalDirection.max else score <= target

    def is_better(self, score: float, other: float) -> bool:
        """`score` is strictly better than `other`."""
        return score > other if self is EvalDirection.max else score < other


class Amp(str, enum.Enum):
    """Mixed precision of the built-in step: torch.autocast around train_step, with a GradScaler
    for fp16 (as torch's AMP recipe does it); off = the model's own dtype."""

    off = "off"
    fp16 = "fp16"
    bf16 = "bf16"


class Backend(str, enum.Enum):
    """The collective backend of nccl_sync and nccl_cadence: auto = NCCL on GPUs, Gloo on CPUs;
    gloo on GPUs lets several ranks share one GPU (testing, debugging), as torch's DDP allows."""

    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Theme(str, enum.Enum):
    auto = "auto"
    light = "light"
    dark = "dark"


@dataclass
class ElCheConfig:
    """The cadence balancer and its guards. Defaults are the nccl_cadence preset."""

    mode: Mode = Mode.nccl_cadence
    """One of the five modes."""
    anchor: int = bounded(10, ge=1)
    """Initial anchor: batches the slowest rank runs per window."""
    min_anchor: Optional[int] = bounded(None, ge=1)
    """Floor for auto-tune shrink, in batches; null = `anchor`. Nudges may go below, to 1."""
    max_anchor: int = bounded(1000, ge=1)
    """Ceiling for the anchor, in batches; >= min_anchor."""
    overhead_target: float = bounded(0.05, ge=0.01, le=0.50)
    """Target share of compute time spent in reduces."""
    max_batch_diff: Optional[int] = bounded(None, ge=0)
    """Max lead in batches of the fastest over the slowest rank; 0 = lockstep; null = unbounded."""
    max_overshoot: Optional[int] = bounded(None, ge=0)
    """cpu_async lookahead in batches past the window; null = auto (start 3, ceiling 15)."""
    relax_up: bool = False
    """Grow the anchor by 1 on each Stable verdict."""
    partition_ratios: Optional[List[float]] = None
    """Per-rank data shares (normalized); length = world size; null = by measured throughput."""
    convergence_guard: GuardKind = GuardKind.trend
    """Divergence guard: none, trend (default) or rate."""
    divergence_threshold: Optional[float] = bounded(None, gt=0)
    """Relative divergence D that counts as rising; null = 0.05, or 0.3 with easgd_alpha."""
    easgd_alpha: Optional[float] = bounded(None, gt=0, le=1)
    """EASGD elastic weight; honoured on cpu_async only; null = plain overwrite."""
    gamma: float = bounded(1.0, ge=0)
    """Consensus weight exponent: w_k = n_k ** gamma."""
    reduce_optimizer_state: bool = False
    """Average the inner optimizer's per-parameter float state (AdamW's moments, SGD's momentum)
    with the parameters' weights at each consensus; step counters stay each rank's own."""
    meta_controller: bool = True
    """LR-aware meta-controller above ElChe."""
    sync_average: SyncAverage = SyncAverage.grads
    """nccl_sync only: grads (exact, work-weighted gradient all-reduce) or params (floDl's)."""
    micro_batch_size: Optional[int] = bounded(None, ge=1)
    """nccl_sync grads: largest micro-batch a rank computes at once, in samples; null = batch_size."""
    window_end: WindowEnd = WindowEnd.count
    """Cadence and async modes: a window ends on the planned counts (count) or once the anchor
    rank's planned count should have taken (deadline: each rank stops after the batch in hand,
    its untrained batches go back to the pool); sync modes always end on counts."""
    deadline_headroom: float = bounded(0.1, ge=0, le=1)
    """Deadline windows: the share past its planned count a rank is lent from the pool, so a
    rank ahead of its plan trains on to the deadline (at most ceil(count x (1 + headroom))
    batches; what it does not train goes back); 0 = the count is the bound."""

    @property
    def averages_gradients(self) -> bool:
        """nccl_sync's exact path: each global step's gradient is averaged, not the replicas."""
        return self.mode is Mode.nccl_sync and self.sync_average is SyncAverage.grads

    @classmethod
    def nccl_sync(cls) -> "ElCheConfig":
        return cls(mode=Mode.nccl_sync, anchor=1)

    @classmethod
    def nccl_cadence(cls) -> "ElCheConfig":
        return cls(mode=Mode.nccl_cadence)

    @classmethod
    def cpu_sync(cls) -> "ElCheConfig":
        return cls(mode=Mode.cpu_sync, anchor=1)

    @classmethod
    def cpu_cadence(cls) -> "ElCheConfig":
        return cls(mode=Mode.cpu_cadence)

    @classmethod
    def cpu_async(cls) -> "ElCheConfig":
        return cls(mode=Mode.cpu_async, easgd_alpha=0.5)

    @classmethod
    def preset(cls, mode: Mode | str) -> "ElCheConfig":
        """The preset of `mode`, as `conf/elche/<mode>.yaml` defines it."""
        return getattr(cls, Mode(mode).value)()


@dataclass
class OuterConfig:
    """Outer optimizer on the consensus."""

    kind: OuterKind = OuterKind.none
    """none (plain averaging), slowmo, or diloco (Nesterov)."""
    lr: float = bounded(1.0, gt=0)
    """Outer learning rate."""
    momentum: float = bounded(0.0, ge=0, lt=1)
    """Outer momentum mu."""
    reset_inner_state: bool = False
    """Clear every rank's inner optimizer state after each outer step (DiLoCo's published reset)."""


@dataclass
class SshConfig:
    """How the launcher reaches a worker host over OpenSSH."""

    user: Optional[str] = None
    """Remote user; null = the ssh client's default."""
    port: int = bounded(22, ge=1, le=65535)
    """sshd port on the worker."""
    identity_file: Optional[str] = None
    """Private key file; null = the ssh client's default."""
    options: List[str] = field(default_factory=list)
    """Extra `-o` options, e.g. ["StrictHostKeyChecking=accept-new"]."""


@dataclass
class WorkerConfig:
    """One host that runs ranks."""

    host: str = "localhost"
    """Address the launcher reaches the host at."""
    local_devices: Any = "all"
    """Device indices or UUIDs on this host as a list, or "all" to probe the host."""
    nccl_socket_ifname: Optional[str] = None
    """Network interface for NCCL; required when hosts differ."""
    path: Optional[str] = None
    """Project checkout on the host; null = the controller's path."""
    python: str = "python3"
    """Python interpreter on the host."""
    ssh: SshConfig = field(default_factory=SshConfig)
    env: Dict[str, str] = field(default_factory=dict)
    """Extra environment for this host's ranks."""
    docker: Optional[str] = None
    """Compose service this host's ranks run in (`docker compose exec` in `path`, where the
    compose file is); null = bare metal."""


@dataclass
class DashboardConfig:
    """The live dashboard the launcher serves while the run goes."""

    serve: Optional[int] = bounded(None, ge=0, le=65535)
    """TCP port to serve it on; 0 = a free port; null = off."""
    host: str = "127.0.0.1"
    """Address it listens on; loopback by default (other machines cannot reach it)."""


@dataclass
class ControllerConfig:
    """Where the coordinator listens for a multi-host run."""

    host: str = "127.0.0.1"
    """Address ranks reach the coordinator at; loopback for single-host runs."""
    port: int = bounded(0, ge=0, le=65535)
    """Control-plane TCP port; 0 = a free port."""
    path: Optional[str] = None
    """Project checkout on the controller host; null = the current directory."""


@dataclass
class SlurmConfig:
    """The allocation `python -m flodl_run.submit` asks Slurm for (topology slurm)."""

    nodes: int = bounded(1, ge=1)
    """Nodes to allocate."""
    gpus_per_node: int = bounded(0, ge=0)
    """GPUs per node, one rank each; 0 = CPU ranks (cluster.num_ranks of them)."""
    time: str = "01:00:00"
    """Wall-clock limit: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]."""
    partition: Optional[str] = None
    """Partition to submit to; null = the cluster's default."""
    job_name: str = "flodl_run"
    """The job's name in squeue."""
    output_dir: Optional[str] = None
    """Where the sbatch script and the job's output go; null = outputs/slurm."""
    sbatch_args: List[str] = field(default_factory=list)
    """Extra `#SBATCH` options, each starting with `--` (e.g. --account=ml, --overcommit)."""


@dataclass
class ClusterConfig:
    """Rank topology."""

    topology: Topology = Topology.auto
    """auto (1 rank per visible GPU if 2+, else in-process), solo, cpu, local_gpus, hosts or
    slurm (inside an allocation: ranks as one srun step)."""
    num_ranks: Optional[int] = bounded(None, ge=1)
    """Number of CPU ranks for topology cpu."""
    threads_per_rank: Optional[int] = bounded(None, ge=1)
    """torch intra-op threads per CPU rank; null = cores / ranks (at least 1)."""
    devices: List[str] = field(default_factory=list)
    """CUDA device indices or UUIDs for topology local_gpus."""
    emulate_slowdown: Optional[List[float]] = None
    """Per-rank slowdown factors >= 1 (rank k sleeps (f_k - 1) x step time)."""
    emulate_jitter: float = bounded(0.0, ge=0.0, le=0.5)
    """Relative std of each emulated step time (f_k x (1 + jitter x N(0, 1)), never below the
    real step), drawn per step from a stream seeded by (seed, rank); 0 = none."""
    backend: Backend = Backend.auto
    """Collective backend of nccl_sync and nccl_cadence: auto (NCCL on GPUs, Gloo on CPUs), nccl,
    or gloo (several ranks may then share one GPU)."""
    master_addr: str = "127.0.0.1"
    """MASTER_ADDR of the torch.distributed rendezvous (local ranks; controller-only hosts
    layouts). Ranks the launcher starts over SSH use its store at controller.host instead."""
    master_port: int = bounded(0, ge=0, le=65535)
    """MASTER_PORT of the rendezvous; 0 = a free port."""
    launch_ranks: bool = True
    """false = controller-only: start the coordinator and wait for ranks started by torchrun/srun."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    workers: List[WorkerConfig] = field(default_factory=list)
    """Hosts in rank order for topology hosts."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The allocation to submit for topology slurm."""


@dataclass
class DataConfig:
    """Per-rank data-plane budgets and delivery."""

    vram_max_usage: float = bounded(0.90, ge=0.50, le=0.99)
    """Share of device memory the data plane may use."""
    ram_max_usage: float = bounded(0.50, ge=0.0, le=0.90)
    """Share of available host RAM for staging tiers; 0 disables the cache."""
    gpu_ram_share: Optional[float] = bounded(None, gt=0)
    """Share of host RAM handed to an integrated GPU; null = what the device reports."""
    sample_cache: bool = True
    """Keep samples in a pinned host-RAM cache."""
    vram_pool: bool = True
    """Keep samples in leftover device memory after the first step."""
    disk_stage_gb: float = bounded(0.0, ge=0)
    """On-disk overflow tier under the RAM cache, in GB; 0 = off."""
    disk_stage_dir: Optional[str] = None
    """Directory of the disk-stage pack file; null = the system temp dir."""
    prefetch: Optional[int] = bounded(None, ge=1)
    """Fixed streaming prefetch depth in batches; null = adaptive."""
    augment: int = bounded(1, ge=1)
    """Times each sample appears per epoch."""
    epoch_splits: int = bounded(1, ge=1)
    """Epochs per data pass."""
    transform: Optional[str] = None
    """Name of a deterministic transform function in the recipe module; null = none."""


@dataclass
class MaxFailureConfig:
    """Dead-rank threshold that ends the run with a save. Set at most one."""

    absolute: Optional[int] = bounded(None, ge=1)
    """Stop when this many ranks are dead."""
    percent: Optional[float] = bounded(None, gt=0, le=1)
    """Stop when ceil(percent x world_size) ranks are dead."""


@dataclass
class RecipeConfig:
    """What to train: a module with the recipe functions plus their keyword arguments."""

    module: str = "recipes.digits_mlp"
    """Dotted module path, importable from the current directory or the environment."""
    params: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to every recipe function."""
    batch_size: int = bounded(32, ge=1)
    """Per-rank batch (samples) the recipe is sized for: the run's `batch_size` unless set."""
    loop: Optional[str] = None
    """The rank's own loop body, `loop(worker)`: `fn` of the module or `pkg.module.fn`; null = the
    module's `loop` if it defines one, else the built-in step (train_step on every batch)."""
    target_eval: Optional[float] = None
    """Eval score the benchmark counts as reached (time-to-target); null = none."""
    eval_direction: EvalDirection = EvalDirection.max
    """Which way eval improves: max (accuracy: reached when >= target) or min (a loss, bits per
    byte: reached when <= target). Bench, sweep comparison and review follow it."""
    amp: Amp = Amp.off
    """Mixed precision of the built-in step: off, fp16 (autocast and a GradScaler) or bf16
    (autocast); a recipe with its own loop does its own."""
    compile: Optional[str] = None
    """torch.compile the model build_model returns, with this backend (inductor on GPUs,
    aot_eager to check a CPU run); null = as build_model returns it (it may compile itself)."""
    find_unused_parameters: bool = False
    """nccl_sync: some parameters get no gradient in some steps (a branch not taken), as torch
    DDP's flag of that name; costs a walk of the autograd graph per step."""
    optimize_ddp: bool = False
    """nccl_sync with a compiled model: dynamo splits the graph at DDP's gradient buckets, so a
    bucket's all-reduce overlaps the rest of the backward (torch's DDPOptimizer, named as torch's
    switch). Off: one graph, all-reduced once its backward ends (a compiled ResNet failed split)."""


@dataclass
class TrackingConfig:
    """Where the coordinator logs runs."""

    kind: TrackingKind = TrackingKind.mlflow
    """mlflow (local SQLite store), mlflow_server (a tracking URI) or off."""
    uri: Optional[str] = None
    """Tracking URI; null = sqlite:///<outputs>/mlflow.db for kind mlflow."""
    experiment: str = "flodl_run"
    """MLflow experiment name."""
    system_metrics: bool = True
    """Log host and GPU figures once per node, and every host over time (MLflow's system-metrics
    collectors: CPU, memory, disk, network, each GPU's utilisation and memory; the launcher's
    host by MLflow's monitor, each other host by its lowest rank through the coordinator)."""
    system_metrics_interval_s: float = bounded(10.0, gt=0)
    """Seconds between two samples of the system-metrics monitor."""


@dataclass
class DdpRunConfig:
    """Run-scope configuration of distributed training (names follow floDl)."""

    elche: ElCheConfig = field(default_factory=ElCheConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint_every: Optional[int] = bounded(None, ge=1)
    """Save a checkpoint bundle every n epochs; null = only at the end."""
    snapshot_timeout_secs: float = bounded(5.0, gt=0)
    """Coordinator-backend wait for parameter snapshots, in seconds."""
    progressive_dispatch: Optional[bool] = None
    """Stream throughput-sized chunks; null = on for cadence/async, off for sync."""
    max_grad_norm: Optional[float] = bounded(None, gt=0)
    """Per-rank L2 gradient clip before each optimizer step; null = no clip."""
    timeline: bool = False
    """Record a high-frequency event timeline for profiling."""
    lr_scale_ratio: float = bounded(1.0, ge=0)
    """lr_factor = 1 + (world_size - 1) x ratio."""
    save_path: Optional[str] = None
    """Checkpoint bundle stem; null = <run dir>/checkpoint."""
    max_failure: MaxFailureConfig = field(default_factory=MaxFailureConfig)
    heartbeat_timeout_secs: float = bounded(30.0, gt=0)
    """A rank silent for this long, in seconds, is dead."""
    max_nonfinite: int = bounded(3, ge=1)
    """Reduces in a row with a non-finite rank (NaN/inf loss or parameters, given weight 0)
    before the run stops as failed, saving the last finite consensus."""
    progress_timeout_secs: float = bounded(300.0, gt=0)
    """A rank with batches to train that finishes none for max(progress_factor x its smoothed
    batch time, this), in seconds, is hung: declared dead and killed. The floor covers
    slow first batches (autotuning, compilation); time in an ordered reduce, eval or save does
    not count. It is also the floor of an eval's or a save's deadline (progress_factor x the
    longest of that kind so far; progress_factor x this before one was timed)."""
    progress_factor: float = bounded(20.0, ge=1)
    """Smoothed batch times a training rank may go without finishing a batch."""
    epoch_callback_policy: str = "fastest"
    """Rank that runs eval/checkpoint hooks: "fastest" or "rank:<n>"."""
    eval_every_epochs: Optional[int] = bounded(1, ge=1)
    """Eval every n epochs; null = only the final eval."""
    reports_per_epoch: Optional[int] = bounded(None, ge=1)
    """Sub-epoch metric reports at reduce boundaries; null = per epoch only."""
    record_log_dir: Optional[str] = None
    """Directory of the JSONL record log tree; null = off."""
    max_log_size: int = bounded(32 * 1024 * 1024, ge=4096)
    """Byte cap of each record log ring (32 MiB)."""
    dashboard_html: Optional[str] = None
    """Path of the self-contained HTML dashboard written at teardown; null = none."""
    dashboard_theme: Theme = Theme.auto
    """Theme the dashboard opens with: auto, light or dark."""
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    scalar_reductions: Dict[str, Reduction] = field(default_factory=dict)
    """Cross-rank roll-up per user scalar name; unlisted scalars use mean."""
    resume_from: Optional[str] = None
    """Checkpoint bundle stem to resume from; must exist."""
    checkpoint_at_epoch: Optional[int] = None
    """One-shot mid-run checkpoint when the cohort reaches this epoch; >= 0."""


@dataclass
class ExperimentConfig(DdpRunConfig):
    """The root of the `conf/` tree: a DdpRunConfig plus what to train, where and how to log."""

    seed: int = bounded(0, ge=0)
    """Seed of model init and the per-pass data permutation."""
    batch_size: int = bounded(32, ge=1)
    """Samples per batch per rank."""
    num_epochs: int = bounded(10, ge=1)
    """Passes over the data (x epoch_splits epochs)."""
    run_name: Optional[str] = None
    """MLflow run name; null = <mode>-<recipe>."""
    device: str = "auto"
    """In-process device: auto (cuda if visible, else cpu), cpu, or cuda[:i]."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def lr_factor(world_size: int, lr_scale_ratio: float) -> float:
    """What `lr_scale_ratio` means for a cohort of `world_size` ranks: the ranks' LR is
    scaled by 1 + (world_size - 1) * ratio (linear scaling at ratio 1). Ranks apply it; the
    coordinator recomputes it for the survivors after a death."""
    return 1.0 + (world_size - 1) * lr_scale_ratio
