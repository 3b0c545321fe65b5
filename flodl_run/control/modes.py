"""The one place on the coordinator that looks at the mode: which family of parts trains the
run, and the settings that follow from the mode, all decided once from the config.

A mode family is one trainer part (`Family`): nccl_sync's exact steps (`control.exact`),
collective windows (`control.windows` with `control.collective`'s round), coordinator-averaged
windows (`control.windows` with `control.central`'s round) and async chunks
(`control.async_chunks`). The coordinator builds the part this module names; every other part
asks its collaborators, never the mode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from flodl_run.averaging.central import CentralAverager
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import ElCheConfig, Mode, OuterConfig, WindowEnd
from flodl_run.contracts.recipe import Recipe

DIVERGENCE_EVERY = 16
"""nccl_sync measures the divergence at one reduce in this many (see RoundBook.sync_now)."""


class Family(enum.Enum):
    """The part that trains a run's epochs."""

    exact_steps = "exact_steps"  # nccl_sync, gradients averaged inside backward
    collective_windows = "collective_windows"  # nccl_sync (parameters), nccl_cadence
    central_windows = "central_windows"  # cpu_sync, cpu_cadence: the coordinator averages
    async_chunks = "async_chunks"  # cpu_async: training overlapped with the reduce


def family_of(elche: ElCheConfig, recipe: Optional[Recipe]) -> Family:
    """nccl_sync's exact path averages gradients inside backward; a recipe with its own loop
    steps its optimizers itself, so it averages parameters (the ranks decide alike)."""
    mode = elche.mode
    has_loop = recipe is not None and recipe.loop is not None
    if elche.averages_gradients and not has_loop:
        return Family.exact_steps
    if mode is Mode.cpu_async:
        return Family.async_chunks
    return Family.collective_windows if mode.is_collective else Family.central_windows


@dataclass(frozen=True)
class WindowRules:
    """How the windows of a sync or cadence mode are cut and reduced."""

    sync_epochs: bool
    """A reduce once every rank with data stepped (sync), else windows of planned counts."""
    progressive: bool
    """Every rank takes its work from the whole epoch (progressive_dispatch, resolved)."""
    folds_sync: bool
    """The reduce order rides on the Train orders when it can (the ranks reduce among themselves)."""
    sends_ahead: bool
    """nccl_sync: a rank's next order goes out before the reduce it follows."""
    deadline_windows: bool
    """elche.window_end=deadline: a window ends on the plan's duration (cadence and async)."""

    @classmethod
    def of(cls, elche: ElCheConfig, progressive_dispatch: Optional[bool]) -> "WindowRules":
        """`progressive_dispatch`: the config's, its auto default (None) resolved by mode: on
        for cadence and async, off for sync."""
        mode, chosen = elche.mode, progressive_dispatch
        return cls(sync_epochs=mode.is_sync,
                   progressive=mode.is_progressive if chosen is None else bool(chosen),
                   folds_sync=mode.is_collective,
                   sends_ahead=mode is Mode.nccl_sync,
                   deadline_windows=elche.window_end is WindowEnd.deadline and not mode.is_sync)


def divergence_every(mode: Mode) -> int:
    """nccl_sync reduces after every step and takes no verdicts: the divergence is measured at
    one reduce in DIVERGENCE_EVERY; every other mode measures it at each."""
    return DIVERGENCE_EVERY if mode is Mode.nccl_sync else 1


def central_averager(elche: ElCheConfig, outer: OuterConfig) -> CentralAverager:
    """The coordinator's averager: the outer optimizer, and EASGD's center in cpu_async."""
    alpha = elche.easgd_alpha if elche.mode is Mode.cpu_async else None
    return CentralAverager(OuterOptimizer(outer), elche.gamma, alpha)


def averages_here(mode: Mode) -> bool:
    """The coordinator averages (its outer state is saved and restored here), or the ranks
    average among themselves."""
    return not mode.is_collective


def forms_groups(mode: Mode) -> bool:
    """The ranks form a process group and average among themselves (a death regroups them)."""
    return mode.is_collective


def easgd_center(averager: Optional[CentralAverager]) -> Optional[list]:
    """The EASGD center, the model of record in cpu_async (evals score it, saves write it);
    None under every other averaging."""
    return averager.center if averager is not None and averager.alpha is not None else None
