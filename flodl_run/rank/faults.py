"""Faults declared as data: the plan a rank reads from FLODL_RUN_FAULT at its process edge.

`FLODL_RUN_FAULT="<rank>:<after batches>:<action>[,...]"`, a test and drill knob: right after
its n-th batch, the named rank sends itself a signal (`1:30:SIGKILL`, `2:8:SIGSTOP`) or hangs
(`2:8:hang`: it stops training and heartbeating, yet does not exit). This module parses the
spec once into a frozen plan and fires what is due; it holds no rank state and knows no wire.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

FAULT_ENV = "FLODL_RUN_FAULT"
HANG = "hang"
EXPECTED = "<rank>:<after batches>:<SIGNAL or hang>[,...], e.g. 1:30:SIGKILL"


class FaultSpecError(ValueError):
    """A malformed FLODL_RUN_FAULT: names the variable, the value and the expected form."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: `rank` does `action` right after its `after_batches`-th batch."""

    rank: int
    after_batches: int
    action: str
    """A signal name (SIGKILL, SIGSTOP, SIGTERM, ...) or `hang`."""

    @property
    def is_hang(self) -> bool:
        return self.action == HANG


@dataclass(frozen=True)
class FaultPlan:
    """Every fault of a run; empty (the normal case) when FLODL_RUN_FAULT is unset."""

    faults: Tuple[Fault, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        """The plan of `spec` (empty for ""); FaultSpecError for an item that is not
        `<rank>:<after batches>:<action>` with rank >= 0, after batches >= 1 (a rank checks
        after each batch it finished) and a signal name of this platform or `hang`."""
        return cls(tuple(_parse_item(spec, item.strip()) for item in spec.split(",") if item.strip()))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "FaultPlan":
        return cls.parse(environ.get(FAULT_ENV, ""))

    def due(self, rank: int, batches: int) -> Optional[Fault]:
        """The fault `rank` suffers right after its `batches`-th batch, if any (the first
        one the spec names)."""
        return next((f for f in self.faults if f.rank == rank and f.after_batches == batches), None)

    def after_batch(self, rank: int, batches: int, hang: Callable[[], None]) -> None:
        """Injection point, called by the rank after each batch it finished: fire what is due.
        A signal is sent to this process (SIGKILL never returns); `hang` is the rank's own way
        to stop progressing, which this module cannot reach (its threads)."""
        fault = self.due(rank, batches)
        if fault is None:
            return
        if fault.is_hang:
            hang()
        else:
            os.kill(os.getpid(), signal.Signals[fault.action])


def _parse_item(spec: str, item: str) -> Fault:
    parts = item.split(":")
    try:
        if len(parts) != 3:
            raise ValueError(f"{len(parts)} fields")
        rank, after, action = int(parts[0]), int(parts[1]), parts[2].strip()
        if rank < 0 or after < 1:
            raise ValueError("rank must be >= 0 and after batches >= 1")
        if action != HANG and action not in signal.Signals.__members__:
            raise ValueError(f"{action!r} is neither a signal name nor {HANG!r}")
    except ValueError as exc:
        raise FaultSpecError(f"{FAULT_ENV}={spec!r}: item {item!r} is not {EXPECTED} ({exc})") from None
    return Fault(rank, after, action)
