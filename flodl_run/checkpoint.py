"""Checkpoint bundles: `S.pt`, `S.optim.pt`, `S.outer.pt`, `S.meta.json`.

Owns the bundle layout, atomic writes (temp file + rename), the meta schema, and the checks a
resume makes before anything trains (schema version, world size, seed, readable files).
Who decides when to save, and which rank writes the tensors, is the coordinator's business.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

SCHEMA_VERSION = 1
SAVE_REASONS = ("checkpoint", "graceful_shutdown", "max_failure_exceeded", "single_survivor",
                "all_ranks_lost", "reduce_stall")


class BundleError(Exception):
    """A bundle cannot be resumed from; the message says why (the CLI exits 2)."""


@dataclass
class Coverage:
    """What training the saved weights include: epochs before `epoch` fully; of `epoch`, all but
    the `uncovered` (pass, start, end) ranges of the permutation."""

    seed: int
    batch_size: int
    epoch_splits: int
    epoch: int
    uncovered: List[List[int]] = field(default_factory=list)


@dataclass
class BundleMeta:
    schema_version: int
    epoch: int
    """The epoch to (re)start at when resuming."""
    global_step: int
    sync_round: int
    world_size_at_save: int
    save_reason: str
    elche_state: Dict[str, Any]
    coverage: Coverage
    config: Dict[str, Any]
    mlflow_run_id: Optional[str] = None


def paths(stem: str | Path) -> Dict[str, Path]:
    stem = str(stem)
    return {"model": Path(stem + ".pt"), "optim": Path(stem + ".optim.pt"),
            "outer": Path(stem + ".outer.pt"), "meta": Path(stem + ".meta.json")}


def rank_optim_path(stem: str | Path, rank: int) -> Path:
    """Each rank's own optimizer state (momentum differs per replica); `S.optim.pt` is the
    callback rank's, used when a rank's own file is absent."""
    return Path(f"{stem}.optim.rank{rank}.pt")


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_tensors(path: Path, state: Any) -> None:
    """torch.save, atomically."""
    _atomic(path, lambda tmp: torch.save(state, tmp))


def save_meta(stem: str | Path, meta: BundleMeta) -> None:
    text = json.dumps(asdict(meta), indent=2, default=str) + "\n"
    _atomic(paths(stem)["meta"], lambda tmp: tmp.write_text(text))


def load_tensors(path: Path) -> Any:
    """torch.load(weights_only=True): a bundle never runs code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except Exception as exc:  # truncated, corrupt, or not a weights-only file
        raise BundleError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def read_meta(stem: str | Path) -> BundleMeta:
    path = paths(stem)["meta"]
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: corrupt ({exc})") from None
    version = raw.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise BundleError(f"{path}: schema_version {version!r} is newer than this flodl_run "
                          f"reads ({SCHEMA_VERSION})")
    try:
        raw["coverage"] = Coverage(**raw["coverage"])
        return BundleMeta(**raw)
    except (KeyError, TypeError) as exc:
        raise BundleError(f"{path}: corrupt ({exc})") from None


def check_resume(meta: BundleMeta, world_size: Optional[int], seed: int, stem: str) -> List[str]:
    """Reasons this run cannot continue the bundle (empty when it can)."""
    problems = []
    if world_size is not None and world_size != meta.world_size_at_save:
        problems.append(f"the bundle was saved by {meta.world_size_at_save} ranks, this run has "
                        f"{world_size}")
    if seed != meta.coverage.seed:
        problems.append(f"the bundle was trained with seed {meta.coverage.seed}, this run has {seed}")
    for name in ("model", "optim"):
        if not paths(stem)[name].is_file():
            problems.append(f"{paths(stem)[name]} is missing")
    return problems
