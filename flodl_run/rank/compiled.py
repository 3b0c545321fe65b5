"""What torch.compile did in this rank's process: the graphs dynamo built and the frames it gave
up on after its recompile limit (those run eagerly, silently, for the rest of the process).

Owns reading dynamo's own counters; it compiles nothing and never imports dynamo itself (a run
without a compiled model reads 0, 0 without paying for the import).
"""

from __future__ import annotations

import sys
from typing import Tuple

LIMIT_HIT = "Dynamo recompile limit exceeded"
"""How dynamo names the graph break of a frame past torch._dynamo.config.recompile_limit."""


def graph_counts() -> Tuple[int, int]:
    """(graphs compiled, frames fallen back to eager) in this process so far."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    counters = utils.counters
    graphs = int(counters["stats"]["unique_graphs"])
    eager = sum(int(n) for reason, n in counters["unimplemented"].items() if reason.startswith(LIMIT_HIT))
    return graphs, eager
