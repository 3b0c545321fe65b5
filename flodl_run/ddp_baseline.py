"""Plain torch DDP as users write it: the benchmark's reference peer.

`python -m flodl_run.ddp_baseline --run RUN_YAML --out DIR` trains the run's recipe with
DistributedDataParallel, a DistributedSampler and per-step gradient all-reduce (Gloo on CPU,
NCCL on GPU), with the rig's `emulate_slowdown` applied per rank, and writes summary.json
(mode `torch_ddp`) into DIR. Without RANK in the environment it spawns one
process per rank with the torchrun contract; under `torchrun -m flodl_run.ddp_baseline` each
process is a rank. None of flodl_run's runtime (coordinator, ElChe) is involved.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from flodl_run.config.compose import experiment_from_yaml
from flodl_run.config.schema import ExperimentConfig
from flodl_run.data import to_device
from flodl_run.recipe import load_recipe
from flodl_run.replica import Replica, lr_factor
from flodl_run.summary import EpochRecord, Summary, write_summary


@dataclass
class _SyncClock:
    """Per step: when the first gradient bucket went to all-reduce, the last one went, and the
    last one came back. A comm hook around DDP's default all-reduce records them; the
    all-reduce itself is DDP's own (mean of the gradients)."""

    first_launch: Optional[float] = None
    last_launch: float = 0.0
    last_done: float = 0.0

    def hook(self, state, bucket):  # no annotations: DDP checks them against the real types
        now = time.perf_counter()
        if self.first_launch is None:
            self.first_launch = now
        self.last_launch = now

        def mark(fut: torch.futures.Future) -> torch.Tensor:
            self.last_done = time.perf_counter()
            return fut.value()

        return default_hooks.allreduce_hook(state, bucket).then(mark)

    def reset(self) -> None:
        self.first_launch = None


@dataclass
class _RankTally:
    """What one rank measured over the run (ms)."""

    compute_ms: float = 0.0
    """Step time outside the all-reduce wait, the emulated slowdown included (as on our ranks)."""
    sync_ms: List[float] = field(default_factory=list)
    samples: int = 0


class DdpBaseline:
    """One rank of the torch DDP reference run."""

    def __init__(self, config: ExperimentConfig, rank: int, world_size: int, device: torch.device):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        if device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        self.recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform)
        # Same construction as our ranks: seed, recipe model/optimizer, linear LR scaling.
        self.replica = Replica(self.recipe, device, config.seed,
                               lr_scale=lr_factor(world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm)
        self.clock = _SyncClock()
        self.model = DistributedDataParallel(self.replica.model,
                                             device_ids=[device] if device.type == "cuda" else None)
        self.model.register_comm_hook(None, self.clock.hook)
        self.dataset = self.recipe.call("train_dataset")
        self.sampler = DistributedSampler(self.dataset, world_size, rank, shuffle=True,
                                          seed=config.seed)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None
        slow = config.cluster.emulate_slowdown
        self.slowdown = slow[rank] if slow and rank < len(slow) else 1.0
        self.tally = _RankTally()

    def _loader(self) -> DataLoader:
        """TensorDatasets are gathered a batch at a time (one index per batch, no collate)."""
        if isinstance(self.dataset, TensorDataset):
            batches = BatchSampler(self.sampler, self.config.batch_size, drop_last=False)
            return DataLoader(self.dataset, sampler=batches, batch_size=None)
        return DataLoader(self.dataset, sampler=self.sampler, batch_size=self.config.batch_size)

    def step(self, batch: Any) -> float:
        """Forward, backward (DDP all-reduces the gradients), clip, optimizer and scheduler step."""
        began = time.perf_counter()
        optimizer = self.replica.optimizer
        optimizer.zero_grad(set_to_none=True)
        self.clock.reset()
        loss = self.recipe.train_step(self.model, batch)
        loss.backward()
        backward_done = time.perf_counter()
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        optimizer.step()
        if self.replica.scheduler is not None:
            self.replica.scheduler.step()
        value = float(loss.detach())  # waits for the device, like the step timing of our ranks
        waited = 0.0
        if self.clock.first_launch is not None:
            self.tally.sync_ms.append((self.clock.last_done - self.clock.first_launch) * 1000.0)
            waited = max(0.0, backward_done - self.clock.last_launch)
        compute = time.perf_counter() - began - waited
        if self.slowdown > 1.0:  # emulated slowdown on compute only: a slower GPU has the same network
            time.sleep((self.slowdown - 1.0) * compute)
        self.tally.compute_ms += (compute * self.slowdown) * 1000.0
        return value

    def train_epoch(self, epoch: int) -> EpochRecord:
        self.sampler.set_epoch(epoch)
        began = time.perf_counter()
        loss_sum, steps, samples = 0.0, 0, 0
        compute_before = self.tally.compute_ms
        for batch in self._loader():
            samples += len(batch[0]) if isinstance(batch, (list, tuple)) else self.config.batch_size
            loss_sum += self.step(to_device(batch, self.device))
            steps += 1
        self.tally.samples += samples
        eval_began = time.perf_counter()
        score = self._evaluate(epoch)
        ended = time.perf_counter()
        epoch_ms, eval_ms = (ended - began) * 1000.0, (ended - eval_began) * 1000.0
        compute_s = (self.tally.compute_ms - compute_before) / 1000.0
        per_rank = self._gather([loss_sum, steps, samples / compute_s if compute_s else 0.0])
        return EpochRecord(
            epoch=epoch, avg_loss=sum(r[0] for r in per_rank) / max(sum(r[1] for r in per_rank), 1),
            eval=score, epoch_ms=epoch_ms, eval_ms=eval_ms,
            per_rank_throughput=[r[2] for r in per_rank],
            per_rank_batch_share=[r[1] / max(sum(x[1] for x in per_rank), 1) for r in per_rank])

    def _evaluate(self, epoch: int) -> Optional[float]:
        """Rank 0 scores the (identical) replica; the others wait for the score."""
        every = self.config.eval_every_epochs
        last = epoch + 1 == self.config.num_epochs
        if self.eval_data is None or not (last or (every and (epoch + 1) % every == 0)):
            return None
        score = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.rank == 0:
            score += self.replica.evaluate(self.eval_data)
        dist.broadcast(score, 0)
        return float(score.item())

    def _gather(self, values: List[float]) -> List[List[float]]:
        """Every rank's `values`, rank by rank (one all-reduce over a zero-padded table)."""
        table = torch.zeros(self.world_size, len(values), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(table)
        return table.cpu().tolist()

    def run(self) -> Summary:
        started = time.perf_counter()
        epochs = [self.train_epoch(e) for e in range(self.config.num_epochs)]
        train_ms = sum(e.epoch_ms for e in epochs)
        sync = self.tally.sync_ms
        per_rank = self._gather([self.tally.compute_ms, sum(sync), len(sync)])
        syncs = int(per_rank[0][2])
        return Summary(
            status="completed", mode="torch_ddp", outer="none", world_size=self.world_size,
            devices=self._devices(), epochs=epochs, final_eval=epochs[-1].eval if epochs else None,
            wall_s=time.perf_counter() - started,
            samples_per_s=(self.tally.samples * self.world_size / (train_ms / 1000.0)
                           if train_ms else 0.0),
            syncs=syncs,
            avg_sync_ms=sum(r[1] for r in per_rank) / max(sum(r[2] for r in per_rank), 1),
            idle_fraction=[max(0.0, 1.0 - r[0] / train_ms) if train_ms else 0.0 for r in per_rank])

    def _devices(self) -> List[str]:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return [name] * self.world_size


def _device(env: dict) -> torch.device:
    if env.get("FLODL_RUN_DEVICE"):
        return torch.device(env["FLODL_RUN_DEVICE"])
    if torch.cuda.is_available():
        return torch.device("cuda", int(env.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def run_rank(config: ExperimentConfig, out: Path) -> int:
    """One process of the group (torchrun contract); rank 0 writes summary.json."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(os.environ)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300),
                            device_id=device if backend == "nccl" else None)
    baseline = DdpBaseline(config, rank, world_size, device)
    summary = baseline.run()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_summary(out / "summary.json", summary)
    # DDP's reducer must go before its process group: destroying the group under a live reducer
    # made about one exit in five abort ("terminate called without an active exception").
    del baseline
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def rank_env(config: ExperimentConfig, rank: int, world_size: int, master_port: int,
             gpu_uuid: Optional[str]) -> dict:
    """The torchrun contract for a local rank, pinned to its GPU or to its CPU threads."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=config.cluster.master_addr,
               MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    if gpu_uuid:
        env.update(CUDA_VISIBLE_DEVICES=gpu_uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID",
                   FLODL_RUN_DEVICE="cuda:0")
    else:
        threads = str(config.cluster.threads_per_rank or 1)
        env.update(FLODL_RUN_DEVICE="cpu", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    return env


def spawn(config: ExperimentConfig, run_file: Path, out: Path) -> int:
    """Start one process per rank of the rig (the launcher's topology plan) and wait for all;
    if one fails, stop the rest."""
    from flodl_run.launcher import plan_topology
    from flodl_run.supervisor import free_port

    plan = plan_topology(config)
    port = config.cluster.master_port or free_port(config.cluster.master_addr)
    procs = []
    for rank in range(plan.world_size):
        uuid = plan.gpus[rank].uuid if plan.gpus else None
        env = rank_env(config, rank, plan.world_size, port, uuid)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flodl_run.ddp_baseline", "--run", str(run_file),
             "--out", str(out)],
            env=env))
    codes: List[Optional[int]] = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            return next(c for c in codes if c not in (None, 0))
        time.sleep(0.05)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodl_run.ddp_baseline", description=__doc__)
    parser.add_argument("--run", type=Path, required=True, help="a resolved run.yaml")
    parser.add_argument("--out", type=Path, required=True, help="where summary.json goes")
    args = parser.parse_args(argv)
    config = experiment_from_yaml(args.run.read_text())
    if config.data.augment != 1 or config.data.epoch_splits != 1 or config.data.transform:
        parser.error("the torch DDP baseline trains plain epochs: data.augment, "
                     "data.epoch_splits and data.transform must keep their defaults")
    if "RANK" in os.environ:
        return run_rank(config, args.out)
    return spawn(config, args.run, args.out)


if __name__ == "__main__":
    sys.exit(main())
