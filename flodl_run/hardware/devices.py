"""What accelerators this host exposes, read through NVML without creating a CUDA context.

Owns GPU discovery (count, names, memory, UUIDs) and the CUDA_VISIBLE_DEVICES rules; the
launcher uses it to decide the topology. Never imports torch.cuda.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class GpuInfo:
    index: int
    """NVML index (PCI bus order)."""
    uuid: str
    name: str
    memory_bytes: int

    @property
    def label(self) -> str:
        short = self.name.replace("NVIDIA ", "")
        return f"{short} ({self.memory_bytes / 2**30:.0f} GB)"  # GiB, as vendors label cards


def _nvml_gpus() -> List[GpuInfo]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: a host without NVIDIA GPUs
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(GpuInfo(i, _text(uuid), _text(name), int(memory)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def select_visible(gpus: List[GpuInfo], visible: Optional[str]) -> List[GpuInfo]:
    """Apply CUDA_VISIBLE_DEVICES as CUDA does: indices or UUID prefixes, stop at the first bad entry.

    Indices are read in PCI bus order (the launcher sets CUDA_DEVICE_ORDER=PCI_BUS_ID for ranks).
    """
    if visible is None:
        return list(gpus)
    chosen: List[GpuInfo] = []
    for token in (t.strip() for t in visible.split(",")):
        match = None
        if token.isdigit() and int(token) < len(gpus):
            match = gpus[int(token)]
        elif token.startswith(("GPU-", "MIG-")):
            hits = [g for g in gpus if g.uuid.startswith(token)]
            match = hits[0] if len(hits) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def visible_gpus() -> List[GpuInfo]:
    """GPUs this process may use, honouring CUDA_VISIBLE_DEVICES."""
    return select_visible(_nvml_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def hardware_line(gpus: List[GpuInfo], ranks: int) -> str:
    """One line saying what the run trains on, e.g.
    `ddp: 2 GPUs (heterogeneous) | H200 (141 GB) | A100 (80 GB)`."""
    if not gpus:
        return f"ddp: {ranks} CPU rank{'s' if ranks != 1 else ''}" if ranks > 1 else "ddp: in-process | cpu"
    if len(gpus) == 1:
        return f"ddp: in-process | {gpus[0].label}"
    kinds = {(g.name, g.memory_bytes) for g in gpus}
    shape = "heterogeneous" if len(kinds) > 1 else "homogeneous"
    return f"ddp: {len(gpus)} GPUs ({shape}) | " + " | ".join(g.label for g in gpus)


def pick_gpus(tokens: List[str]) -> List[GpuInfo]:
    """The visible GPUs named by `tokens` (indices in visible order, or UUID prefixes), in order;
    a GPU may be named twice (ranks sharing a device). Raises LookupError naming a missing one."""
    gpus = visible_gpus()
    picked = []
    for token in tokens:
        found = select_visible(gpus, str(token))
        if not found:
            names = ", ".join(f"{g.index}:{g.uuid}" for g in gpus) or "none"
            raise LookupError(f"no visible GPU {token!r} (visible: {names})")
        picked.append(found[0])
    return picked


GPU_SIZED_PARAMS = 10_000_000
"""Parameters above which a model is GPU-sized: byte_lm's 25.5 M trains for tens of minutes an
epoch on CPU ranks, digits_mlp's 0.03 M in a second."""


def cpu_training_warning(module: str, num_params: int) -> Optional[str]:
    """The warning a GPU-sized model gets when it is about to train on CPUs; None when small.
    Said by whoever built the model (rank 0, or the in-process run), never by the launcher:
    building it there would run the recipe's build_model in the launcher."""
    if num_params < GPU_SIZED_PARAMS:
        return None
    return (f"{module} builds a {num_params / 1e6:.1f} M-parameter model and trains it on CPU: "
            "expect long epochs (a progress line every 30 s shows the epoch's ETA); a GPU or "
            "smaller recipe.params train faster")
