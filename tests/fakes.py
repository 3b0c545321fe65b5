"""Scripted ranks for coordinator-tier tests: threads that speak the real wire format to a
Coordinator in the test's process. Faults and speeds are data: each fake rank reports
`ms_per_batch` of compute per batch, and `late_rounds` holds a rank's snapshot back."""

from __future__ import annotations

import threading
import time
from typing import List, Optional

import torch
import zmq

from flodl_run.coordinator import Coordinator
from flodl_run.wire import (
    Channel,
    CheckpointSaved,
    Evaluate,
    Evaluated,
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
    connect_dealer,
)

NUM_SAMPLES = 640


class FakeRank(threading.Thread):
    def __init__(self, rank: int, world: int, address: str, secret: bytes, ms_per_batch: float,
                 batch_size: int, mode: str):
        super().__init__(daemon=True)
        self.rank, self.world, self.address, self.secret = rank, world, address, secret
        self.ms_per_batch, self.batch_size = ms_per_batch, batch_size
        self.slices: List[tuple] = []
        self.orders: List[str] = []
        self.steps = 0
        self.mode = mode
        self.sync_pending = False
        self.held: List[Train] = []
        self.late_rounds: dict = {}  # round -> seconds this rank sits on its snapshot
        self.reduces_seen = 0
        self.ahead = 0  # Train orders sent ahead of the reduce they follow (after_round set)
        # a collective modelled (nccl_sync): the reduce waits for every member at a barrier that
        # a dying rank breaks; orders sent ahead wait for their reduce; a Regroup drops them
        self.barrier: Optional[threading.Barrier] = None
        self.die_at: Optional[int] = None  # this rank dies before the reduce of its n-th order
        self.on_die = None
        self.trains = 0
        self.reduced_round = 0
        self.held_ahead: List[Train] = []
        self.dropped = 0

    def run(self) -> None:
        sock = connect_dealer(zmq.Context.instance(), self.address, self.secret)
        ch = Channel(sock, self.secret)
        ch.send(RankJoined(self.rank, self.world, 0, "test", "cpu", "cpu", NUM_SAMPLES))
        if self.mode == "cpu_async" and self.rank == 0:
            self._snapshot(ch, 0)  # the EASGD center's starting point
        while True:
            order = ch.recv(timeout_ms=10_000).message
            self.orders.append(type(order).__name__)
            self.ahead += isinstance(order, Train) and order.after_round > 0
            if isinstance(order, Stop):
                break
            if isinstance(order, Train) and order.after_round > self.reduced_round:
                self.held_ahead.append(order)  # its reduce failed: wait for the Regroup
                continue
            if isinstance(order, Regroup):
                self.dropped += len(self.held_ahead)
                self.held_ahead, self.barrier = [], None  # alone now
                ch.send(Regrouped(self.rank, order.generation))
                continue
            if isinstance(order, SyncNow) and self.mode.startswith("cpu_"):
                self.reduces_seen += 1
                self._snapshot(ch, order.round)
                self.sync_pending = False
                for held in self.held:  # chunks that waited for the reduce
                    ch.send(self._answer(held))
                self.held = []
            elif isinstance(order, Train) and self.sync_pending:
                self.held.append(order)  # stay within the overshoot budget: run it after the reduce
            elif isinstance(order, Update):
                if order.train is not None:
                    ch.send(self._answer(order.train))
            else:
                ch.send(self._answer(order))
                self.trains += isinstance(order, Train)
                if isinstance(order, Train) and self.trains == self.die_at:
                    time.sleep(0.3)  # the next orders, sent ahead, reach every rank first
                    del self.slices[-len(order.slices):]  # never reduced: that work dies with it
                    self.barrier.abort()
                    self.on_die(self.rank, "killed by the test")
                    break
                if isinstance(order, Train) and order.then_sync is not None:
                    ch.send(self._answer(order.then_sync))  # the reduce rode on the order
        sock.close()

    def _snapshot(self, ch, round_):
        time.sleep(self.late_rounds.get(round_, 0.0))  # a stalled host, a slow link
        params = torch.full((4,), float(self.rank))
        ch.send(SnapshotTaken(self.rank, round_, self.steps, ["torch.float32"]),
                [memoryview(params.numpy()).cast("B"), b""])
        self.steps = 0

    def _answer(self, order):
        if isinstance(order, Train):
            self.steps += order.num_batches
            self.sync_pending = self.mode == "cpu_async"
            self.slices.extend(order.slices)
            samples = sum(s[2] for s in order.slices)
            n = order.num_batches
            time.sleep(n * self.ms_per_batch / 1000.0)  # the compute the report claims (not a sync)
            return WindowDone(self.rank, order.window, order.epoch, n, samples,
                              n * self.ms_per_batch, 0.0, 1.0 * n, 0.1,
                              reduces_seen=self.reduces_seen)
        if isinstance(order, SyncNow):
            try:
                if self.barrier is not None:
                    self.barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                return ReduceFailed(self.rank, order.round, "a peer died")
            self.reduced_round = order.round
            return Reduced(self.rank, order.round, 0.01, 1.0)
        if isinstance(order, Evaluate):
            return Evaluated(self.rank, order.epoch, 0.5)
        if isinstance(order, SaveCheckpoint):
            return CheckpointSaved(self.rank, order.stem)
        raise AssertionError(order)


def drive(coord: Coordinator, ranks: list) -> tuple:
    """Start the scripted ranks, run the coordinator to its end, wait for the ranks."""
    for r in ranks:
        r.start()
    summary = coord.run()
    for r in ranks:
        r.join(timeout=10)
    return summary, ranks
