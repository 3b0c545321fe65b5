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

from rich.console import Console

from flodl_run.contracts.summary import EpochRecord, Summary
from flodl_run.launch.launcher import _close_records, say_unwritten
from flodl_run.observe.observer import Observer, Observers, OutputErrors
from flodl_run.report.rundir import EventFile
from flodl_run.report.tracking import NullTracker


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
