"""What nccl_sync's exact step costs without a partner, against the bare loop a careful user
writes (zero_grad, train_step, backward, step; the batches already on the device).

Variants, interleaved round by round so drift hits all alike (median of the rounds):
- bare: the loop above, on the recipe's own model and optimizer;
- exact alone: rank.exact.ExactSync as a lone rank runs it (the whole step its share: the
  finiteness check and its read, the timing);
- exact ddp1: the same through torch's DDP reducer and our weighted hook on a one-rank group;
- exact micro2: ddp1 with each step's share cut into two micro-batches (no_sync on the first).
Run on the GPU machine (bash tools/device_run.sh python3 tools/exact_step.py [mlp|byte_lm] ...);
on the CPU it runs too (smaller sizes are up to the caller: --batch, --hidden).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from flodl_run.contracts.recipe import import_recipe
from flodl_run.hardware.slowdown import Slowdown
from flodl_run.rank.exact import ExactSync, Micro
from flodl_run.rank.group import RankGroup
from flodl_run.rank.replica import Replica

RECIPES = {
    "mlp": ("recipes.synthetic_mlp", {"hidden": 4096, "depth": 4, "num_samples": 65536, "lr": 0.02}),
    "byte_lm": ("recipes.byte_lm", {}),
}


def _batches(recipe, device, batch: int, count: int):
    data = recipe.call("train_dataset")
    rows = torch.randperm(len(data))[: batch * count]
    cols = data[rows]
    cols = cols if isinstance(cols, (tuple, list)) else (cols,)
    on = [c.to(device) for c in cols]
    return [tuple(c[i * batch:(i + 1) * batch] for c in on) for i in range(count)]


def _replica(name: str, device, compile_model: bool):
    module, params = RECIPES[name]
    recipe = import_recipe(module, params)
    replica = Replica(recipe, device, seed=0)
    if compile_model:
        replica.model = torch.compile(replica.model)
    return recipe, replica


def _bare(replica, recipe, batch):
    replica.optimizer.zero_grad(set_to_none=True)
    recipe.train_step(replica.model, batch).backward()
    replica.optimizer.step()


def _timed(step, batches, steps: int, device) -> float:
    """ms per step over `steps` steps (the device waited for at both ends)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) * 1000.0 / steps


def _exact(replica, device, alone: bool, micro: int):
    group = RankGroup(0, device, 60.0)
    group.alone = alone
    exact = ExactSync(replica, None, group, Slowdown(1.0))
    exact.rebuild()
    exact.reset_window()

    def step(batch):
        size = batch[0].shape[0]
        part = size // micro
        for i in range(micro):
            exact.begin(Micro(i, micro, part, size, size))
            exact.step(tuple(c[i * part:(i + 1) * part] for c in batch))
    return step, exact


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
    variants = {}
    for label, alone, micro in (("bare", None, 1), ("exact alone", True, 1),
                                ("exact ddp1", False, 1), ("exact micro2", False, 2)):
        recipe, replica = _replica(args.recipe, device, args.compile)
        batches = _batches(recipe, device, args.batch, 16)
        step = (lambda b, r=replica, rc=recipe: _bare(r, rc, b)) if alone is None else \
            _exact(replica, device, alone, micro)[0]
        _timed(step, batches, 10, device)  # warm-up (compilation, allocator, cuBLAS)
        variants[label] = (step, batches)
    times = {label: [] for label in variants}
    peak = {label: 0 for label in variants}
    for _ in range(args.rounds):
        for label, (step, batches) in variants.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[label].append(_timed(step, batches, args.steps, device))
            if device.type == "cuda":
                peak[label] = max(peak[label], torch.cuda.max_memory_allocated(device))
    bare = statistics.median(times["bare"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.recipe} batch {args.batch} on {where}{' (compiled)' if args.compile else ''}: "
          f"median of {args.rounds} rounds x {args.steps} steps")
    for label, values in times.items():
        ms = statistics.median(values)
        print(f"  {label:13s} {ms:8.3f} ms/step  {bare / ms:5.3f}x bare  peak {peak[label] / 2**30:5.2f} GiB"
              f"  rounds {[round(v, 3) for v in values]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
