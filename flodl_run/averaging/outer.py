"""Outer optimizers on the consensus: none, SlowMo and DiLoCo.

Pseudo-gradient g = prev_global - consensus. SlowMo: v = mu*v + g, new = prev - lr*v.
DiLoCo (Nesterov): v = mu*v + g, new = prev - lr*(mu*v + g). First window: prev := consensus.
Parameters only. Replicated bit-identically on every collective rank, or once on the coordinator.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

import torch

from flodl_run.config.schema import OuterConfig, OuterKind


class OuterOptimizer:
    """Holds prev_global and the velocity; `step_` rewrites the consensus in place."""

    def __init__(self, config: OuterConfig):
        self.config = config
        self.prev: Optional[List[torch.Tensor]] = None
        self.velocity: Optional[List[torch.Tensor]] = None

    @property
    def active(self) -> bool:
        return self.config.kind is not OuterKind.none

    def step_(self, params: List[torch.Tensor]) -> bool:
        """Apply one outer step to `params` (the consensus); True when parameters moved."""
        if not self.active:
            return False
        if self.prev is not None and not same_layout(self.prev, params):
            print("warning: the outer optimizer's resumed state has another flat layout than "
                  "this model's (a bundle written before parameter views were 16-byte aligned); "
                  "it starts afresh from this window", file=sys.stderr, flush=True)
            self.prev = None
        if self.prev is None:
            self.prev = [p.clone() for p in params]
            self.velocity = [torch.zeros_like(p) for p in params]
            return False
        lr, mu = self.config.lr, self.config.momentum
        for p, prev, v in zip(params, self.prev, self.velocity):
            g = prev - p
            v.mul_(mu).add_(g)
            step = v if self.config.kind is OuterKind.slowmo else v * mu + g
            p.copy_(prev - lr * step)
            prev.copy_(p)
        return True

    def state_dict(self) -> Dict[str, object]:
        return {"prev": self.prev, "velocity": self.velocity}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.prev = state["prev"]  # type: ignore[assignment]
        self.velocity = state["velocity"]  # type: ignore[assignment]


def same_layout(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two lists of flat buffers have the same count, lengths and dtypes."""
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
