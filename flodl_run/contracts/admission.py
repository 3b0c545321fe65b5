"""A cap on the connections to the coordinator that have sent nothing yet.

Owns one thread per control socket that follows the socket's monitor events (zmq's documented
socket monitor: ACCEPTED and DISCONNECTED carry the connection's descriptor) and, while more
than `max_pending` accepted connections have sent no authentic message, shuts the oldest of
them down, if their peer has sent nothing at all. libzmq has no such option: without it, ~1,100
idle connections without the secret held ~1,100 of the launcher's descriptors for their
handshake deadline, and the run failed on its next file. A connection whose peer has sent
anything (a greeting: its handshake is under way or done) is left to the handshake's deadline
and gate: a rank's connection is idle between its handshake and its first message (while the
rank builds its model), and one shut down once its handshake is done loses what libzmq had
taken from the rank's queue to send on it. It does not own the handshake itself (`wire`'s
gate) nor what a message says.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
from collections import OrderedDict
from typing import Dict, List, Optional

import zmq

log = logging.getLogger(__name__)

MAX_PENDING = 64
"""Connections at once that may be accepted and not yet have sent an authentic message: a rank
opens three or four and each passes in milliseconds; a flood gets no more of the launcher's
descriptors than this (and those libzmq accepts before this thread sees them)."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_POLL_MS = 100  # how soon `stop` is noticed
_BATCH = 4096  # events at most between two looks at the stop flag and the cap
_EVENT_HEAD = struct.Struct("=HI")  # zmq's monitor event frame: event id, value (the fd)
_BYTES_RECEIVED = struct.Struct("=Q")  # struct tcp_info's tcpi_bytes_received (Linux 4.1 on)
_BYTES_RECEIVED_AT = 128


class PendingCap:
    """Watch `sock` (a bound ROUTER) from a thread of its own; `admitted(fd)` (from the thread
    that reads `sock`) marks a connection whose message was authentic, which is never shut
    down, nor is one whose peer has sent any byte. Start once; stop before the socket's
    context terminates.

    A descriptor is only ever shut down through a duplicate of it whose inode is the one seen
    when it was accepted: libzmq closes its descriptors on its own thread, and the number may
    meanwhile name another file. Shutting a socket down (not closing it) lets libzmq see the
    end and close its own descriptor."""

    def __init__(self, sock: zmq.Socket, max_pending: int = MAX_PENDING):
        address = f"inproc://pending-cap-{id(self)}"
        sock.monitor(address, _EVENTS)
        self._monitor = sock.context.socket(zmq.PAIR)
        self._monitor.rcvhwm = 0  # no event dropped however fast connections come
        self._monitor.connect(address)
        self.max_pending = max_pending
        self._pending: "OrderedDict[int, int]" = OrderedDict()  # fd -> inode, oldest first
        self._unverified: Dict[int, int] = {}  # inodes read after the last drain of events
        self._accepted: List[int] = []
        self._admitted: Dict[int, int] = {}  # fd -> inode of the connection that spoke there
        self._admitting = threading.Lock()  # an admission and a shutdown of its fd never cross
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pending-cap", daemon=True)
        self.shut_down = 0
        """Connections shut down for the cap (a flood, or a peer that never spoke in time)."""
        self.most_pending = 0
        """The most connections seen pending at once."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def admitted(self, fd: Optional[int]) -> None:
        """The connection on `fd` delivered an authentic message (thread-safe). Noted with the
        inode of the socket `fd` names now: this runs as the message is read, while the events
        this thread applies lag behind, and a DISCONNECTED still queued for an earlier
        connection with the same number must not undo it (under a flood, that left a rank's
        idle main channel pending: the cap shut it down, and the order sent meanwhile was lost)."""
        if fd is not None and fd >= 0:
            inode = _socket_inode(fd)
            if inode is not None:
                with self._admitting:
                    self._admitted[fd] = inode

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                # inodes read but not yet checked: drain now, events or none, to settle them
                ready = self._monitor.poll(0 if self._unverified else _POLL_MS)
                if (ready or self._unverified) and not self._take_events():
                    break
                self._settle()
        finally:
            self._monitor.close(linger=0)

    def _take_events(self) -> bool:
        """Apply the queued events; False once the monitor stopped (the socket closed).

        libzmq says DISCONNECTED before it closes a descriptor, so an inode read before a drain
        that emptied the queue belongs to a connection still open unless the drain brought its
        DISCONNECTED: only then do those inodes join the pending (a number closed and reused
        meanwhile would name another file). The ones of connections accepted meanwhile are
        read now and wait for the next such drain."""
        emptied = False
        for _ in range(_BATCH):
            try:
                head = self._monitor.recv(zmq.NOBLOCK)
                self._monitor.recv()  # the endpoint: always the one bound
            except zmq.Again:
                emptied = True
                break
            kind, fd = _EVENT_HEAD.unpack_from(head)
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return False
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted.append(fd)
            else:
                self._forget(fd)
        if emptied:
            self._pending.update(self._unverified)
            self._unverified = {}
        for fd in self._accepted:
            inode = _socket_inode(fd)
            if inode is not None:
                self._unverified[fd] = inode
        self._accepted = []
        return True

    def _forget(self, fd: int) -> None:
        """The connection on `fd` is closed (its number may come back for another)."""
        self._pending.pop(fd, None)
        self._unverified.pop(fd, None)
        if fd in self._accepted:
            self._accepted.remove(fd)

    def _settle(self) -> None:
        """Shut down the oldest connections that have not spoken while too many are pending. A
        pending connection has spoken when its own inode was noted for its number: an admission
        left by a closed connection does not cover the next one to get the number. One whose
        peer has sent bytes leaves the pending for good (a rank's, between its handshake and
        its first message: shutting it down could lose that message)."""
        for fd in [fd for fd, inode in self._pending.items() if self._admitted.get(fd) == inode]:
            del self._pending[fd]
        self.most_pending = max(self.most_pending, len(self._pending) + len(self._unverified))
        while len(self._pending) > self.max_pending:
            fd, inode = self._pending.popitem(last=False)
            with self._admitting:  # it may have spoken since the look above: a flood takes a while
                if self._admitted.get(fd) == inode:
                    continue
                if not _shut_down_if_silent(fd, inode):
                    continue
            if not self.shut_down:
                log.warning("control plane: more than %d connections have sent nothing; closing "
                            "the oldest (a connection flood?)", self.max_pending)
            self.shut_down += 1


def _socket_inode(fd: int) -> Optional[int]:
    """The inode of the socket `fd` names now, or None (closed, or not a socket any more)."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_ino if stat.S_ISSOCK(info.st_mode) else None


def _shut_down_if_silent(fd: int, inode: int) -> bool:
    """Shut down the socket `fd` names if it is still the one with `inode` and its peer has sent
    nothing; whether it did (not when the peer has sent bytes, or the number names another file
    now, or none)."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile, or no descriptor left for the copy: next time
        return False
    try:
        if os.fstat(copy).st_ino != inode:
            return False
        sock = socket.socket(fileno=copy)
        copy = -1  # the socket object owns it now
        try:
            if _has_received(sock):
                return False
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
        return True
    except OSError:
        return False
    finally:
        if copy >= 0:
            os.close(copy)


def _has_received(sock: socket.socket) -> bool:
    """Whether the TCP peer of `sock` has sent any byte; False where the kernel does not say
    (not TCP, or a kernel before 4.1): such connections are capped as before."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, AttributeError):
        return False
    if len(info) < _BYTES_RECEIVED_AT + _BYTES_RECEIVED.size:
        return False
    return _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0] > 0
