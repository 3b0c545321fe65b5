"""Deadline windows (elche.window_end=deadline) on the coordinator's side: the instant a
window ends, on the coordinator's clock (the run's time base, which each rank reaches through
its estimated clock offset), and the loan of batches past the planned count a rank may train
before it.

A cadence window's orders share one instant: when they go out, plus how late the latest rank
began the window before (its start as the rank reported it on the coordinator's clock), plus
ElChe's planned duration. An async chunk goes out when its rank reports the one before, so
its instant counts from then. What a loan leaves untrained goes back to the pool as any
deadline cut does (`Windows.take_back`).
"""

from __future__ import annotations

import math
import time
from typing import Dict, Optional

from flodl_run.contracts.wire import WindowDone

MAX_LAG_SHARE = 0.5
"""The latest rank's start delay is allowed for up to half the window: a longer one is no
start delay but a misread clock (an offset estimated over a congested link)."""
KEPT_WINDOWS = 4  # windows whose send instant is kept for the ranks' late reports


class Deadlines:
    """Owns each recent window's send instant and the latest start delay measured; given the
    coordinator's recorder (a `deadline` span per window: from its orders to its end) and
    `elche.deadline_headroom` (the loan)."""

    def __init__(self, recorder, headroom: float):
        self.recorder, self.headroom = recorder, headroom
        self._sent_ns: Dict[int, int] = {}
        self._lag_ns: Dict[int, int] = {}  # window -> its latest rank's start after the send

    def window_ns(self, window: int, window_ms: float) -> int:
        """The instant every order of `window` (sent now) ends, on the coordinator's clock."""
        now = time.perf_counter_ns()
        duration = round(window_ms * 1e6)
        lag = self._lag_ns[max(self._lag_ns)] if self._lag_ns else 0
        instant = now + min(max(0, lag), round(duration * MAX_LAG_SHARE)) + duration
        self._sent_ns[window] = now
        for old in [w for w in self._sent_ns if w <= window - KEPT_WINDOWS]:
            del self._sent_ns[old]
            self._lag_ns.pop(old, None)
        self.recorder.span_between("deadline", now, instant, window)
        return instant

    @staticmethod
    def chunk_ns(window_ms: float) -> int:
        """An async chunk's instant: its planned duration from now (it is trained from now)."""
        return time.perf_counter_ns() + round(window_ms * 1e6)

    def began(self, done: WindowDone) -> None:
        """A rank's report of when it began a cadence window (its start delay after the send)."""
        sent = self._sent_ns.get(done.window)
        if done.began_ns is None or sent is None:
            return
        self._lag_ns[done.window] = max(self._lag_ns.get(done.window, 0), done.began_ns - sent)

    def loan(self, count: int, window_ms: Optional[float]) -> int:
        """The batches a rank is handed for a window planned at `count`: up to
        ceil(count x (1 + headroom)) when the window ends on a deadline (the rank trains what
        fits), the count itself when it ends on counts."""
        if window_ms is None or count <= 0:
            return count
        return max(count, math.ceil(count * (1.0 + self.headroom) - 1e-9))
