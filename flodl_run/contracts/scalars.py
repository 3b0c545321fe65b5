"""User scalars: `record_scalar(name, value)` from inside train_step, rolled up per epoch.

Owns the per-process buffer a rank drains once per window and the cross-rank roll-up of
Per-key reductions (`scalar_reductions`: mean by default, or sum, min, max, last). Core metric keys
(loss, throughput, ...) are the runtime's own and are refused at config time.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping

_buffer: Dict[str, List[float]] = {}


def record_scalar(name: str, value: float) -> None:
    """Record one value of a user metric on this rank (cheap: appends to a list)."""
    _buffer.setdefault(name, []).append(float(value))


def drain() -> Dict[str, List[float]]:
    """Everything recorded since the last drain, in recording order."""
    global _buffer
    taken, _buffer = _buffer, {}
    return taken


def merge(into: Dict[str, List[float]], more: Mapping[str, Iterable[float]]) -> None:
    for name, values in more.items():
        into.setdefault(name, []).extend(values)


def roll_up(values: Mapping[str, List[float]], reductions: Mapping[str, object]) -> Dict[str, float]:
    """One number per scalar: every value of every rank in arrival order, reduced by its rule."""
    out: Dict[str, float] = {}
    for name, series in values.items():
        if not series:
            continue
        rule = getattr(reductions.get(name), "value", reductions.get(name)) or "mean"
        if rule == "sum":
            out[name] = math.fsum(series)
        elif rule == "min":
            out[name] = min(series)
        elif rule == "max":
            out[name] = max(series)
        elif rule == "last":
            out[name] = series[-1]
        else:
            out[name] = math.fsum(series) / len(series)
    return out
