"""Pacing decisions between reduces: the cpu_async overshoot budget and the
max_batch_diff throttle of the coordinator backend.

Owns the overshoot auto-tune (start 3, +1 per Stable verdict up to 15, back to 3 on a nudge)
and the pure "who must pause / wait" questions. It does not send orders: the coordinator does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from flodl_run.guard import NudgeDown, Stable, Verdict

OVERSHOOT_START = 3
OVERSHOOT_CEILING = 15


@dataclass(frozen=True)
class Overshoot:
    """cpu_async lookahead in batches past a rank's window; `fixed` disables the auto-tune."""

    batches: int = OVERSHOOT_START
    fixed: bool = False

    @classmethod
    def from_config(cls, max_overshoot: Optional[int]) -> "Overshoot":
        """An explicit max_overshoot pins the budget; None starts the auto-tune at 3."""
        if max_overshoot is None:
            return cls()
        return cls(int(max_overshoot), fixed=True)

    def after(self, verdict: Verdict) -> "Overshoot":
        """+1 per Stable verdict up to the ceiling, back to the start on NudgeDown."""
        if self.fixed:
            return self
        if isinstance(verdict, NudgeDown):
            return Overshoot(OVERSHOOT_START)
        if isinstance(verdict, Stable):
            return Overshoot(min(OVERSHOOT_CEILING, self.batches + 1))
        return self


def must_wait(batches_done: int, batch_count: int, overshoot_batches: int) -> bool:
    """cpu_async: a rank that ran its window plus the overshoot budget waits for the update."""
    return batches_done >= batch_count + overshoot_batches


def paused_ranks(batches_done: Sequence[int], batch_counts: Sequence[int],
                 max_batch_diff: Optional[int]) -> List[int]:
    """Ranks more than `max_batch_diff` batches ahead of the slowest rank still at work.

    A rank that finished its window (or is dead, count 0) does not hold anyone back, so the
    throttle can never stall a window; None = unbounded, nobody pauses.
    """
    if max_batch_diff is None:
        return []
    working = [done for done, count in zip(batches_done, batch_counts)
               if 0 < count and done < count]
    if not working:
        return []
    limit = min(working) + max_batch_diff
    return [rank for rank, (done, count) in enumerate(zip(batches_done, batch_counts))
            if count > 0 and done < count and done > limit]
