"""The cpu_async overshoot budget: how far past its window a rank may train
while a reduce is in flight.

Owns the overshoot auto-tune (start 3, +1 per Stable verdict up to 15, back to 3 on a nudge).
The max_batch_diff lead is not a run-time pause here: the sync gate, the count plan and the
overshoot cap already bound it (docs/elche.md, "max_batch_diff").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flodl_run.elche.guard import NudgeDown, Stable, Verdict

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
