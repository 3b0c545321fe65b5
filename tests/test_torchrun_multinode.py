"""Multi-node torchrun: two torchrun agents ("nodes" on loopback) meet over the c10d rendezvous
and their ranks join one controller-only launcher, as on a cluster where torchrun runs on
every node. Real processes: the launcher, two agents, three ranks over Gloo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO, _free_port, start_controller

RANKS = ("cluster.threads_per_rank=1", "num_epochs=2")


def _agents(env: dict, second_env: dict) -> list[subprocess.Popen]:
    """Two agents on one c10d rendezvous: 2 ranks on the first "node", 1 on the second. The
    first hosts the rendezvous store (is_host; on a cluster: the node the endpoint names), the
    one the survivors regroup on."""
    endpoint = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={n}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=flodl-test",
         f"--rdzv-conf=is_host={host}", "--max-restarts=0", "-m", "flodl_run.rank"],
        cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for n, e, host in ((2, env, "true"), (1, second_env, "false"))]


@pytest.mark.e2e
@pytest.mark.apart
def test_a_dead_torchrun_node_is_survived_by_the_other(tmp_path):
    """Pins multi-node torchrun and what a lost node means under it: agents with 2 and 1 ranks
    meet at one c10d endpoint and their 3 ranks (numbered by torchrun across both agents) join
    one run with the controller; the second agent's only rank is SIGKILLed after 8 batches (whichever
    global rank torchrun gave it); that agent ends failed, the first
    agent's two ranks carry on (the coordinator drops the silent rank after its heartbeat
    timeout), and the run completes with exactly that rank dead. The surviving agent then
    waits in torchrun's exit barrier for the dead one (300 s), so it is stopped here."""
    launcher, env = start_controller(tmp_path / "run", 3, *RANKS, "heartbeat_timeout_secs=4")
    doomed = dict(env, FLODL_RUN_FAULT="0:8:SIGKILL,1:8:SIGKILL,2:8:SIGKILL")
    agents = _agents(env, doomed)
    try:
        out = launcher.communicate(timeout=240)[0]
        assert launcher.returncode == 0, out[-3000:]
        assert agents[1].wait(timeout=60) != 0
    finally:
        for agent in agents:
            _stop(agent)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 3
    assert len(summary["dead_ranks"]) == 1
    assert f"rank {summary['dead_ranks'][0]} lost" in out


def _stop(agent: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 3 s: an agent waiting in torchrun's exit barrier has no
    rank left to stop, and its SIGTERM path waits out the barrier's store calls (in the suite
    it took 20 s or more)."""
    agent.terminate()
    try:
        agent.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.communicate()
