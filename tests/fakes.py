"""Scripted ranks for coordinator-tier tests: threads that speak the real wire format to a
Coordinator in the test's process, through its public surface only (constructor, run(),
report_death, on_rank_dead, the wire protocol). Speeds and faults are data: each fake rank
reports `ms_per_batch` of compute per batch, `late_rounds` holds a rank's snapshot back, and a
fault plan (a list of `Fault`) says which rank dies, hangs, freezes or fails a reduce, and when.

The fakes model what the coordinator relies on in real ranks (flodl_run/rank/process.py):
- heartbeats on their own socket, carrying the batches finished and whether a Train order is
  being worked on (a rank hung in train_step beats on; a frozen one falls silent), and in the
  collective modes a listener socket on which an AbortGroup aborts the rank's group;
- in the collective modes, a process group per membership generation (`Group`): a reduce
  completes only when every member arrives, a member that vanishes breaks it for the others
  (each then reports ReduceFailed), a Regroup builds the next generation's group, orders sent
  ahead of a failed reduce are dropped, and the retry of a round a rank already reduced starts
  again from its pre-reduce replica;
- orders read between batches: a CutWindow (the run is stopping) ends the window in hand after
  the batch in hand, and every later window after its first batch (`on_batch` lets a test act
  after each batch, e.g. request the stop);
- the launcher: a rank that dies is reported (report_death), a rank the coordinator declares
  dead is killed (on_rank_dead).
`Group.consensus()` then says which samples the survivors' weights include, counted."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import zmq

from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts.wire import (
    AbortGroup,
    Channel,
    CheckpointSaved,
    CutWindow,
    Evaluate,
    Evaluated,
    Heartbeat,
    Listening,
    RankFailed,
    RankJoined,
    Reduced,
    ReduceFailed,
    Regroup,
    Regrouped,
    SaveCheckpoint,
    SnapshotTaken,
    Stop,
    SyncNow,
    Train,
    Update,
    WindowDone,
    new_secret,
)
from flodl_run.contracts.wire import connect_dealer as _connect
from flodl_run.control.coordinator import Coordinator
from flodl_run.control.dispatch import split_trained
from flodl_run.observe.observer import Observer

NUM_SAMPLES = 640
BEAT_S = 1.0  # heartbeat period, as in real ranks (a shorter one: `beat_s`)
WAIT_S = 30.0  # the longest a fake waits for anything: past it, the run is stuck (a failure)

KINDS = {"die": ("train", "reduce", "reduced", "evaluate"), "raise": ("train",),
         "hang": ("train", "batch", "evaluate", "save"),
         "freeze": ("train", "reduce"), "reduce_fail": ("reduce",)}


@dataclass(frozen=True)
class Fault:
    """One scripted failure: rank `rank`, at its `at`-th `point` (1-based), does `kind`.

    Points: "train": while working on its at-th Train order (its batches ran, not yet
    reported, as a SIGKILL after a batch lands); "reduce": on entering its at-th reduce (a
    SyncNow, or one riding on a Train), once its collective peers wait in it; "reduced": on
    leaving its at-th collective reduce, completed, before its answer leaves (a SIGKILL right
    after the all-reduce: the coordinator never hears that the round completed); "evaluate":
    on receiving its at-th Evaluate order, before answering (a death at an epoch's close);
    "save": on receiving its at-th SaveCheckpoint order, before answering; "batch": right after
    its at-th batch of the run (inside a window: the batches before it timed).
    Kinds: "die": the process vanishes (no more messages; its peers' collective breaks; the
    launcher reports the exit). "raise": the recipe's train_step raises: the rank reports
    RankFailed with the error, then its process exits (reported). "hang": stuck in
    train_step (or in a recipe's eval or checkpoint_fn), heartbeats go on, the batch count
    stands still (the coordinator's hung-rank rule, or an order's limit, must catch it).
    "freeze": stopped whole (SIGSTOP): no heartbeats, no messages (the heartbeat timeout
    must catch it). Both wait until the coordinator declares them dead and
    the launcher kills them. "reduce_fail": the collective breaks under every member (a
    transient error) and the rank reports ReduceFailed, as a real rank does; it lives on."""

    rank: int
    kind: str
    at: int
    point: str = "train"

    def __post_init__(self):
        if self.point not in KINDS.get(self.kind, ()):
            raise ValueError(f"no {self.kind!r} fault at a {self.point!r} point")


class _Gone(Exception):
    """The fake rank's process is gone: its thread ends without another message."""


class _Generation:
    """One membership generation's process group: a reusable barrier over its members that
    records what each reduce averaged, and that any member can break."""

    def __init__(self, members: Sequence[int], on_complete: Callable[[Dict[int, tuple]], None]):
        self.members = set(members)
        self.cond = threading.Condition()
        self.arrived: Dict[int, tuple] = {}  # rank -> (round, slices) in the reduce under way
        self.completed = 0
        self.broken = False
        self.on_complete = on_complete

    def reduce(self, rank: int, round_: int, slices: list, between: Callable[[], None]) -> bool:
        """Arrive with this rank's contribution; True once every member did, False when the
        group broke (or nothing completed within WAIT_S). `between` runs while waiting."""
        with self.cond:
            if self.broken:
                return False
            self.arrived[rank] = (round_, slices)
            cycle = self.completed
            if set(self.arrived) == self.members:
                self.on_complete(self.arrived)
                self.arrived, self.completed = {}, self.completed + 1
                self.cond.notify_all()
                return True
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.cond:
                if self.completed != cycle or self.broken:
                    return self.completed != cycle
                self.cond.wait(0.02)
            between()
        self.abort()
        return False

    def waiting(self) -> set:
        with self.cond:
            return set(self.arrived)

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class Group:
    """What the fakes of one run share: in the collective modes their process group (one
    `_Generation` per Regroup), in every mode the ledger of what reached the consensus.

    The ledger keeps, per round and rank, the slices a completed reduce averaged: a collective
    round retried in a later generation replaces what its earlier completion recorded (the
    survivors undid it), and a snapshot on the coordinator backend counts once sent (a rank
    trains on only after its round's update, so a snapshot it sent was averaged)."""

    def __init__(self, world: int, collective: bool):
        self.collective = collective
        self.lock = threading.Lock()
        self.generations: Dict[int, _Generation] = {}
        self.ledger: Dict[Tuple[int, int], list] = {}  # (round, rank) -> slices averaged
        self.mixed: List[Dict[int, int]] = []  # reduces whose members were in different rounds
        self.retried: List[int] = []  # rounds completed again by a later generation
        self.join(0, range(world))

    def join(self, generation: int, members: Sequence[int]) -> _Generation:
        with self.lock:
            return self.generations.setdefault(generation, _Generation(members, self._complete))

    def _complete(self, arrived: Dict[int, tuple]) -> None:
        rounds = {rank: round_ for rank, (round_, _) in arrived.items()}
        if len(set(rounds.values())) > 1:
            self.mixed.append(rounds)
        round_ = max(rounds.values())
        with self.lock:
            stale = [key for key in self.ledger if key[0] == round_]
            if stale:
                self.retried.append(round_)
            for key in stale:
                del self.ledger[key]
            for rank, (_, slices) in arrived.items():
                self.ledger[(round_, rank)] = list(slices)

    def snapshot(self, rank: int, round_: int, slices: list) -> None:
        with self.lock:
            self.ledger[(round_, rank)] = self.ledger.get((round_, rank), []) + list(slices)

    def consensus(self) -> Counter:
        """(pass, position) -> times the consensus weights trained on it."""
        seen: Counter = Counter()
        with self.lock:
            for slices in self.ledger.values():
                for pass_index, offset, size in slices:
                    for pos in range(offset, offset + size):
                        seen[(pass_index, pos)] += 1
        return seen


class FakeRank(threading.Thread):
    def __init__(self, rank: int, world: int, address: str, secret: bytes, ms_per_batch: float,
                 batch_size: int, mode: str, faults: Sequence[Fault] = (),
                 group: Optional[Group] = None, on_die: Optional[Callable[[int, str], None]] = None):
        super().__init__(daemon=True)
        self.rank, self.world, self.address, self.secret = rank, world, address, secret
        self.ms_per_batch, self.batch_size = ms_per_batch, batch_size
        self.slices: List[tuple] = []  # everything this rank trained (reduced or not)
        self.orders: List[str] = []
        self.steps = 0
        self.mode = mode
        self.sync_pending = False
        self.held: List[Train] = []
        self.late_rounds: dict = {}  # round -> seconds this rank sits on its snapshot
        self.reduces_seen = 0
        self.ahead = 0  # Train orders sent ahead of the reduce they follow (after_round set)
        self.faults = {(f.point, f.at): f for f in faults if f.rank == rank}
        self.group, self.on_die = group, on_die
        self.generation = 0
        self.trains = 0  # Train orders started
        self.evaluations = 0  # Evaluate orders received
        self.saves = 0  # SaveCheckpoint orders received
        self.reduces = 0  # reduces entered
        self.reduced_round = 0
        self.held_ahead: List[Train] = []
        self.dropped = 0  # orders sent ahead that a Regroup voided
        self.batches = 0  # batches finished (what heartbeats carry)
        self.training = False  # working on a Train order (what heartbeats carry)
        self.pending: List[tuple] = []  # trained since this rank's last completed reduce
        self.last: Optional[Tuple[int, list]] = None  # (round, slices) of its last completed reduce
        self.inbox: List = []  # orders that arrived while this rank waited in a reduce
        self.killed = threading.Event()  # the launcher killed this process
        self.quiet = threading.Event()  # no more heartbeats
        self.fate = ""  # how the thread ended: "stopped", or the fault that ended it
        self.beat_s = BEAT_S
        self.listens = group is not None and group.collective  # as real ranks: collective modes
        self.notices: List[AbortGroup] = []  # what its listener socket received
        self.speed_at: Dict[int, float] = {}  # Train order number -> ms per batch from then on
        self.deadlines: List[float] = []  # deadline_ms of each deadline order it trained
        self.left = 0  # batches its deadline orders left untrained
        self.cut = False  # a CutWindow came: every window ends after the batch in hand
        self.on_batch: Optional[Callable[["FakeRank"], None]] = None  # after each batch (a test's trigger)
        self.on_stuck: Optional[Callable[["FakeRank"], None]] = None  # as a hang or freeze begins

    # ---- the launcher's view -----------------------------------------------------------------

    def kill(self) -> None:
        """The launcher kills the process (the coordinator declared it dead): its sockets
        close, so a collective it belongs to breaks for the others."""
        self.killed.set()
        self.quiet.set()
        self._break_group()

    def _break_group(self) -> None:
        if self.group is not None and self.group.collective:
            self.group.join(self.generation, []).abort()

    # ---- the process ---------------------------------------------------------------------------

    def run(self) -> None:
        sock = _connect(zmq.Context.instance(), self.address, self.secret, linger_ms=1000)
        self.ch = Channel(sock, self.secret)
        beat = threading.Thread(target=self._beat, daemon=True)
        listener = threading.Thread(target=self._listen, daemon=True)
        try:
            self.ch.send(RankJoined(self.rank, self.world, 0, "test", "cpu", "cpu", NUM_SAMPLES))
            beat.start()
            if self.listens:
                listener.start()
            if self.mode == "cpu_async" and self.rank == 0:
                self._snapshot(0)  # the EASGD center's starting point
            self._serve()
            self.fate = "stopped"
        except _Gone:
            pass
        finally:
            self.quiet.set()
            sock.close(linger=0 if self.fate != "stopped" else 1000)

    def _beat(self) -> None:
        """The heartbeat thread: its own socket, as in a real rank."""
        sock = _connect(zmq.Context.instance(), self.address, self.secret, linger_ms=0)
        channel = Channel(sock, self.secret)
        while not self.quiet.wait(self.beat_s):
            channel.send(Heartbeat(self.rank, self.batches, self.training))
        sock.close()

    def _listen(self) -> None:
        """The listener thread: its own socket, announced with Listening; an AbortGroup for
        this rank's generation aborts its group (NCCL's abort), as in a real rank."""
        sock = _connect(zmq.Context.instance(), self.address, self.secret, linger_ms=0)
        channel = Channel(sock, self.secret)
        channel.send(Listening(self.rank))
        while not self.quiet.is_set():
            got = channel.recv(timeout_ms=50)
            if got is not None and isinstance(got.message, AbortGroup):
                self.notices.append(got.message)
                if got.message.generation == self.generation and self.group is not None:
                    self._break_group()
        sock.close()

    def _next_order(self):
        deadline = time.monotonic() + WAIT_S
        while not self.inbox:
            if self.killed.is_set():
                self._vanish("killed", report=False)
            if time.monotonic() > deadline:
                self._vanish("no order within WAIT_S", report=False)
            got = self.ch.recv(timeout_ms=50)
            if got is not None:
                self.inbox.append(got.message)
        return self.inbox.pop(0)

    def _drain(self) -> None:
        """While waiting in a reduce, orders keep landing in the socket (a real rank's socket
        buffers them): take them in, to be handled in order afterwards."""
        got = self.ch.recv(timeout_ms=0)
        while got is not None:
            self.inbox.append(got.message)
            got = self.ch.recv(timeout_ms=0)

    def _serve(self) -> None:
        while True:
            order = self._next_order()
            self.orders.append(type(order).__name__)
            self.ahead += isinstance(order, Train) and order.after_round > 0
            if isinstance(order, Stop):
                return
            if isinstance(order, Train) and order.after_round > self.reduced_round:
                self.held_ahead.append(order)  # trained once its reduce completed, or dropped
                continue
            if isinstance(order, Regroup):
                self._regroup(order)
            elif isinstance(order, SyncNow):
                self._reduce(order)
            elif isinstance(order, Train) and self.sync_pending:
                self.held.append(order)  # stay within the overshoot budget: run it after the reduce
            elif isinstance(order, Update):
                self._note_update(order.round)
                if order.train is not None:
                    self._train(order.train)
            elif isinstance(order, Train):
                self._train(order)
            elif isinstance(order, CutWindow):
                self.cut = True
            else:
                self.ch.send(self._answer(order))

    def _regroup(self, order: Regroup) -> None:
        if self.rank not in order.members:
            self._vanish("declared dead", report=False)
        self.dropped += len(self.held_ahead)  # sent ahead of a reduce that failed: void
        self.held_ahead = []
        self.generation = order.generation
        if self.group is not None:
            self.group.join(order.generation, order.members)
        self.ch.send(Regrouped(self.rank, order.generation))

    def _train(self, order: Train) -> None:
        self.trains += 1
        fault = self.faults.get(("train", self.trains))
        if fault is not None and fault.kind in ("hang", "freeze"):
            self._stuck(fault)
        done = self._answer(order)
        if fault is not None and fault.kind == "raise":
            self.ch.send(RankFailed(self.rank, f"ValueError: scripted failure at train {fault.at}"))
        if fault is not None:  # die: its batches ran, the process goes before reporting them
            self._vanish(f"{fault.kind} at train {fault.at}")
        self.ch.send(done)
        if order.then_sync is not None:
            self._reduce(order.then_sync)  # the reduce rode on the order
        for held in list(self.held_ahead):  # sent ahead of the reduce that just completed
            if held.after_round <= self.reduced_round:
                self.held_ahead.remove(held)
                self._train(held)

    def _reduce(self, order: SyncNow) -> None:
        self.reduces += 1
        self.reduces_seen += 1
        fault = self.faults.get(("reduce", self.reduces))
        if fault is not None:
            self._await_peers(order.round)
            if fault.kind == "die":
                self._vanish(f"die at reduce {fault.at}")
            if fault.kind == "freeze":
                self._stuck(fault)
        if self.mode.startswith("cpu_"):
            self._snapshot(order.round)
            self.sync_pending = False
            for held in self.held:  # chunks that waited for the reduce
                self._train(held)
            self.held = []
            return
        if fault is not None:  # reduce_fail: the collective breaks under every member
            self._break_group()
        answer = self._collective(order.round)
        after = self.faults.get(("reduced", self.reduces))
        if after is not None and isinstance(answer, Reduced):
            self._vanish(f"die after reduce {after.at}")
        self.ch.send(answer)

    def _collective(self, round_: int):
        """The weighted all-reduce of round `round_`: a retry of a round this rank completed
        starts from its pre-reduce replica (what it trained since is undone)."""
        if self.last is not None and self.last[0] == round_:
            contribution, self.pending = self.last[1], []
        else:
            contribution = self.pending
        if self.group is not None and self.group.collective:
            done = self.group.join(self.generation, []).reduce(
                self.rank, round_, contribution, self._drain)
            if not done:
                return ReduceFailed(self.rank, round_, "a peer died")
        self.last, self.pending = (round_, list(contribution)), []
        self.reduced_round = round_
        return Reduced(self.rank, round_, 0.01, 1.0)

    def _await_peers(self, round_: int) -> None:
        """A fault at a reduce strikes once the peers wait in it, and (where orders go ahead)
        hold the order sent ahead of it, as they do in a real run before the reduce ends."""
        if self.group is None or not self.group.collective:
            return
        gen = self.group.join(self.generation, [])
        peers = gen.members - {self.rank}
        deadline = time.monotonic() + 2.0  # bounded: an order that never comes is not waited for

        def holds(rank):
            return not self.ahead or any(isinstance(o, Train) and o.after_round == round_
                                         for o in self.group_rank(rank).inbox)

        while time.monotonic() < deadline and not (peers <= gen.waiting() and all(map(holds, peers))):
            time.sleep(0.01)  # polling the peers' state, bounded; not ordering anything

    group_rank: Callable[[int], "FakeRank"] = None  # set by `cohort`: rank -> its fake

    def _stuck(self, fault: Fault) -> None:
        """hang: heartbeats on, training, the count standing still; freeze: silent. Until the
        launcher kills the process. Only a rank stuck in train_step says it is training."""
        self.training = fault.point in ("train", "batch")
        if fault.kind == "freeze":
            self.quiet.set()
        if self.on_stuck is not None:
            self.on_stuck(self)
        self.killed.wait(WAIT_S)
        self._vanish(f"{fault.kind} at {fault.point} {fault.at}, killed", report=False)

    def _vanish(self, fate: str, report: bool = True) -> None:
        """The process is gone: heartbeats stop, its collective breaks, the launcher sees the
        exit (`report`; a kill it ordered itself it knows of)."""
        self.fate = fate
        self.quiet.set()
        self._break_group()
        if report and self.on_die is not None:
            self.on_die(self.rank, "killed by the test")
        raise _Gone(fate)

    def _note_update(self, round_: int) -> None:
        self.reduced_round = max(self.reduced_round, round_)

    def _snapshot(self, round_):
        time.sleep(self.late_rounds.get(round_, 0.0))  # a stalled host, a slow link
        params = torch.full((4,), float(self.rank))
        if self.group is not None:
            self.group.snapshot(self.rank, round_, self.pending)
        self.pending = []
        self.ch.send(SnapshotTaken(self.rank, round_, self.steps, ["torch.float32"]),
                     [memoryview(params.numpy()).cast("B"), b""])
        self.steps = 0

    def _answer(self, order):
        if isinstance(order, Train):
            return self._window(order)
        if isinstance(order, Evaluate):
            self.evaluations += 1
            fault = self.faults.get(("evaluate", self.evaluations))
            if fault is not None and fault.kind == "hang":
                self._stuck(fault)
            if fault is not None:
                self._vanish(f"die at evaluate {self.evaluations}")
            return Evaluated(self.rank, order.epoch, 0.5)
        if isinstance(order, SaveCheckpoint):
            self.saves += 1
            fault = self.faults.get(("save", self.saves))
            if fault is not None:
                self._stuck(fault)
            return CheckpointSaved(self.rank, order.stem)
        raise AssertionError(order)


    def _window(self, order: Train) -> WindowDone:
        """Train the order's batches, up to the ones that fit its deadline (the batch that
        crosses it included) or, once a CutWindow came (it is read between batches, as a real
        rank reads orders), up to the batch in hand; report what was trained and how many
        batches were left."""
        self.training = True
        self.sync_pending = self.mode == "cpu_async"
        self.ms_per_batch = self.speed_at.get(self.trains, self.ms_per_batch)
        n = order.num_batches
        if order.deadline_ms:
            self.deadlines.append(order.deadline_ms)
            n = min(n, max(1, math.ceil(order.deadline_ms / self.ms_per_batch)))
        # a batch of batch_size samples costs ms_per_batch; an exact step's share costs in
        # proportion to its samples
        total = sum(s[2] for s in order.slices)
        ms = self.ms_per_batch * (total / (n * self.batch_size) if order.shares else 1.0)
        done = 0
        while done < n:  # the compute the report claims (not a sync), batch by batch
            time.sleep(ms / 1000.0)
            self.batches += 1
            done += 1
            fault = self.faults.get(("batch", self.batches))
            if fault is not None:
                self._stuck(fault)
            if self.on_batch is not None:
                self.on_batch(self)
            if not order.shares and self._cut_seen():
                break
        # an exact window's batches are its steps (shares), not its slices cut into batches
        trained = (order.slices if done == order.num_batches
                   else split_trained(order.slices, done, self.batch_size)[0])
        self.steps += done
        self.left += order.num_batches - done
        self.slices.extend(trained)
        self.pending.extend(trained)
        samples = sum(s[2] for s in trained)
        self.training = False
        return WindowDone(self.rank, order.window, order.epoch, done, samples, done * ms, 0.0,
                          1.0 * done, 0.1, reduces_seen=self.reduces_seen,
                          left=order.num_batches - done)

    def _cut_seen(self) -> bool:
        """Orders that landed meanwhile are taken in (handled in order later); a CutWindow
        among them ends this window after the batch in hand."""
        self._drain()
        if any(isinstance(o, CutWindow) for o in self.inbox):
            self.inbox = [o for o in self.inbox if not isinstance(o, CutWindow)]
            self.orders.append("CutWindow")
            self.cut = True
        return self.cut


class Coverage:
    """Whether the consensus trained on every sample of `epochs` passes exactly once; false,
    it shows what was missing or counted twice, and the group's rounds (for a failure)."""

    def __init__(self, group, epochs: int):
        seen = group.consensus()
        expected = {(e, i) for e in range(epochs) for i in range(NUM_SAMPLES)}
        self.missing = sorted(expected - set(seen))
        self.twice = sorted(key for key, times in seen.items() if times > 1)
        self.extra = sorted(set(seen) - expected)
        self.rounds = sorted(group.ledger)
        self.retried, self.mixed = group.retried, group.mixed

    def __bool__(self) -> bool:
        return not (self.missing or self.twice or self.extra)

    def __repr__(self) -> str:
        return (f"missing {len(self.missing)} {self.missing[:8]}, twice {len(self.twice)} "
                f"{self.twice[:8]}, extra {self.extra[:8]}; ledger (round, rank) {self.rounds}; "
                f"retried rounds {self.retried}; mixed {self.mixed}")


def drive(coord: Coordinator, ranks: list) -> tuple:
    """Start the scripted ranks, run the coordinator to its end, wait for the ranks."""
    for r in ranks:
        r.start()
    summary = coord.run()
    for r in ranks:
        r.join(timeout=WAIT_S)
    return summary, ranks


def cohort(config: ExperimentConfig, speeds: Sequence[float], faults: Sequence[Fault] = (),
           observer: Optional[Observer] = None,
           beat_s: float = BEAT_S) -> Tuple[Coordinator, List[FakeRank], Group]:
    """A coordinator and one fake rank per entry of `speeds` (ms per batch), sharing one
    `Group`, wired as the launcher wires real ranks: a fake that dies is reported, a rank the
    coordinator declares dead is killed. The ranks beat every `beat_s`. Run it with
    `drive(coord, ranks)`."""
    mode = config.elche.mode
    secret = new_secret()
    coord = Coordinator(config, len(speeds), secret, observer=observer)
    group = Group(len(speeds), mode.is_collective)
    ranks = [FakeRank(r, len(speeds), coord.address, secret, ms, config.batch_size, mode.value,
                      faults, group, coord.report_death) for r, ms in enumerate(speeds)]
    for fake in ranks:
        fake.group_rank, fake.beat_s = ranks.__getitem__, beat_s
    coord.on_rank_dead = lambda rank: ranks[rank].kill()
    return coord, ranks, group
