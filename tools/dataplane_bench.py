"""Data-plane figures on one GPU: throughput of resident vs streaming delivery vs a
plain torch DataLoader(pin_memory=True) on the same data and model, and the OOM fallback.

    python3 tools/dataplane_bench.py throughput --out $OUT/throughput.json
    python3 tools/dataplane_bench.py oom --out $OUT/oom.json

Streaming is forced by shrinking the plane's budget (FLODL_RUN_SIM_DEVICE_BYTES, passed to the
plane only), not the GPU. The OOM case caps this process's allocator below what the device
reports free, so the plane decides to go resident and the copy itself fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flodl_run.config.schema import DataConfig, ExperimentConfig  # noqa: E402
from flodl_run.data.dataplane import DataPlane  # noqa: E402


def _data(samples: int, features: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, features, generator=gen),
                         torch.randint(0, 10, (samples,), generator=gen))


def _model(features: int, hidden: int, device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, 10)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _step(model, optimizer, batch) -> float:
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())  # a host sync per step, as Replica.step does


def _timed(batches: Iterable[Any], step: Callable[[Any], float]) -> Dict[str, float]:
    """Run one epoch; wait_ms is the host time spent getting the next batch."""
    began, wait, steps, rows = time.perf_counter(), 0.0, 0, 0
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t0
        step(batch)
        steps += 1
        rows += len(batch[1])
    wall = time.perf_counter() - began
    return {"samples_per_s": rows / wall, "wait_ms_per_step": 1000 * wait / max(steps, 1),
            "epoch_s": wall}


def _plane_epochs(plane: DataPlane, epochs: int, step) -> List[Dict[str, float]]:
    out = []
    for epoch in range(epochs):
        p, start, end = plane.picks.epoch_span(epoch)
        indices = plane.picks.picks(p, start, end - start) % len(plane)
        figures = _timed(plane.batches(indices, plane.batch_size, epoch=epoch), step)
        stats = plane.take_stats()
        steps = max(1, -(-len(indices) // plane.batch_size))
        figures.update(starve_ms_per_step=stats["data_starve_ms"] / steps, rows=stats["data_rows"],
                       delivery=stats["delivery"], hits=stats["data_hits"])
        out.append(figures)
        if epoch == 0:
            plane.settle()  # a resident copy finishes during epoch 0; fix the mode for the rest
    return out


def throughput(args) -> Dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    data = _data(args.samples, args.features)
    set_bytes = sum(t.numel() * t.element_size() for t in data.tensors)
    config = ExperimentConfig(batch_size=args.batch, seed=0, data=DataConfig())
    results: Dict[str, Any] = {"samples": args.samples, "features": args.features,
                               "batch": args.batch, "set_gb": set_bytes / 1e9,
                               "gpu": torch.cuda.get_device_name(device) if cuda else "cpu"}

    def run(name: str, make_batches: Callable[[], List[Dict[str, float]]]) -> None:
        if cuda:
            torch.cuda.synchronize()
        results[name] = make_batches()
        last = results[name][-1]
        print(f"{name:28s} {last['samples_per_s']:>12,.0f} samples/s  "
              f"wait {last['wait_ms_per_step']:.3f} ms/step  {last.get('delivery', '')} "
              f"{last.get('hits', '')}", flush=True)

    model, opt = _model(args.features, args.hidden, device)
    step = lambda batch: _step(model, opt, batch)  # noqa: E731
    on_device = tuple(t[:args.batch].to(device) for t in data.tensors)
    run("compute_only", lambda: [_timed([on_device] * (args.samples // args.batch), step)
                                 for _ in range(args.epochs)])
    run("dataplane_resident", lambda: _plane_epochs(DataPlane(data, device, config), args.epochs,
                                                    step))
    gc.collect()
    used = 0
    if cuda:
        torch.cuda.empty_cache()  # the resident copy is gone: give its blocks back first
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    # Budget = 0.9 x simulated size - used: 256 MiB for a streaming ring, or 0.6 of the set.
    tiny = {"FLODL_RUN_SIM_DEVICE_BYTES": str(int((used + 256 * 2**20) / 0.9)),
            "FLODL_RUN_VRAM_POOL": "off"}
    run("dataplane_streaming", lambda: _plane_epochs(DataPlane(data, device, config, environ=tiny),
                                                     args.epochs, step))
    half = {"FLODL_RUN_SIM_DEVICE_BYTES": str(int((used + 0.6 * set_bytes) / 0.9))}
    run("dataplane_streaming_pool",
        lambda: _plane_epochs(DataPlane(data, device, config, environ=half), args.epochs, step))
    for workers in (0, args.workers):
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, pin_memory=True,
                            num_workers=workers, persistent_workers=workers > 0)
        run(f"dataloader_w{workers}", lambda: [_timed(_moved(loader, device), step)
                                               for _ in range(args.epochs)])
    batched = DataLoader(data, sampler=BatchSampler(RandomSampler(data), args.batch, False),
                         batch_size=None, pin_memory=True, num_workers=args.workers,
                         persistent_workers=True)
    run(f"dataloader_batched_w{args.workers}", lambda: [_timed(_moved(batched, device), step)
                                                        for _ in range(args.epochs)])
    return results


def _moved(loader: DataLoader, device: torch.device) -> Iterable[Any]:
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def oom(args) -> Dict[str, Any]:
    """Cap the allocator so the set cannot be copied; the plane must fall back and keep going."""
    device = torch.device("cuda")
    data = _data(args.samples, args.features)
    set_bytes = sum(t.numel() * t.element_size() for t in data.tensors)
    model, opt = _model(args.features, args.hidden, device)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(device)
    allowed = torch.cuda.memory_reserved(device) + set_bytes // 2 + 512 * 2**20
    torch.cuda.set_per_process_memory_fraction(allowed / total, torch.cuda.current_device())
    records = _Records()
    logging.getLogger("flodl_run.data.dataplane").addHandler(records)
    config = ExperimentConfig(batch_size=args.batch, seed=0, data=DataConfig())
    plane = DataPlane(data, device, config)
    epochs = _plane_epochs(plane, 2, lambda batch: _step(model, opt, batch))
    probe = torch.arange(0, args.samples, max(1, args.samples // args.batch))[:args.batch]
    delivered = next(iter(plane.batches(probe, args.batch)))[0].cpu()
    correct = torch.equal(delivered, data.tensors[0][probe])
    warnings = [m for m in records.messages if "streaming instead" in m]
    result = {"set_gb": set_bytes / 1e9, "allowed_gb": allowed / 1e9, "device_free_gb": free / 1e9,
              "delivery": plane.delivery.value, "warnings": warnings, "epochs": epochs,
              "batches_correct": correct,
              "ok": plane.delivery.value == "streaming" and len(warnings) == 1 and correct}
    print(f"oom fallback: delivery={result['delivery']} warnings={len(warnings)} correct={correct} "
          f"ok={result['ok']}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("throughput", "oom"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    result = throughput(args) if args.what == "throughput" else oom(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
