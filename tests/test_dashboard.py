"""The self-contained dashboard: what it holds, and that a real browser renders it offline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flodl_run.contracts.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.report.dashboard import Dashboard
from flodl_run.report.svgchart import nice_ticks
from tests.support import _chromium, needs_chromium


def _dashboard(path: Path, theme: str) -> Path:
    """A 2-rank run's worth of records through the Observer hooks, written at teardown."""
    board = Dashboard(path, theme, "pair-run", {"mode": "nccl_cadence"})
    board.on_start(4, 40, 2)
    phases = ["probe", "warmup", "warmup", "stable", "stable", "stable", "mature", "mature"]
    for i, phase in enumerate(phases):
        board.on_reduce(ReduceRecord(i + 1, i // 2, 1.0 + i % 3, 0.01, 10 + 5 * i, 1,
                                     [30 + i, 10 + i], 0.1, "Stable()", phase))
        if i % 2:
            board.on_report(ReportRecord(i // 2, 1, 0.5, 20 * i, 1.5 / (i + 1)))
    for epoch in range(4):
        board.on_epoch(EpochRecord(epoch, 2.0 / (epoch + 1), 0.7 + 0.05 * epoch, 50.0,
                                   [40000.0 + 500 * epoch, 16000.0], [0.7, 0.3], {"grad_norm": 1.0}))
    for beat in range(6):  # rank 1 keeps its device busier than rank 0 does
        board.on_busy(0, 40.0 + beat)
        board.on_busy(1, 90.0)
    board.on_event("phase", "probe -> warmup")
    board.on_event("rank_lost", "rank 1 <script>alert(1)</script>")
    board.finish(Summary(status="completed", mode="nccl_cadence", world_size=2,
                         devices=["cpu", "cpu"], final_eval=0.85, wall_s=4.0, syncs=8), path.parent)
    return path


def test_dashboard_is_one_offline_file_with_every_chart(tmp_path):
    """Pins the content contract: one HTML file, no external resource (no src/href, no script),
    the dashboard's charts (each rank's device busy over time beside the shares) and escaped
    event text."""
    html = _dashboard(tmp_path / "dash.html", "auto").read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "dash.html"]
    assert not re.search(r"\b(src|href)=", html) and "<script" not in html
    for title in ("loss", "eval", "throughput (samples/s)", "batch share", "anchor (batches)",
                  "phase", "batch counts", "sync (ms)", "user scalars", "device busy (%)",
                  "rank 0 device busy (%)", "rank 1 device busy (%)"):
        assert f'aria-label="{title}"' in html, title
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'data-theme="auto"' in html and "prefers-color-scheme:dark" in html


@pytest.mark.e2e
@needs_chromium
def test_dashboard_renders_in_headless_chromium(tmp_path):
    """Pins that a real browser draws it without network: the rendered DOM holds the twelve
    charts with their lines (nine, then each rank's device busy and both ranks' together), and the
    screenshot's background follows the theme."""
    light = _dashboard(tmp_path / "light" / "dash.html", "light")
    dom = _chromium("--dump-dom", light.as_uri(), tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count('<svg class="chart"') == 12
    assert dom.stdout.count("<polyline") >= 12 and "pair-run" in dom.stdout
    import matplotlib.image

    corners = {}
    for theme in ("light", "dark"):
        page = _dashboard(tmp_path / theme / "dash.html", theme)
        png = tmp_path / f"{theme}.png"
        shot = _chromium(f"--screenshot={png}", "--window-size=1200,900", page.as_uri(),
                         tmp_path=tmp_path)
        assert shot.returncode == 0 and png.stat().st_size > 10_000, shot.stderr[-2000:]
        corners[theme] = matplotlib.image.imread(str(png))[5, 5, :3].mean()
    assert corners["light"] > 0.9 and corners["dark"] < 0.2


def test_nice_ticks_cover_the_range_with_round_steps():
    """Pins the axis ticks: round steps inside the range, whole steps for epoch/reduce axes."""
    assert nice_ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(1.0, 3.0, 6, integer=True) == [1.0, 2.0, 3.0]
    ticks = nice_ticks(0.013, 0.097)
    assert all(0.013 <= t <= 0.097 for t in ticks) and len(ticks) >= 3


def test_a_cpu_ranks_busy_share_is_its_cpu_time_per_thread_capped_at_its_budget(monkeypatch):
    """Pins rank.busy on the CPU: CPU time used since the last sample over wall time and the
    rank's threads (1 s of CPU in 2 s on 1 thread is 50 %, on 2 threads 25 %), never above 100
    (helper threads count too), and no figure for an empty interval."""
    import time

    import torch

    from flodl_run.rank import busy

    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(time, "process_time", lambda: clock["cpu"])
    one, two = busy.BusySampler(torch.device("cpu"), 1), busy.BusySampler(torch.device("cpu"), 2)
    clock.update(wall=2.0, cpu=1.0)
    assert (one.sample(), two.sample()) == (50.0, 25.0)
    clock.update(wall=3.0, cpu=4.0)
    assert one.sample() == 100.0
    assert one.sample() is None
