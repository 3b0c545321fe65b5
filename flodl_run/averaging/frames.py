"""Tensors as raw frames for the control transport: no pickle, no per-tensor messages.

A model's state travels as one frame per flat parameter buffer (one per dtype) plus one frame
of float buffers. Senders reuse host staging buffers (pinned for CUDA, so the device-to-host
copy is asynchronous and cheap); receivers wrap the frames with `torch.frombuffer` (no copy).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def dtype_names(tensors: Sequence[torch.Tensor]) -> List[str]:
    return [str(t.dtype) for t in tensors]


def as_frame(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (works for bf16, which numpy lacks)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def from_frames(frames: Sequence[memoryview], dtypes: Sequence[str]) -> List[torch.Tensor]:
    """Wrap received frames as 1-D tensors (sharing the frames' memory)."""
    out = []
    for frame, name in zip(frames, dtypes):
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype on the wire: {name}")
        dtype = _DTYPES[name]
        out.append(torch.empty(0, dtype=dtype) if len(frame) == 0 else
                   torch.frombuffer(frame, dtype=dtype))
    return out


class HostStaging:
    """Reused host buffers mirroring a list of device tensors (pinned when the source is CUDA)."""

    def __init__(self, like: Sequence[torch.Tensor]):
        pin = bool(like) and like[0].is_cuda
        self.buffers = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=pin) for t in like]

    def stage(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Copy `tensors` into the staging buffers (waits for the copies to finish)."""
        for dst, src in zip(self.buffers, tensors):
            dst.copy_(src.reshape(-1), non_blocking=True)
        if tensors and tensors[0].is_cuda:
            torch.cuda.current_stream(tensors[0].device).synchronize()
        return self.buffers


def split_frames(frames: Sequence[memoryview], count: int) -> Tuple[List[memoryview], List[memoryview]]:
    return list(frames[:count]), list(frames[count:])
