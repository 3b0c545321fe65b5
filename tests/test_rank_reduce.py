"""The rank's collective reduce over a lone group (no process group needed): what a retry of
the same round undoes, and what a broken group leaves alone; and, over a real Gloo pair, that a
rank leaving a round unfinished frees the peer waiting on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.wire import AbortGroup, Reduced, ReduceFailed, SyncNow
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.group import RankGroup
from flodl_run.rank.reduce import CollectiveReduce, ReduceOptions

GAMMA = 0.5
REPO = Path(__file__).resolve().parents[1]


def _lone_reduce(seeks: list) -> tuple:
    """A CollectiveReduce of rank 0 alone in generation 0 (its reduce is the identity)."""
    group = RankGroup(0, torch.device("cpu"), limit_s=5.0)
    group.join(0, [0])
    replica = SimpleNamespace(seek_schedule=seeks.append, optimizer=SimpleNamespace(state={}))
    flat = FlatParams(torch.nn.Linear(3, 2))
    reduce = CollectiveReduce(0, replica, flat, OuterOptimizer(OuterConfig()), group, Recorder(),
                              ReduceOptions(GAMMA, track_start=True))
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


# One rank of a Gloo pair reducing round 1 through CollectiveReduce. Rank 0 was aborted before
# the round (the listener's AbortGroup) and reports ReduceFailed without entering the collective;
# it then stays alive, its process (and so its sockets) held open until stdin closes. Rank 1
# enters the collective and waits for rank 0 there. Each prints its fact's error.
_GLOO_RANK = """
import sys, torch
from types import SimpleNamespace
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.wire import AbortGroup, SyncNow
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.group import RankGroup
from flodl_run.rank.reduce import CollectiveReduce, ReduceOptions
rank = int(sys.argv[1])
group = RankGroup(rank, torch.device("cpu"), limit_s=float(sys.argv[2]))
group.join(0, [0, 1])
replica = SimpleNamespace(seek_schedule=lambda step: None, optimizer=SimpleNamespace(state={}))
reduce = CollectiveReduce(rank, replica, FlatParams(torch.nn.Linear(3, 2)),
                          OuterOptimizer(OuterConfig()), group, Recorder(),
                          ReduceOptions(0.5, track_start=True))
if rank == 0:
    group.abort(AbortGroup(0, [2]))
fact, _ = reduce.run(SyncNow(round=1, global_step=0), steps=3)
print(type(fact).__name__, fact.error, flush=True)
sys.stdin.read()
"""


@pytest.mark.e2e
def test_a_gloo_rank_that_leaves_a_round_unfinished_frees_the_peer_waiting_on_it():
    """Pins the release of a Gloo round after a death: Gloo has no abort, so a survivor that
    reports ReduceFailed without completing the round (here: its group was aborted before it
    began) destroys its group at once, and a survivor waiting on it inside the collective fails
    with the connection closed (or reset), instead of sitting there until the group timeout (the Regroup
    that would free it only comes once it has answered too)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "FLODL_RUN_STORE_HOSTED": "1", "PYTHONPATH": str(REPO)}
    limit_s = "60"  # the group timeout: only a regression would wait that long
    ranks = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(r), limit_s], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        aborted = ranks[0].stdout.readline()
        waiting = ranks[1].stdout.readline()
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert aborted.startswith("ReduceFailed process group aborted"), aborted
    assert waiting.startswith("ReduceFailed") and "Timed out" not in waiting, waiting
    assert "Connection closed" in waiting or "Connection reset" in waiting, waiting
