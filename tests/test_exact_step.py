"""The exact step of a lone rank (no partner, no DDP): a non-finite gradient skips the step,
on the device for torch's fused optimizers (their own found_inf) and through one read for the
others; a finite one steps as the plain step does."""

from __future__ import annotations

import pytest
import torch

from flodl_run.contracts.recipe import load_recipe
from flodl_run.hardware.slowdown import Slowdown
from flodl_run.rank.exact import ExactSync, Micro
from flodl_run.rank.group import RankGroup
from flodl_run.rank.replica import Replica


def _lone(fused: bool) -> ExactSync:
    recipe = load_recipe("tests.exact_recipe", {"optimizer": "adamw"}, None, None)
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    if fused:
        replica.optimizer = replica.optimizers = torch.optim.AdamW(replica.model.parameters(), fused=True)
    group = RankGroup(0, torch.device("cpu"), 5.0)
    group.alone = True
    exact = ExactSync(replica, None, group, Slowdown(1.0))
    exact.rebuild()
    exact.reset_window()
    return exact


def _step(exact: ExactSync, x: torch.Tensor) -> None:
    exact.begin(Micro(0, 1, len(x), len(x), len(x)))
    exact.step((x, torch.zeros(len(x), dtype=torch.long)))


@pytest.mark.parametrize("fused", [True, False])
def test_a_lone_rank_skips_a_non_finite_step_and_takes_a_finite_one(fused):
    """Pins the skip without a partner: a NaN input leaves every parameter as it was and counts
    one skipped step (read at the window's end); the next finite step moves them."""
    exact = _lone(fused)
    before = [p.detach().clone() for p in exact.replica.model.parameters()]
    _step(exact, torch.full((8, 12), float("nan")))
    assert all(torch.equal(a, p) for a, p in zip(before, exact.replica.model.parameters()))
    assert exact.window_skipped() == 1 and exact.steps == 1
    _step(exact, torch.randn(8, 12))
    assert not all(torch.equal(a, p) for a, p in zip(before, exact.replica.model.parameters()))
    assert exact.window_skipped() == 1 and exact.steps == 2
