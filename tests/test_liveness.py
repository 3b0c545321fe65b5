"""Liveness beyond heartbeats: a rank hung inside train_step is declared dead and killed, and a
SIGKILLed launcher leaves no rank process and no shared-memory slab behind."""

from __future__ import annotations

import glob
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, MaxFailureConfig
from flodl_run.contracts.wire import Heartbeat
from flodl_run.control.context import RunContext
from flodl_run.control.membership import Membership, hung_limit_s
from flodl_run.control.runstate import ShutdownWithSave
from tests.support import REPO, _live_ranks, _run, start_cli

# Rank 1 blocks forever in its 5th train_step; its heartbeat thread keeps beating.
HANGING_RECIPE = """
import os, threading
from recipes.digits_mlp import (build_model, build_optimizer, eval_dataset, eval_step,
                                train_dataset, train_step as _step)
_steps = [0]
def train_step(model, batch):
    _steps[0] += 1
    if os.environ["RANK"] == "1" and _steps[0] == 5:
        threading.Event().wait()
    return _step(model, batch)
"""


class _Deaths:
    """Stands in for what a death does: records (rank, reason)."""

    def __init__(self):
        self.dead = []

    def __call__(self, rank, reason):
        self.dead.append((rank, reason))


def _membership(on_lost, smoothed=lambda: [2000.0, None], world=2, **limits):
    """A Membership driven alone: no coordinator, no socket (the channel, send and next are
    never reached by liveness and death handling in the coordinator backend)."""
    limits = dict(dict(heartbeat_timeout_s=1e9, progress_factor=20.0, progress_floor_s=10.0,
                       max_failure=MaxFailureConfig()), **limits)
    config = ExperimentConfig(elche=ElCheConfig.preset("cpu_cadence"), max_failure=limits["max_failure"],
                              heartbeat_timeout_secs=limits["heartbeat_timeout_s"],
                              progress_factor=limits["progress_factor"],
                              progress_timeout_secs=limits["progress_floor_s"])
    ctx = RunContext(config, world, balance=SimpleNamespace(smoothed_ms=smoothed))
    return Membership(ctx, channel=None, losses=SimpleNamespace(lost=on_lost), collective=False)


def test_the_hung_limit_is_a_multiple_of_the_batch_time_with_a_floor():
    """Pins max(progress_factor x smoothed batch time, progress_timeout_secs); the floor alone
    before any batch was timed (a slow first batch is not a hang)."""
    assert hung_limit_s(None, 20.0, 300.0) == 300.0
    assert hung_limit_s(50.0, 20.0, 300.0) == 300.0
    assert hung_limit_s(30_000.0, 20.0, 300.0) == 600.0


def test_only_a_training_rank_whose_count_stands_still_is_hung():
    """Pins what counts as progress: a new batch count, or not training (idle, or busy in an
    ordered reduce, eval or save) restarts the clock; a training rank stuck on the same count
    past its limit (rank 0: 20 x 2 s = 40 s; rank 1: the 10 s floor) is reported, once per
    check, with the reason."""
    lost = _Deaths()
    ranks = _membership(lost)
    now = time.monotonic()
    ranks.note_progress(Heartbeat(0, 7, True), now - 30)   # 30 s < 40 s: fine
    ranks.note_progress(Heartbeat(1, 3, True), now - 60)
    ranks.note_progress(Heartbeat(1, 3, False), now - 5)   # then it went into an eval
    ranks.check_liveness()
    assert not ranks.absorb() and lost.dead == []
    ranks.note_progress(Heartbeat(0, 7, True), now - 20)   # same count: the clock keeps running
    ranks.batch_clock[1] = (3, now - 11)
    ranks.liveness_checked = 0.0
    ranks.check_liveness()
    assert ranks.absorb() and ranks.alive == {0}
    assert [r for r, _ in lost.dead] == [1]
    assert re.fullmatch(r"hung: no batch finished for 1\d\.\ds while training \(limit 10s; "
                        r"last at batch 3\)", lost.dead[0][1])


def test_a_silent_rank_dies_once_and_the_last_death_ends_the_run_with_a_save():
    """Pins membership's own rules, driven alone: a rank silent past heartbeat_timeout_secs is
    reported with its silence, a death is absorbed once (a second report of the same rank
    changes nothing), and losing every rank raises ShutdownWithSave(all_ranks_lost)."""
    lost = _Deaths()
    ranks = _membership(lost, heartbeat_timeout_s=5.0)
    now = time.monotonic()
    ranks.heard(0, now)
    ranks.heard(1, now - 7.5)
    ranks.check_liveness()
    assert ranks.absorb() and ranks.alive == {0}
    assert lost.dead == [(1, "silent for 7.5s (heartbeat timeout 5s)")]
    ranks.report_death(1, "exited with code -9")
    assert not ranks.absorb() and len(lost.dead) == 1
    ranks.report_death(0, "exited with code 1")
    with pytest.raises(ShutdownWithSave) as stop:
        ranks.absorb()
    assert (stop.value.reason, stop.value.detail) == ("all_ranks_lost", "exited with code 1")
    assert ranks.alive == set() and [r for r, _ in lost.dead] == [1, 0]


def test_a_coordinator_that_was_stopped_gives_every_rank_a_fresh_grace_period():
    """Pins a paused launcher: SIGSTOP for 8 s (Ctrl-Z, a VM pause), then SIGCONT, with
    heartbeat_timeout_secs=5, and healthy ranks were declared `silent for 8.0s` and killed,
    judged by the coordinator's own stalled clock. A gap in the coordinator's loop longer than
    the timeout now restarts every rank's heartbeat and progress clocks instead; the next
    silence is judged as before."""
    lost = _Deaths()
    ranks = _membership(lost, heartbeat_timeout_s=5.0)
    now = time.monotonic()
    ranks.heard(0, now - 8.0, Heartbeat(0, 4, True))
    ranks.heard(1, now - 8.0, Heartbeat(1, 9, True))
    ranks.loop_seen = now - 8.0  # the loop's last pass, before the stop
    ranks.check_liveness()
    assert not ranks.absorb() and lost.dead == []
    assert all(now - seen < 1.0 for seen in ranks.last_seen.values())
    assert [batches for batches, _ in ranks.batch_clock.values()] == [4, 9]
    ranks.last_seen[1] -= 6.0  # then rank 1 falls silent for real
    ranks.liveness_checked = 0.0
    ranks.check_liveness()
    assert ranks.absorb() and [r for r, _ in lost.dead] == [1]


def test_a_silence_is_judged_after_the_queued_heartbeats_are_read():
    """Pins the other half: with heartbeats waiting on the channel, a rank that only looks
    silent (its beats are queued, unread) is not judged until they are read, nor later than
    one more heartbeat timeout while input keeps coming."""
    import zmq

    from flodl_run.contracts.wire import Channel

    ctx = zmq.Context.instance()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://liveness-queue")
    theirs.connect("inproc://liveness-queue")
    try:
        lost = _Deaths()
        ranks = _membership(lost, heartbeat_timeout_s=5.0)
        ranks.channel = Channel(ours, b"k" * 32)
        now = time.monotonic()
        ranks.heard(1, now - 7.0)
        theirs.send(b"rank 1's heartbeat, not read yet")
        assert ours.poll(5000, zmq.POLLIN)
        ranks.check_liveness()
        assert not ranks.absorb()  # put off: the beat that would clear it may be in the queue
        ranks.verdicts_postponed -= 6.0  # input kept coming for longer than a timeout
        ranks.liveness_checked = 0.0
        ranks.check_liveness()
        assert ranks.absorb() and [r for r, _ in lost.dead] == [1]
    finally:
        ours.close(linger=0)
        theirs.close(linger=0)


def test_an_eval_or_save_may_take_a_multiple_of_the_longest_measured_with_a_floor():
    """Pins the order deadlines: progress_factor x the floor (progress_timeout_secs) before
    any was measured, then progress_factor x the longest of its kind, never under the floor; a
    rank past it is reported hung once, naming the order, and one that answered in time is not."""
    lost = _Deaths()
    ranks = _membership(lost, world=3, progress_factor=3.0, progress_floor_s=4.0)
    assert ranks.orders.limit_s("eval") == 12.0
    ranks.orders.took("eval", 2.0)
    ranks.orders.took("eval", 5.0)
    ranks.orders.took("eval", 1.0)
    ranks.orders.took("save", 0.1)
    assert (ranks.orders.limit_s("eval"), ranks.orders.limit_s("save")) == (15.0, 4.0)
    now = time.monotonic()
    assert not ranks.overdue("eval", {1}, now - 14.0)
    assert ranks.overdue("save", {0, 1}, now - 6.0)
    assert ranks.absorb() and ranks.alive == {2}
    assert [r for r, _ in lost.dead] == [0, 1]
    assert re.fullmatch(r"hung: its save ran for \d+\.\ds \(limit 4s\)", lost.dead[0][1])


HANGING_EVAL = """
import os, threading
from recipes import digits_mlp
from recipes.digits_mlp import *  # noqa: F401,F403
def eval_step(model, batch):
    if os.environ["RANK"] == "1":
        threading.Event().wait()
    return digits_mlp.eval_step(model, batch)
"""


@pytest.mark.e2e
def test_a_rank_hung_in_its_eval_is_declared_dead_and_another_evaluates(tmp_path):
    """Pins a hung eval: an eval_step that hangs on the eval rank went undetected
    (100 s with heartbeat 5 s, progress 10 s): a rank not training restarts its batch clock.
    The eval now has its own deadline (here progress_factor x the 2 s floor, none measured
    yet); the rank is declared hung, the other rank evaluates, and the run completes."""
    (tmp_path / "hanging_eval.py").write_text(HANGING_EVAL)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=hanging_eval", "cluster=cpu_pair",
                         "num_epochs=2", "epoch_callback_policy=rank:1", "progress_timeout_secs=2",
                         "progress_factor=1", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["dead_ranks"] == [1]
    assert "rank 1 lost: hung: its eval ran for" in proc.stdout
    assert all(epoch["eval"] is not None for epoch in summary["epochs"])


@pytest.mark.apart
@pytest.mark.e2e
def test_a_rank_hung_in_train_step_is_declared_dead_and_the_run_goes_on(tmp_path):
    """Pins hung-rank detection: rank 1 blocks in its 5th train_step while its heartbeats go
    on; with progress_timeout_secs=3 it is declared dead as hung (within 3-8 s) and the pair's
    survivor completes the run with every sample."""
    (tmp_path / "hanging_recipe.py").write_text(HANGING_RECIPE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=hanging_recipe",
                         "cluster=cpu_pair", "elche=cpu_cadence", "num_epochs=2",
                         "progress_timeout_secs=3", "progress_factor=1", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["dead_ranks"] == [1]
    hung = float(re.search(r"rank 1 lost: hung: no batch finished for ([0-9.]+)s", proc.stdout)[1])
    assert 3.0 <= hung <= 8.0
    assert all(e["samples"] == 1437 for e in summary["epochs"])


@pytest.mark.apart
@pytest.mark.e2e
def test_an_injected_hang_is_declared_dead_by_heartbeat_timeout(tmp_path):
    """Pins the `hang` fault end to end: rank 1 of a cpu_cadence pair stops after its 8th batch,
    sends no more heartbeats and does not exit; it is declared dead as silent after
    heartbeat_timeout_secs=3 (within 3-8 s), the launcher kills it, none of the run's processes
    is left, and the survivor completes the run with every sample."""
    env = dict(os.environ, FLODL_RUN_FAULT="1:8:hang")
    proc, summary = _run(tmp_path, "cluster=cpu_pair", "elche=cpu_cadence", "num_epochs=2",
                         "heartbeat_timeout_secs=3", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["dead_ranks"] == [1]
    assert "rank 1: hanging (injected fault)" in proc.stdout + proc.stderr
    assert "| rank 1 lost (events.jsonl says why)" in proc.stdout.splitlines()[-2]  # the done line
    silent = float(re.search(r"rank 1 lost: silent for ([0-9.]+)s", proc.stdout)[1])
    assert 3.0 <= silent <= 8.0
    assert all(e["samples"] == 1437 for e in summary["epochs"])
    assert _live_ranks(tmp_path / "run") == []


@pytest.mark.e2e
def test_a_sigkilled_launcher_leaves_no_rank_and_no_slab(tmp_path):
    """Pins orphan handling: SIGKILL the launcher of a cpu_sync pair mid-run (slabs in use);
    its ranks notice from their heartbeat thread, remove the run's /dev/shm directory (theirs
    and the coordinator's slabs) and exit: none is left re-parented to init."""
    proc = start_cli("tracking=off", f"hydra.run.dir={tmp_path / 'run'}", "cluster=cpu_pair",
                     "elche=cpu_sync", "num_epochs=500")
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("epoch 1/"):
            break
    slabs = glob.glob(f"/dev/shm/flodl_run-{proc.pid}-*/*")
    ranks = _live_ranks(tmp_path / "run")
    assert slabs and len(ranks) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while (_live_ranks(tmp_path / "run") or glob.glob(f"/dev/shm/flodl_run-{proc.pid}-*")) and \
            time.monotonic() < deadline:
        time.sleep(0.1)  # polling an outcome, bounded; not ordering anything
    assert _live_ranks(tmp_path / "run") == []
    assert glob.glob(f"/dev/shm/flodl_run-{proc.pid}-*") == []


def test_a_launcher_that_exited_is_gone_while_it_waits_to_be_reaped():
    """Pins: a killed launcher stays a zombie until its parent reaps it, and the ranks' orphan
    check (`kill(pid, 0)`) took it for alive all that while; a rank that left meanwhile, on its
    broken output pipe, did not end what its recipe started (a flaky CI failure). A zombie is
    not alive; a live process is, and so is this one."""
    from flodl_run.contracts.checkpoint import pid_alive

    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert not pid_alive(child)
        assert pid_alive(os.getpid()) and pid_alive(os.getppid())
    finally:
        os.waitpid(child, 0)
    assert not pid_alive(child)
