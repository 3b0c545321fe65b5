"""The rank's share of a checkpoint bundle: write it on SaveCheckpoint, load it on resume, and
swap in parameters the coordinator sent along (the EASGD center) for a save or an eval.

Which files form the bundle, and when, is the coordinator's (its meta names them); this module
only writes and reads this rank's files, all tensors on the CPU so a bundle loads anywhere.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.frames import from_frames
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.contracts import checkpoint
from flodl_run.contracts.wire import SaveCheckpoint
from flodl_run.rank.replica import Replica


@contextlib.contextmanager
def swapped_in(flat: FlatParams, payloads: List[memoryview], dtypes: List[str]) -> Iterator[None]:
    """Temporarily swap in parameters sent along (the EASGD center), then restore ours."""
    if not dtypes:
        yield
        return
    saved = flat.clone()
    with torch.no_grad():
        for local, remote in zip(flat.buffers, from_frames(payloads, dtypes)):
            local.copy_(remote)
    try:
        yield
    finally:
        flat.copy_(saved)


def write_share(order: SaveCheckpoint, payloads: List[memoryview], rank: int, replica: Replica,
                flat: FlatParams, outer: OuterOptimizer,
                collective: bool) -> Tuple[str, Dict[str, str], bool]:
    """Model (or the center sent along) and optimizer; the outer state in collective modes.
    `order.stem` is the new generation's: the files become the bundle only when the
    coordinator's meta names them. Non-finite weights are refused, never written. Returns the
    error ("" when none: a full disk must not kill the rank, the coordinator decides), the
    checksum of each file written, by name, and whether the error is the disk's (OSError)."""
    writer = checkpoint.BundleWriter(order.stem)
    try:
        optim = to_cpu(replica.optimizer.state_dict())
        writer.write_optimizer(optim, rank)
        if order.write_model:
            with swapped_in(flat, payloads, order.dtypes):  # on CPU the state shares storage
                writer.write_model(to_cpu(replica.module.state_dict()))
            writer.write_optimizer(optim)
            if collective and outer.active and outer.prev is not None:
                writer.write_outer(to_cpu(outer.state_dict()))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", writer.files, isinstance(exc, OSError)
    return "", writer.files, False


def resume(stem: str, rank: int, replica: Replica, outer: OuterOptimizer, collective: bool,
           device: torch.device) -> None:
    """Load a bundle's model, optimizer and (collective) outer state before training (the
    launcher verified the files against the meta's checksums)."""
    meta = checkpoint.read_meta(stem)
    files = checkpoint.bundle_files(stem, meta)
    replica.module.load_state_dict(checkpoint.load_tensors(files["model"]))
    optim = checkpoint.rank_optim_file(stem, meta, rank)
    replica.optimizer.load_state_dict(checkpoint.load_tensors(optim))
    if collective and outer.active and files["outer"].is_file():
        state = checkpoint.load_tensors(files["outer"])
        outer.load_state_dict({k: [t.to(device) for t in v] for k, v in state.items()
                               if v is not None})


def to_cpu(state: Any) -> Any:
    """A state dict with every tensor on the CPU (bundles load anywhere)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state
