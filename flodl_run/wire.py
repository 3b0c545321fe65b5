"""Control-plane wire format: typed, versioned messages over ZeroMQ, authenticated per run.

Owns the message schema (msgspec structs: past tense from ranks, imperatives from the
coordinator), the frame layout `[version+header, *tensor frames, mac]` and the HMAC check.
Tensors travel as raw buffers, never pickled. The header frame (version, random nonce, message)
is authenticated with HMAC-SHA256; tensor frames with Poly1305 under a one-time key derived
from the secret and that header. Who sends what, when, is the caller's business.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from hashlib import sha256
from typing import Dict, List, Optional, Sequence, Tuple, Union

import msgspec
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305

PROTOCOL_VERSION = 1
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


class Heartbeat(Message):
    rank: int


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


class Stop(Message):
    reason: str


AnyMessage = Union[RankJoined, Heartbeat, WindowDone, Reduced, SnapshotTaken, Evaluated,
                   RankFailed, CheckpointSaved, ReduceFailed, Regrouped, Train, SyncNow, Update,
                   Evaluate, Regroup, SaveCheckpoint, Stop, Listening, AbortGroup]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def new_secret() -> bytes:
    """A fresh per-run key (32 random bytes)."""
    return secrets.token_bytes(32)


_NONCE_BYTES = 16
_HEADER_TAG = 32   # HMAC-SHA256 of the header frame
_PAYLOAD_TAG = 16  # Poly1305 of the tensor frames


def _header_tag(secret: bytes, header: memoryview | bytes) -> bytes:
    return hmac.digest(secret, header, sha256)


def _payload_tag(secret: bytes, header: memoryview | bytes, payloads: Sequence[memoryview | bytes]) -> bytes:
    """Poly1305 over the tensor frames, keyed once per message: HMAC-SHA256(secret, header),
    and every header carries a fresh random nonce. Poly1305 runs at memory speed, where an
    HMAC over 40 MB of parameters would cost more than moving them."""
    mac = Poly1305(hmac.digest(secret, b"payload" + bytes(header), sha256))
    for frame in payloads:
        view = memoryview(frame)
        mac.update(view.nbytes.to_bytes(8, "little"))  # length-prefixed: no frame splicing
        mac.update(view)
    return mac.finalize()


def _mac(secret: bytes, header: memoryview | bytes, payloads: Sequence[memoryview | bytes]) -> bytes:
    tag = _header_tag(secret, header)
    return tag + _payload_tag(secret, header, payloads) if payloads else tag


@dataclass
class Received:
    message: Message
    payloads: List[memoryview]
    identity: Optional[bytes] = None


class Channel:
    """One ZeroMQ socket speaking the wire format; counts frames that fail authentication."""

    def __init__(self, socket: zmq.Socket, secret: bytes):
        self.socket = socket
        self.secret = secret
        self.rejected = 0
        self._router = socket.type == zmq.ROUTER

    def send(self, message: Message, payloads: Sequence[memoryview | bytes] = (),
             identity: Optional[bytes] = None) -> None:
        header = _VERSION_BYTE + secrets.token_bytes(_NONCE_BYTES) + _encoder.encode(message)
        frames: List[memoryview | bytes] = [header, *payloads]
        frames.append(_mac(self.secret, header, payloads))
        if identity is not None:
            frames.insert(0, identity)
        self.socket.send_multipart(frames, copy=len(payloads) == 0)

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[Received]:
        """Next authentic message, or None on timeout. Bad frames are dropped and counted."""
        while True:
            if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
                return None
            frames = self.socket.recv_multipart(copy=False)
            identity = frames.pop(0).bytes if self._router else None
            parsed = self._authentic(frames)
            if parsed is not None:
                message, payloads = parsed
                return Received(message, payloads, identity)

    def _authentic(self, frames: list) -> Optional[Tuple[Message, List[memoryview]]]:
        if len(frames) < 2:
            self.rejected += 1
            return None
        header, payloads = frames[0].buffer, [f.buffer for f in frames[1:-1]]
        tag = frames[-1].bytes
        if not hmac.compare_digest(tag[:_HEADER_TAG], _header_tag(self.secret, header)) or \
                (payloads and not hmac.compare_digest(tag[_HEADER_TAG:],
                                                      _payload_tag(self.secret, header, payloads))):
            self.rejected += 1  # never parsed beyond the frame count
            return None
        if header[:1] != _VERSION_BYTE:
            self.rejected += 1
            return None
        try:
            return _decoder.decode(header[1 + _NONCE_BYTES:]), payloads
        except msgspec.DecodeError:
            self.rejected += 1
            return None
