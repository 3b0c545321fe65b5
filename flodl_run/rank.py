"""The rank process: one replica on one device, driven by the coordinator's orders.

Entry point `python -m flodl_run.rank`, torchrun-compatible: reads RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, plus FLODL_RUN_COORD (coordinator address),
FLODL_RUN_SECRET (hex key) and FLODL_RUN_FILE (the resolved run.yaml). It trains what it is
told, reduces when told, and reports facts; it decides nothing about cadence.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import zmq

from flodl_run import scalars
from flodl_run.averaging.collective import weighted_reduce_
from flodl_run.averaging.flat import FlatParams
from flodl_run.config.compose import experiment_from_yaml
from flodl_run.config.schema import ExperimentConfig, OuterKind
from flodl_run.data import BatchSource, permutation
from flodl_run.outer import OuterOptimizer
from flodl_run.recipe import load_recipe
from flodl_run.replica import Replica, lr_factor
from flodl_run.wire import (
    Channel, Evaluate, Evaluated, Heartbeat, RankFailed, RankJoined, Reduced, Stop, SyncNow,
    Train, WindowDone,
)

HEARTBEAT_PERIOD_S = 1.0


@dataclass(frozen=True)
class RankEnv:
    """The torchrun environment contract plus the coordinator's address, key and run file."""

    rank: int
    local_rank: int
    world_size: int
    coord: str
    secret: bytes
    run_file: Path
    device: Optional[str]
    parent_pid: Optional[int]

    @classmethod
    def from_environ(cls, env: Dict[str, str]) -> "RankEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                               "FLODL_RUN_COORD", "FLODL_RUN_SECRET", "FLODL_RUN_FILE")
                   if k not in env]
        if missing:
            raise SystemExit(f"flodl_run.rank: missing environment: {', '.join(missing)}")
        parent = env.get("FLODL_RUN_PARENT_PID")
        return cls(int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])),
                   int(env["WORLD_SIZE"]), env["FLODL_RUN_COORD"],
                   bytes.fromhex(env["FLODL_RUN_SECRET"]), Path(env["FLODL_RUN_FILE"]),
                   env.get("FLODL_RUN_DEVICE"), int(parent) if parent else None)


def _pick_device(env: RankEnv) -> torch.device:
    if env.device:
        return torch.device(env.device)
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class _Heartbeat(threading.Thread):
    """Sends a Heartbeat every second on its own socket (zmq sockets are single-thread)."""

    def __init__(self, ctx: zmq.Context, env: RankEnv):
        super().__init__(daemon=True, name=f"heartbeat-{env.rank}")
        self.ctx, self.env = ctx, env
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.env.coord)
        channel = Channel(sock, self.env.secret)
        while not self.stopped.wait(HEARTBEAT_PERIOD_S):
            channel.send(Heartbeat(self.env.rank))
        sock.close()


class RankWorker:
    """Follows orders: Train, SyncNow, Evaluate, Stop."""

    def __init__(self, env: RankEnv, config: ExperimentConfig):
        self.env, self.config = env, config
        self.device = _pick_device(env)
        if self.device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        self.recipe = load_recipe(config.recipe.module, config.recipe.params, config.data.transform)
        self.replica = Replica(self.recipe, self.device, config.seed,
                               lr_scale=lr_factor(env.world_size, config.lr_scale_ratio),
                               max_grad_norm=config.max_grad_norm)
        self.flat = FlatParams(self.replica.model)
        self.outer = OuterOptimizer(config.outer)
        self.source = BatchSource(self.recipe.call("train_dataset"), self.device)
        self.eval_data = self.recipe.call("eval_dataset") if self.recipe.has_eval else None
        slow = config.cluster.emulate_slowdown
        self.slowdown = slow[env.rank] if slow and env.rank < len(slow) else 1.0
        self._perms: Dict[int, torch.Tensor] = {}
        self._steps_since_reduce = 0
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(env.coord)
        self.channel = Channel(sock, env.secret)

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=max(60.0, 10 * self.config.heartbeat_timeout_secs))
        dist.init_process_group(backend, rank=self.env.rank, world_size=self.env.world_size,
                                timeout=timeout, device_id=self.device if backend == "nccl" else None)
        heartbeat = _Heartbeat(self.ctx, self.env)
        heartbeat.start()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.channel.send(RankJoined(self.env.rank, self.env.world_size, os.getpid(),
                                     socket.gethostname(), str(self.device), name,
                                     len(self.source)))
        try:
            self._serve()
        finally:
            heartbeat.stopped.set()
            dist.destroy_process_group()
        return 0

    def _serve(self) -> None:
        while True:
            received = self.channel.recv(timeout_ms=1000)
            if received is None:
                if self._orphaned():
                    raise SystemExit("flodl_run.rank: the launcher is gone; exiting")
                continue
            order = received.message
            if isinstance(order, Stop):
                return
            self._handle(order)

    def _orphaned(self) -> bool:
        return self.env.parent_pid is not None and os.getppid() != self.env.parent_pid

    def _handle(self, order: Any) -> None:
        if isinstance(order, Train):
            self._train(order)
        elif isinstance(order, SyncNow):
            self._reduce(order)
        elif isinstance(order, Evaluate):
            score = self.replica.evaluate(self.eval_data) if self.eval_data is not None else float("nan")
            self.channel.send(Evaluated(self.env.rank, order.epoch, score))

    # ---- training --------------------------------------------------------------------------

    def _indices(self, pass_index: int, offset: int, size: int) -> torch.Tensor:
        if pass_index not in self._perms:
            self._perms = {pass_index: permutation(len(self.source) * self.config.data.augment,
                                                   self.config.seed, pass_index)}
        return self._perms[pass_index][offset:offset + size] % len(self.source)

    def _train(self, order: Train) -> None:
        step_ms: List[float] = []
        loss_sum, samples = 0.0, 0
        for pass_index, offset, size in order.slices:
            indices = self._indices(pass_index, offset, size)
            for batch in self.source.batches(indices, self.config.batch_size):
                began = time.perf_counter()
                loss_sum += self.replica.step(batch)
                self._emulate_slowdown(began)
                step_ms.append((time.perf_counter() - began) * 1000.0)
                samples += len(batch[0]) if isinstance(batch, (list, tuple)) else self.config.batch_size
        self._steps_since_reduce += len(step_ms)
        self.channel.send(WindowDone(
            self.env.rank, order.window, order.epoch, len(step_ms), samples, sum(step_ms),
            _fill_ms(step_ms), loss_sum, self.replica.lr, scalars.drain()))

    def _emulate_slowdown(self, began: float) -> None:
        """DESIGN §13: sleep (f - 1) x the measured step time so this rank acts f times slower."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - began))

    def _reduce(self, order: SyncNow) -> None:
        outcome = weighted_reduce_(self.flat, self._steps_since_reduce, self.config.elche.gamma)
        if outcome.applied and self.outer.step_(self.flat.buffers) and \
                self.config.outer.kind is OuterKind.diloco:
            self.replica.optimizer.state.clear()  # DiLoCo: inner state restarts from the new global
        self.replica.seek_schedule(order.global_step)
        self._steps_since_reduce = 0
        self.channel.send(Reduced(self.env.rank, order.round, outcome.divergence, outcome.weight))


def _fill_ms(step_ms: List[float]) -> float:
    """Excess of the first batch over the mean of the rest (cold caches, lazy init)."""
    if len(step_ms) < 2:
        return 0.0
    rest = sum(step_ms[1:]) / (len(step_ms) - 1)
    return max(0.0, step_ms[0] - rest)


def main() -> int:
    env = RankEnv.from_environ(dict(os.environ))
    config = experiment_from_yaml(env.run_file.read_text())
    try:
        worker = RankWorker(env, config)
    except Exception as exc:
        print(f"rank {env.rank}: failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    try:
        return worker.run()
    except Exception as exc:
        worker.channel.send(RankFailed(env.rank, f"{type(exc).__name__}: {exc}"))
        raise


if __name__ == "__main__":
    sys.exit(main())
