"""Data dispatch planning: spans, equal split, progressive windows and the tail."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_run.control.dispatch import (
    epoch_span,
    equal_split,
    largest_remainder,
    split_trained,
    take,
    window_samples,
)


def test_epoch_splits_cut_a_pass_into_contiguous_spans():
    """Pins epoch e -> pass e // s, positions [part*N/s, (part+1)*N/s) of the pick space N*augment."""
    spans = [epoch_span(e, num_samples=100, augment=2, epoch_splits=3) for e in range(6)]
    assert [s.pass_index for s in spans] == [0, 0, 0, 1, 1, 1]
    assert [(s.start, s.end) for s in spans[:3]] == [(0, 66), (66, 133), (133, 200)]


def test_equal_split_spreads_the_remainder_in_whole_batches():
    """Pins sync-mode shares: equal (or by partition_ratios) in whole batches; the batches left
    over go one each to the first ranks (101 over 3 -> 34/34/33, never 35/33/33), and the
    epoch's short last batch is the last rank's."""
    assert equal_split(10, 3) == [4, 3, 3]
    assert equal_split(100, 2, [0.7, 0.3]) == [70, 30]
    assert equal_split(101 * 8, 3, batch_size=8) == [34 * 8, 34 * 8, 33 * 8]
    assert equal_split(101 * 8 - 5, 3, batch_size=8) == [34 * 8, 34 * 8, 33 * 8 - 5]
    assert equal_split(6 * 8, 2, [2.0, 1.0], batch_size=8) == [32, 16]


def test_window_is_counts_times_batch_until_the_tail():
    """Pins progressive chunks sized to batch_counts[r] batches while a full window remains."""
    assert window_samples(1000, [25, 10], 4) == [100, 40]


def test_tail_is_apportioned_by_counts():
    """Pins the epoch tail: a remainder smaller than one window is split by counts so ranks
    finish together (no rank left with a lone batch while others idle)."""
    sizes = window_samples(30, [25, 10], 4)  # 8 batches (last one short)
    assert sum(sizes) == 30
    assert sizes[0] > sizes[1] > 0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), batch=st.integers(1, 64),
       counts=st.lists(st.integers(1, 80), min_size=1, max_size=8))
def test_progressive_dispatch_covers_every_sample_once(n, batch, counts):
    """Invariant: cutting an epoch into windows hands out every position exactly once."""
    span = epoch_span(0, n, 1, 1)
    cursor, seen = span.start, []
    while cursor < span.end:
        for size in window_samples(span.end - cursor, counts, batch):
            piece, cursor = take(cursor, span, size)
            if piece is not None:
                seen.extend(range(piece[1], piece[1] + piece[2]))
    assert seen == list(range(n))


@given(total=st.integers(0, 1000), weights=st.lists(st.floats(0.01, 10), min_size=1, max_size=10))
def test_largest_remainder_sums_exactly(total, weights):
    """Invariant: apportioned integers always sum to the total."""
    assert sum(largest_remainder(total, weights)) == total


def test_split_trained_cuts_after_the_batches_a_deadline_window_ran():
    """Pins: a deadline window's untrained samples computed as a rank did not cut them (each
    slice batched on its own, its last batch short): samples trained twice or never."""
    slices = [(0, 0, 10), (0, 40, 7)]  # batches of 4: 4+4+2, then 4+3
    assert split_trained(slices, 0, 4) == ([], slices)
    assert split_trained(slices, 2, 4) == ([(0, 0, 8)], [(0, 8, 2), (0, 40, 7)])
    assert split_trained(slices, 3, 4) == ([(0, 0, 10)], [(0, 40, 7)])
    assert split_trained(slices, 4, 4) == ([(0, 0, 10), (0, 40, 4)], [(0, 44, 3)])
    assert split_trained(slices, 5, 4) == (slices, [])
