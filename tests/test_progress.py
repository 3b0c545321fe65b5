"""Launcher terminal progress: a live bar with per-rank rates on a TTY, plain lines otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from flodl_run.contracts.summary import EpochRecord, ReportRecord
from flodl_run.report.progress import TerminalProgress


def _drive(console: Console) -> TerminalProgress:
    progress = TerminalProgress(console)
    progress.on_start(2, 10, 2)
    progress.on_batch(0, 5, 1.25)
    progress.on_report(ReportRecord(0, 1, 0.5, 5, 1.25))
    progress.on_epoch(EpochRecord(0, 1.0, 0.8, 120.0, [41000.0, 16500.0], [0.7, 0.3]))
    progress.on_event("phase", "probe -> warmup")
    progress.on_event("rank_lost", "rank 1 exited")
    return progress


def test_plain_lines_without_a_terminal():
    """Pins CI output: no bar or control codes, one line per epoch with per-rank samples/s and
    ETA, one per sub-epoch report, and rank-loss events (not routine ElChe events)."""
    out = io.StringIO()
    _drive(Console(file=out, force_terminal=False, width=200)).close()
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert lines[0].startswith("epoch 1/2  report 1  50%  loss 1.2500")
    assert lines[1].startswith("epoch 1/2  loss 1.0000  eval 0.8000") and "[41,000 16,500]" in lines[1]
    assert "ETA" in lines[1]
    assert lines[2:] == ["rank_lost: rank 1 exited"]


def test_live_bar_shows_per_rank_throughput():
    """Pins the live bar: after an epoch it carries each rank's samples/s next to the loss."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    progress = _drive(console)
    progress._progress.refresh()
    progress.close()
    assert "rank samples/s 41,000 | 16,500" in out.getvalue()


GLOO_ERROR = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] "
              "Read error [127.0.0.1]:55733: Connection reset by peer [bold]")


def test_foreign_text_is_printed_verbatim_never_parsed_as_markup():
    """Pins the CI failure where a Gloo error in a rank-lost event raised rich's MarkupError in
    the coordinator: event messages, run-end messages and forwarded rank output keep their
    brackets as text."""
    from flodl_run.launch.rankproc import forward
    from flodl_run.report.say import labelled

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=400)
    TerminalProgress(console).on_event("rank_lost", f"rank 1 lost: {GLOO_ERROR}")
    console.print(labelled("failed", GLOO_ERROR, "bold red"))

    class _Proc:
        rank = 1
        process = type("P", (), {"stdout": iter([GLOO_ERROR + "\n"])})()
        log = io.StringIO()

    forward(_Proc(), console, "rank 1")
    assert out.getvalue().splitlines() == [f"rank_lost: rank 1 lost: {GLOO_ERROR}",
                                           f"failed: {GLOO_ERROR}", f"[rank 1] {GLOO_ERROR}"]


def test_a_resumed_run_starts_the_bar_where_the_bundle_left_it():
    """Pins: a run resumed 54 batches into epoch 2 (of 2, 64 batches each) showed
    `epoch 1` and 0/128 until its first window and ended at 74/128. The bar now starts at
    epoch 2, 118 of 128, counts that as done rather than as this run's speed, and ends full."""
    out = io.StringIO()
    progress = TerminalProgress(Console(file=out, force_terminal=True, width=200))
    progress.on_start(2, 64, 2)
    progress.on_resume(1, 54)
    task = progress._progress.tasks[0]
    assert (task.description, task.completed, task.total) == ("epoch 2/2", 118, 128)
    assert task.speed is None  # what the bundle held is no speed of this run
    progress.on_batch(1, 64, 0.5)
    assert progress._progress.tasks[0].completed == 128
    progress.close()
