"""The control plane against peers that are not ours: a second process without the secret
(knowing at most the handshake password, as one that watched the wire would), sending forged,
oversized, replayed, stripped or reflected frames to a real coordinator socket."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import zmq
import zmq.utils.monitor

from flodl_run.config.schema import Mode
from flodl_run.contracts.admission import MAX_PENDING, PendingCap
from flodl_run.contracts.wire import (
    _ZAP_USER,
    Channel,
    Heartbeat,
    RankJoined,
    SnapshotTaken,
    Train,
    _zap_password,
    bind_router,
    connect_dealer,
    frame_limit,
    new_secret,
)
from flodl_run.launch.rankproc import host_store
from flodl_run.launch.supervisor import _param_bytes
from tests.support import make

# A peer without the secret: it sends the byte frames it is given, as they are.
_PEER = """
import json, sys, zmq
address, password, messages = json.loads(sys.stdin.read())
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 3000)
if password:
    sock.plain_username, sock.plain_password = b"flodl_run", password.encode()
    # send only once the handshake is decided: on a loaded machine it can outlast the linger
    done = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    monitor = sock.get_monitor_socket(done)
sock.connect(address)
if password:
    monitor.poll(30000)
for frames in messages:
    # a refused handshake tears the pipe down, and a DEALER without a pipe would block on send
    # forever: what cannot be queued is not sent, which is the point
    try:
        sock.send_multipart([bytes.fromhex(f) for f in frames], flags=zmq.NOBLOCK)
    except zmq.Again:
        break
# what is queued reaches the wire only while the context lives, and at exit pyzmq leaves it
# unterminated: a process preempted before its I/O thread wrote the frames lost them. destroy
# closes the sockets (the monitor too) and waits for the queued frames, up to the linger.
zmq.Context.instance().destroy()
"""


class _Capture:
    """Stands in for a socket to record the frames a Channel would send (what a peer that
    watched the wire would have)."""

    def __init__(self, kind: int):
        self.type, self.sent = kind, []

    def send_multipart(self, frames, copy=True):
        self.sent.append([bytes(f).hex() for f in frames])


def _peer(address: str, messages, password: str = "") -> None:
    subprocess.run([sys.executable, "-c", _PEER], input=json.dumps([address, password, messages]),
                   text=True, check=True, timeout=60)


def _coordinator_socket(secret: bytes, limit: int = -1, **options):
    sock, address, gate = bind_router(zmq.Context(), "127.0.0.1", 0, limit, secret, **options)
    return sock, address, Channel(sock, secret, admitted=gate.cap.admitted), gate


@pytest.mark.e2e
def test_a_peer_without_the_secret_never_gets_past_the_handshake():
    """Pins 'nothing is read from a stranger': a peer without the handshake password (or with
    a wrong one) is refused at the handshake, so not even a frame of it is received (neither
    served nor counted as rejected); a rank with the secret gets through."""
    secret = new_secret()
    sock, address, coordinator, gate = _coordinator_socket(secret)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    forged = _Capture(zmq.DEALER)
    Channel(forged, new_secret()).send(Heartbeat(0))
    # No password (the wrong mechanism): zmq drops it at the handshake, with or without an
    # event depending on timing, so what pins it is that none of its frames is ever received
    # (rejected stays 0 below; the peer's process has ended, its 3 s linger spent).
    _peer(address, forged.sent)
    _peer(address, forged.sent, _zap_password(new_secret()))  # another run's password
    assert monitor.poll(20_000), "the wrong password was not refused at the handshake"
    assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    rank = connect_dealer(zmq.Context.instance(), address, secret)
    Channel(rank, secret).send(Heartbeat(1))
    assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(1)
    assert coordinator.rejected == 0
    rank.close(linger=0)
    sock.disable_monitor()
    sock.close()
    gate.stop()


def test_a_connection_that_does_not_pass_the_handshake_in_time_is_closed():
    """Pins a connection flood: idle TCP connections without the secret stayed open
    until, at about 1,100, they used up the launcher's file descriptors (ulimit -n 1024) and
    the run failed. Each must now pass the handshake within its deadline or be closed (here
    300 ms); a rank connecting afterwards still gets through."""
    import socket

    secret = new_secret()
    sock, address, coordinator, gate = _coordinator_socket(secret, handshake_ms=300)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(8)]
    try:
        for conn in idle:
            conn.settimeout(30)  # a bound on a failure, not a synchronization
            closed = False
            while not closed:  # the coordinator's greeting, then its close
                try:
                    closed = conn.recv(1 << 16) == b""
                except ConnectionResetError:
                    closed = True
        rank = connect_dealer(zmq.Context.instance(), address, secret)
        Channel(rank, secret).send(Heartbeat(1))
        assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(1)
        rank.close(linger=0)
    finally:
        for conn in idle:
            conn.close()
        sock.close()
        gate.stop()


def _await_closed(conns, count: int) -> list:
    """Indices of `conns` the far side closed, read until `count` of them are (30 s bound)."""
    closed, deadline = set(), time.monotonic() + 30
    while len(closed) < count and time.monotonic() < deadline:
        readable, _, _ = select.select([c for i, c in enumerate(conns) if i not in closed], [], [], 1)
        for conn in readable:
            try:
                if conn.recv(1 << 16):
                    continue  # the greeting
            except ConnectionResetError:
                pass
            closed.add(conns.index(conn))
    return sorted(closed)


def _flood(address: str, count: int) -> list:
    """`count` idle TCP connections to `address`, 50 at a time, each accepted before the next
    (never past the listener's backlog)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    idle: list = []
    for _ in range(count // 50):
        group = [socket.create_connection((host, int(port))) for _ in range(50)]
        for conn in group:
            conn.settimeout(30)  # a bound on a failure, not a synchronization
            with contextlib.suppress(ConnectionResetError):
                conn.recv(1)  # the greeting's first byte (or the end): it was accepted
        idle += group
    return idle


def test_past_the_cap_the_oldest_connections_still_in_their_handshake_are_closed():
    """Pins the cap on connections still in their handshake (libzmq has none: before it, every
    idle connection held a launcher descriptor until its deadline, ~1,100 of them all it had).
    200 idle connections: the oldest 200 - MAX_PENDING are shut down at once, in the order
    they came, the newest MAX_PENDING wait for their deadline; a rank connected before them
    (it spoke) keeps its connection, and one connecting after them still gets through."""
    secret = new_secret()  # a deadline past the test's bound: only the cap closes connections
    sock, address, coordinator, gate = _coordinator_socket(secret, handshake_ms=120_000)
    early = connect_dealer(zmq.Context.instance(), address, secret)
    Channel(early, secret).send(Heartbeat(0))
    assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(0)
    idle: list = []
    try:
        idle = _flood(address, 200)
        assert _await_closed(idle, 200 - MAX_PENDING) == list(range(200 - MAX_PENDING))
        late = connect_dealer(zmq.Context.instance(), address, secret)
        for rank, dealer in ((0, early), (1, late)):
            Channel(dealer, secret).send(Heartbeat(rank, batches=1))
            assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(rank, batches=1)
            dealer.close(linger=0)
        # and no more, but for one when the late rank's own handshake was seen pending before
        # its heartbeat was read: it was the 65th then, and the oldest idle one made room
        assert gate.cap.shut_down in (200 - MAX_PENDING, 200 - MAX_PENDING + 1)
    finally:
        for conn in idle:
            conn.close()
        sock.close()
        gate.stop()


def test_a_rank_connection_silent_after_its_handshake_is_never_shut_down_by_the_cap():
    """Pins the flood test's hangs: a rank's connection that had passed its handshake but not
    yet sent its first message (a rank builds its model meanwhile) was capped as a flood's idle
    connection and shut down. libzmq reconnects, but what it had taken from the rank's queue
    for the old connection is lost: a RankJoined (the run never started) or the other way, a
    Train order. Here a rank's connection passes its handshake and stays silent while 200 idle
    connections come: the cap shuts down only idle ones, the rank's connection never drops, and
    its first message, sent after the flood, is read."""
    secret = new_secret()  # a deadline past the test's bound: only the cap closes connections
    sock, address, coordinator, gate = _coordinator_socket(secret, handshake_ms=120_000)
    rank = zmq.Context.instance().socket(zmq.DEALER)  # connect_dealer's, watched from the start
    rank.plain_username, rank.plain_password = _ZAP_USER.encode(), _zap_password(secret).encode()
    monitor = rank.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    rank.connect(address)
    idle: list = []
    try:
        assert monitor.poll(20_000), "the rank's handshake did not pass"
        assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        idle = _flood(address, 200)
        assert _await_closed(idle, 200 - MAX_PENDING) == list(range(200 - MAX_PENDING))
        Channel(rank, secret).send(Heartbeat(0, batches=1))
        assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(0, batches=1)
        assert not monitor.poll(0), "the rank's connection was shut down and came back"
        assert gate.cap.shut_down == 200 - MAX_PENDING
    finally:
        for conn in idle:
            conn.close()
        rank.disable_monitor()
        rank.close(linger=0)
        sock.close()
        gate.stop()


@pytest.fixture
def idle_cap():
    """A PendingCap with max_pending=1 whose thread is not started (the test makes its calls),
    and `connections(n)`: n connected socket pairs (ours, theirs), closed at the end."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    cap = PendingCap(router, max_pending=1)
    pairs: list = []

    def connections(n: int) -> list:
        pairs.extend(socket.socketpair() for _ in range(n))
        return pairs[-n:]

    yield cap, connections
    for ours, theirs in pairs:
        ours.close()
        theirs.close()
    cap._monitor.close(linger=0)
    router.close(linger=0)
    ctx.term()


def _accepted(cap: PendingCap, *conns: socket.socket) -> None:
    """What the cap's thread notes for connections whose ACCEPTED it applied: pending, by inode."""
    for conn in conns:
        cap._pending[conn.fileno()] = os.fstat(conn.fileno()).st_ino


def _still_connected(ours: socket.socket, theirs: socket.socket) -> bool:
    ours.sendall(b"x")
    theirs.settimeout(5)  # a bound on a failure, not a synchronization
    return theirs.recv(1) == b"x"


def test_a_stale_disconnect_of_an_earlier_connection_does_not_undo_a_ranks_admission(idle_cap):
    """Pins the cap's bookkeeping against its own lag: a rank's message is read (and its
    connection admitted) as it arrives, while the monitor's events are applied later. Under a
    flood, a rank's new connection took the number of a flood connection just shut down, spoke,
    and then that old connection's DISCONNECTED, still queued, erased the admission: the rank's
    connection could become the oldest pending one and be shut down. Here the same order of
    calls on real sockets: the rank's connection survives the cap, the oldest flood connection
    is shut down."""
    cap, connections = idle_cap
    (rank, rank_peer), (oldest, oldest_peer), (newest, _) = connections(3)
    cap.admitted(rank.fileno())  # the rank's hello, read at once
    cap._forget(rank.fileno())  # a DISCONNECTED queued for the number's previous connection
    _accepted(cap, rank, oldest, newest)  # then the ACCEPTED events, the rank's first
    cap._settle()
    assert _still_connected(rank, rank_peer)
    oldest_peer.settimeout(5)
    assert oldest_peer.recv(1) == b""  # shut down
    assert cap.shut_down == 1 and list(cap._pending) == [newest.fileno()]


def test_a_rank_that_speaks_while_the_cap_shuts_a_flood_down_is_spared(idle_cap, monkeypatch):
    """Pins the second half of that race: the cap looks at which pending connections spoke, then
    shuts the oldest down one by one, which takes milliseconds for a flood's hundreds. A rank
    whose message was read and noted meanwhile is spared: each shutdown looks again, under the
    lock the admission takes (a debug log of the flood test's runs showed a connection shut
    down 4.6 ms after it was admitted)."""
    from flodl_run.contracts import admission

    cap, connections = idle_cap
    (first, _), (rank, rank_peer), (second, _), (newest, _) = connections(4)
    real_shut_down = admission._shut_down_if_silent

    def shut_down_while_the_rank_speaks(fd, inode):
        if fd == first.fileno():  # meanwhile the pump thread read the rank's hello and noted it
            cap._admitted[rank.fileno()] = os.fstat(rank.fileno()).st_ino
        return real_shut_down(fd, inode)

    monkeypatch.setattr(admission, "_shut_down_if_silent", shut_down_while_the_rank_speaks)
    _accepted(cap, first, rank, second, newest)
    cap._settle()
    assert _still_connected(rank, rank_peer)
    assert cap.shut_down == 2 and list(cap._pending) == [newest.fileno()]


@pytest.mark.e2e
def test_replayed_stripped_and_reflected_frames_are_rejected():
    """Pins freshness, frame-count binding and direction: a RankJoined replayed from another
    socket, a SnapshotTaken stripped of its tensor frames (tag kept whole, or cut to the header
    tag), and a Train reflected back to the coordinator are all dropped; the genuine messages
    around them arrive once, in order. The sending process never sees the secret."""
    secret = new_secret()
    sock, address, coordinator, gate = _coordinator_socket(secret)
    rank, ours = _Capture(zmq.DEALER), _Capture(zmq.ROUTER)
    from_rank = Channel(rank, secret)
    from_rank.send(RankJoined(0, 1, 1, "h", "cpu", "cpu", 10))
    from_rank.send(SnapshotTaken(0, 1, 4, ["torch.float32"]), [b"\0" * 16, b"\0" * 8])
    from_rank.send(Heartbeat(0))
    Channel(ours, secret).send(Train(1, 0, [(0, 0, 8)], 1), identity=b"x")
    joined, snapshot, beat = rank.sent
    stripped = [snapshot[0], snapshot[-1]]
    cut = [snapshot[0], snapshot[-1][:64]]  # only the 32-byte header tag (hex)
    reflected = ours.sent[0][1:]  # without the ROUTER's identity frame
    _peer(address, [joined, joined, stripped, cut, reflected, beat], _zap_password(secret))
    got = [coordinator.recv(timeout_ms=20_000).message for _ in range(2)]
    assert [type(m).__name__ for m in got] == ["RankJoined", "Heartbeat"]
    assert coordinator.recv(timeout_ms=0) is None
    assert coordinator.rejected == 4 and coordinator.malformed == 0
    sock.close()
    gate.stop()


@pytest.mark.e2e
def test_an_authentic_but_malformed_message_is_dropped_with_a_warning(caplog):
    """Pins 'malformed never crashes the coordinator': a SnapshotTaken whose frames do not fit
    its dtypes (correctly signed, so only a bug of ours could send it) is dropped and named in a
    warning; the next message is served."""
    secret = new_secret()
    sock, address, coordinator, gate = _coordinator_socket(secret)
    rank = _Capture(zmq.DEALER)
    channel = Channel(rank, secret)
    channel.send(SnapshotTaken(0, 1, 4, ["torch.float32", "torch.float64"]), [b"\0" * 8])
    channel.send(Heartbeat(0))
    _peer(address, rank.sent, _zap_password(secret))
    assert coordinator.recv(timeout_ms=20_000).message == Heartbeat(0)
    assert coordinator.malformed == 1 and coordinator.rejected == 0
    assert "SnapshotTaken with 1 tensor frames (its fields call for 3)" in caplog.text
    sock.close()
    gate.stop()


@pytest.mark.e2e
def test_an_oversized_frame_is_refused_before_it_is_buffered():
    """Pins the bound on memory: the coordinator's socket has a frame limit sized from the
    model (never below what control messages need), and a peer without the secret that sends
    a larger frame is disconnected by zmq, so the frame never reaches the MAC check (without
    the limit it would be received whole, then counted as rejected)."""
    assert frame_limit(None) == -1 and frame_limit(10) == 4 << 20
    assert frame_limit(100 << 20) == (100 << 20) + (1 << 20)
    secret = new_secret()
    sock, address, coordinator, gate = _coordinator_socket(secret, limit=frame_limit(1000))
    assert sock.getsockopt(zmq.MAXMSGSIZE) == 4 << 20
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    _peer(address, [[(b"\1" * (5 << 20)).hex(), "00" * 32]], _zap_password(secret))
    assert monitor.poll(20_000), "the oversized peer was never disconnected"
    assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert coordinator.recv(timeout_ms=0) is None and coordinator.rejected == 0
    sock.disable_monitor()
    sock.close()
    gate.stop()


def _listeners(port: int, field: int = 1) -> set:
    """Local addresses (hex, as the kernel lists them) of TCP sockets listening on `port`, or
    their inodes (`field` 9)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(local.rsplit(":", 1)[0] if field == 1 else row.split()[field])
    return found


def _open_files(pid: int) -> dict:
    """What each descriptor of process `pid` names (`socket:[inode]` for a socket)."""
    names = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            names[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor)
            pass
    return names


def test_the_rendezvous_store_listens_on_master_addr_only():
    """Pins the store's exposure: hosted for a single-host run at master_addr=127.0.0.1, it
    listens on loopback only (torch's own listener would take every interface, unauthenticated),
    and ranks still reach it."""
    import datetime

    import torch.distributed as dist

    store = host_store("127.0.0.1", 0)
    try:
        assert _listeners(store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
        clients = [dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                 timeout=datetime.timedelta(seconds=30)) for _ in range(2)]
        clients[0].set("k", "v")
        assert clients[1].get("k") == b"v"
    finally:
        store.close()
    assert not os.path.exists(f"/proc/{store.pid}")  # closed with the ranks, nothing left


def test_the_rendezvous_store_is_another_process_with_only_its_own_descriptors():
    """Pins where the store's connections land: in a child of the launcher, never among the
    launcher's descriptors (1,000 idle connections to torch's store, which takes any number,
    used to leave the launcher none for its own files), and that child holds none of the
    launcher's files (a copy would keep a log, pipe or port of the run open past its end)."""
    import datetime

    import torch.distributed as dist

    mine = tempfile.TemporaryFile()
    store = host_store("127.0.0.1", 0)
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=datetime.timedelta(seconds=30))
        client.set("k", "v")  # it serves
        listener = {f"socket:[{inode}]" for inode in _listeners(store.port, field=9)}
        theirs, ours = set(_open_files(store.pid).values()), _open_files(os.getpid())
        assert store.pid != os.getpid() and listener and listener <= theirs
        assert not listener & set(ours.values()) and ours[mine.fileno()] not in theirs
    finally:
        store.close()
        mine.close()


def test_the_rendezvous_store_runs_none_of_the_launchers_signal_handlers(monkeypatch):
    """Pins the store child's signals: it is forked from the launcher, and Slurm signals every
    process of a sweep job's step, so a Python handler it kept (submitit's preemption handler)
    ran there and requeued the job at once, before the launcher saved. The child catches none
    of them; the scheduler's stop signal is ignored, as in a rank (its default would end the
    store under the ranks)."""
    monkeypatch.setenv("FLODL_RUN_STOP_SIGNAL", "USR2")
    ours = (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM)
    kept = {sig: signal.signal(sig, lambda *_: None) for sig in ours}
    try:
        store = host_store("127.0.0.1", 0)
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    try:
        with open(f"/proc/{store.pid}/status") as status:
            masks = dict(line.split(":", 1) for line in status if line.startswith("Sig"))
    finally:
        store.close()
    bits = {name: int(masks[name], 16) for name in ("SigCgt", "SigIgn")}
    assert not bits["SigCgt"] & sum(1 << (sig - 1) for sig in (*ours, signal.SIGINT))
    assert bits["SigIgn"] & 1 << (signal.SIGUSR2 - 1)


def test_the_frame_limit_is_sized_from_the_model():
    """Pins where the coordinator's frame limit comes from: the recipe's model built on the
    meta device (digits_mlp: 26,122 float32 parameters, no buffers); collective modes send the
    coordinator no tensors, so only control messages count there."""
    config = make()
    assert _param_bytes(Mode.cpu_sync, config.recipe, config.data.transform) == 26_122 * 4
    assert _param_bytes(Mode.nccl_sync, config.recipe, config.data.transform) == 0


def test_every_message_type_has_a_direction():
    """Pins the direction lists against the schema: a message type added to the wire but to
    neither FACTS nor ORDERS would lose the check that keeps it to one direction."""
    import typing

    from flodl_run.contracts.wire import FACTS, ORDERS, AnyMessage

    assert set(typing.get_args(AnyMessage)) == set(FACTS) | set(ORDERS)
    assert not set(FACTS) & set(ORDERS)
