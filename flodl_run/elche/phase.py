"""ElChe's trust level: a monotonic phase machine.

Owns the four phases and the calibration counts that open them. It does not decide what a
phase allows: ElChe, the anchor auto-tune and the meta-controller read the phase and gate
themselves.
"""

from __future__ import annotations

import enum

# Calibrations (successful timing reports, one per reduce) that open each phase.
WARMUP_AT = 1
STABLE_AT = 5
MATURE_AT = 20


class Phase(enum.IntEnum):
    """Probe < Warmup < Stable < Mature; an IntEnum so gates read `phase >= Phase.STABLE`."""

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3

    @classmethod
    def after(cls, calibrations: int) -> "Phase":
        """The phase once `calibrations` reports have landed (a function of the count only)."""
        if calibrations >= MATURE_AT:
            return cls.MATURE
        if calibrations >= STABLE_AT:
            return cls.STABLE
        if calibrations >= WARMUP_AT:
            return cls.WARMUP
        return cls.PROBE

    @property
    def label(self) -> str:
        """Lower-case name, the spelling used in JSON, tables and checkpoints."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> "Phase":
        return cls[label.upper()]
