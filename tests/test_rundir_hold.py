"""One live run per directory: a second run (or sweep) given a directory a live one holds is
refused before it writes anything, and the refusal deletes nothing of the live run's. End to
end: two CLI processes on one directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest

from tests.support import run_cli, start_cli, text_of, wait_for

pytestmark = pytest.mark.e2e


def _started(events: Path) -> bool:
    return any(json.loads(line)["kind"] == "start" for line in text_of(events).splitlines())


def _snapshot(folder: Path, *names: str) -> Dict[str, bytes]:
    """The bytes of each named file (and of every file under each named folder)."""
    found = {}
    for name in names:
        path = folder / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        found.update({str(p.relative_to(folder)): p.read_bytes() for p in files})
    return found


def _stop(proc) -> None:
    proc.kill()
    proc.communicate(timeout=60)


def test_a_run_refused_for_a_live_runs_directory_leaves_its_files(tmp_path):
    """Pins: a second run with a live run's hydra.run.dir was refused (the save_path lock),
    and on its way out deleted the live run's run.yaml, cli.log and .hydra/ (its config error
    tidied the run dir as if it were its own). Now it is refused before it writes anything,
    exit 2 naming hydra.run.dir and the run that holds it, and every file of the live run is
    as it was."""
    run_dir = tmp_path / "run"
    first = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "cluster=solo", "num_epochs=500")
    try:
        wait_for("the first run's start", lambda: _started(run_dir / "events.jsonl"))
        before = _snapshot(run_dir, "run.yaml", ".hydra")
        assert (run_dir / "cli.log").is_file() and before
        second = run_cli("tracking=off", f"hydra.run.dir={run_dir}", "cluster=solo", "num_epochs=1")
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"hydra.run.dir={run_dir}" in out and f"pid {first.pid}" in out, out
        assert "Traceback" not in out, out
        assert _snapshot(run_dir, "run.yaml", ".hydra") == before
        assert (run_dir / "cli.log").is_file() and first.poll() is None
    finally:
        _stop(first)


def test_a_sweep_refused_for_a_live_sweeps_directory_leaves_its_files(tmp_path):
    """Pins: a second sweep into a live sweep's hydra.sweep.dir ran its job 0 in the first's
    job dir (the first's job 0 then crashed on its missing run.yaml) and overwrote its
    comparison.md. Now the second sweep is refused at its start, exit 2 naming
    hydra.sweep.dir, and writes nothing there: the first's multirun.yaml and job dir are as
    they were, and no comparison appears while the first sweep runs."""
    sweep_dir = tmp_path / "sweep"
    first = start_cli("-m", "tracking=off", f"hydra.sweep.dir={sweep_dir}", "cluster=solo",
                      "num_epochs=500", "seed=0,1")
    try:
        wait_for("the first sweep's job 0", lambda: _started(sweep_dir / "0" / "events.jsonl"))
        before = _snapshot(sweep_dir, "multirun.yaml", "0/run.yaml", "0/.hydra")
        second = run_cli("-m", "tracking=off", f"hydra.sweep.dir={sweep_dir}", "cluster=solo",
                         "num_epochs=1", "seed=0,1")
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"hydra.sweep.dir={sweep_dir}" in out and "Traceback" not in out, out
        assert _snapshot(sweep_dir, "multirun.yaml", "0/run.yaml", "0/.hydra") == before
        assert not (sweep_dir / "comparison.md").exists() and not (sweep_dir / "1").exists()
        assert first.poll() is None
    finally:
        _stop(first)
