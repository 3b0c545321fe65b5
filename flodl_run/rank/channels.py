"""The rank's two side channels to the coordinator, each a thread with its own socket (zmq
sockets are single-thread): the heartbeat, which also ships the timeline and notices a dead
launcher, and the listener, which receives AbortGroup while the main thread is stuck inside a
collective. The main channel (orders in, facts out) belongs to the control loop.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Tuple

import zmq

from flodl_run.contracts.wire import AbortGroup, Channel, Heartbeat, Listening, NodeSample, connect_dealer
from flodl_run.rank.env import RankEnv

HEARTBEAT_PERIOD_S = 1.0
LISTEN_POLL_MS = 200


class HeartbeatThread(threading.Thread):
    """Sends a Heartbeat every second on its own socket, carrying the rank's progress
    (`progress()`: batches finished, working on a Train order). Being a thread, it also notices
    a dead launcher while the main thread is busy in a step: then it removes the run's slabs and
    ends the process, so no orphan rank stays behind. `silence()` stops the beats (an injected
    hang) but not the orphan watch."""

    def __init__(self, ctx: zmq.Context, env: RankEnv, progress: Callable[[], Tuple[int, bool]],
                 on_beat: Callable[[Channel], None] = lambda channel: None,
                 busy: Callable[[], Optional[float]] = lambda: None,
                 node_sample: Callable[[], Optional[NodeSample]] = lambda: None):
        """`busy()`: the device's busy percent since the last beat (rank.busy), or None;
        `node_sample()`: the node's system metrics when this rank samples them and one is due
        (rank.nodesample), or None."""
        super().__init__(daemon=True, name=f"heartbeat-{env.rank}")
        self.ctx, self.env, self.progress, self.on_beat = ctx, env, progress, on_beat
        self.busy, self.node_sample = busy, node_sample
        self.stopped = threading.Event()
        self.silenced = threading.Event()

    def silence(self) -> None:
        self.silenced.set()

    def run(self) -> None:
        sock = connect_dealer(self.ctx, self.env.coord, self.env.secret, linger_ms=0)
        channel = Channel(sock, self.env.secret)
        self.on_beat(channel)
        while not self.stopped.wait(HEARTBEAT_PERIOD_S):
            if self.silenced.is_set():
                continue
            channel.send(Heartbeat(self.env.rank, *self.progress(), self.busy(),
                                   self.node_sample()))
            self.on_beat(channel)  # the timeline's clock pings, counters and shipment
        sock.close()


class ListenerThread(threading.Thread):
    """Receives the coordinator's notices on its own socket, so they land while the main thread
    is blocked inside a collective with a dead peer: AbortGroup aborts the group from here.
    `on_idle` runs every LISTEN_POLL_MS when nothing arrived."""

    def __init__(self, ctx: zmq.Context, env: RankEnv, on_abort: Callable[[AbortGroup], None],
                 on_idle: Callable[[], None]):
        super().__init__(daemon=True, name=f"listener-{env.rank}")
        self.ctx, self.env, self.on_abort, self.on_idle = ctx, env, on_abort, on_idle
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = connect_dealer(self.ctx, self.env.coord, self.env.secret, linger_ms=0)
        channel = Channel(sock, self.env.secret)
        channel.send(Listening(self.env.rank))
        while not self.stopped.is_set():
            received = channel.recv(timeout_ms=LISTEN_POLL_MS)
            if received is None:
                self.on_idle()
            elif isinstance(received.message, AbortGroup):
                self.on_abort(received.message)
        sock.close()
