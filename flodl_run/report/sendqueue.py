"""What the MLflow tracker sends, off the training thread and kept through an outage.

Owns one sender thread and its queue of sends (a batch of metrics, the outcome tags, the end
status), sent in order. A send that fails (a locked store, a server gone, a full disk) stays
first in line and is tried again, less and less often, while the rest waits behind it: nothing
is skipped, and a later send never lands before an earlier one. The queue holds at most
MAX_BUFFERED items' worth of metrics; past that the oldest go, counted as lost. It knows nothing
of MLflow: the tracker hands it callables.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, Optional, Tuple

log = logging.getLogger(__name__)

MAX_BUFFERED = 200_000
"""Metrics kept while the store is out of reach (~200 B each: 40 MB at most); an outage of
hours at a reduce a second stays within it."""
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 15.0  # the wait between tries doubles up to this: a store back is seen within it


class SendQueue:
    """Sends in order from a daemon thread; a failed send is retried until it goes or the
    queue is closed. `lost()` says what never went (dropped for room, or left at close)."""

    def __init__(self, name: str, first_retry_s: float = FIRST_RETRY_S,
                 max_retry_s: float = MAX_RETRY_S, max_buffered: int = MAX_BUFFERED):
        self.name, self.first_retry_s, self.max_retry_s = name, first_retry_s, max_retry_s
        self.max_buffered = max_buffered
        self._items: Deque[Tuple[str, Callable[[], None], int]] = collections.deque()
        self._size = 0  # the buffered items' sizes (metrics), summed
        self._lost: Dict[str, int] = {}  # what -> sends that never went
        self._cond = threading.Condition()
        self._closed = False
        self._stopped = threading.Event()  # a retry waits on this, not on new sends
        self.failures = 0
        """Sends that failed (each retry counts): how a test sees an outage was met."""
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def put(self, what: str, send: Callable[[], None], size: int = 1) -> None:
        """Queue `send` (named `what` in warnings; `size` its metrics, for the bound)."""
        with self._cond:
            if self._closed:
                self._lost[what] = self._lost.get(what, 0) + 1
                return
            self._items.append((what, send, size))
            self._size += size
            while self._size > self.max_buffered and len(self._items) > 1:
                dropped, _, dropped_size = self._items.popleft()
                self._size -= dropped_size
                self._lost[dropped] = self._lost.get(dropped, 0) + 1
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued went (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop sending: what is still queued is lost (a send under way may still land)."""
        with self._cond:
            self._closed = True
            for what, _, _ in self._items:
                self._lost[what] = self._lost.get(what, 0) + 1
            self._items.clear()
            self._size = 0
            self._cond.notify_all()
        self._stopped.set()

    def lost(self) -> Dict[str, int]:
        """What never went, by name: how many sends of each."""
        with self._cond:
            return dict(self._lost)

    def _next(self) -> Optional[Tuple[str, Callable[[], None], int]]:
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            return self._items[0] if self._items else None

    def _done(self, item: Tuple[str, Callable[[], None], int]) -> None:
        with self._cond:
            if self._items and self._items[0] is item:  # not dropped or closed meanwhile
                self._items.popleft()
                self._size -= item[2]
            self._cond.notify_all()

    def _run(self) -> None:
        wait_s, since = self.first_retry_s, None
        while True:
            item = self._next()
            if item is None:
                return
            try:
                item[1]()
            except Exception as exc:  # the store locked or gone, the disk full, ...
                self.failures += 1
                if since is None:
                    since = time.monotonic()
                    first_line = (str(exc).splitlines() or [""])[0][:300]
                    log.warning("%s: %s failed (%s: %s); kept to send again, training goes on",
                                self.name, item[0], type(exc).__name__, first_line)
                self._stopped.wait(wait_s)
                wait_s = min(wait_s * 2, self.max_retry_s)
                continue
            if since is not None:
                log.warning("%s: sending again after %.0f s; nothing was skipped", self.name,
                            time.monotonic() - since)
                wait_s, since = self.first_retry_s, None
            self._done(item)
