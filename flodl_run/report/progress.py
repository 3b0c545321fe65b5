"""Progress on the launcher's terminal: a live bar on a TTY, plain lines in logs (CI).

An Observer; everything here is presentation. The bar shows epoch, batches, loss, the last
epoch's samples/s per rank, elapsed time and ETA; every epoch (and sub-epoch report) also
prints one plain line. A non-terminal (CI log, `nohup`) also gets a line within a long epoch,
every LINE_EVERY_S: batches done, batches/s and the epoch's ETA.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from flodl_run.contracts.summary import EpochRecord, ReportRecord
from flodl_run.observe.observer import Observer
from flodl_run.report.say import say, say_labelled

LINE_EVERY_S = 30.0
"""Without a TTY, at most one within-epoch line this often: a slow epoch shows it is moving."""


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


class TerminalProgress(Observer):
    """Epochs, batches, loss, throughput and ETA; degrades to one line per epoch without a TTY."""

    def __init__(self, console: Optional[Console] = None, clock: Callable[[], float] = time.perf_counter):
        self.console = console or Console()
        self.live = self.console.is_terminal
        self.clock = clock
        self._progress: Optional[Progress] = None
        self._task = None
        self._total_epochs = 0
        self._batches_per_epoch = 0
        self._start = (0, 0)  # (epoch, batches done in it) where this run began: a resume's
        self._started = 0.0
        self._epoch_began = 0.0
        self._last_line = 0.0

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        self._total_epochs = total_epochs
        self._batches_per_epoch = batches_per_epoch
        self._started = self._epoch_began = self._last_line = self.clock()
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rates]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "epoch 1", total=total_epochs * batches_per_epoch, loss="-",
            rates="samples/s -" if world_size > 1 else "")

    def on_resume(self, epoch: int, batches_done: int) -> None:
        """The bar starts where the bundle left the run (what it holds counts as done, not as
        this run's speed); the rates and ETAs count only what this run trains."""
        self._start = (epoch, batches_done)
        if self._progress is not None:
            self._progress.reset(self._task, completed=epoch * self._batches_per_epoch + batches_done,
                                 description=f"epoch {epoch + 1}/{self._total_epochs}")

    def on_batch(self, epoch: int, batches_done: int, loss: Optional[float]) -> None:
        if self._progress is not None:
            done = epoch * self._batches_per_epoch + batches_done
            self._progress.update(self._task, completed=done, loss=_fmt(loss),
                                  description=f"epoch {epoch + 1}/{self._total_epochs}")
        elif self.clock() - self._last_line >= LINE_EVERY_S:
            self._within_epoch_line(epoch, batches_done, loss)

    def _within_epoch_line(self, epoch: int, batches_done: int, loss: Optional[float]) -> None:
        now = self.clock()
        self._last_line = now
        trained = batches_done - (self._start[1] if epoch == self._start[0] else 0)  # by this run
        rate = trained / (now - self._epoch_began) if now > self._epoch_began else 0.0
        left = max(self._batches_per_epoch - batches_done, 0)
        eta = f"{left / rate:,.0f}s" if rate > 0 else "-"
        say(self.console, f"epoch {epoch + 1}/{self._total_epochs}  batch {batches_done}/"
                          f"{self._batches_per_epoch}  loss {_fmt(loss)}  {rate:,.2f} batches/s  "
                          f"epoch ETA {eta}")

    def on_epoch(self, record: EpochRecord) -> None:
        done = record.epoch + 1
        self._epoch_began = self._last_line = self.clock()
        elapsed = self._epoch_began - self._started
        ran = max(done - self._start[0] - self._start[1] / max(self._batches_per_epoch, 1), 1e-9)
        eta = elapsed / ran * (self._total_epochs - done)  # epochs (or the part of one) run here
        rates = " ".join(f"{r:,.0f}" for r in record.per_rank_throughput)
        shares = " ".join(f"{s:.2f}" for s in record.per_rank_batch_share)
        line = (f"epoch {done}/{self._total_epochs}  loss {_fmt(record.avg_loss)}  "
                f"eval {_fmt(record.eval)}  {record.epoch_ms:,.0f} ms  samples/s [{rates}]  "
                f"share [{shares}]  ETA {eta:,.0f}s")
        say(self.console, line)
        if self._progress is not None:  # the bar shows the last epoch's per-rank rates
            label = "rank samples/s" if len(record.per_rank_throughput) > 1 else "samples/s"
            self._progress.update(self._task, rates=f"{label} {rates.replace(' ', ' | ')}")

    def on_report(self, record: ReportRecord) -> None:
        """Sub-epoch reports get a line of their own (long epochs in CI logs)."""
        say(self.console, f"epoch {record.epoch + 1}/{self._total_epochs}  report {record.index}  "
                          f"{record.fraction:.0%}  loss {_fmt(record.avg_loss)}  step {record.global_step}")

    def on_event(self, kind: str, message: str) -> None:
        """Events that change who trains (rank lost, shutdown) are worth a line; the rest go to
        the record log, the dashboard and MLflow."""
        if kind.startswith(("rank_", "shutdown")) or kind in ("failed", "interrupted"):
            say_labelled(self.console, kind, message, "yellow")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
