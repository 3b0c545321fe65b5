"""Shared-memory slabs: the coordinator backend's parameter path between co-located processes.

On one host, a snapshot or an update does not need to cross a socket: the sender writes its
flat parameters into a file under /dev/shm that both sides map (MAP_SHARED), and the control
message names the files. This saves the socket copies and the payload MAC of the frame path
(the round trip's floor is one memcpy of the bytes that move).

Owns a run's private directory for slabs (0700, an unguessable name that carries the launcher's
pid, so a later run sweeps what a killed launcher left), creating a slab (space reserved up
front with posix_fallocate, so a full /dev/shm is a clean fallback to frames, never a SIGBUS
mid-write; a failed creation is warned about once and not retried), mapping someone else's slab
by path (paths must lie in the run's directory), and removing a run's files (a failure there is
a warning, never a failed run). When to use a slab is the caller's call; who may read a slab
when follows from the protocol (a slab is rewritten only after every reader has used the
previous contents).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import secrets
import shutil
from typing import Dict, List, Optional, Sequence, Set

import torch

from flodl_run.contracts.checkpoint import pid_alive
from flodl_run.contracts.rankenv import SHM_PREFIX_ENV

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX_ENV = SHM_PREFIX_ENV
"""Set by the launcher for ranks on its own host: where this run's slabs live (the rank
environment's contract names it)."""
KILL_SWITCH_ENV = "FLODL_RUN_SHM"
"""`off`: never use shared memory (every snapshot and update travels as frames)."""


_RUN_DIR = re.compile(r"flodl_run-(\d+)-[0-9a-f]{32}")
_failed: Set[str] = set()  # prefixes where a slab could not be made: frames, without asking again


def run_prefix(root: str = SHM_DIR) -> Optional[str]:
    """A fresh private directory for one run's slabs (path ending in a separator), or None when
    shared memory is off or unavailable. Sweeps the directories of dead launchers first."""
    if os.environ.get(KILL_SWITCH_ENV, "").lower() == "off" or not os.path.isdir(root):
        return None
    sweep_stale(root)
    path = os.path.join(root, f"flodl_run-{os.getpid()}-{secrets.token_hex(16)}")
    try:
        os.mkdir(path, 0o700)  # only this user may list or create files in it
    except OSError as exc:
        log.warning("shared memory unavailable (%s); parameters travel as frames", exc)
        return None
    return path + os.sep


def sweep_stale(root: str = SHM_DIR) -> None:
    """Remove this user's run directories whose launcher is gone (killed before it could)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        match = _RUN_DIR.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False) or pid_alive(int(match[1])):
            continue
        if entry.stat(follow_symlinks=False).st_uid == os.getuid():
            remove_run(entry.path + os.sep)


def remove_run(prefix: Optional[str]) -> None:
    """Delete every slab of a run, and its directory (the launcher at the end, a rank whose
    launcher died, a later run's sweep). What cannot be removed is a warning, not an error."""
    if not prefix:
        return
    for path in glob.glob(glob.escape(prefix) + "*"):
        _unlink(path)
    if prefix.endswith(os.sep):
        shutil.rmtree(prefix, onerror=lambda _f, path, exc: log.warning(
            "could not remove %s: %s", path, exc[1]))


class Slab:
    """Flat tensors (one per dtype group) backed by /dev/shm files this process created."""

    def __init__(self, paths: List[str], tensors: List[torch.Tensor]):
        self.paths, self.tensors = paths, tensors

    @classmethod
    def create(cls, prefix: str, name: str, like: Sequence[torch.Tensor]) -> Optional["Slab"]:
        """Files `<prefix><name>.<i>` sized like `like`; None when /dev/shm has no room or
        refuses, so the caller keeps using frames. Warned once: after a failure under `prefix`
        this process does not try that prefix again."""
        if prefix in _failed:
            return None
        paths: List[str] = []
        try:
            for i, t in enumerate(like):
                path = f"{prefix}{name}.{i}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                paths.append(path)
                try:
                    if t.numel():
                        os.posix_fallocate(fd, 0, t.numel() * t.element_size())
                finally:
                    os.close(fd)
            tensors = [_map(p, t.numel(), t.dtype) for p, t in zip(paths, like)]
        except OSError as exc:
            for path in paths:
                _unlink(path)
            log.warning("shared memory unavailable (%s); parameters travel as frames", exc)
            _failed.add(prefix)
            return None
        return cls(paths, tensors)

    def write(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy `tensors` (any device) into the slab; returns when the bytes are there."""
        for dst, src in zip(self.tensors, tensors):
            dst.copy_(src.reshape(-1))

    def unlink(self) -> None:
        for path in self.paths:
            _unlink(path)


class Mapper:
    """Maps other processes' slabs on demand and keeps the mappings (a slab is reused)."""

    def __init__(self, prefix: Optional[str]):
        self.prefix = prefix
        self._maps: Dict[str, torch.Tensor] = {}

    def tensors(self, paths: Sequence[str], dtypes: Sequence[str],
                numels: Sequence[int]) -> List[torch.Tensor]:
        """The slab's tensors; refuses a path outside this run's prefix (the message naming it
        is authenticated, the check keeps a bug from mapping an arbitrary file)."""
        out = []
        for path, dtype, numel in zip(paths, dtypes, numels):
            if not self.prefix or not path.startswith(self.prefix) or os.sep in path[len(self.prefix):]:
                raise ValueError(f"shared-memory path outside this run: {path}")
            mapped = self._maps.get(path)
            if mapped is None or mapped.numel() != numel or str(mapped.dtype) != dtype:
                mapped = self._maps[path] = _map(path, numel, _dtype(dtype))
            out.append(mapped)
        return out


def _map(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unsupported dtype in shared memory: {name}")
    return dtype


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # e.g. a file someone else put there: cleanup must not fail a run
        log.warning("could not remove %s: %s", path, exc)
