"""Emulated heterogeneity: which steps sleep, and for how long (the clock and the sleep faked)."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_run.hardware import slowdown
from flodl_run.hardware.slowdown import Slowdown, factor_for, slowdown_for


@pytest.fixture
def clock(monkeypatch):
    """perf_counter reads `now[0]`; sleeps are recorded, not slept."""
    now, slept = [0.0], []
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(slowdown.time, "sleep", slept.append)
    return now, slept


def test_every_step_but_the_first_sleeps_f_minus_one_times_its_time(clock):
    """Pins the emulation's rule: factor 2.5 sleeps 1.5 x each step's time, and the first step
    (one-time warm-up a slower GPU does not multiply) is not slowed."""
    now, slept = clock
    slow = Slowdown(2.5)
    for began, took in ((0.0, 1.7), (2.0, 0.02), (3.0, 0.04)):
        now[0] = began + took
        slow.after_step(began)
    assert slept == pytest.approx([1.5 * 0.02, 1.5 * 0.04])


def test_factor_one_never_sleeps_and_the_rig_list_is_read_per_rank(clock):
    """Pins that a rank at full speed is never slowed, and each rank reads its own factor
    (1.0 when the rig names none, or names fewer ranks)."""
    now, slept = clock
    full = Slowdown(1.0)
    for began in (0.0, 1.0):
        now[0] = began + 0.5
        full.after_step(began)
    assert slept == [] and not full.active
    assert [factor_for([1.0, 2.5], r) for r in (0, 1, 2)] == [1.0, 2.5, 1.0]
    assert factor_for(None, 0) == 1.0


def test_jitter_draws_each_step_around_the_factor_reproducibly_per_rank(clock):
    """Pins cluster.emulate_jitter: each step sleeps (f x (1 + j x N(0, 1)) - 1) x its time,
    never a negative sleep; the draws repeat for the same (seed, rank) and differ across ranks;
    their spread is the jitter (std of the emulated step over the mean, within sampling)."""
    now, slept = clock

    def sleeps(factor: float, rank: int, seed: int = 7) -> list:
        slept.clear()
        slow = slowdown_for([1.0, factor], 0.05, rank, seed)
        for step in range(2001):
            now[0] = step + 0.01  # 10 ms steps
            slow.after_step(float(step))
        return list(slept)

    rank1 = sleeps(2.5, 1)
    assert len(rank1) == 2000 and rank1 == sleeps(2.5, 1)
    assert rank1 != sleeps(2.5, 1, seed=8)
    emulated = 0.01 + np.array(rank1)
    assert emulated.mean() == pytest.approx(0.025, rel=0.01)
    assert emulated.std() / emulated.mean() == pytest.approx(0.05, rel=0.1)
    rank0 = sleeps(1.0, 0)  # factor 1: only the slow half of the draws sleeps
    assert min(rank0) > 0 and 800 < len(rank0) < 1200
    assert Slowdown(1.0, jitter=0.05).active and not Slowdown(1.0).active
