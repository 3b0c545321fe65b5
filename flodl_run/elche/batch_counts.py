"""Per-rank batch counts of the next window.

Owns the speed-proportional target (64x cap), the 5% dead zone, the max_batch_diff step clamp
and the one-epoch window cap. It does not pick the anchor or the anchor rank (ElChe does) and
does not pause ranks at run time (see `throttle`).
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence

import numpy as np

from flodl_run.elche.timing import column, known

# No rank runs more than 64x the anchor rank's batches: beyond that a reading is more likely
# a measurement fault than a real speed gap.
MAX_SPEED_RATIO = 64.0
# A new target within 5% of the current count is noise; keep the count.
DEAD_ZONE = 0.05


def target_count(anchor: int, ms_per_batch: Optional[float], slow_ms: Optional[float]) -> int:
    """Batches a rank of speed `ms_per_batch` runs while the anchor rank (`slow_ms`) runs
    `anchor`: max(1, round(anchor * min(slow / m, 64))); the anchor itself when either speed is
    unknown."""
    return int(targets(anchor, [ms_per_batch], slow_ms)[0])


def targets(anchor: int, ms_per_batch: Sequence[Optional[float]],
            slow_ms: Optional[float]) -> np.ndarray:
    """target_count of every rank at once (a column; None or NaN = unknown speed)."""
    ms = column(ms_per_batch)
    out = np.full(len(ms), anchor, dtype=np.int64)
    if slow_ms is None or slow_ms != slow_ms:
        return out
    work = anchor * slow_ms
    # np.rint rounds half to even, as round() does.
    with np.errstate(divide="ignore", invalid="ignore"):
        count = np.rint(np.minimum(work / ms, anchor * MAX_SPEED_RATIO))
    measured = (ms > 0) & (ms != slow_ms)  # NaN (unknown) fails both
    out[measured] = np.maximum(count[measured], 1).astype(np.int64)
    return out


def ratio_counts(anchor: int, shares: Sequence[float], alive: Sequence[bool]) -> List[int]:
    """Counts fixed by explicit partition shares: the smallest living share runs `anchor`."""
    living = [s for s, up in zip(shares, alive) if up]
    if not living:
        return [0] * len(shares)
    smallest = min(living)
    return [max(1, round(anchor * s / smallest)) if up else 0 for s, up in zip(shares, alive)]


def next_counts(current: Sequence[int], anchor: int, anchor_rank: Optional[int],
                ms_per_batch: Sequence[Optional[float]], alive: Sequence[bool],
                calibrated: Sequence[bool], anchor_step: int = 0,
                max_batch_diff: Optional[int] = None) -> List[int]:
    """Counts after a reduce; dead ranks get 0 and the anchor rank gets exactly `anchor`.

    A rank's count moves to its target only when the target differs by more than 5% or the
    rank has no calibrated count yet. With `max_batch_diff` = M a count moves at most M away
    from where the anchor's own step (`anchor_step`) carries it, so M = 0 keeps lockstep.
    """
    ms = column(ms_per_batch)
    slow_ms = known(ms[anchor_rank]) if anchor_rank is not None else None
    now = np.asarray(current, dtype=np.int64)
    wanted = targets(anchor, ms, slow_ms)
    noise = np.asarray(calibrated, dtype=bool) & (np.abs(wanted - now) <= DEAD_ZONE * now)
    counts = np.where(noise, now, wanted)
    if max_batch_diff is not None:
        carried = now + anchor_step
        clamped = np.minimum(np.maximum(counts, carried - max_batch_diff),
                             carried + max_batch_diff)
        counts = np.where(now > 0, clamped, counts)
    counts = np.maximum(counts, 1)
    if anchor_rank is not None:
        counts[anchor_rank] = anchor
    return np.where(np.asarray(alive, dtype=bool), counts, 0).tolist()


def cap_to_window(counts: Sequence[int], max_total: Optional[int]) -> List[int]:
    """Scale counts down proportionally so they sum to at most `max_total` (one epoch).

    Floors each share (at least 1 for a living rank) and gives the remainder to the largest;
    batches the floors of 1 add are taken back from the largest counts. When the floors alone
    exceed the cap (more living ranks than batches), every living rank runs one batch.
    """
    total = sum(counts)
    if max_total is None or total <= max_total:
        return list(counts)
    scaled = [max(1, c * max_total // total) if c > 0 else 0 for c in counts]
    spare = max_total - sum(scaled)
    if spare > 0:
        largest = max(range(len(scaled)), key=lambda r: (scaled[r], -r))
        scaled[largest] += spare
    elif spare < 0:
        _shave(scaled, -spare)
    return scaled


def _shave(counts: List[int], excess: int) -> None:
    """Take `excess` batches from the largest counts, one at a time, never below 1 (in place)."""
    heap = [(-c, r) for r, c in enumerate(counts) if c > 1]
    heapq.heapify(heap)
    while excess > 0 and heap:
        negative, rank = heapq.heappop(heap)
        counts[rank] -= 1
        excess -= 1
        if counts[rank] > 1:
            heapq.heappush(heap, (negative + 1, rank))
