"""Shared fixtures, and how the suite runs.

Running: the plain `python -m pytest` runs every test, spread over one pytest-xdist worker per
core (`-n logical --dist loadgroup` in pyproject.toml). An end-to-end run spends most of its time
importing torch in the launcher, then in each rank, so a lone run keeps about one core busy and
two runs side by side use both. `-n0` runs in one process (for a debugger, or `-x` on one file).

Sharing across workers: a module-scoped fixture would run once per worker that gets one of its
tests, so every test that uses one is put in one xdist group (named after its module) and runs
on one worker. A run several modules need is a session fixture computed once for all workers
(`shared_once`).

Helpers (running the CLI, a free port, a small model) live in tests/support.py; test modules
import them from there and never from each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from tests.support import LOCKSTEP, _run


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups to schedule
def pytest_collection_modifyitems(config, items):
    """Every test that uses a module-scoped fixture joins the xdist group of its module."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = [d[-1].scope for d in defs.name2fixturedefs.values()] if defs else []
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def shared_once(tmp_path_factory, name: str, produce: Callable[[Path], object]):
    """`produce(folder)` run once per pytest invocation, even across xdist workers: the first
    caller runs it under a file lock and stores its JSON result, later callers read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base temps are siblings in one folder per invocation
    folder, result = root / f"shared-{name}", root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(produce(folder)))
        return json.loads(result.read_text())


def _solo(folder: Path) -> float:
    solo, summary = _run(folder, "cluster=solo")
    assert solo.returncode == 0, solo.stderr
    return summary["final_eval"]


@pytest.fixture(scope="session")
def solo_eval(tmp_path_factory) -> float:
    """Held-out accuracy of the default recipe trained in-process (the reference of the
    distributed runs' accuracy), one run for the whole suite."""
    return shared_once(tmp_path_factory, "solo_eval", _solo)


def _lockstep(folder: Path) -> dict:
    proc, summary = _run(folder, *LOCKSTEP, "num_epochs=1", env=dict(os.environ, FLODL_RUN_WAITS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"run_dir": str(folder / "run"), "summary": summary}


@pytest.fixture(scope="session")
def lockstep_run(tmp_path_factory) -> dict:
    """One clean epoch of LOCKSTEP (nccl_sync on an equal pair, batch 32) with FLODL_RUN_WAITS=1,
    once for the suite: {"run_dir", "summary"}. Tests read its counts and logs, resume from its
    bundle, or copy the bundle to damage it; none writes into it."""
    return shared_once(tmp_path_factory, "lockstep_run", _lockstep)


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store whose schema is created once per session: the migrations
    cost seconds, so tests that are not about creating a store copy this one (`mlflow_db`)."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(migrated_mlflow_db, tmp_path) -> Path:
    """A fresh copy of the migrated store at `<tmp>/store/mlflow.db` (artifacts go beside it)."""
    path = tmp_path / "store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(migrated_mlflow_db, path)
    return path
