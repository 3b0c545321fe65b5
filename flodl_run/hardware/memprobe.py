"""Measuring for the data plane's budgets: device memory, host RAM, free disk, and the
simulated device size a test or a diagnosis can impose.

Owns how each figure is read (torch's `mem_get_info`, /proc/meminfo, `shutil.disk_usage`) and
what a CPU rank calls device memory (host RAM). The arithmetic on the figures is `membudget`'s.
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping, Optional, Tuple

import torch

from flodl_run.hardware import membudget as mb

SIM_ENV = "FLODL_RUN_SIM_DEVICE_BYTES"
"""Test and diagnostic knob: pretend the device has this many bytes (`<SIM_ENV>_<rank>` for one
rank wins over the plain name). On a GPU it caps the real size (usage stays the real usage); on
a CPU rank it stands for a separate device that holds nothing but this rank's data."""


def sim_device_bytes(environ: Mapping[str, str], rank: int) -> Optional[int]:
    value = environ.get(f"{SIM_ENV}_{rank}") or environ.get(SIM_ENV)
    return int(float(value)) if value else None


def host_memory() -> Tuple[int, int]:
    """(MemTotal, MemAvailable) of this host in bytes."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if "kB" in line}
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")


def disk_free_bytes(directory: str) -> int:
    """Free bytes on the file system of `directory` (0 when it cannot be asked)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


class DeviceProbe:
    """Reads one device's memory; `own_bytes` is what the data plane itself holds there."""

    def __init__(self, device: torch.device, sim_bytes: Optional[int] = None,
                 gpu_ram_share: Optional[float] = None):
        self.device, self.sim_bytes, self.gpu_ram_share = device, sim_bytes, gpu_ram_share

    @property
    def is_simulated(self) -> bool:
        return self.sim_bytes is not None

    def memory(self, own_bytes: int = 0) -> mb.DeviceMemory:
        """Device memory now: measured (capped by the simulated size), a simulated CPU device
        holding only our `own_bytes`, or host RAM on a CPU rank."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            limit = self.split(total).device_total_bytes
            if self.sim_bytes is not None:
                limit = min(limit, self.sim_bytes)
            return mb.DeviceMemory(limit, max(0, limit - (total - free)))
        if self.sim_bytes is not None:
            return mb.DeviceMemory(self.sim_bytes, max(0, self.sim_bytes - own_bytes))
        total, available = host_memory()
        return mb.DeviceMemory(total, available)

    def split(self, reported_total: Optional[int] = None) -> mb.HostSplit:
        """The integrated-GPU split (device share of host RAM); nothing reserved elsewhere."""
        if self.device.type != "cuda":
            return mb.HostSplit(reported_total or 0, 0)
        if reported_total is None:
            reported_total = torch.cuda.mem_get_info(self.device)[1]
        props = torch.cuda.get_device_properties(self.device)
        return mb.integrated_split(reported_total, host_memory()[0],
                                   bool(getattr(props, "is_integrated", False)), self.gpu_ram_share)

    def ram_budget(self, ram_max_usage: float, local_world_size: int, sample_cache: bool,
                   own_bytes: int = 0) -> int:
        """This rank's host-RAM cache budget now."""
        _, available = host_memory()
        return mb.ram_budget(available, ram_max_usage, local_world_size, sample_cache, own_bytes,
                             self.split().reserved_host_bytes)
