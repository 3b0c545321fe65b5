"""The rank side imports nothing of the coordinator side: both sit on the same layer and share
only the modules below them (wire, checkpoint, averaging, data, config, ...)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import _imports

PACKAGE = Path(__file__).resolve().parents[1] / "flodl_run"

RANK_SIDE = ("rank", "rank_env", "rank_channels", "rank_group", "rank_jobs", "rank_reduce",
             "rank_snapshot", "rank_bundle", "rank_loop", "faults", "replica", "worker", "solo")
CONTROL_SIDE = {f"flodl_run.{name}" for name in
                ("coordinator", "membership", "saving", "windows", "reduces", "overlap", "dispatch")}


@pytest.mark.parametrize("module", RANK_SIDE)
def test_a_rank_side_module_imports_no_coordinator_module(module: str) -> None:
    """Pins the rank/control boundary: a rank-side module importing the coordinator or one of
    its collaborators (a shortcut across the layer) fails here."""
    crossing = sorted(set(_imports(PACKAGE / f"{module}.py")) & CONTROL_SIDE)
    assert not crossing, f"flodl_run/{module}.py imports coordinator-side modules {crossing}"
