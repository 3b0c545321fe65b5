"""summary.json: the machine-readable outcome of a run.

Owns the record types and the atomic write; it does not compute any figure itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional


@dataclass
class EpochRecord:
    epoch: int
    avg_loss: float
    eval: Optional[float]
    epoch_ms: float
    per_rank_throughput: List[float]
    """Samples per second of compute, per rank."""
    per_rank_batch_share: List[float]
    """Share of the epoch's batches each rank trained."""
    scalars: Dict[str, float] = field(default_factory=dict)
    """User scalars (record_scalar), rolled up by scalar_reductions."""
    samples: int = 0
    """Samples whose training reached the consensus (work of ranks that died is not counted:
    it was redone by survivors)."""
    per_rank_data_starve_ms: List[float] = field(default_factory=list)
    """Per rank: time its steps waited for their batches in the epoch, in ms."""
    per_rank_delivery: List[str] = field(default_factory=list)
    """Per rank: how its data reached its device at the epoch's end (resident or streaming)."""
    per_rank_cache_hit_rate: List[Dict[str, float]] = field(default_factory=list)
    """Per rank: share of the epoch's rows served by each tier (vram, ram, disk; a CPU rank's
    device-held rows are ram)."""
    eval_ms: float = 0.0
    """Time of the epoch's eval (and, in a distributed run, epoch_fn) inside epoch_ms, in ms
    (about 0: none due); the bench subtracts it to compare training throughput."""


@dataclass
class ReduceRecord:
    """One reduce as the coordinator saw it, with ElChe's plan for the next window."""

    round: int
    epoch: int
    sync_ms: float
    divergence: Optional[float]
    """D of this reduce; None where not measured (nccl_sync measures one reduce in 16)."""
    anchor: int
    anchor_rank: Optional[int]
    batch_counts: List[int]
    overhead: Optional[float]
    verdict: str
    phase: str
    nudge_factor: Optional[float] = None
    cosine: List[Optional[float]] = field(default_factory=list)
    """Per rank: cosine between its window update and the consensus's (None: not measured)."""
    magnitude: List[Optional[float]] = field(default_factory=list)
    """Per rank: ||its window update|| / ||the consensus's|| (None: not measured)."""
    left: List[int] = field(default_factory=list)
    """Per rank: batches of the window just reduced that its deadline left untrained
    (elche.window_end=deadline; they went back to the pool); empty where not tallied."""


@dataclass
class ReportRecord:
    """A sub-epoch report (reports_per_epoch) at a reduce boundary."""

    epoch: int
    index: int
    """1..reports_per_epoch within the epoch."""
    fraction: float
    """Share of the epoch's batches done when the report fired."""
    global_step: int
    avg_loss: float
    """Per-batch loss since the previous report."""
    scalars: Dict[str, float] = field(default_factory=dict)


@dataclass
class Summary:
    status: str = "failed"
    """completed | failed | interrupted | shutdown_with_save (failed until a run says otherwise;
    with a save_path, shutdown_with_save only when that stop's bundle was written)."""
    mode: str = "solo"
    outer: str = "none"
    world_size: int = 1
    devices: List[str] = field(default_factory=list)
    epochs: List[EpochRecord] = field(default_factory=list)
    final_eval: Optional[float] = None
    wall_s: float = 0.0
    samples_per_s: float = 0.0
    syncs: int = 0
    avg_sync_ms: float = 0.0
    idle_fraction: List[float] = field(default_factory=list)
    """Per rank: share of the training wall time it spent not computing (waiting, reducing)."""
    anchor_trajectory: List[int] = field(default_factory=list)
    phase: Optional[str] = None
    dead_ranks: List[int] = field(default_factory=list)
    param_transport: List[str] = field(default_factory=list)
    """cpu_* modes, per rank: how its parameters last reached the coordinator and back, `shm`
    (shared memory, ranks on the launcher's host) or `frames` (over the socket)."""
    compiled_graphs: List[int] = field(default_factory=list)
    """Per rank, a compiled model (recipe.compile): graphs torch.compile built in the run; empty
    when none was built."""
    eager_frames: List[int] = field(default_factory=list)
    """Per rank, with compiled_graphs: frames dynamo gave up on after its recompile limit (they
    ran eagerly from then on)."""
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    """Per node the ranks ran on: host, cpu_count, ram_bytes, gpus (static facts)."""
    nonfinite: List[Dict[str, Any]] = field(default_factory=list)
    """Each time a rank's loss or parameters were NaN/inf at a reduce (it gave weight 0):
    round, rank, what ("loss" or "parameters")."""
    checkpoint: Optional[str] = None
    mlflow_run_id: Optional[str] = None
    message: Optional[str] = None
    """Human-readable reason for a status other than completed; for a completed run, the
    ranks that failed (a recipe error) while the survivors carried on, else None."""


def _clean(value: Any) -> Any:
    """JSON has no NaN: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


CHECKPOINT_FAILED = "checkpoint_failed"
"""The event of a save the disk refused: the run goes on, its end line says so."""

OUTCOME_FIELDS = ("status", "message", "mode", "outer", "world_size", "final_eval", "wall_s",
                  "dead_ranks", "checkpoint", "mlflow_run_id")
"""What `write_outcome` keeps: how the run ended and where its bundle is, in a few hundred bytes."""


def write_outcome(path: str | Path, summary: Summary) -> None:
    """summary.json with the outcome only (OUTCOME_FIELDS), written as `write_summary` writes:
    the launcher writes it first, so that a disk with no room for the whole record (its epochs
    and reduces grow with the run) still keeps how the run ended."""
    record = dataclasses.asdict(summary)
    _write_atomically(Path(path), {key: record[key] for key in OUTCOME_FIELDS})


def write_summary(path: str | Path, summary: Summary) -> None:
    """Write atomically and durably (temp file, fsync, rename, directory fsync) so a reader
    never sees half a file, even after a crash; a write that fails leaves no temp file."""
    _write_atomically(Path(path), dataclasses.asdict(summary))


def _write_atomically(path: Path, record: Dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(_clean(record), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk keeps no half record (and gets its space back)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
