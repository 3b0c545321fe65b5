"""What a rank reports of torch.compile: graphs built and frames past dynamo's recompile limit,
read from dynamo's own counters (flodl_run/rank/compiled.py)."""

from __future__ import annotations

import torch
import torch._dynamo

from flodl_run.rank.compiled import graph_counts


def test_graphs_and_frames_past_the_recompile_limit_are_counted():
    """Pins the reading: a function compiled for 4 sizes with shapes kept static and a limit of
    2 builds 2 graphs, then dynamo gives the frame up (it runs eagerly): the eager fallback a
    run reports, which a count of graphs alone would hide."""
    before = graph_counts()

    def double_sum(x):
        return (x * 2).sum()

    compiled = torch.compile(double_sum, backend="aot_eager")
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=2):
        for n in range(1, 5):
            assert compiled(torch.ones(n)).item() == 2 * n
    graphs, eager = graph_counts()
    assert (graphs - before[0], eager - before[1]) == (2, 1)
