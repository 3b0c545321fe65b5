"""Measure the coordinator backend's round trip against the memcpy floor.

Two rank processes and a coordinator (this process) on loopback, the real wire format (HMAC,
raw frames), host staging, the central averager and the rank-side blend. One round: SyncNow ->
two snapshots -> consensus -> two updates -> both ranks applied (a Heartbeat acknowledges).
The floor is one memcpy of the bytes that must move (two snapshots in, two updates out).

    python tools/roundtrip.py --params 10000000 --rounds 10
    python tools/roundtrip.py --shm     # parameters through /dev/shm slabs, as co-located runs do
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
import zmq

from flodl_run.averaging.central import CentralAverager, Snapshot, blend_
from flodl_run.averaging.frames import HostStaging, as_frame, dtype_names, from_frames
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.averaging.shm import Mapper, Slab, remove_run, run_prefix
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.wire import Channel, Heartbeat, SnapshotTaken, SyncNow, Update, new_secret


def _rank(rank: int, address: str, secret: bytes, numel: int, rounds: int, prefix: str) -> None:
    torch.set_num_threads(1)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    ch = Channel(sock, secret)
    params = [torch.randn(numel)]
    staging = HostStaging(params)
    slab = Slab.create(prefix, f"rank{rank}", params) if prefix else None
    mapper = Mapper(prefix or None)
    ch.send(Heartbeat(rank))
    for _ in range(rounds + 1):
        order = ch.recv().message
        if slab is not None:
            slab.write(params)
            ch.send(SnapshotTaken(rank, order.round, 5, dtype_names(params), slab.paths, [numel]), [b""])
        else:
            staged = staging.stage(params)
            ch.send(SnapshotTaken(rank, order.round, 5, dtype_names(staged)),
                    [as_frame(p) for p in staged] + [b""])
        got = ch.recv()
        update = got.message
        remote = (mapper.tensors(update.shm, update.dtypes, update.numels) if update.shm
                  else from_frames(got.payloads[:1], update.dtypes))
        blend_(params, remote, update.blend)
        ch.send(Heartbeat(rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ipc", action="store_true", help="unix socket instead of TCP loopback")
    parser.add_argument("--shm", action="store_true", help="parameters through /dev/shm slabs")
    args = parser.parse_args()
    prefix = run_prefix() if args.shm else None
    torch.set_num_threads(1)
    secret = new_secret()
    sock = zmq.Context().socket(zmq.ROUTER)
    if args.ipc:
        address = f"ipc:///tmp/flodl-rt-{os.getpid()}"
        sock.bind(address)
    else:
        address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    ch = Channel(sock, secret)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, address, secret, args.params, args.rounds, prefix or ""))
             for r in range(2)]
    for p in procs:
        p.start()
    ids = {}
    while len(ids) < 2:
        got = ch.recv()
        ids[got.message.rank] = got.identity
    avg = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None)
    mapper, update_slab = Mapper(prefix), None
    times, phases = [], []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        began = time.perf_counter()
        for r in range(2):
            ch.send(SyncNow(round_, 0), identity=ids[r])
        snaps = []
        while len(snaps) < 2:
            got = ch.recv()
            taken = got.message
            params = (mapper.tensors(taken.shm, taken.dtypes, taken.numels) if taken.shm
                      else from_frames(got.payloads[:1], taken.dtypes))
            snaps.append(Snapshot(taken.rank, taken.steps, params, torch.empty(0)))
        got_snaps = time.perf_counter()
        if prefix:  # the consensus is built in the update slab, as the coordinator does
            update_slab = update_slab or Slab.create(prefix, "update", snaps[0].params)
        result = avg.reduce(sorted(snaps, key=lambda s: s.rank),
                            out=update_slab.tensors if prefix else None)
        reduced = time.perf_counter()
        if prefix:
            for r in range(2):
                ch.send(Update(round_, 0, 1.0, False, dtype_names(result.params), shm=update_slab.paths,
                               numels=[args.params]), identity=ids[r])
        else:
            frames = [as_frame(p) for p in result.params]
            for r in range(2):
                ch.send(Update(round_, 0, 1.0, False, dtype_names(result.params)), frames, identity=ids[r])
        sent = time.perf_counter()
        for _ in range(2):
            ch.recv()
        if round_:
            end = time.perf_counter()
            times.append((end - began) * 1000.0)
            phases.append([(got_snaps - began) * 1e3, (reduced - got_snaps) * 1e3,
                           (sent - reduced) * 1e3, (end - sent) * 1e3])
    for p in procs:
        p.join()
    remove_run(prefix)
    moved = torch.empty(4 * args.params)  # 2 snapshots in + 2 updates out
    src = torch.randn(4 * args.params)
    floors = []
    for _ in range(5):
        t = time.perf_counter()
        moved.copy_(src)
        floors.append((time.perf_counter() - t) * 1000.0)
    rt, floor = statistics.median(times), statistics.median(floors)
    mb = 4 * args.params * 4 / 1e6
    print(f"{'shm' if prefix else 'frames'} | params {args.params:,} | "
          f"round trip median {rt:.1f} ms (min {min(times):.1f}) | "
          f"memcpy of {mb:.0f} MB {floor:.1f} ms | ratio {rt / floor:.2f}x")
    names = ("snapshots in", "average", "updates out", "applied")
    print(" | ".join(f"{n} {statistics.median(p[i] for p in phases):.1f} ms" for i, n in enumerate(names)))


if __name__ == "__main__":
    main()
