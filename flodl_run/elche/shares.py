"""nccl_sync's split of one global step: how many of its samples each rank computes.

Owns the speed-proportional share (samples per rank of a step of `total` samples), the 64x cap
on a speed ratio and the rule that every member computes at least one sample. Pure: smoothed
timings in, integers out. Which samples they are is dispatch's; the window length is ElChe's
anchor.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from flodl_run.elche.batch_counts import MAX_SPEED_RATIO

EVEN_WITHIN = 1.10
"""Speeds within 10% of each other split a step equally: on a homogeneous rig the measured
speeds differ by noise only, and an equal split is exactly torch DDP's."""


def step_shares(total: int, ms_per_batch: Sequence[Optional[float]], members: Sequence[int],
                ratios: Optional[Sequence[float]] = None) -> List[int]:
    """Samples of a step of `total` per rank (indexed by rank, 0 for a non-member).

    Shares follow `ratios` when given, else speed (1 / ms per batch of the same size); a member
    without a timing counts at the mean speed of those with one, and with no timing at all the
    split is equal. Ratios are capped at 64x the slowest member, and every member gets at least
    one sample (each must take part in the step's all-reduce) when `total` allows. Speeds
    within EVEN_WITHIN of each other count as equal.
    """
    size = max(ms_per_batch and len(ms_per_batch) or 0, (max(members) + 1) if members else 0,
               len(ratios) if ratios else 0)
    out = [0] * size
    if not members or total <= 0:
        return out
    split = largest_remainder(total, _weights(ms_per_batch, members, ratios))
    if total >= len(members):
        for i in [i for i, share in enumerate(split) if share == 0]:
            split[i] = 1
            split[max(range(len(split)), key=lambda j: split[j])] -= 1
    for rank, share in zip(members, split):
        out[rank] = share
    return out


def _weights(ms_per_batch: Sequence[Optional[float]], members: Sequence[int],
             ratios: Optional[Sequence[float]]) -> List[float]:
    if ratios:
        speeds = [float(ratios[r]) for r in members]
    else:
        known = [1.0 / ms_per_batch[r] for r in members
                 if r < len(ms_per_batch) and ms_per_batch[r] and ms_per_batch[r] > 0]
        mean = sum(known) / len(known) if known else 1.0
        speeds = [1.0 / ms_per_batch[r] if r < len(ms_per_batch) and ms_per_batch[r]
                  and ms_per_batch[r] > 0 else mean for r in members]
    slowest = min(speeds)
    if not ratios and max(speeds) <= EVEN_WITHIN * slowest:
        return [1.0] * len(speeds)
    return [min(s, slowest * MAX_SPEED_RATIO) for s in speeds]


def largest_remainder(total: int, weights: Sequence[float]) -> List[int]:
    """Integers summing to `total`, proportional to weights (ties to the lowest index)."""
    wsum = sum(weights)
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    exact = [total * w / wsum for w in weights]
    out = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))[:total - sum(out)]:
        out[i] += 1
    return out
