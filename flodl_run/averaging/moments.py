"""The inner optimizer's per-parameter float state (AdamW's exp_avg and exp_avg_sq, SGD's
momentum buffer) as flat buffers, so a reduce can average it like the parameters.

Owns which state entries count (floating tensors shaped like their parameter; never the scalar
`step` counters, which stay each rank's own), their re-homing as views into one buffer per
dtype (the optimizer keeps stepping them in place), and the layout fingerprint ranks compare
before reducing them together. Not the reduce itself (see `averaging.collective`).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from flodl_run.averaging.flat import pack_aligned

_COUNTERS = ("step",)
"""State keys never averaged: counters (AdamW's bias correction) stay each rank's own."""

_Entry = Tuple[int, Dict[str, Any], str, torch.Tensor]  # (parameter index, its state, key, tensor)


def _members(optimizer: Any) -> List[Any]:
    """The torch optimizers behind `optimizer` (one, or the members of Optimizers)."""
    return list(getattr(optimizer, "members", [optimizer]))


class FlatMoments:
    """The optimizer state of `model`'s parameters that rides the reduce, re-homed into flat
    per-dtype buffers.

    The optimizer creates its state lazily and replaces it on load_state_dict or a clear, so
    `bind()` is called before each reduce: it re-homes whatever is new and returns the buffers.
    Ranks reduce these buffers together only when their `fingerprint()` agrees (a rank whose
    state was cleared, or that never stepped a parameter, holds a different layout)."""

    def __init__(self, model: nn.Module, optimizer: Any):
        self.params = list(model.parameters())
        self.optimizer = optimizer
        self.buffers: List[torch.Tensor] = []
        self._bound: List[_Entry] = []
        self._fingerprint = 0

    def entries(self) -> List[_Entry]:
        """The state tensors that ride, in parameter order, then by optimizer and key."""
        found: List[_Entry] = []
        for i, p in enumerate(self.params):
            for member in _members(self.optimizer):
                state = member.state.get(p)
                if not state:
                    continue
                for key in sorted(state):
                    value = state[key]
                    if (key not in _COUNTERS and isinstance(value, torch.Tensor)
                            and value.is_floating_point() and value.shape == p.shape):
                        found.append((i, state, key, value))
        return found

    def bind(self) -> List[torch.Tensor]:
        """The flat buffers now backing the state (re-homed if the optimizer made new
        tensors since the last call); empty while the optimizer holds no state."""
        entries = self.entries()
        if len(entries) == len(self._bound) and all(
                e[3] is b[3] for e, b in zip(entries, self._bound)):
            return self.buffers
        self.buffers, self._bound = _rehome(entries)
        self._fingerprint = _layout_crc(entries)
        return self.buffers

    def fingerprint(self) -> int:
        """A crc32 of the bound layout (which parameter, key, dtype and shape); 0 when empty.
        Two ranks with the same fingerprint hold buffers of the same sizes and meaning."""
        return self._fingerprint if self._bound else 0

    def clone(self) -> List[torch.Tensor]:
        return [b.clone() for b in self.buffers]

    def copy_(self, source: Sequence[torch.Tensor]) -> None:
        for dst, src in zip(self.buffers, source):
            dst.copy_(src)


def _rehome(entries: List[_Entry]) -> Tuple[List[torch.Tensor], List[_Entry]]:
    """One flat buffer per dtype holding `entries`' values; each state entry becomes a view.
    Returns the buffers and the entries (in their order) now holding the views."""
    by_dtype: Dict[torch.dtype, List[int]] = OrderedDict()
    for k, entry in enumerate(entries):
        by_dtype.setdefault(entry[3].dtype, []).append(k)
    buffers: List[torch.Tensor] = []
    bound: List[_Entry] = list(entries)
    for picks in by_dtype.values():
        flat, views = pack_aligned([entries[k][3] for k in picks])
        for k, view in zip(picks, views):
            i, state, key, _ = entries[k]
            state[key] = view
            bound[k] = (i, state, key, view)
        buffers.append(flat)
    return buffers, bound


def _layout_crc(entries: List[_Entry]) -> int:
    """crc32 of (parameter index, key, dtype, shape) per entry; never 0 (0 means no state)."""
    parts = [f"{i}:{key}:{value.dtype}:{tuple(value.shape)}" for i, _, key, value in entries]
    return zlib.crc32(";".join(parts).encode()) or 1
