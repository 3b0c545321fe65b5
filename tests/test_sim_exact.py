"""The simulator's model of nccl_sync's exact path (pure): a step's fixed cost, the runner's
planner splitting each step, and what that split is worth against the speed split."""

from __future__ import annotations

from dataclasses import replace

from flodl_run.config.schema import ElCheConfig
from flodl_run.sim.cli import SimRunConfig, check
from flodl_run.sim.exact import simulate_mode
from flodl_run.sim.rig import SimConfig

RIG = SimConfig(rank_ms=[10.0, 25.0], step_fixed_ms=4.0, windows=30)


def test_a_fixed_cost_moves_the_split_to_where_steps_end_together():
    """Pins the model and the fit together: with 4 of the fast rank's 10 ms fixed (the same
    40% of the slow rank's 25), the steps end together at 55 / 9 of 64 (the closed form gives
    54.9), not at the speed split 46 / 18; that split delivers more of the ideal than the
    speed split held by partition_ratios, where the fast rank waits ~30% of the time."""
    fitted = simulate_mode(RIG, ElCheConfig.nccl_sync())
    assert fitted.windows[-1].shares == [55, 9]
    held = simulate_mode(RIG, replace(ElCheConfig.nccl_sync(), partition_ratios=[5.0, 2.0]))
    assert held.windows[-1].shares == [46, 18]
    assert fitted.summary.ratio_to_ideal > held.summary.ratio_to_ideal + 0.1
    assert held.summary.idle_fraction[0] > 0.25 > fitted.summary.idle_fraction[0]


def test_without_a_fixed_cost_the_split_is_the_speed_split():
    """Pins the other end: all of a step's time per sample, equal time is equal speed (46 / 18
    for a 2.5x pair), reached in the second window and kept."""
    result = simulate_mode(replace(RIG, step_fixed_ms=0.0), ElCheConfig.nccl_sync())
    assert result.windows[0].shares == [32, 32]
    assert all(w.shares == [46, 18] for w in result.windows[1:])
    assert result.summary.shares == [46 / 64, 18 / 64]


def test_a_fixed_cost_past_the_fastest_batch_is_refused_and_elsewhere_has_no_effect():
    """Pins sim.step_fixed_ms's rule (below the fastest rank's ms per batch, named with its
    value) and the warning that it models nccl_sync's exact path only."""
    problems, _ = check(SimRunConfig(elche=ElCheConfig.nccl_sync(), sim=replace(RIG, step_fixed_ms=10.0)))
    assert [(p.key, p.value) for p in problems] == [("sim.step_fixed_ms", 10.0)]
    _, warnings = check(SimRunConfig(sim=RIG))
    assert any(w.startswith("sim.step_fixed_ms=4 has no effect in mode nccl_cadence") for w in warnings)
