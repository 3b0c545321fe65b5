"""nccl_sync's split of a global step: shares by speed (pure), the step's slices cut by them,
and a share cut into micro-batches."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flodl_run.control.dispatch import cut_step
from flodl_run.elche.shares import step_shares
from flodl_run.rank.exact import micro_plan


def test_shares_follow_speed_and_sum_to_the_step():
    """Pins the split: a rank 2.5x faster computes 5/7 of a step of 64 (46 + 18); unknown
    speeds split equally; partition_ratios override speed; a non-member gets nothing."""
    assert step_shares(64, [10.0, 25.0], [0, 1]) == [46, 18]
    assert step_shares(64, [None, None], [0, 1]) == [32, 32]
    assert step_shares(64, [10.0, 25.0], [0, 1], ratios=[3, 1]) == [48, 16]
    assert step_shares(64, [10.0, 25.0, 10.0], [0, 2]) == [32, 0, 32]


def test_speeds_within_ten_percent_split_equally():
    """Pins the dead band: ranks of one kind measured 9% apart (noise) split a step evenly, as
    torch DDP would; 12% apart is a real difference and shifts the split."""
    assert step_shares(64, [10.0, 10.9], [0, 1]) == [32, 32]
    assert step_shares(64, [10.0, 11.2], [0, 1]) == [34, 30]


def test_every_member_computes_at_least_one_sample():
    """Pins the floor: each member takes part in every step's all-reduce, so even a rank 64x
    slower (the cap) or a tail step of 3 samples gives each member one."""
    assert step_shares(64, [1.0, 1000.0], [0, 1]) == [63, 1]
    assert step_shares(3, [1.0, 10.0, 10.0], [0, 1, 2]) == [1, 1, 1]


@given(st.integers(1, 5000), st.lists(st.floats(0.1, 100.0), min_size=1, max_size=8))
def test_shares_always_sum_to_the_step(total, ms):
    """Pins the invariant the exactness rests on: the shares cover the step's samples exactly."""
    members = list(range(len(ms)))
    shares = step_shares(total, ms, members)
    assert sum(shares) == total
    assert total < len(ms) or min(shares) >= 1


def test_a_step_is_cut_in_rank_order_across_slices():
    """Pins the cut: consecutive pieces of the step's samples, a piece may span two slices."""
    step = [(0, 0, 10), (0, 50, 6)]
    assert cut_step(step, [12, 4]) == [[(0, 0, 10), (0, 50, 2)], [(0, 52, 4)]]
    assert cut_step(step, [16, 0]) == [[(0, 0, 10), (0, 50, 6)], []]


def test_a_share_above_the_limit_becomes_even_micro_batches():
    """Pins the micro-batches: 91 samples at a limit of 64 are 46 + 45 (synced on the last),
    a share within the limit stays whole, and each keeps the step's share and total."""
    plan = micro_plan([91, 30], [128, 128], 64)
    assert [(m.index, m.count, m.samples) for m in plan] == [(0, 2, 46), (1, 2, 45), (0, 1, 30)]
    assert [m.last for m in plan] == [False, True, True]
    assert {(m.share, m.total) for m in plan[:2]} == {(91, 128)}
