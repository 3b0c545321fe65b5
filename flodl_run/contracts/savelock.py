"""The lock a run holds on what it writes (a save_path, its run or sweep directory): one file,
flocked from the run's start to its end and naming the run. No torch here: the CLI takes the run
directory's lock before it imports anything heavy."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class SavePathTaken(Exception):
    """Another live run writes this save_path; the message names it (pid, run dir)."""


class SaveLock:
    """The save_path's writer: `.S.lock` beside the bundle, held (fcntl, exclusive) from the
    run's start to its end, naming the run that holds it. Two runs on one save_path used to
    break each other's bundles: one's prune deleted the other's temp files, metas named files
    that were gone, generations went backwards. The kernel drops the lock with its process, so
    a run killed by SIGKILL leaves no stale lock; the file goes with the release."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, stem: str | Path, run_dir: str | Path) -> "SaveLock":
        """Hold the lock for `stem` or raise SavePathTaken naming its holder."""
        path = Path(stem).with_name(f".{Path(stem).name}.lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                raise SavePathTaken(f"is being written by another run "
                                    f"({holder or 'unknown holder'})") from None
            if _same_file(fd, path):  # not a file its holder unlinked as we opened it: ours now
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, run dir {run_dir}".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Remove the file while holding it, then let go (a run that opened it meanwhile sees
        another file at the path, and starts over)."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
