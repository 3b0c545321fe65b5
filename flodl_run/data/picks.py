"""Picks: positions of a data pass, the keys of the delivery transform, and the transform call.

A pass is a permutation of the pick space `N * augment`: the pick at a position
trains sample `pick % N` as its repeat `pick // N`, in the epoch whose slice of the pass holds
the position. A `PickKey` names one pick for `transform(rows, pick_keys)`, so a re-run or a
resumed epoch sees the same augmentation. Who trains which positions is dispatch's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from flodl_run.data.passes import permutation

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class PickKey:
    """One pick of a sample: the identity a deterministic transform is a function of."""

    sample: int
    """Index of the sample in the train set."""
    repeat: int
    """Which of the sample's `augment` copies in this pass: pick // num_samples."""
    epoch: int
    """The run's epoch (0 .. num_epochs x epoch_splits - 1) whose slice holds the pick."""
    seed: int
    """The run's seed."""

    def seed_value(self) -> int:
        """A 63-bit integer fixed by the four fields, e.g. for `torch.Generator().manual_seed`.
        splitmix64 rounds over the fields, so nearby keys give unrelated seeds."""
        h = 0x9E3779B97F4A7C15
        for part in (self.sample, self.repeat, self.epoch, self.seed):
            h = (h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
            h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        return h >> 1


Transform = Callable[[Any, List[PickKey]], Any]
"""transform(rows, pick_keys) -> rows: the batch as train_step gets it (on the device), one
key per row, in row order. It must depend on nothing but its arguments."""


@dataclass(frozen=True)
class Work:
    """One planned batch: `indices` are the samples at positions [start, start + len) of pass
    `pass_index`. `pass_index` None: positions unknown (no keys)."""

    indices: torch.Tensor
    pass_index: Optional[int] = None
    start: int = 0


def epoch_of(position: torch.Tensor | int, pass_index: int, picks_per_pass: int,
             epoch_splits: int) -> torch.Tensor | int:
    """The epoch of a pass position: part j covers [floor(j P / s), floor((j+1) P / s)), so the
    part of p is the largest j with j P < (p + 1) s (dispatch.epoch_span's cut, inverted)."""
    part = ((position + 1) * epoch_splits - 1) // picks_per_pass
    if isinstance(part, torch.Tensor):
        part = part.clamp(max=epoch_splits - 1)
    else:
        part = min(part, epoch_splits - 1)
    return pass_index * epoch_splits + part


class PickSpace:
    """The pick space of a run: reproduces a pass's permutation and names its picks."""

    def __init__(self, num_samples: int, augment: int, epoch_splits: int, seed: int):
        self.num_samples, self.augment = num_samples, augment
        self.epoch_splits, self.seed = epoch_splits, seed
        self._perms: Dict[int, torch.Tensor] = {}

    @property
    def picks_per_pass(self) -> int:
        return self.num_samples * self.augment

    def picks(self, pass_index: int, start: int, count: int) -> torch.Tensor:
        if pass_index not in self._perms:  # keep two passes: cpu_async may straddle a boundary
            self._perms = {k: v for k, v in self._perms.items() if k == pass_index - 1}
            self._perms[pass_index] = permutation(self.picks_per_pass, self.seed, pass_index)
        return self._perms[pass_index][start:start + count]

    def epoch_span(self, epoch: int) -> Tuple[int, int, int]:
        """(pass_index, start, end) of epoch `epoch` (the same cut as dispatch.epoch_span)."""
        part, n = epoch % self.epoch_splits, self.picks_per_pass
        splits = self.epoch_splits
        return epoch // splits, part * n // splits, (part + 1) * n // splits

    def keys(self, work: Work) -> List[PickKey]:
        """The PickKey of every row of `work`; checks that the rows are the pass's picks."""
        picks = self.picks(work.pass_index, work.start, len(work.indices))
        samples = picks % self.num_samples
        if not torch.equal(samples, work.indices.to(samples.dtype)):
            raise ValueError(f"batch at pass {work.pass_index} position {work.start} is not the "
                             "pass's permutation: cannot key the transform")
        positions = torch.arange(work.start, work.start + len(picks))
        epochs = epoch_of(positions, work.pass_index, self.picks_per_pass, self.epoch_splits)
        return [PickKey(s, r, e, self.seed) for s, r, e in
                zip(samples.tolist(), (picks // self.num_samples).tolist(), epochs.tolist())]

    def epoch_works(self, epoch: int, indices: torch.Tensor, batch_size: int) -> Iterator[Work]:
        """Batches of an epoch's samples (solo): consecutive positions of its span."""
        pass_index, start, _ = self.epoch_span(epoch)
        for offset in range(0, len(indices), batch_size):
            yield Work(indices[offset:offset + batch_size], pass_index, start + offset)


def slice_works(slices: Sequence[Sequence[int]], batches: Sequence[torch.Tensor],
                batch_size: int) -> Optional[List[Work]]:
    """Works of a Train order: each (pass, offset, size) slice cut into batch_size batches,
    as the rank cuts it. None when `batches` does not match that cut."""
    works: List[Work] = []
    for pass_index, offset, size in slices:
        for start in range(0, size, batch_size):
            if len(works) >= len(batches):
                return None
            rows = batches[len(works)]
            if len(rows) != min(batch_size, size - start):
                return None
            works.append(Work(rows, pass_index, offset + start))
    return works if len(works) == len(batches) else None


class JobPlan:
    """Reads a rank's queue of Train orders as Works: the batch being trained and the ones
    after it. Jobs are read by duck typing (`.order.slices`, `.batches`, `.done`), so a queue
    that changed shape gives no plan rather than wrong positions."""

    def __init__(self, batch_size: int, horizon: int):
        self.batch_size, self.horizon = batch_size, horizon
        self._cache: Dict[int, Tuple[Any, Optional[List[Work]]]] = {}

    def works(self, indices: torch.Tensor, jobs: Optional[Sequence[Any]]) -> List[Work]:
        """[the Work of `indices`, then up to `horizon` Works after it]; [Work(indices)] when
        `indices` is not the head job's next batch."""
        current: Optional[Work] = None
        ahead: List[Work] = []
        live: Dict[int, Tuple[Any, Optional[List[Work]]]] = {}
        for job in list(jobs or ()):
            works = self._works_of(job)
            live[id(job)] = (job, works)
            if works is None:
                break
            if current is None:
                done = getattr(job, "done", 0)
                if done >= len(works) or works[done].indices is not indices:
                    break
                current, ahead = works[done], works[done + 1:]
            else:
                ahead += works
            if len(ahead) >= self.horizon:
                break
        self._cache = live  # only jobs still queued stay cached
        return [current, *ahead[:self.horizon]] if current is not None else [Work(indices)]

    def _works_of(self, job: Any) -> Optional[List[Work]]:
        cached = self._cache.get(id(job))
        if cached is not None and cached[0] is job:
            return cached[1]
        try:
            return slice_works(job.order.slices, job.batches, self.batch_size)
        except (AttributeError, TypeError, ValueError):
            return None


def apply_transform(transform: Transform, rows: Any, keys: List[PickKey]) -> Any:
    """Run the user's transform; it must hand back a batch of the same number of rows."""
    out = transform(rows, keys)
    first = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(first, torch.Tensor) and first.dim() > 0 and len(first) != len(keys):
        raise ValueError(f"data.transform returned {len(first)} rows for {len(keys)} picks")
    return out
