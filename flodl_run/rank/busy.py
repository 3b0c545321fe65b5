"""How busy a rank's device was between two heartbeats, in percent: what the dashboard plots
beside the rank's share and the tracker logs over time (`utilization/rank<k>`).

A GPU rank reads its GPU's utilisation as NVML samples it (`torch.cuda.utilization`, the share
of the last sample period in which a kernel ran); a CPU rank divides the CPU time its process
used since the last reading by the wall time and its intra-op threads (100 = every thread it
was given busy). Never raises: a device that cannot say gives None.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class BusySampler:
    """`sample()` once per heartbeat: the device's busy share since the previous call."""

    def __init__(self, device: torch.device, threads: int):
        self.device, self.threads = device, max(1, threads)
        self._wall_s, self._cpu_s = time.monotonic(), time.process_time()

    def sample(self) -> Optional[float]:
        if self.device.type == "cuda":
            try:
                return float(torch.cuda.utilization(self.device))
            except Exception:  # no NVML here (or not an NVIDIA GPU): say nothing
                return None
        wall_s, cpu_s = time.monotonic(), time.process_time()
        spent_s, used_s = wall_s - self._wall_s, cpu_s - self._cpu_s
        self._wall_s, self._cpu_s = wall_s, cpu_s
        if spent_s <= 0:
            return None
        # CPU time of every thread (data loading, heartbeat too): capped at the rank's budget
        return min(100.0, 100.0 * used_s / (spent_s * self.threads))
