"""`python -m flodl_run.sim.measured`: a run dir read into the sim's rig numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flodl_run.sim.measured import measure, ms_per_batch, window_noise


def _steps(pid: int, windows: list, start: float = 0.0) -> list:
    """Trace events of one rank: each window a list of step ms, a window_end after each."""
    events, ts = [], start
    for w, durations in enumerate(windows):
        for d in durations:
            events.append({"name": "step", "ph": "X", "pid": pid, "ts": ts, "dur": d * 1000.0})
            ts += d * 1000.0
        events.append({"name": "window_end", "ph": "i", "pid": pid, "ts": ts,
                       "args": {"window": w}})
        ts += 10.0
    return events


def test_window_noise_is_the_spread_of_per_window_ms_per_batch() -> None:
    """Pins the noise reading: the first window (warm-up) and each window's first batch (fill)
    are left out; a steady rank reads 0; a rank alternating 9 and 11 ms windows reads
    std / mean of those (0.1 x sqrt(4/3) for four windows)."""
    steady = _steps(1, [[50, 5, 5]] + [[20, 5, 5, 5]] * 4)
    wobbly = _steps(2, [[50, 9]] + [[30, 9, 9], [30, 11, 11]] * 2)
    coordinator = [{"name": "reduce", "ph": "X", "pid": 0, "ts": 0.0, "dur": 1.0}]
    got = window_noise(coordinator + steady + wobbly)
    assert got[0] == 0.0
    assert got[1] == pytest.approx(0.1 * (4 / 3) ** 0.5)


def test_measure_reads_ms_per_batch_and_sync_from_a_run_dir(tmp_path: Path) -> None:
    """Pins the run-dir intake: ms per batch = batch_size x 1000 / the last epoch's
    throughput (the first carries the warm-up), sync from avg_sync_ms, no timeline = no noise."""
    summary = {"epochs": [{"per_rank_throughput": [100.0, 50.0]},
                          {"per_rank_throughput": [3200.0, 1600.0]}], "avg_sync_ms": 4.5}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "run.yaml").write_text("batch_size: 32\n")
    got = measure(tmp_path)
    assert got.ms_per_batch == [10.0, 20.0] and got.sync_ms == 4.5 and got.noise is None
    assert ms_per_batch(summary, 64) == [20.0, 40.0]
