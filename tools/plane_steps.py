"""Host time per batch of the solo path's data plane, resident on the device, against a
careful user's own index of rows already on the device; and where the plane's time goes
(`_at_step`, the order's slice, the rows' gather), each timed around its call. No model: what
is measured is the host's cost of handing over one batch, which a small model's step feels
when the GPU waits for the host (zoo_amp, zoo_frozen).

    python3 tools/plane_steps.py zoo_amp --device cuda --rounds 5 --epochs 20

Prints a table of microseconds per batch (median of the rounds; the two feeds alternate, A B A
B, since a machine's speed drifts within a call) and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_speed import Phases, _sync, experiment  # noqa: E402  (the same config and clock as the speed rounds)

from flodl_run.contracts.recipe import import_recipe  # noqa: E402
from flodl_run.data import dataplane  # noqa: E402
from flodl_run.data.dataplane import DataPlane  # noqa: E402


def _per_batch(epochs: int, n: int, batch_size: int, device: torch.device,
               feed: Callable[[torch.Tensor], int]) -> float:
    """Host microseconds per batch over `epochs` epochs (the device waited for at each end)."""
    batches, total = 0, 0.0
    for _ in range(epochs):
        order = torch.randperm(n)
        _sync(device)
        began = time.perf_counter()
        batches += feed(order)
        total += time.perf_counter() - began
        _sync(device)
    return total * 1e6 / max(batches, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = experiment(args.name, device, 1, None)
    recipe = import_recipe(config.recipe.module, config.recipe.params)
    data = recipe.call("train_dataset")
    n, size = len(data), config.batch_size

    plane = DataPlane(data, device, config, recipe.transform)
    for _ in plane.batches(torch.randperm(n), size):  # past the first step's decision
        pass
    plane.settle()
    parts = Phases()  # only the plane's feed calls what it wraps (the own feeds call none of it)
    parts.tag = "plane"
    parts.wrap(plane, "_at_step", "_at_step")
    parts.wrap(plane, "_resident_batch", "_resident_batch (gather or slice)")
    parts.wrap(dataplane._OrderOnDevice, "rows", "order slice")

    rows = torch.utils.data.default_collate([data[i] for i in range(n)])
    rows = [v.to(device) for v in rows]

    def plane_feed(order: torch.Tensor) -> int:
        count = 0
        for _ in plane.batches(order, size):
            count += 1
        return count

    def own_feed(order: torch.Tensor) -> int:
        order = order.to(device)
        count = 0
        for start in range(0, n, size):
            index = order[start:start + size]
            [v[index] for v in rows]
            count += 1
        return count

    def own_select(order: torch.Tensor) -> int:  # the plane's kernels, the own loop's bookkeeping
        order = order.to(device)
        count = 0
        for start in range(0, n, size):
            index = order[start:start + size]
            [v.index_select(0, index) for v in rows]
            count += 1
        return count

    figures: Dict[str, List[float]] = defaultdict(list)
    for _ in range(args.rounds):
        figures["own index"].append(_per_batch(args.epochs, n, size, device, own_feed))
        figures["own index_select"].append(_per_batch(args.epochs, n, size, device, own_select))
        parts.calls.clear()
        figures["data plane"].append(_per_batch(args.epochs, n, size, device, plane_feed))
        batches = args.epochs * -(-n // size)
        for label, calls in parts.calls.items():
            figures[f"  {label.replace('plane_', 'plane: ', 1)}"].append(
                sum(end - began for began, end in calls) * 1e6 / batches)
    medians = {label: statistics.median(values) for label, values in figures.items()}
    print(f"{args.name} on {device}: host us per batch, median of {args.rounds} rounds "
          f"({args.epochs} epochs of {-(-n // size)} batches each; delivery {plane.delivery.value})")
    for label, us in medians.items():
        print(f"{label:32s} {us:8.1f}   rounds {[round(v, 1) for v in figures[label]]}")
    print(json.dumps({"model": args.name, "device": str(device), "us_per_batch": medians}))


if __name__ == "__main__":
    main()
