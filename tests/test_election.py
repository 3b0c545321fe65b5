"""Anchor-rank election."""

from __future__ import annotations

import pytest

from flodl_run.elche.election import elect, initial_pin, should_elect, slow_cohort
from flodl_run.elche.phase import Phase


@pytest.mark.parametrize(
    "ms, expected",
    [
        ([10.0, 25.0], [1]),
        ([22.0, 25.0, 21.25, 21.2], [0, 1, 2]),   # 0.85 x 25 = 21.25 is in, 21.2 is out
        ([None, 25.0, None], [1]),                 # ranks without data are never in
        ([None, None], []),
    ],
)
def test_slow_cohort_band(ms, expected) -> None:
    """Pins the 15% band: the cohort is every rank at >= 0.85 x the slowest smoothed ms."""
    assert slow_cohort(ms) == expected


@pytest.mark.parametrize(
    "ms, current, expected",
    [
        ([10.0, 25.0], None, 1),              # one cohort member wins outright
        ([10.0, 25.0], 0, 1),                 # ... even against a sitting rank outside it
        ([24.0, 25.0], 0, 0),                 # sitting rank in the cohort, challenger < 10% slower
        ([24.0, 26.4], 0, 1),                 # challenger exactly 10% slower takes the seat
        ([24.0, 26.3], 0, 0),                 # 9.6% slower: not enough
        ([24.0, 25.0, 24.5], None, 0),        # no sitting rank: lowest index in the cohort
        ([30.0, 25.0, 24.5], 2, 0),           # sitting rank out of the cohort -> lowest index
        ([None, None], 1, None),              # nobody has data
    ],
)
def test_elect(ms, current, expected) -> None:
    """Pins the election: cohort of one wins; a sitting anchor rank in the cohort keeps its seat
    unless a challenger is >= 10% slower; otherwise the lowest index in the cohort."""
    assert elect(ms, current) == expected


@pytest.mark.parametrize(
    "ratios, prior, expected",
    [
        ([0.5, 0.2, 0.3], None, 1),             # smallest explicit share
        ([0.5, 0.2, 0.3], [1.0, 9.0, 1.0], 1),  # explicit shares beat the spec prior
        (None, [3.0, 1.0, 1.0], 1),             # slowest spec, ties to the lowest index
        (None, None, None),                     # nothing known: the first election decides
    ],
)
def test_initial_pin(ratios, prior, expected) -> None:
    """Pins the initial pin order: partition_ratios, then a spec prior, then none."""
    assert initial_pin(3, ratios, prior) == expected


@pytest.mark.parametrize(
    "phase, current, streak, expected",
    [
        (Phase.WARMUP, None, 0, True),     # no anchor rank yet: elect
        (Phase.WARMUP, 1, 0, False),       # the pin holds through Warmup
        (Phase.WARMUP, 1, 4, False),
        (Phase.WARMUP, 1, 5, True),        # dead-window escape after 5 reports
        (Phase.STABLE, 1, 0, True),
        (Phase.MATURE, 1, 0, True),
    ],
)
def test_should_elect(phase, current, streak, expected) -> None:
    """Pins when the seat may move: from Stable on, to seat a first rank, or after the sitting
    rank gave no valid reading for 5 reports."""
    assert should_elect(phase, current, streak) is expected
