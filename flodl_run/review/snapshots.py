"""Snapshots of the named experiments' resolved configs, and the check that fails on drift.

Owns `--snapshot DIR` (write one YAML per experiment), `--check DIR` (what differs from each
snapshot, field by field, with what it means) and `--update DIR` (rewrite what differs, remove
snapshots of experiments that are gone). The snapshot form is `config.experiments`'; the
tables and the meaning lines are `review.table`'s and `review.meaning`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from flodl_run.config.compose import compose, conf_dir, to_experiment
from flodl_run.config.experiments import (
    GROUP,
    config_of,
    experiment_files,
    experiment_overrides,
    normalized,
    read_snapshot,
    snapshot_items,
    snapshot_text,
)
from flodl_run.config.materialize import ConfigError, Materialized
from flodl_run.config.validate import validate
from flodl_run.review.meaning import Rig, meaning_lines
from flodl_run.review.table import ReviewError, Row, paired_rows, show, validated

SUFFIX = ".yaml"


@dataclass(frozen=True)
class Current:
    """One experiment as the working tree resolves it."""

    name: str
    items: Dict[str, Any]
    """Its snapshot items, as a snapshot file reads back."""


@dataclass(frozen=True)
class Drift:
    """An experiment whose resolved config is not its snapshot (or has none, or is gone)."""

    name: str
    rows: List[Row] = field(default_factory=list)
    """key, the snapshot's value, the value now: only the fields that differ."""
    lines: List[str] = field(default_factory=list)
    """What the change does to the run (review.meaning)."""
    problem: str = "differs from its snapshot"
    current: Optional[Current] = None
    """None when the experiment is gone."""


def current(name: str, overrides: Sequence[str]) -> Current:
    """Compose, validate and resolve experiment `name`; an invalid one raises ReviewError
    naming it (the runner's messages; the recipe module is found, not imported)."""
    args = experiment_overrides(name, overrides)
    try:
        composed = compose(args)
        unresolved, _ = to_experiment(composed)
        config = validated(composed).config
    except ConfigError as exc:
        raise ReviewError(f"experiment {name}: {exc}") from None
    return Current(name, normalized(snapshot_items(config, unresolved)))


@dataclass(frozen=True)
class Selection:
    """Which experiments a snapshot command covers: all of them, or those an `experiment=a,b`
    among the overrides names (the other snapshots are then left alone)."""

    names: List[str]
    overrides: List[str]
    """The other overrides, applied to each experiment."""
    is_all: bool


def selection(overrides: Sequence[str]) -> Selection:
    picked = [o.partition("=")[2] for o in overrides if o.startswith(f"{GROUP}=")]
    rest = [o for o in overrides if not o.startswith(f"{GROUP}=")]
    known = list(experiment_files(conf_dir(), rest))
    if not known:
        raise ReviewError(f"no named experiments: {conf_dir() / GROUP} has no YAML")
    names = [n for value in picked for n in value.split(",")] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ReviewError(f"{GROUP}: must be one of {', '.join(known)}, got {', '.join(unknown)}")
    return Selection(names, rest, not picked)


def experiments(chosen: Selection) -> List[Current]:
    return [current(name, chosen.overrides) for name in chosen.names]


def write(directory: Path, now: Current) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{now.name}{SUFFIX}").write_text(snapshot_text(now.name, now.items))


def snapshot(directory: Path, overrides: Sequence[str]) -> List[str]:
    """Write every experiment's snapshot into `directory`; returns their names."""
    written = experiments(selection(overrides))
    for now in written:
        write(directory, now)
    return [now.name for now in written]


def check(directory: Path, overrides: Sequence[str], rig: Rig = Rig()) -> List[Drift]:
    """Every experiment that differs from its snapshot in `directory`, has none, or is gone."""
    if not directory.is_dir():
        raise ReviewError(f"--check: {directory} is not a directory (write it with --snapshot)")
    drifts: List[Drift] = []
    chosen = selection(overrides)
    nows = experiments(chosen)
    for now in nows:
        path = directory / f"{now.name}{SUFFIX}"
        if not path.is_file():
            drifts.append(Drift(now.name, problem="has no snapshot", current=now))
            continue
        drift = compared(now, _read(path), rig)
        if drift is not None:
            drifts.append(drift)
    if chosen.is_all:
        names = {now.name for now in nows}
        drifts += [Drift(path.stem, problem="has a snapshot but is no longer an experiment")
                   for path in sorted(directory.glob(f"*{SUFFIX}")) if path.stem not in names]
    return drifts


def update(directory: Path, overrides: Sequence[str], rig: Rig = Rig()) -> List[Drift]:
    """Rewrite the snapshots that differ, write missing ones, remove those of experiments that
    are gone; returns what changed."""
    drifts = check(directory, overrides, rig) if directory.is_dir() else [
        Drift(now.name, problem="has no snapshot", current=now)
        for now in experiments(selection(overrides))]
    for drift in drifts:
        if drift.current is None:
            (directory / f"{drift.name}{SUFFIX}").unlink()
        else:
            write(directory, drift.current)
    return drifts


def compared(now: Current, snap: Dict[str, Any], rig: Rig) -> Optional[Drift]:
    """The drift of `now` from snapshot `snap`; None when they are the same."""
    if snap == now.items:
        return None
    shown_now = {k: show(v) for k, v in now.items.items()}
    shown_snap = {k: show(v) for k, v in snap.items()}
    rows = [(key, then, value) for key, value, then in paired_rows(shown_now, shown_snap)
            if value != then]
    before, after = config_of(snap), config_of(now.items)
    lines: List[str] = []
    if before is not None and after is not None:
        lines = meaning_lines(_with_warnings(before), _with_warnings(after), rig)
    elif before is None:
        lines = ["the snapshot no longer fits the config schema (keys renamed or removed)"]
    return Drift(now.name, rows, lines, current=now)


def _with_warnings(config: Any) -> Materialized:
    """A snapshot side with the validator's warnings (the same rules on both sides)."""
    return Materialized(config, validate(config).warnings)


def _read(path: Path) -> Dict[str, Any]:
    try:
        return read_snapshot(path.read_text())
    except Exception as exc:  # a YAML error of any kind: the file is not a snapshot
        raise ReviewError(f"{path}: not a snapshot ({str(exc).splitlines()[0]})") from None

