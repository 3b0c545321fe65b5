"""nccl_sync's time model (pure): each rank's step fitted as a fixed cost plus a cost per
sample, the equal-time split it gives, the bounded move per window, and the planner that
goes from the cold start's speed rule to the time model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_run.elche.shares import SharePlanner, bounded, equal_time
from flodl_run.elche.stepfit import KEEP_POINTS, StepCost, StepFit, fit_line


def test_a_line_through_windows_at_several_shares_gives_both_costs():
    """Pins the fit: windows at 20, 30 and 40 samples a step of a device costing 2 ms + 0.1 ms
    a sample give back exactly those costs (a speed rule would read 0.2, 0.167, 0.15 ms a
    sample: a small share looks slow)."""
    line = fit_line([(20, 4.0), (30, 5.0), (40, 6.0)])
    assert line.fixed_ms == pytest.approx(2.0) and line.per_sample_ms == pytest.approx(0.1)


def test_points_that_cannot_show_a_slope_give_no_line():
    """Pins the fallback's triggers: samples a step within 10% of each other (the shares have
    settled), two windows (a line through any two), or windows scattered more than 10% of the
    step around the line (a loaded machine: the slope would be noise) read no line."""
    assert fit_line([(30, 5.0), (30, 5.2), (31, 5.1)]) is None
    assert fit_line([(20, 4.0), (40, 6.0)]) is None
    assert fit_line([(20, 4.0), (30, 7.0), (40, 4.5)]) is None
    assert fit_line([(20, 4.0), (30, 5.2), (40, 6.0)]) is not None  # 3% off the line
    assert fit_line([]) is None


def test_a_noisy_slope_is_clamped_to_costs_a_device_can_have():
    """Pins the clamps: time falling with samples (noise) keeps a per-sample cost of 5% of the
    mean ms per sample; a line crossing zero time above zero samples becomes a per-sample cost
    through the origin (no negative fixed cost)."""
    falling = fit_line([(20, 6.0), (30, 5.5), (40, 5.0)])
    assert falling.per_sample_ms == pytest.approx(0.05 * 5.5 / 30)
    assert falling.fixed_ms == pytest.approx(5.5 - falling.per_sample_ms * 30)
    steep = fit_line([(20, 1.0), (30, 3.0), (40, 5.0)])
    assert steep.fixed_ms == 0.0
    assert steep.per_sample_ms == pytest.approx((20 * 1.0 + 30 * 3.0 + 40 * 5.0) / (400 + 900 + 1600))


def test_settled_shares_keep_the_last_lines_shape_at_the_measured_level():
    """Pins the history: before any line the cost is the speed rule (all per sample); once a
    line was read, windows that all sit at one share keep its fixed cost in samples (a / b),
    scaled to what they measure (a device that got 2x slower reads 2x the
    cost, not a return to the speed rule that would move the shares back)."""
    fit = StepFit()
    fit.record(0, steps=10, samples=300, compute_ms=50.0)
    assert fit.cost(0) == StepCost(0.0, pytest.approx(5.0 / 30))
    fit.record(0, steps=10, samples=200, compute_ms=40.0)
    fit.record(0, steps=10, samples=400, compute_ms=60.0)
    assert fit.cost(0).fixed_ms == pytest.approx(2.0)
    for _ in range(KEEP_POINTS):  # the shares settle at 30: the line's points leave
        fit.record(0, steps=5, samples=150, compute_ms=25.0)
    assert fit.cost(0) == StepCost(pytest.approx(2.0), pytest.approx(0.1))
    for _ in range(KEEP_POINTS):
        fit.record(0, steps=5, samples=150, compute_ms=50.0)  # 30 a step, 10 ms: 2x slower
    assert fit.cost(0) == StepCost(pytest.approx(4.0), pytest.approx(0.2))
    assert fit.cost(1) is None
    fit.forget(0)
    assert fit.cost(0) is None


def test_equal_time_solves_the_closed_form():
    """Pins the split: ranks costing 1 + 0.1 s and 2.5 + 0.25 s (the second 2.5x slower at
    both) end a step of 64 together at 50 / 14 (6 ms each); the speed rule at a batch of 32
    would give 46 / 18, the slow rank's step then 7 ms against the fast rank's 5.6."""
    costs = [StepCost(1.0, 0.1), StepCost(2.5, 0.25)]
    shares = equal_time(64, costs)
    assert shares == pytest.approx([50.0, 14.0])
    assert costs[0].ms(shares[0]) == pytest.approx(costs[1].ms(shares[1]))


def test_a_rank_whose_fixed_cost_alone_passes_the_step_keeps_one_sample():
    """Pins the floor: when a slow rank's fixed cost is more than the fast rank needs for the
    whole step, it still computes one sample (it takes part in every all-reduce) and the
    others are solved without it."""
    assert equal_time(64, [StepCost(1.0, 0.01), StepCost(5.0, 0.025)]) == pytest.approx([63.0, 1.0])


def test_costs_within_ten_percent_at_an_equal_split_split_equally():
    """Pins the homogeneous rig: predicted steps within 10% of each other split as torch DDP
    does (noise between ranks of one kind does not move the split)."""
    assert equal_time(64, [StepCost(1.0, 0.1), StepCost(1.05, 0.105)]) == [32.0, 32.0]


@given(st.integers(1, 4000),
       st.lists(st.tuples(st.floats(0.0, 50.0), st.floats(1e-4, 5.0)), min_size=1, max_size=8))
def test_equal_time_covers_the_step(total, pairs):
    """Pins the invariant the exactness rests on: the continuous split sums to the step and
    gives each rank one sample at least when the step has enough."""
    shares = equal_time(total, [StepCost(a, b) for a, b in pairs])
    assert sum(shares) == pytest.approx(total)
    assert total < len(pairs) or min(shares) >= 1.0 - 1e-9


def test_a_split_moves_at_most_twice_or_half_per_window():
    """Pins the bound: from an even split toward 0.9 / 0.1 the small share halves at most
    (0.25), the rest goes to the other, and the fractions still sum to 1."""
    assert bounded([0.5, 0.5], [0.9, 0.1], 2.0) == pytest.approx([0.75, 0.25])
    assert bounded([0.5, 0.5], [0.6, 0.4], 2.0) == pytest.approx([0.6, 0.4])


def _rig_step_ms(rank: int, samples: float) -> float:
    """A pair where rank 1 is 2.5x slower, fixed cost included (as cluster.emulate_slowdown
    stretches the whole step): 0.2 ms + 0.02 ms a sample on rank 0."""
    return (0.2 + 0.02 * samples) * (1.0 if rank == 0 else 2.5)


def test_the_planner_starts_equal_then_by_speed_then_ends_steps_together():
    """Pins the planner's phases on a rig with a fixed cost: the first window splits equally,
    the next two by speed (no line through fewer than three windows), then by the fitted times,
    moving at most 2x a window, where both ranks' steps take the same time. With
    partition_ratios the ratios hold throughout."""
    planner = SharePlanner()
    ms = [None, None]
    plans = []
    for _ in range(12):
        split = planner.plan([64, 64], [0, 1], ms)[0]
        plans.append(split)
        for rank in (0, 1):
            step = _rig_step_ms(rank, split[rank])
            planner.observe(rank, steps=2, samples=2 * split[rank], compute_ms=2 * step)
        ms = [_rig_step_ms(r, split[r]) * 32 / split[r] for r in (0, 1)]
    assert plans[0] == [32, 32]
    assert plans[1] == [46, 18]  # speed at 32 a step: 2.5x
    for before, after in zip(plans[1:], plans[2:]):
        assert after[1] >= before[1] / 2 - 1
    # T = (64 + 0.2 / 0.02 + 0.5 / 0.05) / (1 / 0.02 + 1 / 0.05) = 1.2 ms: 50 and 14 samples
    assert plans[2] == [47, 17]  # speed at the shares of the two windows measured
    assert plans[-1] == [50, 14] and plans[3] == [50, 14]
    fixed = SharePlanner(ratios=[3, 1])
    fixed.observe(0, 2, 64, 4.0)
    fixed.observe(1, 2, 64, 9.0)
    assert fixed.plan([64], [0, 1], [1.0, 2.0]) == [[48, 16]]


def test_a_tail_step_is_solved_on_its_own_and_a_new_membership_unbounded():
    """Pins the tail: the epoch's smaller last step gets its own equal-time split (not the
    full step's fractions), and after a death the survivor takes the whole step at once."""
    planner = SharePlanner()
    for rank, cost in ((0, StepCost(1.0, 0.1)), (1, StepCost(2.5, 0.25))):
        for samples in (20, 30, 40):
            planner.observe(rank, 1, samples, cost.ms(samples))
    full, tail = planner.plan([64, 10], [0, 1], [None, None])
    assert full == [50, 14] and tail == [9, 1]
    assert planner.plan([64], [0], [None, None]) == [[64, 0]]


def test_a_planner_saved_in_a_bundle_plans_on_where_it_left_off():
    """Pins the planner's state through a bundle's JSON: a planner restored from a saved one
    (mid-way, the split still moving) plans the next windows exactly as the saved one would,
    where a fresh one starts over from an equal split. Before, a resumed nccl_sync run
    re-learned its shares from 50/50."""
    import json

    planner, ms = SharePlanner(), [None, None]
    for _ in range(3):
        split = planner.plan([64, 64], [0, 1], ms)[0]
        for rank in (0, 1):
            step_ms = _rig_step_ms(rank, split[rank])
            planner.observe(rank, steps=2, samples=2 * split[rank], compute_ms=2 * step_ms)
        ms = [_rig_step_ms(r, split[r]) * 32 / split[r] for r in (0, 1)]
    restored = SharePlanner()
    restored.load_state(json.loads(json.dumps(planner.export_state())))
    assert restored.last_split() == planner.last_split() and restored.fit.points(1) == planner.fit.points(1)
    for _ in range(3):
        ahead, again = planner.plan([64, 64], [0, 1], ms)[0], restored.plan([64, 64], [0, 1], ms)[0]
        assert again == ahead
        for plan in (planner, restored):
            for rank in (0, 1):
                plan.observe(rank, 2, 2 * ahead[rank], 2 * _rig_step_ms(rank, ahead[rank]))
    assert SharePlanner().plan([64], [0, 1], [None, None]) == [[32, 32]]
    assert ahead == [50, 14]


def test_a_slope_read_from_points_close_together_through_noise_is_no_line():
    """Pins MAX_SLOPE_ERROR: bench=lm_cpu's slow rank at a settled share (15-18 samples a step)
    gave lines whose fixed cost swung between 0 and 166 ms, and its share between 8 and 18
    samples of 64. Points like those (6% of noise, under MAX_SCATTER) read 92 ms + 3.2 ms a
    sample for a device of 5 ms + 8.4 ms, and now read no line; the same noise over shares that
    differ (10-40 samples) still reads the per-sample cost within 10%."""
    noise = [1.06, 1.06, 0.94, 0.94, 1.05, 1.03, 1.02, 0.97]
    settled = [(s, (5.0 + 8.4 * s) * k) for s, k in zip([15, 16, 17, 18, 15, 16, 17, 18], noise)]
    assert fit_line(settled) is None
    spread = [(s, (5.0 + 8.4 * s) * k) for s, k in zip([10, 20, 30, 40, 10, 20, 30, 40], noise)]
    line = fit_line(spread)
    assert line is not None and line.per_sample_ms == pytest.approx(8.4, rel=0.1)
