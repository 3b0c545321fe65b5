"""The run directory as a user reads it after a run.

Owns `events.jsonl` (every event of the run, one JSON object a line), the `outputs/latest`
link to the last run, the list of what a run wrote (the launcher's final line), a fresh
directory for runs started from Python, the hold a run (or a sweep) keeps on its directory,
and tidying away a directory a config error left. run.yaml, summary.json, the bundle and the
dashboard are written by their own owners.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any, List, Optional

from flodl_run.contracts.summary import Summary
from flodl_run.observe.observer import Observer

# What the runner itself puts in a run dir before the run starts: a config error removes only these.
STARTUP_FILES = (".hydra", "cli.log", "run.yaml")


class EventFile(Observer):
    """`<run dir>/events.jsonl`: a start line, every event, and an end line with the status."""

    output = "events.jsonl"

    def __init__(self, run_dir: Path):
        self.path = run_dir / "events.jsonl"

    def _write(self, kind: str, message: str) -> None:
        line = json.dumps({"time": time.time(), "kind": kind, "message": message})
        with open(self.path, "a") as out:  # append and close: a crash keeps every line written
            out.write(line + "\n")

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        self._write("start", f"{total_epochs} epochs on {world_size} rank(s)")

    def on_event(self, kind: str, message: str) -> None:
        self._write(kind, message)

    def finish(self, summary: Summary, run_dir: Path) -> None:
        self._write("end", summary.status if not summary.message
                    else f"{summary.status}: {summary.message}")


def new_run_dir(outputs: Path) -> Path:
    """`outputs/<date>/<time>` as the CLI names it, with a suffix when that second is taken."""
    now = datetime.now()
    base = outputs / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
    path, n = base, 0
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def link_latest(run_dir: Path, outputs: Path) -> Optional[Path]:
    """Point `outputs/latest` at `run_dir` (relative, swapped in atomically) when the run dir is
    under `outputs`; returns the link, or None for a run dir elsewhere."""
    run_dir, outputs = run_dir.resolve(), outputs.resolve()
    if outputs not in run_dir.parents:
        return None
    link = outputs / "latest"
    tmp = outputs / f".latest.{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(os.path.relpath(run_dir, outputs), tmp)
    os.replace(tmp, link)
    return link


def written(run_dir: Path, summary: Summary, latest: Optional[Path] = None,
            tracking_uri: Optional[str] = None) -> List[str]:
    """What the run left, for the final line: the run dir's entries (folders end in `/`, the
    bundle's files as one `<stem>.*`), a bundle saved elsewhere, the latest link, the MLflow run."""
    stem = Path(summary.checkpoint) if summary.checkpoint else None
    bundle_here = stem is not None and stem.resolve().parent == run_dir.resolve()
    names = []
    for path in sorted(run_dir.iterdir()):
        if path.name.startswith("."):
            continue
        if bundle_here and path.name.startswith(stem.name + "."):
            name = f"{stem.name}.* (bundle)"
        else:
            name = path.name + ("/" if path.is_dir() else "")
        if name not in names:
            names.append(name)
    items = [f"{run_dir}/: {', '.join(names)}"]
    if stem is not None and not bundle_here:
        items.append(f"bundle {stem}.*")
    if latest is not None:
        items.append(f"{latest} -> this run")
    if summary.mlflow_run_id:
        items.append(f"mlflow run {summary.mlflow_run_id}" + (f" in {tracking_uri}" if tracking_uri else ""))
    return items


def remove_startup_files(run_dir: Path, outputs: Path) -> None:
    """After a config error: remove what the runner put in `run_dir`, then the folder, and its
    parents up to `outputs` included, each only while empty: a stray `outputs/` is not left in
    a directory the run never started in. A folder holding anything else stays. Only a run
    that holds `run_dir` (`hold_dir`) gets here: one refused for another's directory never
    wrote in it, and used to delete the live run's run.yaml, cli.log and .hydra/ here."""
    import shutil

    release_dirs()

    for name in STARTUP_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    run_dir, outputs = run_dir.resolve(), outputs.resolve()
    folders = [run_dir]
    if outputs in run_dir.parents:
        folders += [p for p in run_dir.parents if outputs in p.parents] + [outputs]
    for folder in folders:
        try:
            folder.rmdir()  # only succeeds when empty
        except OSError:
            return


HOLD_NAME = "flodl_run"  # the hold's file: `.flodl_run.lock` in the directory held
_held: List[Any] = []  # this process's holds (SaveLock), released at exit


class DirTaken(Exception):
    """Another live run (or sweep) holds this directory; the message names it."""


def hold_dir(directory: Path, key: str) -> None:
    """Hold `directory` (a run's or a sweep's, `key` the Hydra key that named it) for this
    process until it exits: an flock on `.flodl_run.lock` inside, naming this run. Raises
    DirTaken naming the holder when another live process holds it: two runs in one directory
    used to overwrite each other's run.yaml, .hydra/, cli.log, job dirs and comparison.md, and
    the refused one deleted the live one's files on its way out."""
    from flodl_run.contracts.savelock import SaveLock, SavePathTaken

    directory = directory.resolve()
    made = [] if directory.exists() else [directory]  # an empty one goes again on release
    try:
        lock = SaveLock.take(directory / HOLD_NAME, directory)
    except SavePathTaken as exc:
        holder = str(exc).split("(", 1)[-1].rstrip(")")
        raise DirTaken(f"{key}={directory}: must not be another live run's directory (held by "
                       f"{holder}): give each run its own {key}") from None
    if not _held:
        atexit.register(release_dirs)
    _held.append((lock, made))


def release_dirs() -> None:
    """Let go of every directory this process holds (its lock files go too)."""
    while _held:
        lock, made = _held.pop()
        lock.release()
        for directory in made:  # a run or sweep refused before it wrote there leaves no folder
            try:
                directory.rmdir()  # only succeeds when empty
            except OSError:
                pass


class RunDirCallback:
    """Hydra callback (`hydra.callbacks.rundir` in conf/config.yaml): holds the run's directory
    (hydra.run.dir) or the sweep's (hydra.sweep.dir) before Hydra writes anything into it; a
    directory another live run holds exits 2 (a config error) with nothing written there.
    Hydra calls the on_* methods by name."""

    def on_run_start(self, config: Any, **_: Any) -> None:
        _hold_or_exit(Path(str(config.hydra.run.dir)), "hydra.run.dir")

    def on_multirun_start(self, config: Any, **_: Any) -> None:
        _hold_or_exit(Path(str(config.hydra.sweep.dir)), "hydra.sweep.dir")

    def on_run_end(self, config: Any, **_: Any) -> None:
        pass

    def on_multirun_end(self, config: Any, **_: Any) -> None:
        pass

    def on_job_start(self, config: Any, **_: Any) -> None:
        pass

    def on_job_end(self, config: Any, **_: Any) -> None:
        pass


def _hold_or_exit(directory: Path, key: str) -> None:
    from rich.console import Console

    from flodl_run.config.app import fail_config

    try:
        hold_dir(directory, key)
    except DirTaken as exc:
        fail_config(str(exc), Console(stderr=True))
