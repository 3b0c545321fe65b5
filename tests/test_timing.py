"""Timing intake of ElChe."""

from __future__ import annotations

import pytest

from flodl_run.elche.timing import INVALID, RankTiming, Reading, TimingHistory, read, read_timing


@pytest.mark.parametrize(
    "wall_ms, batches, callback_ms, first_ms, skip, fill_ms, expected",
    [
        # ms per batch divides by batches actually done, not planned.
        (250.0, 10, 0.0, None, False, None, Reading(25.0)),
        (100.0, 4, 0.0, None, False, None, Reading(25.0)),
        # callback time (eval, checkpoint) is subtracted before dividing.
        (300.0, 10, 50.0, None, False, None, Reading(25.0)),
        # cadence/async: the first batch is left out and its excess comes back as fill_ms.
        (290.0, 10, 0.0, 65.0, True, None, Reading(25.0, 40.0)),
        # ... but sync modes count it like any batch.
        (290.0, 10, 0.0, 65.0, False, None, Reading(29.0)),
        # a rank that split off its fill itself: (wall - fill) / batches.
        (290.0, 10, 0.0, None, True, 40.0, Reading(25.0, 40.0)),
        # one batch cannot be split: the whole wall counts.
        (65.0, 1, 0.0, 65.0, True, None, Reading(65.0)),
        # invalid: nothing done, no wall, a wall eaten by callbacks, a non-finite wall.
        (250.0, 0, 0.0, None, False, None, INVALID),
        (None, 10, 0.0, None, False, None, INVALID),
        (100.0, 10, 100.0, None, False, None, INVALID),
        (float("nan"), 10, 0.0, None, False, None, INVALID),
    ],
)
def test_reading_rules(wall_ms, batches, callback_ms, first_ms, skip, fill_ms, expected) -> None:
    """Pins the timing rule: divisor = actual batches, callbacks excluded, first-batch fill split
    off only for cadence/async, and the cases that yield no reading at all."""
    got = read(wall_ms, batches, callback_ms, first_ms, skip, fill_ms)
    assert got.is_valid == expected.is_valid
    if expected.is_valid:
        assert got.ms_per_batch == pytest.approx(expected.ms_per_batch)
        want_fill = expected.fill_ms
        assert got.fill_ms == (None if want_fill is None else pytest.approx(want_fill))


def test_read_timing_matches_read() -> None:
    """Pins that the RankTiming record is read with the same rules as the columns."""
    timing = RankTiming(rank=1, wall_ms=300.0, batches=10, callback_ms=25.0, first_batch_ms=50.0)
    assert read_timing(timing, skip_first_batch=True) == Reading(25.0, 25.0)


def test_smoothed_is_mean_of_last_five_valid_readings() -> None:
    """Pins the trust window: the 6th reading pushes out the 1st; invalid readings in between
    neither count nor reset the mean."""
    history = TimingHistory(1)
    for ms in (10.0, 20.0, 30.0, 40.0, 50.0):
        history.record(0, Reading(ms))
    assert history.smoothed_ms(0) == pytest.approx(30.0)
    history.record(0, INVALID)
    history.record(0, Reading(60.0))
    assert history.smoothed_ms(0) == pytest.approx(40.0)  # mean of 20..60


def test_five_invalid_readings_in_a_row_clear_the_history() -> None:
    """Pins the clear rule: 4 invalid readings keep the speed, the 5th in a row drops it, and a
    valid reading in between restarts the count."""
    history = TimingHistory(2)
    history.record(0, Reading(10.0))
    history.record(1, Reading(10.0))
    cleared = [history.record(0, INVALID) for _ in range(4)]
    assert cleared == [False] * 4 and history.smoothed_ms(0) == 10.0
    assert history.record(0, INVALID) is True
    assert history.smoothed_ms(0) is None and history.invalid_streak(0) == 5
    for _ in range(4):
        history.record(1, INVALID)
    history.record(1, Reading(20.0))
    for _ in range(4):
        history.record(1, INVALID)
    assert history.smoothed_ms(1) == pytest.approx(15.0)


def test_fill_is_kept_apart_from_speed() -> None:
    """Pins that fill cost is tracked on its own (mean of recent splits) and never enters the
    smoothed speed."""
    history = TimingHistory(1)
    history.record(0, Reading(25.0, 40.0))
    history.record(0, Reading(25.0, 20.0))
    assert history.smoothed_ms(0) == 25.0 and history.fill_ms(0) == pytest.approx(30.0)


def test_history_round_trips_through_state() -> None:
    """Pins that a resumed run keeps each rank's readings, fills and invalid streak."""
    history = TimingHistory(3)
    history.record(0, Reading(10.0, 2.0))
    history.record(0, Reading(12.0))
    history.record(2, INVALID)
    copy = TimingHistory.from_state(history.export_state())
    assert copy.all_smoothed_ms() == [11.0, None, None]
    assert copy.fill_ms(0) == 2.0 and copy.invalid_streak(2) == 1
    assert copy.export_state() == history.export_state()
