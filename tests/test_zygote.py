"""The rank zygote: a rank forked from it looks to the supervisor like one it spawned (its own
environment, output pipe, process group and exit code), and the zygote does not outlive the
launcher's end of its socket. Full runs through the zygote are every other e2e test's default;
a SIGKILLed launcher is test_liveness's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from flodl_run.launch.zygote import START_ENV, Zygote, fork_ranks

RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FLODL_RUN_COORD",
             "FLODL_RUN_SECRET", "FLODL_RUN_FILE")


def _until(condition, timeout_s: float = 60.0) -> bool:
    """Poll an outcome until it holds (bounded): not an ordering device."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _base_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in RANK_KEYS}


def test_the_start_mode_is_zygote_unless_spawn_is_asked_and_a_bad_value_is_named():
    """FLODL_RUN_RANK_START: unset or `zygote` forks (on Linux), `spawn` starts one interpreter
    per rank, anything else stops the launch naming the variable and the value."""
    assert fork_ranks({}) is True
    assert fork_ranks({START_ENV: "zygote"}) is True
    assert fork_ranks({START_ENV: "spawn"}) is False
    assert fork_ranks({}, on_gpus=True) is False  # GPU ranks spawn unless asked
    assert fork_ranks({START_ENV: "zygote"}, on_gpus=True) is True
    with pytest.raises(SystemExit, match="FLODL_RUN_RANK_START='fork'"):
        fork_ranks({START_ENV: "fork"})


def test_a_forked_rank_draws_fresh_random_state_like_a_new_interpreter():
    """Forked ranks must not share the zygote's global generators (a new interpreter seeds
    torch's and numpy's from the OS): the child reseeds both before the rank starts."""
    import numpy as np
    import torch

    from flodl_run.launch.zygote import fresh_random_state

    saved_torch, saved_numpy = torch.get_rng_state(), np.random.get_state()
    try:
        before = (torch.rand(4).tolist(), np.random.rand(4).tolist())
        torch.set_rng_state(saved_torch)
        np.random.set_state(saved_numpy)
        fresh_random_state()
        after = (torch.rand(4).tolist(), np.random.rand(4).tolist())
        assert after[0] != before[0] and after[1] != before[1]
    finally:
        torch.set_rng_state(saved_torch)
        np.random.set_state(saved_numpy)


@pytest.mark.e2e
def test_a_forked_rank_runs_the_rank_with_its_environment_and_its_output_and_exit_code(tmp_path):
    """The child runs flodl_run.rank under the environment it was sent (this one lacks keys,
    and the rank names exactly those), writes to the pipe passed with the request, and its exit
    code comes back as Popen's returncode would. Sealed, the zygote exits after its last child."""
    env = {**_base_env(), "RANK": "0", "WORLD_SIZE": "2"}
    zygote = Zygote(env, tmp_path / "zygote.log")
    rank = zygote.spawn(env)
    zygote.seal()
    output = rank.stdout.read()
    assert ("missing environment: MASTER_ADDR, MASTER_PORT, FLODL_RUN_COORD, FLODL_RUN_SECRET, "
            "FLODL_RUN_FILE") in output
    assert _until(lambda: rank.poll() is not None)
    assert rank.returncode == 1
    assert zygote.process.wait(timeout=60) == 0


@pytest.mark.e2e
def test_forked_ranks_lead_their_own_groups_die_by_them_and_the_zygote_leaves_on_eof(tmp_path):
    """Each rank is its own session (as start_new_session made it), named flodl_rankN: the
    supervisor's killpg(pid, SIGKILL) ends that rank only, reported as -9. When the launcher's
    end of the socket closes (its process died), the zygote exits though a child still runs."""
    run_file = tmp_path / "run.yaml"
    os.mkfifo(run_file)  # reading it blocks (no writer): a rank that stays alive, doing nothing
    env = {**_base_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "FLODL_RUN_COORD": "tcp://127.0.0.1:1", "FLODL_RUN_SECRET": "00",
           "FLODL_RUN_FILE": str(run_file)}
    zygote = Zygote(env, tmp_path / "zygote.log")
    ranks = [zygote.spawn({**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        for r, rank in enumerate(ranks):
            assert _until(lambda: os.getpgid(rank.pid) == rank.pid)
            assert _until(lambda: Path(f"/proc/{rank.pid}/comm").read_text() == f"flodl_rank{r}\n")
        os.killpg(ranks[0].pid, signal.SIGKILL)
        assert _until(lambda: ranks[0].poll() is not None)
        assert ranks[0].returncode == -signal.SIGKILL
        assert ranks[1].poll() is None
        zygote.sock.close()
        assert zygote.process.wait(timeout=60) == 0
    finally:
        for rank in ranks:
            try:
                os.killpg(rank.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
