"""The benchmark's peers, written the way a careful user writes them: the bar flodl_run must clear.

`python -m flodl_run.bench.peers --peer PEER --run RUN_YAML --out DIR [--period N]` trains the run's
recipe and writes summary.json (mode = PEER) into DIR. Peers:

- `solo`: a bare loop on one device (the ideal of a rig is the sum of these at each rank speed);
- `torch_ddp`: DistributedDataParallel (gradient all-reduce each step, overlapped with backward,
  `gradient_as_bucket_view=True`);
- `torch_localsgd`: torch's own local SGD, `PeriodicModelAverager(period)` after each step.

Every peer trains the same data as flodl_run's ranks: the data set moved to the device once, the
same per-pass permutation (dealt to ranks as DistributedSampler deals it, so DDP's step s trains
the samples of nccl_sync's step s), batches gathered on the device, an equal split among ranks,
and no host sync per step (losses are summed on the device and read once per epoch). The rig's
`emulate_slowdown` applies as on our ranks: a rank of factor f > 1 waits for each step and sleeps
(f - 1) x its time (the first step excepted, flodl_run/hardware/slowdown.py says why). Without RANK in
the environment a collective peer starts one process per rank with the torchrun contract
(forked from the peer's own process on a CPU rig, a new interpreter each on GPUs). None
of flodl_run's runtime (coordinator, ElChe) is involved.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data.dataloader import default_collate

from flodl_run.config.compose import experiment_from_yaml
from flodl_run.config.schema import ClusterConfig, ExperimentConfig, lr_factor

if TYPE_CHECKING:  # pragma: no cover
    from flodl_run.launch.zygote import ForkedChild
from flodl_run.contracts.rankenv import DEVICE_ENV, RankEnvironment
from flodl_run.contracts.recipe import load_recipe
from flodl_run.contracts.summary import EpochRecord, Summary, write_summary
from flodl_run.control.dispatch import epoch_span
from flodl_run.data.passes import map_tensors, permutation, to_device
from flodl_run.hardware.slowdown import slowdown_for
from flodl_run.rank.replica import Replica

PEERS = ("solo", "torch_ddp", "torch_localsgd")
DEFAULT_PERIOD = 8  # torch_localsgd's averaging period when the bench has no cadence run to copy


def on_device(dataset: Dataset, device: torch.device) -> Any:
    """The whole data set as batched tensors on `device`, moved once (a TensorDataset's tensors,
    else every sample collated together)."""
    if isinstance(dataset, TensorDataset):
        return to_device(tuple(dataset.tensors), device)
    return to_device(default_collate([dataset[i] for i in range(len(dataset))]), device)


def take(data: Any, index: torch.Tensor) -> Any:
    """Rows `index` of every tensor in `data` (tensor, tuple/list or dict of them)."""
    return map_tensors(data, lambda t: t.index_select(0, index))


class PeerRank:
    """One rank of a peer run (the only rank of `solo`)."""

    def __init__(self, config: ExperimentConfig, peer: str, rank: int, world_size: int,
                 device: torch.device, period: int = DEFAULT_PERIOD):
        self.config, self.peer, self.rank, self.world_size = config, peer, rank, world_size
        self.device = device
        if device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        self.recipe = load_recipe(config)
        # Same construction as our ranks: seed, recipe model/optimizer, linear LR scaling.
        self.replica = Replica(self.recipe, device, config.seed,
                               lr_scale=lr_factor(world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm, options=config.recipe)
        self.model = self.replica.model
        if peer == "torch_ddp":
            self.model = DistributedDataParallel(
                self.replica.model, device_ids=[device] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)
        self.averager = None
        if peer == "torch_localsgd":
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            self.averager = PeriodicModelAverager(period=period, warmup_steps=0)
        self.period = period
        dataset = self.recipe.call("train_dataset")
        self.num_samples = len(dataset)
        self.data = on_device(dataset, device)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None
        self.slowdown = slowdown_for(config.cluster.emulate_slowdown,
                                     config.cluster.emulate_jitter, rank, config.seed)
        self.steps = 0
        self.samples = 0

    @property
    def total_epochs(self) -> int:
        return self.config.num_epochs * self.config.data.epoch_splits

    def _my_rows(self, epoch: int) -> torch.Tensor:
        """This rank's equal share of the epoch's slice of the pass, on the device. The slice is
        the runner's (dispatch.epoch_span: 1/data.epoch_splits of the pass), dealt the way
        torch's DistributedSampler deals a data set (rank r takes positions r, r + W, r + 2W, ...
        of its first W x (size // W)), so global step j of the epoch trains slice positions
        [j*W*B, (j+1)*W*B): the samples nccl_sync's step j trains. Every rank gets size // W
        rows, so all run the same number of steps (DDP needs that)."""
        span = epoch_span(epoch, self.num_samples, 1, self.config.data.epoch_splits)
        order = permutation(self.num_samples, self.config.seed, span.pass_index)
        share = span.size // self.world_size
        mine = order[span.start:span.start + share * self.world_size][self.rank::self.world_size]
        return mine.to(self.device)

    def _step(self, index: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        optimizer = self.replica.optimizer
        if not self.model.training:  # as a careful loop: once, not a walk of every module a step
            self.model.train()
        optimizer.zero_grad(set_to_none=True)
        precision = self.replica.precision  # recipe.amp, as our ranks train it
        with precision.autocast():
            loss = self.recipe.train_step(self.model, take(self.data, index))
        precision.backward(loss)
        if self.config.max_grad_norm is not None:
            precision.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        precision.step(optimizer)
        if self.replica.scheduler is not None:
            self.replica.scheduler.step()
        if self.averager is not None:
            self.averager.average_parameters(self.model.parameters())
        self.slowdown.after_step(began, self.device)  # an emulated slower GPU sleeps in proportion
        self.steps += 1
        return loss.detach()

    def train_epoch(self, epoch: int) -> EpochRecord:
        rows = self._my_rows(epoch)
        began = time.perf_counter()
        loss_sum, steps = None, 0
        for index in rows.split(self.config.batch_size):
            loss = self._step(index)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        train_ms = (time.perf_counter() - began) * 1000.0
        self.samples += len(rows)
        eval_began = time.perf_counter()
        score = self._evaluate(epoch)
        eval_ms = (time.perf_counter() - eval_began) * 1000.0
        local_rate = len(rows) / (train_ms / 1000.0) if train_ms else 0.0
        per_rank = self._gather([float(loss_sum) if loss_sum is not None else 0.0, steps, local_rate])
        total_steps = max(sum(r[1] for r in per_rank), 1)
        return EpochRecord(
            epoch=epoch, avg_loss=sum(r[0] for r in per_rank) / total_steps, eval=score,
            epoch_ms=train_ms + eval_ms, eval_ms=eval_ms, samples=len(rows) * self.world_size,
            per_rank_throughput=[r[2] for r in per_rank],
            per_rank_batch_share=[r[1] / total_steps for r in per_rank])

    def _evaluate(self, epoch: int) -> Optional[float]:
        """Rank 0 scores its replica (DDP: identical on all ranks; local SGD: rank 0's, as a
        user of PeriodicModelAverager would); the others wait for the score."""
        every = self.config.eval_every_epochs
        last = epoch + 1 == self.total_epochs
        if self.eval_data is None or not (last or (every and (epoch + 1) % every == 0)):
            return None
        score = self.replica.evaluate(self.eval_data) if self.rank == 0 else 0.0
        return self._gather([score])[0][0]

    def _gather(self, values: List[float]) -> List[List[float]]:
        """Every rank's `values`, rank by rank (one all-reduce over a zero-padded table)."""
        if self.world_size == 1:
            return [list(values)]
        table = torch.zeros(self.world_size, len(values), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(table)
        return table.cpu().tolist()

    def run(self) -> Summary:
        started = time.perf_counter()
        epochs = [self.train_epoch(e) for e in range(self.total_epochs)]
        # per second of epoch time, eval included, as the runner's summaries count it (the bench
        # takes the eval callbacks out of every entry alike)
        epoch_s = sum(e.epoch_ms for e in epochs) / 1000.0
        syncs = {"solo": 0, "torch_ddp": self.steps, "torch_localsgd": self.steps // self.period}
        return Summary(
            status="completed", mode=self.peer, outer="none", world_size=self.world_size,
            devices=[_device_name(self.device)] * self.world_size, epochs=epochs,
            final_eval=epochs[-1].eval if epochs else None,
            wall_s=time.perf_counter() - started,
            samples_per_s=self.samples * self.world_size / epoch_s if epoch_s else 0.0,
            syncs=syncs[self.peer], avg_sync_ms=0.0)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _device(env: dict, device: str) -> torch.device:
    """The rank's device: the launcher's pin, else the `device` key, else a GPU by local rank."""
    if env.get(DEVICE_ENV):
        return torch.device(env[DEVICE_ENV])
    if device not in ("auto", ""):
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(env.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def run_solo(config: ExperimentConfig, out: Path) -> int:
    summary = PeerRank(config, "solo", 0, 1, _device(os.environ, config.device)).run()
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out / "summary.json", summary)
    return 0


def run_rank(config: ExperimentConfig, peer: str, out: Path, period: int) -> int:
    """One process of a collective peer (torchrun contract); rank 0 writes summary.json."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(os.environ, config.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300),
                            device_id=device if backend == "nccl" else None)
    peer_rank = PeerRank(config, peer, rank, world_size, device, period)
    summary = peer_rank.run()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_summary(out / "summary.json", summary)
    # DDP's reducer must go before its process group: destroying the group under a live reducer
    # made about one exit in five abort ("terminate called without an active exception").
    del peer_rank
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def rank_env(cluster: ClusterConfig, rank: int, world_size: int, master_port: int,
             gpu_uuid: Optional[str]) -> dict:
    """The torchrun contract for a local rank, pinned to its GPU or to its CPU threads."""
    contract = RankEnvironment(rank=rank, local_rank=rank, world_size=world_size,
                               local_world_size=world_size, master_addr=cluster.master_addr,
                               master_port=master_port, unbuffered=True, project=os.getcwd())
    if gpu_uuid:
        contract = dataclasses.replace(contract, gpu=gpu_uuid, device="cuda:0")
    else:
        contract = dataclasses.replace(contract, device="cpu", threads=cluster.threads_per_rank or 1)
    return contract.over(os.environ)


def spawn(config: ExperimentConfig, argv: List[str], args: argparse.Namespace) -> int:
    """Start one process per rank of the rig (the launcher's topology plan) and wait for all;
    if one fails, or this process is interrupted, stop the rest. On a CPU rig each rank is
    forked from this process, which has imported torch once (a new interpreter spends about
    3 CPU-seconds importing torch and what an optimizer's step imports; the peer's timing
    starts after that either way); on GPUs each rank is a new interpreter, since a CUDA
    context does not survive fork."""
    from flodl_run.launch.launcher import plan_topology
    from flodl_run.launch.rankproc import free_port

    plan = plan_topology(config)
    port = config.cluster.master_port or free_port(config.cluster.master_addr)
    envs = [rank_env(config.cluster, rank, plan.world_size, port,
                     plan.gpus[rank].uuid if plan.gpus else None) for rank in range(plan.world_size)]
    if not plan.gpus and _can_fork():
        procs: List[Any] = [_fork_rank(env, lambda: run_rank(config, args.peer, args.out, args.period))
                            for env in envs]
    else:
        procs = [subprocess.Popen([sys.executable, "-m", "flodl_run.bench.peers", *argv], env=env)
                 for env in envs]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    finally:  # a failed rank, or an interrupt here: stop the rest
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    return failed[0] if failed else 0


def _can_fork() -> bool:
    """Forking ranks is safe (fork exists, this process has not initialized CUDA) and not
    turned off (`FLODL_RUN_RANK_START=spawn`, as for flodl_run's own ranks)."""
    from flodl_run.launch.zygote import START_ENV

    return hasattr(os, "fork") and not torch.cuda.is_initialized() \
        and os.environ.get(START_ENV) != "spawn"


def _fork_rank(env: dict, run: Callable[[], int]) -> "ForkedChild":
    """Fork one rank: the child takes the rank's environment, torch's thread count and fresh
    random generators as a new interpreter would, runs it and leaves without the teardown."""
    import torch._dynamo  # noqa: F401  (an optimizer's step imports it: once here, not per rank)

    from flodl_run.launch.zygote import ForkedChild, fresh_random_state, intra_op_threads, run_forked

    gc.freeze()  # the children's collections then leave our objects' pages unshared alone
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would print what we had buffered a second time
    pid = os.fork()
    if pid:
        return ForkedChild(pid)
    os.environ.clear()
    os.environ.update(env)
    intra_op_threads(env)
    fresh_random_state()
    run_forked(run)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodl_run.bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--run", type=Path, required=True, help="a resolved run.yaml")
    parser.add_argument("--out", type=Path, required=True, help="where summary.json goes")
    parser.add_argument("--period", type=int, default=DEFAULT_PERIOD,
                        help="torch_localsgd: local steps between averages (>= 1)")
    args = parser.parse_args(argv)
    if args.period < 1:
        parser.error(f"--period must be >= 1, got {args.period}")
    config = experiment_from_yaml(args.run.read_text())
    if config.data.augment != 1 or config.data.transform:
        parser.error("the peers train plain passes: data.augment and data.transform must keep "
                     "their defaults")
    if args.peer == "solo":
        return run_solo(config, args.out)
    if "RANK" in os.environ:
        return run_rank(config, args.peer, args.out, args.period)
    return spawn(config, sys.argv[1:] if argv is None else list(argv), args)


if __name__ == "__main__":
    sys.exit(main())
