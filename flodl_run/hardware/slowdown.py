"""Emulated heterogeneity (`cluster.emulate_slowdown`, `cluster.emulate_jitter`): a process of
factor f acts f times slower by sleeping after each step, the device waited for; with jitter j
each step's emulated time is also drawn around that, f x (1 + j x N(0, 1)), from a stream seeded
by (run seed, rank) so a rerun jitters the same way.

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

import numpy as np
import torch


class Slowdown:
    """Sleeps after each step but the first when the factor is above 1 or steps jitter.

    An emulated step never runs faster than the real one: a draw below the real time sleeps
    nothing, so at factor 1 jitter only slows (its mean rises by about 0.4 x jitter).
    """

    def __init__(self, factor: float, jitter: float = 0.0, seed: int = 0, rank: int = 0):
        self.factor = factor
        self.jitter = jitter
        self._rng = np.random.default_rng([seed, rank]) if jitter > 0 else None
        self._warm = False

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or self.jitter > 0

    def stretch(self) -> float:
        """This step's emulated time over its real time: factor x (1 + jitter x N(0, 1)), at
        least 1. Draws one value from the rank's stream when jitter is on."""
        if self._rng is None:
            return self.factor
        return max(1.0, self.factor * (1.0 + self.jitter * float(self._rng.standard_normal())))

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
        stretch = self.stretch()
        if stretch > 1.0:
            time.sleep((stretch - 1.0) * (time.perf_counter() - began))


def factor_for(slowdowns, rank: int) -> float:
    """The factor of `rank` in the rig's `emulate_slowdown` list (1.0 when none is given)."""
    return slowdowns[rank] if slowdowns and rank < len(slowdowns) else 1.0


def slowdown_for(slowdowns, jitter: float, rank: int, seed: int) -> Slowdown:
    """The Slowdown of `rank`: its factor in `emulate_slowdown`, the rig's `emulate_jitter`,
    its jitter stream seeded by (seed, rank)."""
    return Slowdown(factor_for(slowdowns, rank), jitter, seed, rank)
