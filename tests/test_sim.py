"""`python -m flodl_run.sim`: the simulated rig drives the real ElChe."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import List

import pytest
from omegaconf import OmegaConf

from flodl_run.config.compose import compose, register_schemas
from flodl_run.config.schema import ElCheConfig, Mode
from flodl_run.sim.cli import SCHEMA, SimRunConfig, check, sim_json
from flodl_run.sim.rig import ColdStartSkew, RankGroup, SimConfig, simulate
from tests.support import run_module

ROOT = Path(__file__).resolve().parents[1]
WINDOW_KEYS = {"window", "phase", "anchor", "anchor_rank", "batch_counts", "overhead",
               "divergence", "verdict", "nudge_factor", "deadline_ms", "batches", "shares"}
SUMMARY_KEYS = {"samples_per_s", "ideal_samples_per_s", "ratio_to_ideal", "idle_fraction",
                "reduces_to_settle", "shares"}


def run_sim(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return run_module("flodl_run.sim", f"hydra.run.dir={tmp_path}", *overrides, cwd=ROOT, env=env,
                      timeout=120)


@pytest.mark.e2e
def test_cli_two_ranks_10_vs_25(tmp_path: Path) -> None:
    """Pins the headline sim case through the CLI: rank_ms=[10,25], sync_ms=5 -> Warmup
    from window 1, Stable from 5, Mature from 20; the fast rank runs 2.5x the slow one's
    batches (within 10%) after calibration; overhead at or under 0.05 within 40 windows; and
    sim.json in the run dir with exactly the issue's schema."""
    done = run_sim(tmp_path, "sim.rank_ms=[10,25]", "sim.sync_ms=5", "sim.windows=40")
    assert done.returncode == 0, done.stderr
    assert "Summary" in done.stdout and "ratio to ideal" in done.stdout
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert set(doc) == {"windows", "summary"} and set(doc["summary"]) == SUMMARY_KEYS
    rows = doc["windows"]
    assert len(rows) == 40 and all(set(r) == WINDOW_KEYS for r in rows)
    phases = [r["phase"] for r in rows]
    assert phases[0] == "probe" and set(phases[1:5]) == {"warmup"}
    assert set(phases[5:20]) == {"stable"} and set(phases[20:]) == {"mature"}
    for r in rows[1:]:
        assert r["batch_counts"][0] / r["batch_counts"][1] == pytest.approx(2.5, rel=0.10)
    assert all(r["overhead"] <= 0.05 for r in rows[-5:])
    assert len(doc["summary"]["idle_fraction"]) == 2


@pytest.mark.e2e
def test_cli_cold_start_skew_keeps_the_slow_anchor_rank(tmp_path: Path) -> None:
    """Pins the cold-start "Done means": rank 0 reads 3x slower (30 > 25 ms) for 3 windows,
    yet the anchor rank stays rank 1 in every window, and the 2.5x ratio is reached once the
    skewed readings leave the 5-reading trust window."""
    done = run_sim(tmp_path, "sim.rank_ms=[10,25]", "sim.sync_ms=5", "sim.windows=40",
                   "sim.cold_start_skew={rank:0,factor:3,windows:3}", "sim.table=none")
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "sim.json").read_text())["windows"]
    assert {r["anchor_rank"] for r in rows} == {1}
    assert rows[0]["batch_counts"] == [10, 10]
    for r in rows[9:]:
        assert r["batch_counts"][0] / r["batch_counts"][1] == pytest.approx(2.5, rel=0.10)


@pytest.mark.e2e
def test_cli_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    """Pins user errors: every bad value named by its dotted key at once, exit 2, no traceback;
    an unknown key (Hydra's compose error, exit 1 inside Hydra) also exits 2 naming it."""
    bad = run_sim(tmp_path, "sim.rank_ms=[0,25]", "sim.windows=0", "elche.anchor=0")
    assert bad.returncode == 2
    for key in ("sim.rank_ms", "sim.windows", "elche.anchor"):
        assert key in bad.stderr + bad.stdout
    unknown = run_sim(tmp_path, "sim.nope=1")
    assert unknown.returncode == 2 and "sim.nope" in unknown.stderr
    assert "Traceback" not in bad.stderr + unknown.stderr


def _sim(**kwargs) -> SimConfig:
    return SimConfig(**{"rank_ms": [10.0, 25.0], "sync_ms": 5.0, "windows": 40, **kwargs})


def test_overhead_settles_when_growth_is_needed() -> None:
    """Pins the overhead target on a rig that needs growth (sync 25 ms: 0.1 at anchor 10):
    the anchor grows and the overhead is at or under 0.05 by window 40 and stays there."""
    rows = simulate(_sim(sync_ms=25.0), ElCheConfig()).windows
    assert rows[-1].anchor > rows[0].anchor
    assert all(r.overhead <= 0.05 + 1e-12 for r in rows[10:])


def test_scripted_rising_divergence_vetoes_growth() -> None:
    """Pins guard authority in the sim: with overhead asking for growth (sync 30 ms), a scripted
    D rising above 0.05 yields suppress_growth and the anchor never grows past where it stood
    when the rise began; a flat D lets it grow."""
    # rising from the first reduce: the veto lands (reduce 3) before the trust window could agree
    rising = [0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.10, 0.11, 0.12, 0.13, 0.14, 0.15]
    elche = ElCheConfig(meta_controller=False)
    # no reduce timed before training: the first report's sizing comes before any guard evidence
    vetoed = simulate(_sim(sync_ms=30.0, divergence=rising, windows=12, reduce_probe=False),
                      elche).windows
    free = simulate(_sim(sync_ms=30.0, divergence=[0.01], windows=12, reduce_probe=False),
                    elche).windows
    assert "suppress_growth" in {r.verdict for r in vetoed}
    assert max(r.anchor for r in vetoed) < max(r.anchor for r in free)
    first = next(r.window for r in vetoed if r.verdict == "suppress_growth")
    assert max(r.anchor for r in vetoed[first:]) == vetoed[first].anchor


@pytest.mark.parametrize("drop, phase, factor, anchor", [(3, "warmup", 0.3, 3),
                                                         (10, "stable", 0.5, 5),
                                                         (25, "mature", 0.7, 7)])
def test_lr_cliff_nudges_with_the_phase_factor(drop: int, phase: str, factor: float,
                                               anchor: int) -> None:
    """Pins the LR-cliff "Done means": sim.lr_drops=[w] divides the LR by 10 at window w and
    that window's reduce nudges with the current phase's factor (flat anchor, trend 0)."""
    rows = simulate(_sim(lr_drops=[drop]), ElCheConfig()).windows
    cliff = rows[drop]
    assert cliff.phase == phase
    assert cliff.verdict == "nudge_down" and cliff.nudge_factor == pytest.approx(factor)
    assert rows[drop + 1].anchor == anchor
    assert all(r.nudge_factor is None for r in rows[:drop])


def test_divergence_model_grows_with_steps_and_falls_after_lr_drop() -> None:
    """Pins the default D model: proportional to the longest window's batches and to the LR
    relative to the initial one."""
    rows = simulate(_sim(lr_drops=[8]), ElCheConfig(meta_controller=False)).windows
    assert rows[1].divergence == pytest.approx(0.001 * 25)
    assert rows[8].divergence == pytest.approx(rows[7].divergence / 10)


def test_summary_against_ideal() -> None:
    """Pins the summary: ideal = sum of per-rank throughputs (32 x 1000 / ms), simulated rate
    below it by the reduce share and idle time, idle per rank (the fast rank waits in Probe)."""
    result = simulate(_sim(windows=20), ElCheConfig())
    s = result.summary
    assert s.ideal_samples_per_s == pytest.approx(32 * 100 + 32 * 40)
    assert 0.9 < s.ratio_to_ideal < 1.0
    assert s.idle_fraction[0] > 0 and s.idle_fraction[1] == 0


def test_groups_noise_and_async_run_and_serialize() -> None:
    """Pins the compact rig form (groups), noise, drift and cpu_async: a 3-generation rig runs,
    the slowest generation anchors, and sim.json serializes."""
    groups = [RankGroup(4, 10.0), RankGroup(3, 18.0, drift=0.001), RankGroup(2, 30.0)]
    sim = SimConfig(groups=groups,
                    noise=0.05, windows=30, cold_start_skew=ColdStartSkew(0, 3.0, 2))
    result = simulate(sim, ElCheConfig.cpu_async())
    assert result.windows[-1].anchor_rank in (7, 8)
    doc = json.loads(json.dumps(sim_json(result)))
    assert len(doc["windows"][0]["batch_counts"]) == 9


def _composed(*overrides: str) -> SimRunConfig:
    register_schemas(extra=[SCHEMA])
    return OmegaConf.to_object(compose(list(overrides), config_name="sim"))


def test_sim_takes_elche_presets_and_knobs() -> None:
    """Pins that the sim composes the runner's elche group: `elche=cpu_async
    elche.overhead_target=0.1` gives the cpu_async preset with that knob, and a rig of groups
    composes from the command line."""
    cfg = _composed("elche=cpu_async", "elche.overhead_target=0.1",
                    "sim.groups=[{count:2,ms_per_batch:10},{count:1,ms_per_batch:30}]")
    assert cfg.elche.mode is Mode.cpu_async and cfg.elche.easgd_alpha == 0.5
    assert cfg.elche.overhead_target == 0.1
    assert [g.count for g in cfg.sim.groups] == [2, 1]
    assert check(cfg) == ([], [])


def test_check_reports_every_problem() -> None:
    """Pins the sim's own rules with dotted keys, plus the runner's elche rules against the
    rig's world size (partition_ratios length)."""
    cfg = SimRunConfig(elche=ElCheConfig(partition_ratios=[1.0, 2.0, 3.0]),
                       sim=SimConfig(noise=-1.0, cold_start_skew=ColdStartSkew(5, 2.0, 1),
                                     drift=[0.1], lr=0.0, lr_drops=[-1], divergence=[]))
    keys: List[str] = [p.key for p in check(cfg)[0]]
    assert keys == ["sim.drift", "sim.cold_start_skew.rank", "sim.noise", "sim.divergence",
                    "sim.lr", "sim.lr_drops", "elche.partition_ratios"]
