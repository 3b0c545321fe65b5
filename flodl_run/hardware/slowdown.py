"""Emulated heterogeneity (`cluster.emulate_slowdown`): a process of factor f > 1 acts f times
slower by sleeping (f - 1) x each step's time right after the step, the device waited for.

A process's first step is not slowed. It carries one-time costs (the CUDA context, cuBLAS
handles, the allocator's first blocks, kernel selection) that take as long on a slower GPU as on
a faster one; multiplied, they would make the fast rank of a pair idle at the first reduce for
(f - 1) x that warm-up (1.5 x 1.7 s for byte_lm on an H200), a cost of the emulation that a real
mixed rig does not have. Every runner applies it the same way: ranks, solo runs and the bench's
peers.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class Slowdown:
    """Sleeps after each step but the first when the factor is above 1."""

    def __init__(self, factor: float):
        self.factor = factor
        self._warm = False

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def after_step(self, began: float, device: Optional[torch.device] = None) -> None:
        """`began`: time.perf_counter() at the step's start. Given a CUDA `device`, the step is
        waited for here; without one the caller has waited for it (a rank does, for its clock)."""
        if not self.active:
            return
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        if not self._warm:
            self._warm = True
            return
        time.sleep((self.factor - 1.0) * (time.perf_counter() - began))


def factor_for(slowdowns, rank: int) -> float:
    """The factor of `rank` in the rig's `emulate_slowdown` list (1.0 when none is given)."""
    return slowdowns[rank] if slowdowns and rank < len(slowdowns) else 1.0
