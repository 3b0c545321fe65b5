"""Per-rank batch counts of the next window.

Owns the speed-proportional target (64x cap), the 5% dead zone, the max_batch_diff step clamp
and the one-epoch window cap. It does not pick the anchor or the anchor rank (ElChe does) and
does not pause ranks at run time (see `throttle`).
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence

# No rank runs more than 64x the anchor rank's batches: beyond that a reading is more likely
# a measurement fault than a real speed gap.
MAX_SPEED_RATIO = 64.0
# A new target within 5% of the current count is noise; keep the count.
DEAD_ZONE = 0.05


def target_count(anchor: int, ms_per_batch: Optional[float], slow_ms: Optional[float]) -> int:
    """Batches a rank of speed `ms_per_batch` runs while the anchor rank (`slow_ms`) runs
    `anchor`: max(1, round(anchor * min(slow / m, 64))); the anchor itself when either speed is
    unknown."""
    return _targets(anchor, [ms_per_batch], slow_ms)[0]


def _targets(anchor: int, ms_per_batch: Sequence[Optional[float]],
             slow_ms: Optional[float]) -> List[int]:
    """target_count over every rank at once (one loop, no call per rank: 1024-rank sims)."""
    if slow_ms is None:
        return [anchor] * len(ms_per_batch)
    work = anchor * slow_ms
    ceiling = anchor * MAX_SPEED_RATIO
    out = []
    for ms in ms_per_batch:
        if ms is None or ms == slow_ms or ms <= 0:
            out.append(anchor)
        else:
            count = round(work / ms if work / ms < ceiling else ceiling)
            out.append(count if count > 1 else 1)
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
    slow_ms = ms_per_batch[anchor_rank] if anchor_rank is not None else None
    targets = _targets(anchor, ms_per_batch, slow_ms)
    counts: List[int] = []
    for rank, now in enumerate(current):
        target = targets[rank]
        if not alive[rank]:
            target = 0
        elif rank == anchor_rank:
            target = anchor
        else:
            if calibrated[rank] and abs(target - now) <= DEAD_ZONE * now:
                target = now
            if max_batch_diff is not None and now > 0:
                carried = now + anchor_step
                target = min(max(target, carried - max_batch_diff), carried + max_batch_diff)
            target = target if target > 1 else 1
        counts.append(target)
    return counts


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
