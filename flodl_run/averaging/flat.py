"""Flat parameter storage: a model's parameters become views into one buffer per dtype.

One contiguous buffer lets a reduce be a few large collectives (not one per tensor) and the
pre-reduce scratch copy one memcpy. Owns the flattening, the buffer rule (float buffers ride
the reduce, integer buffers stay local) and the divergence arithmetic; not the reduce itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

# Each parameter's view starts on a 16-byte boundary, as a fresh allocation would: fused and
# compiled kernels load 16 bytes at a time and fault on a view that starts between two (CUDA's
# "misaligned address"). The gaps hold zeros, which every reduce and outer step keeps at zero.
ALIGN_BYTES = 16


def aligned_offsets(numels: List[int], dtype: torch.dtype) -> Tuple[List[int], int]:
    """Where each of `numels` starts in a flat buffer of `dtype` with aligned views, and the
    buffer's length (a multiple of the alignment, so a following buffer stays aligned too)."""
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    offsets, offset = [], 0
    for n in numels:
        offsets.append(offset)
        offset += -(-n // step) * step
    return offsets, offset


def pack_aligned(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One zero-gapped flat buffer holding `tensors` (one dtype and device) at aligned offsets,
    and a view of it shaped like each tensor; the caller re-homes its tensors onto the views."""
    offsets, total = aligned_offsets([t.numel() for t in tensors], tensors[0].dtype)
    flat = torch.zeros(total, dtype=tensors[0].dtype, device=tensors[0].device)
    views = []
    for t, offset in zip(tensors, offsets):
        view = flat[offset:offset + t.numel()]
        view.copy_(t.detach().reshape(-1))
        views.append(view.view_as(t))
    return flat, views


class FlatParams:
    """The parameters of `model`, re-homed as views into flat per-dtype buffers.

    Must be built after the model is on its device and before anything caches parameter
    storage; the optimizer keeps working because the Parameter objects stay the same.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = OrderedDict()
        for p in model.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers: List[torch.Tensor] = []
        for params in by_dtype.values():
            flat, views = pack_aligned(params)
            for p, view in zip(params, views):
                p.data = view
            self.buffers.append(flat)
        self.float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.num_params = sum(p.numel() for params in by_dtype.values() for p in params)

    @property
    def numel(self) -> int:
        """Elements of the flat buffers, the gaps included (what a reduce or a snapshot moves)."""
        return sum(b.numel() for b in self.buffers)

    def clone(self) -> List[torch.Tensor]:
        return [b.clone() for b in self.buffers]

    def copy_(self, source: List[torch.Tensor]) -> None:
        for dst, src in zip(self.buffers, source):
            dst.copy_(src)

    def flat_float_buffers(self) -> torch.Tensor:
        """The float buffers (BatchNorm running stats) as one new flat tensor (may be empty)."""
        if not self.float_buffers:
            return torch.empty(0)
        return torch.cat([b.detach().reshape(-1).float() for b in self.float_buffers])

    def load_float_buffers_(self, flat: torch.Tensor) -> None:
        offset = 0
        for b in self.float_buffers:
            n = b.numel()
            b.copy_(flat[offset:offset + n].view_as(b))
            offset += n


# Elements per pass, which bounds the temporary of a difference: on a GPU the whole buffer (two
# kernels per tensor; the norm is a tree reduction, accurate to ~1e-6 in float32), on the CPU 4 M
# elements (16 MB of float32 the allocator reuses instead of mapping fresh pages each time).
_CPU_BLOCK = 1 << 22


@torch.no_grad()
def _sum_squares(tensors: List[torch.Tensor], minus: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """sum ||t (- minus)||^2 as a float64 scalar on the tensors' device, computed there (nothing
    is read back to the host); blocks are summed in float64."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for i, t in enumerate(tensors):
        flat = t.reshape(-1)
        other = None if minus is None else minus[i].reshape(-1)
        block = flat.numel() if flat.device.type == "cuda" else _CPU_BLOCK
        for start in range(0, flat.numel(), block):
            piece = flat[start:start + block].float()
            if other is not None:
                piece = piece - other[start:start + block].float()
            total += torch.linalg.vector_norm(piece).double().square()
    return total


def relative_distance(before: List[torch.Tensor], after: List[torch.Tensor],
                      after_norm_sq: Optional[float] = None) -> float:
    """||before - after|| / ||after|| over all buffers (global L2, float64 accumulation);
    0 when ||after|| ~ 0. Pass `after_norm_sq` to reuse ||after||^2 across several `before`.
    Reads one pair of numbers from the device."""
    diff_sq = _sum_squares(before, minus=after)
    norm_sq = _sum_squares(after) if after_norm_sq is None else after_norm_sq
    if isinstance(norm_sq, torch.Tensor):
        diff, norm = torch.stack([diff_sq, norm_sq]).tolist()
    else:
        diff, norm = float(diff_sq), norm_sq
    return ratio(diff, norm)


def ratio(diff_sq: float, norm_sq: float) -> float:
    """sqrt(diff_sq / norm_sq), 0 when the norm is ~0 (the divergence of one rank)."""
    return 0.0 if norm_sq <= 1e-24 else (diff_sq / norm_sq) ** 0.5


@torch.no_grad()
def divergence_parts(before: List[torch.Tensor], after: List[torch.Tensor],
                     start: Optional[List[torch.Tensor]]) -> torch.Tensor:
    """On the device, as one float64 vector (read it once): ||before - after||^2, ||after||^2,
    and, given the window's `start`, <u, v>, ||u||^2 and ||v||^2 for this rank's window update
    u = before - start and the consensus's v = after - start (see `alignment`). Each block's
    differences are formed once and every sum is taken from them."""
    device = after[0].device
    sums = torch.zeros(5 if start is not None else 2, dtype=torch.float64, device=device)
    for i, (b, a) in enumerate(zip(before, after)):
        b, a = b.reshape(-1), a.reshape(-1)
        s0 = None if start is None else start[i].reshape(-1)
        block = b.numel() if b.device.type == "cuda" else _CPU_BLOCK
        for lo in range(0, b.numel(), block):
            pb, pa = b[lo:lo + block].float(), a[lo:lo + block].float()
            terms = [torch.linalg.vector_norm(pb - pa).square(), torch.linalg.vector_norm(pa).square()]
            if s0 is not None:
                ps = s0[lo:lo + block].float()
                u, v = pb - ps, pa - ps
                terms += [(u * v).sum(), torch.linalg.vector_norm(u).square(),
                          torch.linalg.vector_norm(v).square()]
            sums += torch.stack(terms).double()
    return sums


@torch.no_grad()
def divergence_table(befores: List[List[torch.Tensor]], after: List[torch.Tensor],
                     start: Optional[List[torch.Tensor]]) -> List[List[float]]:
    """`divergence_parts` of several ranks' `befores` against one consensus, as a row of floats
    per rank; CPU tensors (the coordinator backend runs it every round). ||after||^2 and the
    consensus's update v = after - start are computed once; the differences go into scratch
    buffers reused across ranks and blocks (fresh 16 MB temporaries cost more in page faults
    than the arithmetic)."""
    width = 5 if start is not None else 2
    rows = [[0.0] * width for _ in befores]
    norm_sq = v_sq = 0.0
    largest = max((t.numel() for t in after), default=1)
    scratch = [torch.empty(min(_CPU_BLOCK, max(largest, 1))) for _ in range(3)]
    for i, a in enumerate(after):
        a = a.reshape(-1)
        for lo in range(0, a.numel(), _CPU_BLOCK):
            piece = a[lo:lo + _CPU_BLOCK].float()
            n = piece.numel()
            u, v, d = (buf[:n] for buf in scratch)
            norm_sq += float(torch.dot(piece, piece))
            if start is not None:
                torch.sub(piece, start[i].reshape(-1)[lo:lo + n].float(), out=v)
                v_sq += float(torch.dot(v, v))
            for k, before in enumerate(befores):
                b = before[i].reshape(-1)[lo:lo + n].float()
                torch.sub(b, piece, out=d)
                rows[k][0] += float(torch.dot(d, d))
                if start is not None:
                    torch.sub(b, start[i].reshape(-1)[lo:lo + n].float(), out=u)
                    rows[k][2] += float(torch.dot(u, v))
                    rows[k][3] += float(torch.dot(u, u))
    for row in rows:
        row[1] = norm_sq
        if start is not None:
            row[4] = v_sq
    return rows


def alignment(dot: float, u_sq: float, v_sq: float) -> Tuple[Optional[float], Optional[float]]:
    """The divergence's two parts for one rank: the cosine between its window update and the
    consensus's, and the ratio of their lengths. With them, ||u - v|| = ||v|| x
    sqrt(m^2 + 1 - 2 m cos): m > 1 with cos ~ 1 is a rank that ran further the same way (more
    steps, a larger LR); cos well below 1 is a rank pulling elsewhere. None when either update
    is ~0 (nothing to compare)."""
    if u_sq <= 1e-24 or v_sq <= 1e-24:
        return None, None
    return dot / (u_sq * v_sq) ** 0.5, (u_sq / v_sq) ** 0.5


def squared_norm(tensors: List[torch.Tensor]) -> float:
    return float(_sum_squares(tensors))
