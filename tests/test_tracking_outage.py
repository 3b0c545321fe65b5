"""MLflow through an outage of its store: a real local SQLite store that refuses every write for
a while (the launcher's file-size limit set to 16 bytes, as on a full disk: SQLite cannot write
its journal), queried back with MlflowClient afterwards. Tracking used to stop for good at the
first failure, and the run was still marked FINISHED, its outcome tags missing, unsaid."""

from __future__ import annotations

import contextlib
import io
import logging
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from rich.console import Console

from flodl_run.config.schema import ExperimentConfig, TrackingConfig, TrackingKind
from flodl_run.contracts.summary import EpochRecord, Summary
from flodl_run.launch.launcher import _close_records, say_unwritten
from flodl_run.observe.observer import OutputErrors
from flodl_run.report.tracking import MlflowTracker

QUICK_RETRY_S = 0.05  # the first retry; the real default is a second


@contextlib.contextmanager
def _no_room() -> Iterator[None]:
    """No file of this process may grow past 16 bytes while inside (EFBIG, as a full disk)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


class _Failed(logging.Handler):
    """Set once a flodl_run logger warns that an MLflow write failed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.getMessage():
            self.seen.set()


@contextlib.contextmanager
def _watching_for_failures() -> Iterator[_Failed]:
    handler, logger = _Failed(), logging.getLogger("flodl_run")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _tracker(mlflow_db: Path, run_dir: Path, **kwargs) -> MlflowTracker:
    """A started tracker on the store, system metrics off (no monitor thread writing)."""
    tracking = TrackingConfig(kind=TrackingKind.mlflow, uri=f"sqlite:///{mlflow_db}",
                              experiment="outage", system_metrics=False)
    config = ExperimentConfig()
    config.tracking = tracking
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text("seed: 0\n")
    tracker = MlflowTracker(tracking, first_retry_s=QUICK_RETRY_S, **kwargs)
    tracker.start(config, run_dir)
    return tracker


def _epoch(n: int) -> EpochRecord:
    return EpochRecord(n, 1.0 / (n + 1), None, 10.0, [100.0], [1.0])


def test_metrics_logged_while_the_store_refuses_writes_reach_it_afterwards(tmp_path, mlflow_db):
    """Pins: one failed write (the coordinator blocked ~22 s on a locked store, then an error)
    stopped tracking for good: 28 of 30 epochs' metrics and the outcome tags were missing and
    MLflow showed the run FINISHED. Now the epochs logged during the outage return at once
    (the coordinator never waits on MLflow), are kept, and reach the store when it takes writes
    again, in order; the outcome tags and FINISHED follow them, and nothing is said lost."""
    import mlflow

    run_dir = tmp_path / "run"
    tracker = _tracker(mlflow_db, run_dir)
    tracker.on_epoch(_epoch(0))
    with _watching_for_failures() as failed:
        with _no_room():
            began = time.monotonic()
            tracker.on_epoch(_epoch(1))
            tracker.on_epoch(_epoch(2))
            queued_s = time.monotonic() - began
            assert failed.seen.wait(30), "no write failed: the store took them"
    summary = Summary(status="completed", world_size=1, devices=["cpu"])
    (run_dir / "summary.json").write_text("{}")
    tracker.finish(summary, run_dir)
    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == [0, 1, 2]
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "completed"
    assert "tracking_incomplete" not in run.data.tags
    assert queued_s < 1.0 and tracker.unwritten() is None


def test_an_outage_that_outlasts_the_run_is_said_and_the_run_is_not_marked_finished(tmp_path,
                                                                                   mlflow_db):
    """Pins: with the store still refusing writes at the run's end, the launcher's last line
    said nothing of tracking (its "not written" list left it out). Now the end line names the
    MLflow run and what it did not get, and the run is not marked FINISHED without its
    outcome: it stays RUNNING, summary.json holding the outcome."""
    import mlflow

    run_dir = tmp_path / "run"
    tracker = _tracker(mlflow_db, run_dir, finish_wait_s=0.5)
    errors = OutputErrors()
    with _watching_for_failures() as failed:
        with _no_room():
            tracker.on_epoch(_epoch(0))
            assert failed.seen.wait(30), "no write failed: the store took it"
            _close_records(Summary(status="completed", world_size=1, devices=["cpu"]), run_dir, [],
                           tracker, errors, Console(file=io.StringIO()))
    assert "the MLflow run" in errors.failed, errors.failed
    lost = errors.failed["the MLflow run"]
    assert "logging epoch metrics" in lost and "the run's outcome" in lost and "RUNNING" in lost, lost
    console = Console(file=io.StringIO(), width=400)
    say_unwritten(console, errors)
    assert f"the MLflow run (run {tracker.run_id} did not get: " in console.file.getvalue()
    run = mlflow.MlflowClient(f"sqlite:///{mlflow_db}").get_run(tracker.run_id)
    assert run.info.status == "RUNNING" and "status" not in run.data.tags


def test_the_queue_keeps_order_through_an_outage_and_drops_the_oldest_past_its_bound():
    """Pins the queue behind the tracker: a send that fails stays first and is retried, what
    comes meanwhile waits behind it in order, and past the bound the oldest go, counted as
    lost (the tracker names them in the run's `tracking_incomplete` tag) rather than the
    launcher's memory growing without end."""
    from flodl_run.report.sendqueue import SendQueue

    store_back, refused, sent = threading.Event(), threading.Event(), []

    def send(n: int):
        def go() -> None:
            if not store_back.is_set():
                refused.set()
                raise OSError("the store is locked")
            sent.append(n)
        return go

    queue = SendQueue("test", first_retry_s=0.5, max_retry_s=0.5, max_buffered=3)  # puts land in the wait
    queue.put("batch 0", send(0))
    assert refused.wait(10)  # the outage met: batch 0 stays first, retried
    for n in range(1, 5):
        queue.put(f"batch {n}", send(n))
    assert queue.lost() == {"batch 0": 1, "batch 1": 1}
    store_back.set()
    assert queue.drain(10)
    queue.close()
    assert sent == [2, 3, 4] and queue.lost() == {"batch 0": 1, "batch 1": 1}
