"""outer.reset_inner_state: after an outer step a rank clears its inner optimizer's state (AdamW's
moments and step count) only when asked, on both paths an outer step reaches a rank: the
collective reduce (nccl_sync, nccl_cadence steps the outer optimizer on every rank) and the
coordinator's Update (cpu_sync, cpu_cadence, cpu_async); a non-finite rank's reset stays."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig, OuterKind
from flodl_run.contracts.wire import Reduced, SyncNow, Update
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.central_windows import CentralWindows
from flodl_run.rank.group import RankGroup
from flodl_run.rank.reduce import CollectiveReduce, ReduceOptions


def _trained_adamw() -> tuple:
    """A Linear and its AdamW after one step: the state holds exp_avg for each parameter."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    assert all("exp_avg" in optimizer.state[p] for p in model.parameters())
    return model, optimizer


def _moments_kept(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    return all("exp_avg" in optimizer.state.get(p, {}) for p in model.parameters())


@pytest.mark.parametrize("reset", [False, True])
def test_a_collective_outer_step_resets_the_inner_state_only_when_asked(reset):
    """Pins the collective path: a lone rank's DiLoCo reduces (the first only records the global,
    the second steps the outer optimizer) keep AdamW's moments with reset_inner_state=false and
    leave its state empty with true; the first reduce (no outer step) never clears it."""
    model, optimizer = _trained_adamw()
    group = RankGroup(0, torch.device("cpu"), limit_s=5.0)
    group.join(0, [0])
    replica = SimpleNamespace(seek_schedule=lambda step: None, optimizer=optimizer)
    outer = OuterOptimizer(OuterConfig(kind=OuterKind.diloco, lr=0.7, momentum=0.9,
                                       reset_inner_state=reset))
    reduce = CollectiveReduce(0, replica, FlatParams(model), outer, group, Recorder(),
                              ReduceOptions(0.5, track_start=True))
    fact, _ = reduce.run(SyncNow(round=1, global_step=1), steps=1)
    assert isinstance(fact, Reduced) and _moments_kept(model, optimizer)
    reduce.forget()
    fact, _ = reduce.run(SyncNow(round=2, global_step=2), steps=1)
    assert isinstance(fact, Reduced) and outer.prev is not None
    assert _moments_kept(model, optimizer) is not reset
    assert (len(optimizer.state) == 0) is reset


def _apply(reset_inner_state: bool, update: Update) -> tuple:
    """CentralWindows.apply_update on a rank whose parameters arrive unchanged (no exchange)."""
    model, optimizer = _trained_adamw()
    config = SimpleNamespace(outer=OuterConfig(kind=OuterKind.diloco,
                                               reset_inner_state=reset_inner_state))
    rank = SimpleNamespace(exchange=SimpleNamespace(apply_=lambda update, payloads: None),
                           replica=SimpleNamespace(optimizer=optimizer, seek_schedule=lambda s: None),
                           outer=SimpleNamespace(config=config.outer), _awaiting_update=True)
    CentralWindows.apply_update(rank, update, [])
    assert rank._awaiting_update is False
    return model, optimizer


@pytest.mark.parametrize("reset", [False, True])
def test_a_coordinator_outer_step_resets_the_inner_state_only_when_asked(reset):
    """Pins the coordinator path (cpu_sync, cpu_cadence, cpu_async): an Update that says the
    outer optimizer stepped keeps AdamW's moments with reset_inner_state=false and clears them
    with true; an Update without an outer step keeps them either way."""
    stepped = Update(round=2, global_step=2, blend=1.0, buffers=False, dtypes=[], outer_stepped=True)
    model, optimizer = _apply(reset, stepped)
    assert _moments_kept(model, optimizer) is not reset
    assert (len(optimizer.state) == 0) is reset
    plain = Update(round=1, global_step=1, blend=1.0, buffers=False, dtypes=[])
    assert _moments_kept(*_apply(reset, plain))


def test_a_nonfinite_rank_is_reset_whatever_the_key_says():
    """Pins that the key leaves the non-finite reset alone: an Update marking this rank
    non-finite clears its inner state with reset_inner_state=false."""
    update = Update(round=2, global_step=2, blend=1.0, buffers=False, dtypes=[], reset=True)
    model, optimizer = _apply(False, update)
    assert len(optimizer.state) == 0
