"""Data dispatch planning: which samples of an epoch each rank trains next.

Pure: sizes and (pass, offset, size) slices in, slices out. The coordinator owns the cursor
state and sends the orders; ranks turn slices into batches with the shared permutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from flodl_run.elche.shares import largest_remainder

SliceT = Tuple[int, int, int]  # (pass_index, offset into the pass permutation, size)


@dataclass(frozen=True)
class EpochSpan:
    """Epoch `epoch` covers positions [start, end) of pass `pass_index`'s permutation."""

    epoch: int
    pass_index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def epoch_span(epoch: int, num_samples: int, augment: int, epoch_splits: int) -> EpochSpan:
    """Epochs are 1/epoch_splits of a pass over the pick space num_samples * augment."""
    picks = num_samples * augment
    part = epoch % epoch_splits
    return EpochSpan(epoch, epoch // epoch_splits, part * picks // epoch_splits,
                     (part + 1) * picks // epoch_splits)


def equal_split(size: int, num_ranks: int, ratios: Optional[Sequence[float]] = None,
                batch_size: int = 1) -> List[int]:
    """Sync modes: samples per rank, equal (or by `ratios`) in whole batches of `batch_size`.

    The batches that do not divide evenly go one each to the ranks with the largest remainder
    (ties to the lowest rank): 101 batches over 3 ranks are 34/34/33, not 35/33/33. The short
    last batch of the epoch, if any, is the last rank's with data.
    """
    weights = list(ratios) if ratios else [1.0] * num_ranks
    batches = largest_remainder(-(-size // batch_size), weights)
    samples = [b * batch_size for b in batches]
    excess = sum(samples) - size
    if excess > 0:
        samples[max(i for i, b in enumerate(batches) if b > 0)] -= excess
    return samples


def window_samples(remaining: int, counts: Sequence[int], batch_size: int) -> List[int]:
    """Samples per rank for the next window of a progressive epoch.

    Each rank gets `counts[r]` batches while the epoch has more than one full window left;
    a smaller tail is apportioned by counts in whole batches, so ranks finish together and no
    rank is left with a lone single batch while the others idle.
    """
    full = [c * batch_size for c in counts]
    if remaining >= sum(full):
        return full
    tail_batches = -(-remaining // batch_size)
    batches = largest_remainder(tail_batches, counts)
    samples = [b * batch_size for b in batches]
    excess = sum(samples) - remaining  # the last batch of the epoch may be short
    if excess > 0:
        last = max(i for i, b in enumerate(batches) if b > 0)
        samples[last] -= excess
    return samples


def cut_step(slices: Sequence[SliceT], shares: Sequence[int]) -> List[List[SliceT]]:
    """nccl_sync: one global step's slices cut into consecutive pieces of `shares` samples
    (rank by rank, in rank order; an empty list for a share of 0)."""
    pieces: List[List[SliceT]] = []
    queue = [list(s) for s in slices]
    for share in shares:
        piece: List[SliceT] = []
        while share > 0 and queue:
            pass_index, offset, size = queue[0]
            n = min(share, size)
            piece.append((pass_index, offset, n))
            share -= n
            if n == size:
                queue.pop(0)
            else:
                queue[0] = [pass_index, offset + n, size - n]
        pieces.append(piece)
    return pieces


def split_trained(slices: Sequence[SliceT], batches: int,
                  batch_size: int) -> Tuple[List[SliceT], List[SliceT]]:
    """An order's slices split after its first `batches` batches: (trained, left). A rank cuts
    each slice into batches on its own (the last one may be short) and trains them in order."""
    trained: List[SliceT] = []
    left: List[SliceT] = []
    for pass_index, offset, size in slices:
        n = min(size, max(0, batches) * batch_size)
        batches -= slice_batches(size, batch_size)
        if n:
            trained.append((pass_index, offset, n))
        if n < size:
            left.append((pass_index, offset + n, size - n))
    return trained, left


def as_range(piece: SliceT) -> List[int]:
    """A slice (pass, offset, size) as the [pass, start, end] range a bundle's coverage holds."""
    pass_index, offset, size = piece
    return [pass_index, offset, offset + size]


def take(span_cursor: int, span: EpochSpan, size: int) -> Tuple[Optional[SliceT], int]:
    """Cut `size` samples at the cursor; returns the slice (None if empty) and the new cursor."""
    size = max(0, min(size, span.end - span_cursor))
    if size == 0:
        return None, span_cursor
    return (span.pass_index, span_cursor, size), span_cursor + size


def slice_batches(size: int, batch_size: int) -> int:
    return -(-size // batch_size)


class EpochPool:
    """The positions of one epoch not yet handed out, as (start, end) ranges of one pass.

    Work handed to a rank that died comes back with `give_back` and is handed out first, so
    nothing is skipped; `uncovered()` is what a mid-epoch checkpoint records.
    """

    def __init__(self, pass_index: int, ranges: Sequence[Tuple[int, int]]):
        self.pass_index = pass_index
        self.ranges: List[List[int]] = [[s, e] for s, e in ranges if e > s]

    @classmethod
    def whole(cls, span: EpochSpan) -> "EpochPool":
        return cls(span.pass_index, [(span.start, span.end)])

    @property
    def remaining(self) -> int:
        return sum(e - s for s, e in self.ranges)

    def take(self, size: int) -> List[SliceT]:
        """Up to `size` positions from the front, as slices (several if ranges are split)."""
        out: List[SliceT] = []
        while size > 0 and self.ranges:
            start, end = self.ranges[0]
            n = min(size, end - start)
            out.append((self.pass_index, start, n))
            size -= n
            if start + n >= end:
                self.ranges.pop(0)
            else:
                self.ranges[0][0] = start + n
        return out

    def give_back(self, slices: Sequence[SliceT]) -> None:
        """Return slices (of a dead rank) to the front of the pool."""
        self.ranges[:0] = [[off, off + n] for p, off, n in slices if p == self.pass_index and n > 0]

    def split(self, sizes: Sequence[int]) -> List["EpochPool"]:
        """Consecutive sub-pools of the given sizes (sync modes' per-rank partitions)."""
        return [EpochPool(self.pass_index, [(off, off + n) for _, off, n in self.take(size)])
                for size in sizes]

    def uncovered(self) -> List[List[int]]:
        return [[self.pass_index, s, e] for s, e in self.ranges]


@dataclass
class Course:
    """The epochs a run trains, from `start` on: each one's span, and its pool (the whole
    epoch, or of the resumed one what the bundle left `resumed_uncovered`)."""

    spans: List[EpochSpan]
    pools: List[EpochPool]
    start: int = 0
    resumed_uncovered: Optional[List[List[int]]] = None
    batches_before: Dict[int, int] = field(default_factory=dict)
    """A resumed epoch's batches the bundle holds (its progress counts on from them)."""

    def epochs(self) -> range:
        return range(self.start, len(self.spans))

    def left_before(self, epoch: int) -> List[List[int]]:
        """What a save before `epoch` began lacks of it: of the resumed epoch, what the bundle
        lacked; of any other, nothing (an empty list names the whole epoch)."""
        return list(self.resumed_uncovered or []) if epoch == self.start else []
