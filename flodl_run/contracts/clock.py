"""The run's aligned clock: the coordinator's `perf_counter_ns` is the run's time base, and
each rank estimates the coordinator's clock minus its own from NTP-style round trips
(ClockPing/ClockEcho on its heartbeat socket). Pure: the caller reads the clocks and feeds
the four stamps of each round trip in.

The timeline shifts a rank's events by the estimate; a deadline window's instant, sent in
the coordinator's time base, becomes a rank's own with `local_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

RECENT_SAMPLES = 64
"""Round trips the estimate picks from (one a heartbeat: about a minute): old enough to have
caught a quiet one, recent enough that the clocks' drift (a few ppm: tens of microseconds a
minute) stays below a batch."""


@dataclass(frozen=True)
class ClockEstimate:
    """The coordinator's clock minus this process's, and half the round trip it came from
    (the worst case of its error)."""

    offset_ns: int
    uncertainty_ns: int
    samples: int


class ClockSync:
    """NTP's estimate over request/response pairs: t0 sent (ours), t1 received and t2 replied
    (theirs), t3 received (ours). offset = ((t1 - t0) + (t2 - t3)) / 2; the sample with the
    shortest round trip ((t3 - t0) - (t2 - t1)) wins, since queueing delays only add to it.
    `recent`: pick among the latest that many samples (None: every sample of the run)."""

    def __init__(self, recent: Optional[int] = None) -> None:
        self.best: Optional[Tuple[int, int]] = None  # (round trip, offset)
        self.window: Optional[Deque[Tuple[int, int]]] = deque(maxlen=recent) if recent else None
        self.samples = 0

    def add(self, t0: int, t1: int, t2: int, t3: int) -> None:
        round_trip = (t3 - t0) - (t2 - t1)
        if round_trip < 0:
            return  # impossible under any offset: a mismatched echo
        self.samples += 1
        sample = (round_trip, ((t1 - t0) + (t2 - t3)) // 2)
        if self.window is not None:
            self.window.append(sample)
            self.best = min(self.window)  # one assignment: a reader on another thread sees either
        elif self.best is None or sample[0] < self.best[0]:
            self.best = sample

    def estimate(self) -> Optional[ClockEstimate]:
        best = self.best
        if best is None:
            return None
        return ClockEstimate(best[1], (best[0] + 1) // 2, self.samples)


def local_s(coordinator_ns: int, estimate: ClockEstimate) -> float:
    """An instant on the coordinator's clock (perf_counter_ns there) as this process's
    `perf_counter()` reads it: the offset is the coordinator's clock minus ours."""
    return (coordinator_ns - estimate.offset_ns) / 1e9


def coordinator_ns(local: float, estimate: ClockEstimate) -> int:
    """The inverse of `local_s`: this process's `perf_counter()` reading on the coordinator's
    clock."""
    return round(local * 1e9) + estimate.offset_ns
