"""Control-plane wire format: typed, versioned messages over ZeroMQ, authenticated per run.

Owns the message schema (msgspec structs: past tense from ranks, imperatives from the
coordinator), the handshake a rank passes before the coordinator reads anything from it, the
frame layout `[header, *tensor frames, mac]` and its checks. Tensors travel as
raw buffers, never pickled. Each direction has its own key derived from the run secret, so an
order reflected back to the coordinator fails. The header (version, sender id, sequence number,
message) and the number and lengths of the frames are authenticated with HMAC-SHA256, tensor
frames with Poly1305 under a one-time key; a receiver takes each sender's numbers only rising
(no replay) and drops an authentic message whose frames do not fit its type, with a warning.
Who sends what, when, is the caller's business.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from dataclasses import dataclass
from hashlib import sha256
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import msgspec
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305
from zmq.auth.thread import ThreadAuthenticator

from flodl_run.contracts.admission import PendingCap

PROTOCOL_VERSION = 2  # 2: per-direction keys, sender id and sequence number in the header
_VERSION_BYTE = bytes([PROTOCOL_VERSION])


class Message(msgspec.Struct, tag_field="type", tag=True, frozen=True):
    """Base of every control-plane message."""


# ---- rank -> coordinator: facts, past tense -------------------------------------------------


class NodeFacts(msgspec.Struct, frozen=True):
    """The static facts of the node a rank runs on, for system metrics once per node."""

    name: str
    """The worker's `host` from the cluster config, else the node's host name."""
    cpu_count: int
    ram_bytes: Optional[int]
    gpus: List[Tuple[int, str, str, int]] = []
    """GPUs the rank sees through NVML: (index, uuid, name, memory_bytes)."""

class RankJoined(Message):
    rank: int
    world_size: int
    pid: int
    host: str
    device: str
    device_name: str
    num_samples: int
    """Length of the rank's train set: every rank must see the same data."""
    node: Optional[NodeFacts] = None
    reduce_ms: Optional[float] = None
    """Wall of one all-reduce of the flat parameters, timed before training (collective modes)."""


class NodeSample(msgspec.Struct, frozen=True):
    """One reading of MLflow's system-metrics collectors on a node the launcher does not run on."""

    node: str
    """The node's name as its ranks report it (NodeFacts.name)."""
    metrics: Dict[str, float]
    """MLflow's own names (`cpu_utilization_percentage`, `gpu_0_utilization_percentage`, ...)."""


class Heartbeat(Message):
    rank: int
    batches: int = 0
    """Batches this rank has finished so far (its progress: a hung rank's count stands still)."""
    training: bool = False
    """The rank is working through a Train order (not idle, not in a reduce, eval or save)."""
    busy_percent: Optional[float] = None
    """How busy the rank's device was since its last beat, in percent (rank.busy); None when
    not sampled (tracking.system_metrics off) or the device cannot say."""
    node_sample: Optional[NodeSample] = None
    """The system metrics of the rank's node, when this rank samples them and one is due
    (rank.nodesample); None on every other beat, and on every rank of the launcher's node."""


class WindowDone(Message):
    """A rank finished the batches of a Train order (or ran out of data: `quiesced`)."""

    rank: int
    window: int
    epoch: int
    batches: int
    samples: int
    wall_ms: float
    """Compute time of the window, callbacks excluded."""
    fill_ms: float
    """Excess of the window's first batch over the rank's mean batch (cadence/async)."""
    loss_sum: float
    lr: float
    scalars: Dict[str, List[float]] = {}
    """User scalars recorded during the window (record_scalar)."""
    reduces_seen: int = 0
    """SyncNow orders this rank had handled when the window ended (cpu_async: tells the
    coordinator which reduce the window's steps went into)."""
    data_starve_ms: float = 0.0
    """Time the window's steps waited for their batches (the data plane), in ms."""
    data_rows: int = 0
    """Rows the data plane delivered in the window."""
    data_hits: Dict[str, int] = {}
    """Rows served by each cache tier (vram, ram, disk); the rest came from the data set."""
    delivery: str = ""
    """resident or streaming: how the rank's data reached its device at the window's end."""
    device_bytes: int = 0
    """Bytes the rank's GPU caching allocator held at the window's end (0 on CPU)."""
    skipped: int = 0
    """nccl_sync (gradients): steps every rank skipped for a non-finite averaged gradient."""
    graphs: int = 0
    """Graphs torch.compile has built in this rank's process so far (0: no compiled model)."""
    eager_frames: int = 0
    """Frames dynamo gave up on after its recompile limit (they run eagerly from then on)."""
    window_wall_ms: float = 0.0
    """nccl_sync (gradients): the window's wall, the waits at each step's all-reduce included
    (`wall_ms` is compute only, up to each step's gradient being ready: the rank's speed)."""
    left: int = 0
    """Batches of the order not trained (its deadline passed first): the last `left` of them,
    batches being trained in order; their samples go back to the epoch's pool."""
    began_ns: Optional[int] = None
    """Deadline windows: when the window's first batch began, on the coordinator's clock as
    this rank estimates it (None: no estimate); the coordinator's next deadline allows for
    the latest rank's start."""
    loss_batches: Optional[int] = None
    """The batches whose losses `loss_sum` adds up (None: all `batches`). A batch of no sample
    adds none: nccl_sync gives a rank none of a step smaller than the ranks, and the mean of
    an empty batch is NaN."""

    @property
    def loss_count(self) -> int:
        return self.batches if self.loss_batches is None else self.loss_batches


class WindowFailed(Message):
    """nccl_sync (gradients): the window broke after `steps` completed steps (a peer died inside
    a step's all-reduce); this rank holds the state after those steps and waits for a Regroup."""

    rank: int
    window: int
    steps: int
    error: str


class Reduced(Message):
    """A rank adopted the consensus of round `round`."""

    rank: int
    round: int
    divergence: float
    """||theta_before - consensus|| / ||consensus|| of this rank."""
    weight: float
    finite: bool = True
    """False: this rank's parameters were NaN/inf; it gave weight 0 and adopted the others'."""
    cosine: Optional[float] = None
    """Cosine between this rank's window update and the consensus's (the divergence's direction)."""
    magnitude: Optional[float] = None
    """||this rank's window update|| / ||the consensus's|| (the divergence's size)."""


class SnapshotTaken(Message):
    """A rank's parameters at a reduce (coordinator backend); frames: one per flat parameter
    buffer (dtypes in order), then one of flat float buffers. With `shm`, the parameters are in
    those shared-memory files instead (`numels` elements each) and the only frame is the float
    buffers'."""

    rank: int
    round: int
    steps: int
    """Batches trained since the previous snapshot (the consensus weight's n_k)."""
    dtypes: List[str]
    shm: List[str] = []
    numels: List[int] = []
    finite: bool = True
    """False: the parameters hold NaN/inf (the coordinator gives them weight 0)."""


class CheckpointSaved(Message):
    rank: int
    stem: str
    error: str = ""
    """Empty when the model and optimizer files were written."""
    files: Dict[str, str] = {}
    """File name -> SHA-256 of each file this rank wrote (the meta records them)."""
    disk: bool = False
    """The error is the disk's (an OSError: full, over a size limit): an output failure, the
    run goes on with the previous generation as its bundle."""


class ReduceFailed(Message):
    """A collective reduce broke (a peer died); the rank restored its pre-reduce parameters."""

    rank: int
    round: int
    error: str


class Regrouped(Message):
    """A rank joined the process group of membership generation `generation`."""

    rank: int
    generation: int


class Listening(Message):
    """A rank's listener socket is up: notices that must reach the rank while its main thread
    is blocked inside a collective (AbortGroup) go to the socket this came from."""

    rank: int


class Evaluated(Message):
    rank: int
    epoch: int
    score: float


class ClockPing(Message):
    """Timeline: a rank's clock (perf_counter_ns) as it sent this; answered by ClockEcho."""

    rank: int
    sent_ns: int


class TimelineEvents(Message):
    """Timeline: a rank's recorded events since its last shipment (at most a few MB), with
    its current estimate of the coordinator's clock minus its own (`uncertainty_ns` -1: none
    yet). `final`: the last shipment, sent at Stop."""

    rank: int
    events: List[Tuple[str, str, int, int, Union[int, float, str]]]
    offset_ns: int
    uncertainty_ns: int
    label: str = ""
    """Where the rank runs (host, device), for its track's name."""
    final: bool = False


class RankFailed(Message):
    rank: int
    error: str
    callback: str = ""
    """The recipe callback that raised (the rank lives on, the run fails); empty: the rank is gone."""


# ---- coordinator -> rank: orders, imperative ------------------------------------------------

class SyncNow(Message):
    round: int
    global_step: int
    lr_factor: float = 0.0
    """LR scaling for the live cohort (1 + (alive - 1) x ratio); 0 = unchanged."""
    measure: bool = True
    """Compute the divergence at this reduce (nccl_sync measures one reduce in 16)."""


class Train(Message):
    """Train `num_batches` batches over these (pass, offset, size) slices of the permutation."""

    window: int
    epoch: int
    slices: List[Tuple[int, int, int]]
    num_batches: int
    overshoot: int = 0
    """cpu_async: batches this rank may run past the window before it must wait for SyncNow."""
    then_sync: Optional[SyncNow] = None
    """nccl_sync on an even rig: reduce right after this window, without waiting for SyncNow."""
    after_round: int = 0
    """Sent ahead (nccl_sync on an even rig): train it only once this rank's reduce of round
    `after_round` has completed; a Regroup drops it if that reduce failed. 0: train it now."""
    shares: List[int] = []
    """nccl_sync (gradients): this rank's samples of each step of the window, in step order
    (the slices hold them back to back); empty for every other mode."""
    totals: List[int] = []
    """... and each step's samples over all ranks: the rank's gradient weighs share / total."""
    deadline_ms: Optional[float] = None
    """Cadence and async, elche.window_end=deadline: the window's planned duration;
    `num_batches` stays the most it trains. None: train every batch (a count window, or no
    timings yet)."""
    deadline_ns: Optional[int] = None
    """... and the instant it ends, on the coordinator's clock (its perf_counter_ns): the rank
    stops after the batch in hand once its own clock, shifted by its estimated offset, passes
    it, so every rank of the window stops at the same moment. A rank with no estimate yet
    stops `deadline_ms` after its first batch began."""


class Update(Message):
    """Adopt the coordinator's result (frames as in SnapshotTaken): blend parameters with
    weight `blend` (1.0 = overwrite; EASGD alpha in cpu_async), overwrite float buffers when
    `buffers`, then train `train` if given (the next chunk, folded in). With `shm`, the
    parameters are in those shared-memory files, as in SnapshotTaken."""

    round: int
    global_step: int
    blend: float
    buffers: bool
    dtypes: List[str]
    outer_stepped: bool = False
    train: Optional[Train] = None
    shm: List[str] = []
    numels: List[int] = []
    reset: bool = False
    """This rank was non-finite: `blend` is 1.0 and its optimizer state restarts (NaN too)."""


class Evaluate(Message):
    """Score the eval set; with `dtypes`, on the parameters in the frames (the EASGD center)."""

    epoch: int
    dtypes: List[str] = []
    score: bool = True
    """False: no eval this epoch, only the recipe's epoch_fn (Evaluated.score is NaN)."""
    epoch_fn: bool = False
    """Run the recipe's epoch_fn(epoch, model) after the eval, on the same parameters."""


class Regroup(Message):
    """Collective modes after a death: rebuild the process group among `members` (ascending
    old ranks; new rank = index) under a fresh store prefix for `generation`."""

    generation: int
    members: List[int]
    source: int = -1
    """nccl_sync (gradients): the member whose model and optimizer state every member adopts
    once the group is rebuilt (it completed the most steps of the broken window); -1: none."""


class AbortGroup(Message):
    """Sent to a rank's listener socket when members of its process group died: abort the
    group of membership `generation` now, so a survivor blocked in a collective with the dead
    leaves it at once instead of waiting for a timeout."""

    generation: int
    dead: List[int]


class SaveCheckpoint(Message):
    """Write `<stem>.pt` and `<stem>.optim.pt` (and `<stem>.outer.pt` in collective modes); with
    `dtypes`, the model state is the parameters in the frames (the EASGD center)."""

    stem: str
    dtypes: List[str] = []
    write_model: bool = True
    """False: only this rank's own optimizer state (`<stem>.optim.rank<k>.pt`)."""
    epoch: Optional[int] = None
    """The writer then runs the recipe's checkpoint_fn(epoch, model); None: it runs none."""


class ClockEcho(Message):
    """The answer to a ClockPing: its `sent_ns`, and the coordinator's clock when the ping was
    received and when this was sent."""

    sent_ns: int
    received_ns: int
    replied_ns: int


class CutWindow(Message):
    """The run is stopping (Ctrl-C, SIGTERM): end the window in hand after the batch in hand and
    report it (WindowDone.left counts what was not trained); every later order of a count or
    deadline window ends after one batch the same way. An exact window (nccl_sync's steps) is
    not cut: its steps are collective, and it runs to its end (at most about 2 s of compute)."""

    reason: str


class Stop(Message):
    reason: str


AnyMessage = Union[RankJoined, Heartbeat, WindowDone, WindowFailed, Reduced, SnapshotTaken,
                   Evaluated, RankFailed, CheckpointSaved, ReduceFailed, Regrouped, Train, SyncNow,
                   Update, Evaluate, Regroup, SaveCheckpoint, CutWindow, Stop, Listening,
                   AbortGroup, ClockPing, ClockEcho, TimelineEvents]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
log = logging.getLogger(__name__)

FACTS = (RankJoined, Heartbeat, WindowDone, WindowFailed, Reduced, SnapshotTaken, Evaluated,
         RankFailed, CheckpointSaved, ReduceFailed, Regrouped, Listening, ClockPing, TimelineEvents)
"""What ranks send; only the coordinator receives these."""
ORDERS = (SyncNow, Train, Update, Evaluate, Regroup, SaveCheckpoint, CutWindow, Stop, AbortGroup,
          ClockEcho)
"""What the coordinator sends; only ranks receive these. (A type in neither list is taken by
both sides: the per-direction keys already keep a message from being turned around.)"""
CONTROL_FRAME_BYTES = 4 << 20
"""Largest frame a message without tensors needs (a WindowDone with many scalars is ~100 KB)."""
FRAME_HEADROOM_BYTES = 1 << 20


def new_secret() -> bytes:
    """A fresh per-run key (32 random bytes)."""
    return secrets.token_bytes(32)


def frame_limit(param_bytes: Optional[int]) -> int:
    """The largest frame the coordinator accepts: one flat buffer of every parameter and float
    buffer (`param_bytes`) plus headroom, and never less than a control message needs; -1 (no
    limit) when the model's size is unknown."""
    if param_bytes is None:
        return -1
    return max(CONTROL_FRAME_BYTES, param_bytes + FRAME_HEADROOM_BYTES)


_ZAP_USER = "flodl_run"


def _zap_password(secret: bytes) -> str:
    """What a rank shows at the handshake: an HMAC of a fixed label, never the secret itself."""
    return hmac.digest(secret, b"flodl_run handshake", sha256).hex()


class _Gate(ThreadAuthenticator):
    """zmq's ZAP handler for one context: lets a connection through its handshake only when it
    shows this run's handshake password (compared in constant time), so a peer without the
    secret is dropped before zmq reads a single message from it. It also owns the socket's
    `cap` on connections not yet past the handshake (`admission`), stopped with it."""

    cap: Optional[PendingCap] = None

    def __init__(self, ctx: zmq.Context, secret: bytes):
        super().__init__(ctx)
        self._password = _zap_password(secret).encode()

    def stop(self) -> None:
        if self.cap is not None:
            self.cap.stop()
        super().stop()

    def _authenticate_plain(self, domain: str, username: str, password: str) -> Tuple[bool, bytes]:
        allowed = username == _ZAP_USER and hmac.compare_digest(password.encode(), self._password)
        return allowed, b"OK" if allowed else b"not this run"


HANDSHAKE_DEADLINE_MS = 10_000
"""How long a connection to the coordinator may take to pass the handshake before it is
closed: a rank's takes milliseconds; idle connections without the secret used to stay open
until they used up the launcher's file descriptors."""


@dataclass(frozen=True)
class ControlEndpoint:
    """Where the coordinator's ROUTER binds, and the largest frame it accepts (-1: no cap)."""

    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port, picked at bind."""
    max_frame_bytes: int = -1


def bind_router(ctx: zmq.Context, host: str, port: int, max_frame_bytes: int,
                secret: bytes, handshake_ms: int = HANDSHAKE_DEADLINE_MS) -> Tuple[zmq.Socket, str, _Gate]:
    """The coordinator's ROUTER, bound to `host` (random port when 0), behind a handshake that
    only this run's ranks pass (`connect_dealer`) within `handshake_ms`, and refusing frames
    over `max_frame_bytes` before they are buffered whole (MAXMSGSIZE is per frame and, as
    HANDSHAKE_IVL, must be set before bind: the listener copies the socket's options), with at
    most `admission.MAX_PENDING` connections at once that have not yet sent an authentic
    message (the gate's `cap`; hand its `admitted` to the socket's Channel). `ctx` must be the
    coordinator's own: zmq has one handshake handler per context. Stop the gate when the run
    ends."""
    gate = _Gate(ctx, secret)
    gate.start()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.plain_server = True
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    gate.cap = PendingCap(sock)
    gate.cap.start()
    return sock, f"tcp://{host}:{port}", gate


def connect_dealer(ctx: zmq.Context, address: str, secret: bytes,
                   linger_ms: Optional[int] = None) -> zmq.Socket:
    """A rank's DEALER to the coordinator at `address`, passing its handshake; `linger_ms`:
    how long unsent messages are kept at close (zmq's default: forever)."""
    sock = ctx.socket(zmq.DEALER)
    if linger_ms is not None:
        sock.setsockopt(zmq.LINGER, linger_ms)
    sock.plain_username = _ZAP_USER.encode()
    sock.plain_password = _zap_password(secret).encode()
    sock.connect(address)
    return sock


_SENDER_BYTES = 8
_SEQ_BYTES = 8
_PREFIX_BYTES = 1 + _SENDER_BYTES + _SEQ_BYTES  # version, sender id, sequence number
_HEADER_TAG = 32   # HMAC-SHA256 of the header frame and the frame layout
_PAYLOAD_TAG = 16  # Poly1305 of the tensor frames
_LABELS = {"rank": b"rank->coordinator", "coordinator": b"coordinator->rank"}


def direction_key(secret: bytes, sender: str) -> bytes:
    """The key of one direction (`sender` is "rank" or "coordinator"): HMAC-SHA256 of the
    direction's label under the run secret, so neither direction's tags verify in the other."""
    return hmac.digest(secret, b"flodl_run key " + _LABELS[sender], sha256)


def _layout(payloads: Sequence[memoryview | bytes]) -> bytes:
    """The number and lengths of the tensor frames, for the header tag (no frame dropped,
    added or re-cut goes unnoticed)."""
    sizes = [memoryview(f).nbytes for f in payloads]
    return len(sizes).to_bytes(4, "little") + b"".join(n.to_bytes(8, "little") for n in sizes)


def _header_tag(key: bytes, header: memoryview | bytes, payloads: Sequence) -> bytes:
    return hmac.digest(key, bytes(header) + _layout(payloads), sha256)


def _payload_tag(key: bytes, header: memoryview | bytes, payloads: Sequence[memoryview | bytes]) -> bytes:
    """Poly1305 over the tensor frames, keyed once per message: HMAC-SHA256(key, header), and
    no two headers of a key repeat (random sender id, rising sequence number). Poly1305 runs at
    memory speed, where an HMAC over 40 MB of parameters would cost more than moving them."""
    mac = Poly1305(hmac.digest(key, b"payload" + bytes(header), sha256))
    for frame in payloads:
        mac.update(memoryview(frame))  # lengths are under the header tag
    return mac.finalize()


def _mac(key: bytes, header: memoryview | bytes, payloads: Sequence[memoryview | bytes]) -> bytes:
    tag = _header_tag(key, header, payloads)
    return tag + _payload_tag(key, header, payloads) if payloads else tag


def expected_frames(message: Message) -> int:
    """How many tensor frames `message` carries (the layouts documented on each type)."""
    if isinstance(message, SnapshotTaken):
        return (0 if message.shm else len(message.dtypes)) + 1
    if isinstance(message, Update):
        return (0 if message.shm else len(message.dtypes)) + int(message.buffers)
    if isinstance(message, (Evaluate, SaveCheckpoint)):
        return len(message.dtypes)
    return 0


@dataclass
class Received:
    message: Message
    payloads: List[memoryview]
    identity: Optional[bytes] = None


class Channel:
    """One ZeroMQ socket speaking the wire format for one side ("rank" or "coordinator"; by
    default a ROUTER is the coordinator). Counts what it drops: `rejected` (not authentic,
    replayed) and `malformed` (authentic, but not a message this side may get). `admitted`
    is told the descriptor of each connection an authentic message came from."""

    def __init__(self, socket: zmq.Socket, secret: bytes, side: Optional[str] = None,
                 admitted: Optional[Callable[[int], None]] = None):
        self.socket = socket
        self._on_admitted = admitted
        self._router = socket.type == zmq.ROUTER
        self.side = side or ("coordinator" if self._router else "rank")
        peer = "rank" if self.side == "coordinator" else "coordinator"
        self._send_key, self._recv_key = direction_key(secret, self.side), direction_key(secret, peer)
        self._sender = secrets.token_bytes(_SENDER_BYTES)
        self._seq = 0
        self._last_seq: Dict[bytes, int] = {}  # per sender: the highest number taken
        self.rejected = 0
        self.malformed = 0

    def send(self, message: Message, payloads: Sequence[memoryview | bytes] = (),
             identity: Optional[bytes] = None) -> None:
        self._seq += 1
        header = (_VERSION_BYTE + self._sender + self._seq.to_bytes(_SEQ_BYTES, "little")
                  + _encoder.encode(message))
        frames: List[memoryview | bytes] = [header, *payloads]
        frames.append(_mac(self._send_key, header, payloads))
        if identity is not None:
            frames.insert(0, identity)
        self.socket.send_multipart(frames, copy=len(payloads) == 0)

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[Received]:
        """Next authentic, fresh, well-formed message, or None on timeout. Anything else is
        dropped and counted; a malformed authentic message also logs a warning."""
        while True:
            if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
                return None
            frames = self.socket.recv_multipart(copy=False)
            identity = frames.pop(0).bytes if self._router and frames else None
            parsed = self._authentic(frames)
            if parsed is not None and self._on_admitted is not None:
                self._on_admitted(frames[0].get(zmq.SRCFD))
            if parsed is not None:
                message, payloads = parsed
                return Received(message, payloads, identity)

    def _authentic(self, frames: list) -> Optional[Tuple[Message, List[memoryview]]]:
        if len(frames) < 2 or len(frames[0].buffer) <= _PREFIX_BYTES:
            self.rejected += 1
            return None
        header, payloads = frames[0].buffer, [f.buffer for f in frames[1:-1]]
        tag = frames[-1].bytes
        if len(tag) != _HEADER_TAG + (_PAYLOAD_TAG if payloads else 0) or \
                not hmac.compare_digest(tag[:_HEADER_TAG], _header_tag(self._recv_key, header, payloads)) or \
                (payloads and not hmac.compare_digest(tag[_HEADER_TAG:],
                                                      _payload_tag(self._recv_key, header, payloads))):
            self.rejected += 1  # never parsed: payload lengths are all we looked at
            return None
        sender = bytes(header[1:1 + _SENDER_BYTES])
        seq = int.from_bytes(header[1 + _SENDER_BYTES:_PREFIX_BYTES], "little")
        if header[:1] != _VERSION_BYTE or seq <= self._last_seq.get(sender, 0):
            self.rejected += 1  # another protocol version, or a replay
            return None
        self._last_seq[sender] = seq
        return self._well_formed(header[_PREFIX_BYTES:], payloads)

    def _well_formed(self, body: memoryview,
                     payloads: List[memoryview]) -> Optional[Tuple[Message, List[memoryview]]]:
        """An authentic message of the right direction with the frames its type carries."""
        try:
            message = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            return self._malformed(f"undecodable message ({exc})")
        if isinstance(message, ORDERS if self.side == "coordinator" else FACTS):
            return self._malformed(f"{type(message).__name__} is not sent to the {self.side}")
        expected = expected_frames(message)
        if expected != len(payloads):
            return self._malformed(f"{type(message).__name__} with {len(payloads)} tensor frames "
                                   f"(its fields call for {expected})")
        return message, payloads

    def _malformed(self, why: str) -> None:
        """Count and name a message that was signed by our side but cannot be served."""
        self.malformed += 1
        log.warning("dropped an authenticated but malformed message: %s", why)
        return None
