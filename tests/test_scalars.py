"""User scalars (record_scalar) and their cross-rank roll-up."""

import pytest

from flodl_run.config.schema import Reduction
from flodl_run.contracts import scalars


@pytest.mark.parametrize("rule,expected", [(None, 2.5), (Reduction.sum, 10.0), (Reduction.min, 1.0),
                                           (Reduction.max, 4.0), (Reduction.last, 2.0)])
def test_roll_up_applies_each_reduction(rule, expected):
    """Pins mean as the default and sum/min/max/last over every value in arrival order."""
    reductions = {} if rule is None else {"x": rule}
    assert scalars.roll_up({"x": [1.0, 4.0, 3.0, 2.0]}, reductions) == {"x": expected}


def test_drain_empties_the_buffer_and_merge_concatenates():
    """Pins that a window's drain hands each value over once, in recording order."""
    scalars.record_scalar("a", 1)
    scalars.record_scalar("a", 2)
    first = scalars.drain()
    assert first == {"a": [1.0, 2.0]} and scalars.drain() == {}
    into = {"a": [0.0]}
    scalars.merge(into, first)
    assert into == {"a": [0.0, 1.0, 2.0]}
