"""The rank zygote: a rank forked from it looks to the supervisor like one it spawned (its own
environment, output pipe, process group and exit code), and the zygote does not outlive the
launcher's end of its socket. The spare that `python -m flodl_run` forks when it starts gives its
ranks what a spawned rank has. Full runs through the zygote are every other e2e test's default;
a SIGKILLed launcher is test_liveness's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_run.launch.zygote import START_ENV, Zygote, fork_ranks
from tests.support import REPO, SLOW_STEPS, _run, run_cli, run_module, start_cli, user_recipe

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
    code comes back as Popen's returncode would. Sealed, the zygote exits after its last child.
    The zygote is the spare of a launcher forked from this worker's launch server
    (tests/zygote_probe.py), as a forked test launcher's runs have it: started here as a new
    interpreter it imported torch and the rank for about 4 CPU-s (the next test starts one)."""
    probe = run_module("tests.zygote_probe", str(tmp_path / "zygote.log"), timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen["spare"], seen
    assert ("missing environment: MASTER_ADDR, MASTER_PORT, FLODL_RUN_COORD, FLODL_RUN_SECRET, "
            "FLODL_RUN_FILE") in seen["output"]
    assert seen["code"] == 1
    assert seen["zygote"] == 0


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
    zygote = Zygote.start(env, tmp_path / "zygote.log")
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


SPARE_SCRIPT = """
import json, os, sys, threading, time
from flodl_run.launch import zygote
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
zygote.prefork()
spare, seen = zygote._spare, {}
if spare is not None:
    pid = spare.process.pid
    deadline = time.monotonic() + 30
    while open(f"/proc/{pid}/comm").read() != "flodl_zygote\\n" and time.monotonic() < deadline:
        time.sleep(0.02)
    seen = {"comm": open(f"/proc/{pid}/comm").read().strip(), "leads": os.getsid(pid) == pid,
            "parent": os.getpid()}
    zygote.ready_spare(None)
    seen["code"] = spare.process.returncode
print(json.dumps({"spare": spare is not None, **seen}))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("threads", ["bare", "thread"])
def test_the_spare_is_forked_only_from_one_bare_thread_and_a_run_without_ranks_dismisses_it(threads):
    """prefork: from a process that is one thread, a child named flodl_zygote leading its own
    session; `ready_spare(None)` (a run whose ranks do not fork here) makes it exit 0, reaped.
    With a second thread running, no fork (it would copy only the calling thread)."""
    out = subprocess.run([sys.executable, "-c", SPARE_SCRIPT, threads], cwd=REPO, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    if threads == "thread":
        assert seen == {"spare": False}
    else:
        assert seen == {"spare": True, "comm": "flodl_zygote", "leads": True,
                        "parent": seen["parent"], "code": 0}


VIEW_RECIPE = '''
import json, logging, os, signal, sys, torch
parent = f"/proc/{os.getppid()}/"
forked = open(parent + "comm").read().strip() == "flodl_zygote"  # the launcher is its parent then
launcher = int(open(parent + "stat").read().rsplit(")", 1)[1].split()[1]) if forked else os.getppid()
if "RANK" in os.environ:  # the ranks; the launcher imports this recipe too
    with open(os.environ["SEEN_FILE"], "a") as seen:
        seen.write(json.dumps({
            "rank": os.environ["RANK"], "threads": torch.get_num_threads(),
            "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through],
            "stderr": [type(sys.stderr.buffer).__name__, sys.stderr.write_through],
            "cwd": os.getcwd(), "path": list(dict.fromkeys(sys.path)),
            "argv0": os.path.basename(sys.argv[0]), "leads": os.getsid(0) == os.getpid(),
            "watches": os.environ["FLODL_RUN_PARENT_PID"] == str(launcher),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
            "logging": [len(logging.root.handlers), logging.root.level],
            "parent": [open(parent + "comm").read().strip(),
                       b"flodl_run.launch.zygote" in open(parent + "cmdline", "rb").read()]}) + "\\n")
from recipes.digits_mlp import *  # noqa: F401,F403  (the contract, from the default recipe)
'''


@pytest.mark.e2e
def test_a_rank_forked_from_the_spare_sees_what_a_spawned_rank_sees(tmp_path, monkeypatch):
    """The spare was forked from the launcher, not started by the supervisor: its ranks must
    still get the rank's threads (OMP_NUM_THREADS, which torch read before), unbuffered
    output, the launcher's working directory when they start (here Hydra's job.chdir moved it
    after the fork), sys.path, argv[0], their own session, the launcher to watch (not the
    zygote, which is the forked ranks' parent), default signal
    handlers and no logging handler, exactly as the same run's spawned ranks."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "view_recipe.py").write_text(VIEW_RECIPE)
    views = {}
    for start in ("spawn", "zygote"):
        seen = tmp_path / f"{start}.jsonl"
        env = dict(os.environ, PYTHONPATH=str(pkg), SEEN_FILE=str(seen), FLODL_RUN_RANK_START=start)
        proc, summary = _run(tmp_path / start, "cluster=cpu_pair", "cluster.threads_per_rank=null",
                             "num_epochs=1", "recipe=custom", "recipe.module=view_recipe",
                             "hydra.job.chdir=true", env=env)
        assert proc.returncode == 0 and summary["status"] == "completed", proc.stderr[-2000:]
        views[start] = sorted((json.loads(line) for line in seen.read_text().splitlines()),
                              key=lambda view: view["rank"])
        # Hydra moved the launcher into its run dir after the spare was forked: ranks start there
        run_dir = str(tmp_path / start / "run")
        assert [view.pop("cwd") for view in views[start]] == [run_dir] * 2
        for view in views[start]:
            view["path"] = ["<run dir>" if entry == run_dir else entry for entry in view["path"]]
    assert [view["rank"] for view in views["spawn"]] == ["0", "1"]
    parents = {start: [view.pop("parent") for view in views[start]] for start in views}
    assert parents["zygote"] == [["flodl_zygote", False]] * 2  # the spare, not a new interpreter
    assert all(comm != "flodl_zygote" for comm, _ in parents["spawn"])
    for key in views["spawn"][0]:
        assert [view[key] for view in views["zygote"]] == [view[key] for view in views["spawn"]], key
    assert views["spawn"][0]["threads"] == 1 and views["spawn"][0]["stdout"] == ["FileIO", True]


def _zygotes_of(pid: int) -> list[int]:
    """The children of `pid` named flodl_zygote."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, NotADirectoryError):
            continue
        name, rest = stat.split(" (", 1)[1].rsplit(") ", 1)
        if name == "flodl_zygote" and int(rest.split()[1]) == pid:
            found.append(int(entry.name))
    return found


@pytest.mark.e2e
def test_a_zygote_killed_alone_is_reported_and_its_ranks_train_on(tmp_path):
    """Pins: forked ranks watched the zygote as their launcher (FLODL_RUN_PARENT_PID was its
    pid), so a SIGKILL of flodl_zygote alone made every rank remove the run's /dev/shm and
    exit, and the run ended `all_ranks_lost` while the launcher was alive. Now they watch the
    launcher: 2.5 heartbeat periods after the kill (each rank checks once a period) both still
    train, the launcher says the zygote is gone, and a SIGTERM still stops the run with a save."""
    run_dir = tmp_path / "run"
    env = user_recipe(tmp_path, "slow_recipe", SLOW_STEPS)
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "cluster=cpu_pair", "recipe=custom",
                     "recipe.module=slow_recipe", "num_epochs=500", env=env)
    lines = []
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        if line.startswith("epoch 1/"):
            break
    (zygote,) = _zygotes_of(proc.pid)
    os.kill(zygote, signal.SIGKILL)
    killed = time.monotonic()
    for line in proc.stdout:  # not a synchronization: how long the ranks must have had to notice
        lines.append(line)
        if time.monotonic() - killed > 2.5 and line.startswith("epoch "):
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert proc.returncode == 130 and summary["status"] == "interrupted", out
    assert summary["dead_ranks"] == [] and "the launcher is gone" not in out, out
    assert f"the rank zygote (pid {zygote}) is gone" in out, out
    assert summary["checkpoint"] == str(run_dir / "checkpoint"), out


PARENT_RECIPE = '''
import json, os
if "RANK" in os.environ:  # the ranks; the launcher imports this recipe too
    parent = f"/proc/{os.getppid()}/"
    with open(os.environ["SEEN_FILE"], "a") as seen:
        seen.write(json.dumps({"run": os.environ["FLODL_RUN_FILE"], "rank": os.environ["RANK"],
                               "zygote": os.getppid(),
                               "comm": open(parent + "comm").read().strip()}) + "\\n")
from recipes.digits_mlp import *  # noqa: F401,F403  (the contract, from the default recipe)
'''


@pytest.mark.e2e
def test_a_sweeps_later_jobs_fork_their_ranks_from_the_first_jobs_zygote(tmp_path):
    """Pins the zygote kept between runs of one process: the jobs of a local multirun sweep run
    one after another in the sweep's process, and each later job used to start a new
    interpreter as its zygote (about 4 CPU-seconds of imports for a job that trains in a tenth
    of a second). Now the ranks of all three jobs are children of one flodl_zygote, each job's
    ranks see that job's own environment, each job has its zygote log, and the zygote does not
    outlive the sweep."""
    seen = tmp_path / "seen.jsonl"
    env = user_recipe(tmp_path, "parent_recipe", PARENT_RECIPE, SEEN_FILE=str(seen))
    sweep_dir = tmp_path / "multirun"
    done = run_cli("-m", "seed=1,2,3", "tracking=off", "cluster=cpu_pair", "num_epochs=1",
                   "recipe=custom", "recipe.module=parent_recipe", f"hydra.sweep.dir={sweep_dir}",
                   env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    views = [json.loads(line) for line in seen.read_text().splitlines()]
    runs = [str(sweep_dir / job / "run.yaml") for job in ("0", "1", "2")]
    assert sorted((v["run"], v["rank"]) for v in views) == [(r, k) for r in runs for k in ("0", "1")]
    assert {v["comm"] for v in views} == {"flodl_zygote"}
    (zygote,) = {v["zygote"] for v in views}  # one zygote for the three jobs
    assert all((sweep_dir / job / "ranks" / "zygote.log").exists() for job in ("0", "1", "2"))
    assert _until(lambda: not Path(f"/proc/{zygote}").exists(), 10.0)
