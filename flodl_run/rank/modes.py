"""The one place a rank's mode is decided: the config's mode (and whether the recipe steps
itself) picks the part that holds everything the modes do differently on a rank. The rest of
rank/ asks that part (rank.part.RankMode), never the mode.
"""

from __future__ import annotations

from typing import Dict, Type

from flodl_run.config.schema import ElCheConfig, Mode
from flodl_run.rank.async_windows import AsyncWindows
from flodl_run.rank.central_windows import CentralWindows
from flodl_run.rank.collective_windows import CadenceWindows, CollectiveWindows
from flodl_run.rank.exact_steps import ExactSteps
from flodl_run.rank.part import RankMode

WINDOWS: Dict[Mode, Type[RankMode]] = {
    Mode.nccl_sync: CollectiveWindows,  # parameters averaged after each rank's own step
    Mode.nccl_cadence: CadenceWindows,
    Mode.cpu_sync: CentralWindows,
    Mode.cpu_cadence: CentralWindows,
    Mode.cpu_async: AsyncWindows,
}


def rank_mode(elche: ElCheConfig, own_loop: bool) -> Type[RankMode]:
    """The part of a rank under `elche`'s mode; `own_loop`: the recipe has its own loop.
    nccl_sync averaging gradients runs exact steps, unless the recipe's loop steps its
    optimizers itself: it then averages parameters (the coordinator decides alike)."""
    if elche.averages_gradients and not own_loop:
        return ExactSteps
    return WINDOWS[elche.mode]
