"""The rank's collective reduce over a lone group (no process group needed): what a retry of
the same round undoes, and what a broken group leaves alone."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig, OuterKind
from flodl_run.contracts.wire import AbortGroup, Reduced, ReduceFailed, SyncNow
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.group import RankGroup
from flodl_run.rank.reduce import CollectiveReduce

GAMMA = 0.5


def _lone_reduce(seeks: list) -> tuple:
    """A CollectiveReduce of rank 0 alone in generation 0 (its reduce is the identity)."""
    group = RankGroup(0, torch.device("cpu"), limit_s=5.0)
    group.join(0, [0])
    replica = SimpleNamespace(seek_schedule=seeks.append, optimizer=SimpleNamespace(state={}))
    flat = FlatParams(torch.nn.Linear(3, 2))
    reduce = CollectiveReduce(0, replica, flat, OuterOptimizer(OuterConfig()), group, Recorder(),
                              GAMMA, OuterKind.none, track_start=True)
    return reduce, group


def test_a_retried_round_is_weighted_by_the_batches_before_its_first_attempt():
    """Pins the undo of a retry: a round reduced here and ordered again (the coordinator redoes
    it after a death elsewhere) reduces again from the count before its first attempt (7, not
    the 0 left after it), and a completed reduce leaves the count at 0 and seeks the schedule
    to the cohort's step."""
    seeks: list = []
    reduce, _ = _lone_reduce(seeks)
    fact, steps = reduce.run(SyncNow(round=1, global_step=10), steps=7)
    assert isinstance(fact, Reduced) and fact.weight == 7 ** GAMMA and fact.finite and steps == 0
    fact, steps = reduce.run(SyncNow(round=1, global_step=10), steps=0)
    assert isinstance(fact, Reduced) and fact.weight == 7 ** GAMMA and steps == 0
    reduce.forget()  # training moved on: round 2 is new, its count is the one given
    fact, steps = reduce.run(SyncNow(round=2, global_step=14), steps=4)
    assert fact.weight == 4 ** GAMMA and seeks == [10, 10, 14]


def test_a_reduce_on_an_aborted_group_fails_and_keeps_the_count():
    """Pins the broken-group path: once the listener aborted this generation, a reduce reports
    ReduceFailed for its round and hands back the batch count untouched (the retry after the
    Regroup weighs them all)."""
    reduce, group = _lone_reduce([])
    group.abort(AbortGroup(0, []))
    fact, steps = reduce.run(SyncNow(round=3, global_step=0), steps=5)
    assert isinstance(fact, ReduceFailed) and fact.round == 3 and steps == 5
