"""Deadline windows in the simulator (sim.window_end=deadline) and the sweep (sweep.*)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flodl_run.config.schema import ElCheConfig
from flodl_run.elche.balancer import ElChe, ReduceReport
from flodl_run.sim.cli import SimRunConfig, check
from flodl_run.sim.rig import RankGroup, SimConfig, WindowEnd, fit_by_deadline, simulate
from flodl_run.sim.sweep import SweepConfig, run_sweep, scaled_groups, sweep_table

GEN3 = [RankGroup(8, 8.0), RankGroup(4, 14.0), RankGroup(4, 30.0)]


def test_a_rank_finishes_its_batch_in_hand_within_its_bound() -> None:
    """Pins the deadline rule: batches started before the deadline (the first carries the
    fill), the one in hand finished; at least 1, at most the bound; a dead rank none."""
    bound = np.array([100, 100, 3, 0, 5])
    ms = np.array([10.0, 30.0, 10.0, 10.0, 500.0])
    got = fit_by_deadline(bound, ms, fill_ms=5.0, deadline_ms=305.0)
    # 300 ms past the fill: 30 batches of 10 ms end exactly on it; 10 of 30 ms likewise;
    # bound 3 caps; dead stays 0; a 500 ms batch started at 0 is still one batch.
    assert got.tolist() == [30, 10, 3, 0, 1]
    assert fit_by_deadline(np.array([50]), np.array([10.0]), 0.0, 301.0).tolist() == [31]


def test_window_ms_is_the_anchor_ranks_count_at_its_smoothed_speed() -> None:
    """Pins ElChe's deadline: None in Probe (no reading of the anchor rank), then the anchor
    rank's planned count x its smoothed ms per batch + its smoothed fill."""
    elche = ElChe(ElCheConfig(), 2, prior=[1 / 10, 1 / 25])
    assert elche.window_ms() is None
    elche.on_reduce(ReduceReport(wall_ms=[100.0 + 4.0, 250.0 + 4.0], batches=[10, 10],
                                 sync_ms=5.0, first_batch_ms=[14.0, 29.0]))
    rank = elche.anchor_rank
    assert rank == 1
    assert elche.window_ms() == pytest.approx(elche.batch_counts[1] * 25.0 + 4.0)


def test_without_noise_deadline_windows_are_count_windows() -> None:
    """Pins that a quiet rig loses nothing to the deadline: every rank's count fits it, so the
    plans and samples/s equal those of count windows."""
    sim = SimConfig(groups=GEN3, sync_ms=40.0, sync_ms_per_rank=0.5, windows=40)
    count = simulate(sim, ElCheConfig())
    deadline = simulate(replace(sim, window_end=WindowEnd.deadline), ElCheConfig())
    assert deadline.summary == count.summary
    assert deadline.windows[0].deadline_ms is None and deadline.windows[1].deadline_ms > 0


def test_on_a_noisy_rig_deadline_windows_beat_count_windows() -> None:
    """Pins the point of deadlines: 16 ranks at noise 0.05 stop waiting for the
    unluckiest draw, so idle falls and samples/s rises; no window trains past its bounds."""
    sim = SimConfig(groups=GEN3, sync_ms=40.0, sync_ms_per_rank=0.5, noise=0.05, windows=60)
    count = simulate(sim, ElCheConfig()).summary
    ends = {h: simulate(replace(sim, window_end=WindowEnd.deadline, deadline_headroom=h),
                        ElCheConfig()) for h in (0, 0.1)}
    assert ends[0].summary.ratio_to_ideal > count.ratio_to_ideal + 0.02
    assert np.mean(ends[0].summary.idle_fraction) < np.mean(count.idle_fraction) / 2
    assert ends[0.1].summary.ratio_to_ideal > ends[0].summary.ratio_to_ideal
    assert all(w.batches <= sum(w.batch_counts) for w in ends[0].windows)


def test_scaled_groups_keep_the_mix() -> None:
    """Pins the sweep's rig sizes: the docs' 32/16/16 mix at 8 ranks is 4/2/2, at 1024 it is
    512/256/256; remainders go to the largest fractions, empty groups are left out."""
    assert [g.count for g in scaled_groups(GEN3, 8)] == [4, 2, 2]
    assert [g.count for g in scaled_groups(GEN3, 1024)] == [512, 256, 256]
    assert [g.count for g in scaled_groups(GEN3, 5)] == [3, 1, 1]
    assert [g.ms_per_batch for g in scaled_groups(GEN3, 1)] == [8.0]


def test_sweep_runs_the_grid_and_checks_its_keys() -> None:
    """Pins the sweep: one cell per size x noise x variant (count, then deadline per headroom)
    with its table; bad sweep values are named by their dotted keys."""
    sweep = SweepConfig(ranks=[4, 8], noise=[0.05], window_end=[WindowEnd.count,
                                                                 WindowEnd.deadline],
                        deadline_headroom=[0.0, 0.1])
    cells = run_sweep(sweep, SimConfig(groups=GEN3, windows=15), ElCheConfig())
    assert [(c.ranks, c.variant) for c in cells] == [
        (4, "count"), (4, "deadline"), (4, "deadline +0.1"),
        (8, "count"), (8, "deadline"), (8, "deadline +0.1")]
    assert sweep_table(cells).row_count == 2
    bad = SimRunConfig(sweep=SweepConfig(ranks=[0], noise=[-1.0], seeds=0))
    assert [p.key for p in check(bad)[0]] == ["sweep.ranks", "sweep.noise", "sweep.seeds"]


@pytest.mark.e2e
def test_cli_sweep_writes_sweep_json(tmp_path: Path) -> None:
    """Pins the sweep's command line: sweep.* overrides run the grid instead of one sim, print
    its table and write sweep.json with one cell per size x noise x variant; a deadline
    without sweep.deadline_headroom lends what the real runs lend (elche.deadline_headroom)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "flodl_run.sim", f"hydra.run.dir={tmp_path}", "sim.windows=10",
         "sweep.ranks=[2,4]", "sweep.window_end=[count,deadline]"],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Ratio to ideal" in done.stdout
    cells = json.loads((tmp_path / "sweep.json").read_text())["cells"]
    assert [(c["ranks"], c["variant"]) for c in cells] == [
        (2, "count"), (2, "deadline +0.1"), (4, "count"), (4, "deadline +0.1")]


def test_sync_modes_end_on_counts_and_say_so() -> None:
    """Pins that deadline windows stay out of the sync modes (a reduce after every step): the
    run equals its count run, and check() warns that the option has no effect there."""
    sim = SimConfig(groups=GEN3, noise=0.05, windows=20)
    sync = ElCheConfig.nccl_sync()
    deadline = simulate(replace(sim, window_end=WindowEnd.deadline, deadline_headroom=0.1), sync)
    assert deadline.summary == simulate(sim, sync).summary
    cfg = SimRunConfig(elche=sync, sim=replace(sim, window_end=WindowEnd.deadline))
    assert any(w.startswith("sim.window_end=deadline has no effect") for w in check(cfg)[1])
