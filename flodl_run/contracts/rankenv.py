"""The rank's environment contract: every variable a launcher gives a rank, written and read here.

torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, plus ours
(FLODL_RUN_*: the coordinator's address and key, the run file, the device pin, the launcher's
pid and node) and the process knobs a launcher sets with them (threads, GPU pin, interfaces).
Each launcher (local, ssh, docker, Slurm, a zygote's fork) fills what it knows and writes it
with `RankEnvironment.to_environ`; the rank reads it back with `from_environ`
(flodl_run.rank.env). Standard library only: the ssh and srun entries import it before torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional

# Our variables (FLODL_RUN_*): every launcher writes them through RankEnvironment, never by name.
COORD_ENV = "FLODL_RUN_COORD"
SECRET_ENV = "FLODL_RUN_SECRET"
SECRET_FILE_ENV = "FLODL_RUN_SECRET_FILE"
RUN_FILE_ENV = "FLODL_RUN_FILE"
PARENT_PID_ENV = "FLODL_RUN_PARENT_PID"
DEVICE_ENV = "FLODL_RUN_DEVICE"
NODE_ENV = "FLODL_RUN_NODE"
LAUNCHER_NODE_ENV = "FLODL_RUN_LAUNCHER_NODE"
STORE_HOSTED_ENV = "FLODL_RUN_STORE_HOSTED"
SHM_PREFIX_ENV = "FLODL_RUN_SHM_PREFIX"

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            COORD_ENV, SECRET_ENV, RUN_FILE_ENV)
"""What a rank cannot start without."""


@dataclass(frozen=True)
class RankEnvironment:
    """What a launcher tells one rank through its environment; None (or False) = not written.

    Launchers write in stages (the ssh launcher knows the rank's numbers, the remote end the run
    file; srun's step the coordinator, each task its numbers), so every field is optional here;
    the rank checks REQUIRED when it reads."""

    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    local_world_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    coord: Optional[str] = None
    """The coordinator's address (tcp://host:port)."""
    secret: Optional[bytes] = None
    """The run's key; written only where no argv or log sees it (a child's environment, stdin)."""
    secret_file: Optional[Path] = None
    """A 0600 file holding the key as hex (Slurm: srun's environment must not carry it)."""
    run_file: Optional[Path] = None
    """The resolved run.yaml."""
    parent_pid: Optional[int] = None
    """The launcher's pid, which the rank's orphan check watches."""
    device: Optional[str] = None
    """The rank's device pin (`cpu`, `cuda:0`); a cuda pin numbers GPUs in PCI bus order."""
    gpu: Optional[str] = None
    """CUDA_VISIBLE_DEVICES: the one GPU (a UUID) this rank sees."""
    threads: Optional[int] = None
    """OMP_NUM_THREADS and MKL_NUM_THREADS of a CPU rank."""
    node: Optional[str] = None
    """This rank's host as the config names it."""
    launcher_node: Optional[str] = None
    """The launcher's host: its MLflow monitor samples that node, so ranks there sample nothing."""
    store_hosted: bool = False
    """The launcher hosts the rendezvous store; rank 0 does not start one."""
    shm_prefix: Optional[str] = None
    """Same host as the coordinator: parameters may travel through /dev/shm under this prefix."""
    socket_ifname: Optional[str] = None
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME."""
    unbuffered: bool = False
    """PYTHONUNBUFFERED=1: the rank's output reaches the launcher line by line."""
    project: Optional[str] = None
    """The directory the rank imports the recipe from first, as the launcher did: put before
    the PYTHONPATH the rank would otherwise have (written by `over`, which knows that one)."""

    def to_environ(self) -> Dict[str, str]:
        """The variables of the fields that are set, as strings."""
        cuda = self.device is not None and self.device.startswith("cuda")
        written = {
            "RANK": self.rank, "LOCAL_RANK": self.local_rank, "WORLD_SIZE": self.world_size,
            "LOCAL_WORLD_SIZE": self.local_world_size, "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port, COORD_ENV: self.coord,
            SECRET_ENV: self.secret.hex() if self.secret is not None else None,
            SECRET_FILE_ENV: self.secret_file, RUN_FILE_ENV: self.run_file,
            PARENT_PID_ENV: self.parent_pid, NODE_ENV: self.node,
            LAUNCHER_NODE_ENV: self.launcher_node,
            STORE_HOSTED_ENV: "1" if self.store_hosted else None,
            SHM_PREFIX_ENV: self.shm_prefix or None,
            "PYTHONUNBUFFERED": "1" if self.unbuffered else None,
            "NCCL_SOCKET_IFNAME": self.socket_ifname, "GLOO_SOCKET_IFNAME": self.socket_ifname,
            "CUDA_VISIBLE_DEVICES": self.gpu,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID" if cuda else None,
            DEVICE_ENV: self.device,
            "OMP_NUM_THREADS": self.threads, "MKL_NUM_THREADS": self.threads,
        }
        return {name: str(value) for name, value in written.items() if value is not None}

    def over(self, base: Mapping[str, str]) -> Dict[str, str]:
        """`base` (an environment to inherit) with this contract's variables written over it,
        and the project first on its PYTHONPATH."""
        env = dict(base)
        env.update(self.to_environ())
        if self.project:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.project, env.get("PYTHONPATH")) if p)
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "RankEnvironment":
        """What `env` holds of the contract (a variable not there stays None); a rank's
        LOCAL_RANK defaults to its RANK, as on one host."""
        def number(name: str) -> Optional[int]:
            value = env.get(name)
            return int(value) if value else None

        def path(name: str) -> Optional[Path]:
            value = env.get(name)
            return Path(value) if value is not None else None

        secret, threads = env.get(SECRET_ENV), env.get("OMP_NUM_THREADS", "")
        return cls(
            rank=number("RANK"), local_rank=number("LOCAL_RANK" if "LOCAL_RANK" in env else "RANK"),
            world_size=number("WORLD_SIZE"), local_world_size=number("LOCAL_WORLD_SIZE"),
            master_addr=env.get("MASTER_ADDR"), master_port=number("MASTER_PORT"),
            coord=env.get(COORD_ENV),
            secret=bytes.fromhex(secret) if secret is not None else None,
            secret_file=path(SECRET_FILE_ENV), run_file=path(RUN_FILE_ENV),
            parent_pid=number(PARENT_PID_ENV), device=env.get(DEVICE_ENV),
            gpu=env.get("CUDA_VISIBLE_DEVICES"), threads=int(threads) if threads.isdigit() else None,
            node=env.get(NODE_ENV), launcher_node=env.get(LAUNCHER_NODE_ENV),
            store_hosted=env.get(STORE_HOSTED_ENV) == "1",
            shm_prefix=env.get(SHM_PREFIX_ENV), socket_ifname=env.get("NCCL_SOCKET_IFNAME"),
            unbuffered=env.get("PYTHONUNBUFFERED") == "1")


def missing(env: Mapping[str, str]) -> List[str]:
    """The REQUIRED variables `env` lacks, in REQUIRED's order."""
    return [name for name in REQUIRED if name not in env]

