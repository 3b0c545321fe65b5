"""A run's records when the disk will not take them: the outcome is written first, what does not
fit is said, and an output error never fails the run by itself. The errors are real: a file
size limit (RLIMIT_FSIZE, as a nearly full disk, writes past it fail) or a directory where a
file should be."""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
from pathlib import Path
from typing import List

import pytest
from rich.console import Console

from flodl_run.contracts.checkpoint import read_meta
from flodl_run.contracts.summary import EpochRecord, Summary
from flodl_run.launch.launcher import _close_records, say_unwritten
from flodl_run.observe.observer import Observer, Observers, OutputErrors
from flodl_run.report.rundir import EventFile
from flodl_run.report.tracking import NullTracker
from tests.support import start_cli, text_of, user_recipe, wait_for


@contextlib.contextmanager
def _room_for(num_bytes: int):
    """Writes past `num_bytes` of a file fail (EFBIG) while inside, as on a nearly full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _long_summary() -> Summary:
    epochs = [EpochRecord(e, 0.5, 0.9, 100.0, [1.0, 2.0], [0.5, 0.5]) for e in range(40)]
    return Summary(status="completed", world_size=2, epochs=epochs, checkpoint="/runs/r/checkpoint")


def test_a_disk_with_room_for_the_outcome_only_keeps_it_and_the_end_line(tmp_path):
    """Pins: with little room left at the end, the launcher died in write_summary (a Hydra
    traceback), leaving no summary.json, a partial summary.json.tmp and no `end` event. Now the
    outcome goes first, the whole record's failure leaves no temp file, the `end` line is still
    written, and what did not fit is named for the terminal."""
    errors = OutputErrors()
    with _room_for(2048):
        latest = _close_records(_long_summary(), tmp_path, [EventFile(tmp_path)], NullTracker(), errors,
                                Console(file=io.StringIO()))
    assert latest is None
    outcome = json.loads((tmp_path / "summary.json").read_text())
    assert outcome["status"] == "completed" and outcome["checkpoint"] == "/runs/r/checkpoint"
    assert "epochs" not in outcome and not (tmp_path / "summary.json.tmp").exists()
    end = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["message"] == "completed"
    assert list(errors.failed) == ["summary.json in full (its outcome is there)"]


def test_when_nothing_fits_the_terminal_says_what_was_not_written(tmp_path):
    """Pins: the same run on a disk with no room at all: nothing is written, nothing raises,
    and the last line names summary.json and the end of events.jsonl."""
    errors = OutputErrors()
    with _room_for(16):
        _close_records(_long_summary(), tmp_path, [EventFile(tmp_path)], NullTracker(), errors,
                       Console(file=io.StringIO()))
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "summary.json.tmp").exists()
    assert list(errors.failed) == ["summary.json", "the end of events.jsonl"]
    console = Console(file=io.StringIO(), width=200)
    say_unwritten(console, errors)
    said = console.file.getvalue()
    assert said.startswith("not written: summary.json (") and "the end of events.jsonl (" in said


class _Events(Observer):
    def __init__(self):
        self.kinds = []

    def on_event(self, kind: str, message: str) -> None:
        self.kinds.append(kind)


def test_an_output_that_cannot_write_neither_stops_the_run_nor_the_other_observers(tmp_path):
    """Pins: an OSError from an output (events.jsonl with no descriptor or no room left) went
    up through the coordinator, which failed the run (`coordinator error: OSError: [Errno 24]
    ... events.jsonl`). Now it is said once and the other observers still hear every hook."""
    (tmp_path / "events.jsonl").mkdir()  # opening it for append fails, every time
    others = _Events()
    observers = Observers(EventFile(tmp_path), others)
    observers.on_event("rank_lost", "rank 1 lost")
    observers.on_event("regroup", "generation 1")
    assert others.kinds == ["rank_lost", "regroup"]
    assert list(observers.errors.failed) == ["events.jsonl"]


WAITS_IN_EPOCH_2 = (
    "import os, time\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def epoch_fn(epoch, model):\n"
    "    while epoch == 1 and not os.path.exists(os.environ['GO_FILE']):\n"
    "        time.sleep(0.02)\n"
)


def _checkpoints(events: Path) -> List[str]:
    return [json.loads(line)["kind"] for line in text_of(events).splitlines()
            if json.loads(line)["kind"] in ("checkpoint", "checkpoint_failed")]


def _disk_fills_after_the_first_checkpoint(tmp_path: Path, room_bytes: int, *overrides: str):
    """A run with a checkpoint every epoch whose launcher may write no file past `room_bytes`
    from its first checkpoint on (its recipe's epoch_fn(1) waits for that): (the finished
    process with its output, its run dir, the bundle's stem)."""
    run_dir, stem, go = tmp_path / "run", tmp_path / "bundle", tmp_path / "go"
    env = user_recipe(tmp_path, "waiting_recipe", WAITS_IN_EPOCH_2, GO_FILE=str(go))
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "recipe=custom",
                     "recipe.module=waiting_recipe", "num_epochs=4", "checkpoint_every=1",
                     f"save_path={stem}", *overrides, env=env)
    try:
        wait_for("the first checkpoint", lambda: _checkpoints(run_dir / "events.jsonl") == ["checkpoint"])
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (room_bytes, room_bytes))
        go.touch()
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, out, run_dir, stem


def _assert_the_first_generation_stands(proc, out: str, run_dir: Path, stem: Path) -> None:
    """The run completed all its epochs, exit 0; the bundle is generation 1 (epoch 1), nothing
    of the later generations is left beside it; the end line names the checkpoint that was
    not written and what the bundle still holds."""
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["checkpoint"] == str(stem), summary
    meta = read_meta(stem)
    assert (meta.generation, meta.epoch) == (1, 1)
    assert sorted({p.name.split(".")[1] for p in stem.parent.glob("bundle.g*")}) == ["g1"]
    unwritten = [line for line in out.splitlines() if line.startswith("not written:")]
    assert unwritten and "a checkpoint (" in unwritten[0], out[-3000:]
    assert "the bundle stays intact at generation g1 (resume at epoch 2)" in unwritten[0], unwritten
    assert "failed" not in summary["status"] and "Traceback" not in out, out[-3000:]


@pytest.mark.e2e
def test_a_full_disk_at_a_solo_checkpoint_says_so_and_training_goes_on(tmp_path):
    """Pins: a solo run whose checkpoint at `checkpoint_every` met a full disk ended `failed`
    with torch's `unexpected pos 1024 vs 918` (not saying it was the disk), its summary wiped.
    Now the write's own error (File too large) is said, the previous generation stays the
    bundle, and the run trains on to the end."""
    proc, out, run_dir, stem = _disk_fills_after_the_first_checkpoint(
        tmp_path, 64 * 1024, "cluster=solo")  # the model's file is ~105 kB, the run's text ones less
    _assert_the_first_generation_stands(proc, out, run_dir, stem)
    assert "File too large" in out and "unexpected pos" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [0, 1, 2, 3]


@pytest.mark.e2e
def test_a_meta_the_launcher_cannot_write_says_so_and_training_goes_on(tmp_path):
    """Pins: two ranks, the launcher under a file-size limit: its write of the bundle's meta
    failed the run (`coordinator error: OSError: [Errno 27] File too large`). Now the failed
    generation's files go, the previous generation stays the bundle, it is said, and the
    ranks train on to the end."""
    proc, out, run_dir, stem = _disk_fills_after_the_first_checkpoint(
        tmp_path, 4096, "cluster=cpu_pair")  # a meta takes 5 kB, the run's log and events less
    _assert_the_first_generation_stands(proc, out, run_dir, stem)
