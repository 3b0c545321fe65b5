"""Data delivery on one rank: the reproducible per-pass permutation and batch gathering.

Every rank reproduces the same permutation of a pass, so a plan is just an
(offset, size) slice of it. This module does not decide who trains which slice (dispatch does).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data.dataloader import default_collate


def permutation(num_samples: int, seed: int, pass_index: int) -> torch.Tensor:
    """The shuffle of data pass `pass_index`: `randperm(N)` seeded with `seed + pass_index`."""
    gen = torch.Generator().manual_seed(seed + pass_index)
    return torch.randperm(num_samples, generator=gen)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor of a batch (a tensor, or tuples/lists/dicts of them), the
    structure kept; anything else passes through."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch (tensor, or tuples/lists/dicts of them) to `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class BatchSource:
    """Gathers batches of a map-style dataset by sample index, onto one device.

    TensorDatasets are indexed as whole tensors (one gather per batch); any other dataset goes
    through `__getitem__` and torch's default collate.
    """

    def __init__(self, dataset: Dataset, device: torch.device):
        self.dataset = dataset
        self.device = device
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) else None

    def __len__(self) -> int:
        return len(self.dataset)

    def gather(self, indices: torch.Tensor) -> Any:
        if self._tensors is not None:
            batch = tuple(t[indices] for t in self._tensors)
        else:
            batch = default_collate([self.dataset[int(i)] for i in indices])
        return to_device(batch, self.device)

    def batches(self, indices: torch.Tensor, batch_size: int) -> Iterator[Any]:
        """Consecutive batches over `indices` (the last one may be short)."""
        for start in range(0, len(indices), batch_size):
            yield self.gather(indices[start:start + batch_size])


def num_batches(num_samples: int, batch_size: int) -> int:
    return -(-num_samples // batch_size)


def batch_sizes(indices: Sequence[int] | torch.Tensor, batch_size: int) -> list[int]:
    n = len(indices)
    return [min(batch_size, n - s) for s in range(0, n, batch_size)]
