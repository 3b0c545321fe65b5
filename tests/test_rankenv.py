"""The rank-environment contract (contracts/rankenv): what a launcher writes is what a rank
reads back, field for field, and a partial write (one stage of a launch) reads as partial."""

from __future__ import annotations

from pathlib import Path

from flodl_run.contracts.rankenv import REQUIRED, RankEnvironment, missing


def test_every_field_a_launcher_writes_reads_back_the_same() -> None:
    """Rule: to_environ then from_environ is the identity for a fully written contract, and
    the variables are the ones torchrun and torch.distributed read (strings)."""
    written = RankEnvironment(
        rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="127.0.0.1",
        master_port=29511, coord="tcp://127.0.0.1:5555", secret=b"\x01\xfe" * 16,
        secret_file=Path("/tmp/key"), run_file=Path("/tmp/run.yaml"), parent_pid=4242,
        device="cuda:1", gpu="GPU-0f", threads=None, node="node-b.invalid",
        launcher_node="node-a.invalid", store_hosted=True, shm_prefix="flodl_run-1-x",
        socket_ifname="lo", unbuffered=True)
    env = written.to_environ()
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["MASTER_PORT"] == "29511"
    assert env["FLODL_RUN_SECRET"] == (b"\x01\xfe" * 16).hex()
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert all(isinstance(value, str) for value in env.values())
    assert RankEnvironment.from_environ(env) == written
    assert missing(env) == []


def test_a_stage_of_a_launch_writes_only_what_it_knows() -> None:
    """Rule: unset fields write no variable (a later stage fills them), `over` keeps the base
    environment and puts the project first on PYTHONPATH, and `missing` names what a rank
    still lacks in REQUIRED's order."""
    stage = RankEnvironment(rank=0, world_size=2, threads=2, project="/work/project")
    env = stage.over({"PATH": "/usr/bin", "PYTHONPATH": "/site"})
    assert env["PATH"] == "/usr/bin" and env["PYTHONPATH"] == "/work/project:/site"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert "FLODL_RUN_COORD" not in env and "CUDA_DEVICE_ORDER" not in env
    assert missing(env) == [name for name in REQUIRED if name not in ("RANK", "WORLD_SIZE")]
    read = RankEnvironment.from_environ(env)
    assert (read.rank, read.local_rank, read.world_size, read.threads, read.coord) == (0, 0, 2, 2, None)
