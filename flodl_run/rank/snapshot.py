"""The rank's part in a coordinator reduce (cpu_sync, cpu_cadence, cpu_async): send a snapshot
of the parameters, blend in the update that comes back.

Parameters travel through this rank's shared-memory slab when the launcher runs on this host,
else staged on the host as frames; float buffers always as a frame. Owns the slab, the staging
buffers and the mapping of the coordinator's slabs; the averaging is the coordinator's.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from flodl_run.averaging.central import blend_
from flodl_run.averaging.collective import all_finite
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.frames import HostStaging, as_frame, dtype_names, from_frames
from flodl_run.averaging.shm import Mapper, Slab
from flodl_run.contracts.wire import Channel, SnapshotTaken, Update


class SnapshotExchange:
    """Snapshots out, updates in, for one rank over its main channel."""

    def __init__(self, rank: int, flat: FlatParams, channel: Channel, shm_prefix: Optional[str]):
        self.rank, self.flat, self.channel = rank, flat, channel
        self._staging: Optional[HostStaging] = None  # frames path (no shared memory)
        self._shm_prefix = shm_prefix  # set by a launcher on this host
        self._slab: Optional[Slab] = None
        self._shm = Mapper(shm_prefix)

    def send(self, round_: int, steps: int) -> None:
        """SnapshotTaken for `round_`, `steps` batches since the last reduce, with a finite flag
        (one device-side check, read once per reduce)."""
        buffers = as_frame(self.flat.flat_float_buffers().cpu())  # a frame is host memory
        finite = bool(all_finite(self.flat))
        slab = self._snapshot_slab()
        if slab is not None:
            slab.write(self.flat.buffers)
            params = slab.tensors
            taken = SnapshotTaken(self.rank, round_, steps, dtype_names(params), slab.paths,
                                  [p.numel() for p in params], finite)
            self.channel.send(taken, [buffers])
        else:
            self._staging = self._staging or HostStaging(self.flat.buffers)
            params = self._staging.stage(self.flat.buffers)
            self.channel.send(SnapshotTaken(self.rank, round_, steps, dtype_names(params),
                                            finite=finite),
                              [as_frame(p) for p in params] + [buffers])

    def _snapshot_slab(self) -> Optional[Slab]:
        if self._slab is None and self._shm_prefix:
            self._slab = Slab.create(self._shm_prefix, f"rank{self.rank}", self.flat.buffers)
            if self._slab is None:
                self._shm_prefix = None  # no room: frames from now on
        return self._slab

    def apply_(self, update: Update, payloads: List[memoryview]) -> None:
        """Blend in the coordinator's parameters (1.0 = overwrite), overwrite float buffers."""
        if update.shm:
            count, params = 0, self._shm.tensors(update.shm, update.dtypes, update.numels)
        else:
            count = len(update.dtypes)
            params = from_frames(payloads[:count], update.dtypes)
        blend_(self.flat.buffers, params, update.blend)
        with torch.no_grad():
            if update.buffers:
                self.flat.load_float_buffers_(from_frames(payloads[count:], ["torch.float32"])[0])

    def close(self) -> None:
        """Remove this rank's slab (the run is over for it)."""
        if self._slab is not None:
            self._slab.unlink()
