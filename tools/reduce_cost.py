"""What one flodl_run reduce costs next to the bare all-reduce of the same bytes, on 2+ ranks.

    torchrun --nproc-per-node 2 tools/reduce_cost.py [--params 51400000] [--rounds 20]

Times, on the model-sized flat float32 buffer of every rank (mean of --rounds after warm-up):
the bare NCCL (or Gloo) all-reduce; the divergence signal alone (||before - after|| / ||after||
on the device, one read); and flodl_run's whole weighted reduce (weights all-reduce, scratch
copy, pre-scale, all-reduce, divergence). Rank 0 prints one line and a JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from flodl_run.averaging.collective import weighted_reduce_
from flodl_run.averaging.flat import FlatParams, relative_distance


def _timed(fn, rounds: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(rounds):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) / rounds * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=51_400_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    model = nn.Linear(1, 1).to(device)
    model.weight = nn.Parameter(torch.randn(args.params, device=device) * (1 + rank * 1e-3))
    flat = FlatParams(model)
    bare = flat.buffers[0].clone()
    other = [b + 1e-3 for b in flat.buffers]
    allreduce_ms = _timed(lambda: dist.all_reduce(bare), args.rounds, device)
    divergence_ms = _timed(lambda: relative_distance(flat.buffers, other), args.rounds, device)
    reduce_ms = _timed(lambda: weighted_reduce_(flat, 10 + rank, 1.0), args.rounds, device)
    if rank == 0:
        floor = allreduce_ms + divergence_ms
        record = {"params": args.params, "megabytes": args.params * 4 / 1e6,
                  "world_size": dist.get_world_size(), "device": str(device),
                  "allreduce_ms": allreduce_ms, "divergence_ms": divergence_ms,
                  "reduce_ms": reduce_ms, "ratio_to_allreduce_plus_divergence": reduce_ms / floor}
        print(f"{args.params / 1e6:.1f} M params ({args.params * 4 / 1e6:.0f} MB) on "
              f"{dist.get_world_size()} x {device.type}: bare all-reduce {allreduce_ms:.2f} ms, "
              f"divergence {divergence_ms:.2f} ms, flodl_run reduce {reduce_ms:.2f} ms = "
              f"{reduce_ms / floor:.2f} x (all-reduce + divergence)")
        print(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
