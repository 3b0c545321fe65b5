"""Failures read as failures: a recipe that raises, and a stop by SIGTERM, end to end with real
rank processes over Gloo."""

from __future__ import annotations

import json
import os
import signal

import pytest

from flodl_run.contracts.checkpoint import read_meta
from tests.support import _live_ranks, _run, start_cli, text_of, user_recipe, wait_for

pytestmark = pytest.mark.e2e

RAISES_IN_BUILD_MODEL = (
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def build_model(device, **_):\n"
    "    raise ValueError('the recipe cannot build its model')\n"
)


def test_a_recipe_that_raises_fails_the_run_with_its_own_error_and_nothing_else(tmp_path):
    """Rule: a recipe error in the ranks gives status failed and exit 1; each rank prints the
    user's exception once (rank, then the traceback of the recipe's code only, ending in the one
    error line), and no internal error follows (it used to end with an AttributeError and status
    shutdown_with_save). Exactly once: the test accepted a rank that printed nothing, and each
    rank printed its error line twice (in its first line, then under the traceback)."""
    env = user_recipe(tmp_path, "raising_recipe", RAISES_IN_BUILD_MODEL)
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=raising_recipe",
                         "cluster=cpu_pair", "num_epochs=1", env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert summary["status"] == "failed"
    assert "ValueError: the recipe cannot build its model" in summary["message"]
    assert summary["checkpoint"] is None
    for rank in (0, 1):
        printed = [line for line in out.splitlines() if line.startswith(f"[rank {rank}]")]
        assert sum("Traceback" in line for line in printed) == 1, out
        assert sum("ValueError: the recipe cannot" in line for line in printed) == 1, out
    frames = [line for line in out.splitlines() if line.startswith("[rank") and 'File "' in line]
    assert frames and all('raising_recipe.py", line 3, in build_model' in f for f in frames), out
    assert "AttributeError" not in out and "Exception in thread" not in out, out


@pytest.mark.parametrize("cluster", ["cpu_pair", "solo"])
def test_sigterm_is_named_sigterm(tmp_path, cluster):
    """Rule: a run stopped by SIGTERM says so (distributed runs said SIGINT; in-process runs died
    without a summary), ends interrupted with exit 130 and leaves no rank behind; both save
    what they trained (the in-process run saved nothing)."""
    run_dir = tmp_path / "run"
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", f"cluster={cluster}", "num_epochs=500")
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("epoch 1/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert _live_ranks(run_dir) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "SIGTERM" in summary["message"] and "SIGINT" not in summary["message"]
    assert summary["checkpoint"] == str(run_dir / "checkpoint")
    assert read_meta(summary["checkpoint"]).save_reason == "graceful_shutdown"


EXITS_IN_TRAIN_STEP = (
    "import os, sys\n"
    "from recipes import digits_mlp\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "steps = []\n"
    "def train_step(model, batch):\n"
    "    steps.append(1)\n"
    "    if len(steps) == 2 and os.environ['RANK'] == '1':\n"
    "        sys.exit(0)\n"
    "    if len(steps) == 2 and os.environ['RANK'] == '2':\n"
    "        os._exit(0)\n"
    "    return digits_mlp.train_step(model, batch)\n"
)


def test_a_recipe_that_exits_fails_its_rank_as_a_recipe_error(tmp_path):
    """Rule: a recipe's sys.exit or os._exit fails its rank as a recipe error, and the `done:`
    line says so when the survivors finish the run. It used to read `rank 1 lost: exited with
    code 0`, and the run completed as if nothing of the recipe's had gone wrong."""
    env = user_recipe(tmp_path, "exiting_recipe", EXITS_IN_TRAIN_STEP)
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=exiting_recipe", "cluster=cpu",
                         "cluster.num_ranks=3", "cluster.threads_per_rank=1", "num_epochs=1", env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and summary["status"] == "completed", out
    assert sorted(summary["dead_ranks"]) == [1, 2], out
    assert summary["message"].startswith("rank 1 failed: SystemExit: the recipe called sys.exit(0)"), out
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert done and "rank 1 failed: SystemExit: the recipe called sys.exit(0)" in done[0], out
    lost = [json.loads(line)["message"] for line in (tmp_path / "run" / "events.jsonl").open()
            if json.loads(line)["kind"] == "rank_lost"]
    assert any(m.startswith("rank 2 lost: failed: exited with code 0 before it was told to stop")
               for m in lost), lost
    # once, by the progress: the coordinator's log line went to the terminal too
    assert out.count("rank 2 lost: failed: exited with code 0") == 1, out
    printed = [line for line in out.splitlines() if line.startswith("[rank 1]")]
    assert sum("Traceback" in line for line in printed) == 1, out
    assert 'exiting_recipe.py", line 8, in train_step' in out, out


STARTS_PROCESSES = (
    "import os, subprocess, time\n"
    "from recipes import digits_mlp\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def build_model(device, **kw):\n"
    "    sleeper = subprocess.Popen(['sleep', '3600'])\n"
    "    child = os.fork()\n"
    "    if child == 0:\n"
    "        while True:\n"
    "            time.sleep(60)\n"
    "    with open(os.environ['LEFT_FILE'], 'a') as left:\n"
    "        left.write(f'{sleeper.pid} {child}\\n')\n"
    "    return digits_mlp.build_model(device, **kw)\n"
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap what it inherits)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_what_a_recipe_starts_ends_with_the_run(tmp_path):
    """Pins: ranks that exited cleanly left what the recipe started (a `sleep 3600`, an os.fork
    child) running, re-parented to init: the supervisor signalled only ranks still alive. Now
    what is left in the ranks' process groups is ended with the run."""
    left = tmp_path / "left"
    env = user_recipe(tmp_path, "spawning_recipe", STARTS_PROCESSES, LEFT_FILE=str(left))
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=spawning_recipe",
                         "cluster=cpu_pair", "num_epochs=1", env=env)
    pids = [int(pid) for pid in left.read_text().split()]
    try:
        assert proc.returncode == 0 and summary["status"] == "completed", proc.stdout + proc.stderr
        assert len(pids) == 4 and [pid for pid in pids if _running(pid)] == []
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.apart  # its bound is in seconds (the children end within 10 s)
def test_what_a_recipe_starts_ends_with_a_killed_launcher(tmp_path):
    """Pins: with the launcher killed by SIGKILL, the ranks saw they were orphaned (or their
    output pipe broke) and exited, and what their recipe had started (a `sleep 3600`, an
    os.fork child) ran on, re-parented to init: no launcher was left to end the ranks' process
    groups, and a rank did not end its own. Now an orphaned rank ends its group as it exits."""
    left, run_dir = tmp_path / "left", tmp_path / "run"
    env = user_recipe(tmp_path, "spawning_recipe", STARTS_PROCESSES, LEFT_FILE=str(left))
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", "recipe=custom",
                     "recipe.module=spawning_recipe", "cluster=cpu_pair", "num_epochs=500", env=env)
    pids = []
    try:
        wait_for("both ranks' children", lambda: len(text_of(left).split()) == 4)
        pids = [int(pid) for pid in left.read_text().split()]
        assert len(_live_ranks(run_dir)) == 2
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        wait_for("the orphaned ranks' exit", lambda: _live_ranks(run_dir) == [], timeout_s=30)
        wait_for("the recipe's children's end", lambda: [p for p in pids if _running(p)] == [],
                 timeout_s=10)
    finally:
        for pid in pids + _live_ranks(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


PRINTS_ITS_CHILDS_ENVIRONMENT = (
    "import os, subprocess\n"
    "from recipes import digits_mlp\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def build_model(device, **kw):\n"
    "    names = subprocess.run(['env'], capture_output=True, text=True).stdout\n"
    "    with open(os.environ['ENV_FILE'], 'a') as out:\n"
    "        out.write(''.join(line.split('=', 1)[0] + '\\n' for line in names.splitlines()))\n"
    "    return digits_mlp.build_model(device, **kw)\n"
)


def test_what_a_recipe_starts_does_not_inherit_the_run_secret(tmp_path):
    """Pins: every process a recipe started inherited FLODL_RUN_SECRET, the key that lets a
    process speak for a rank on the control plane. Now the rank drops it from its environment
    once read: an `env` the recipe runs on either rank lists the run's other variables, not
    the secret."""
    names = tmp_path / "names"
    env = user_recipe(tmp_path, "env_recipe", PRINTS_ITS_CHILDS_ENVIRONMENT, ENV_FILE=str(names))
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=env_recipe", "cluster=cpu_pair",
                         "num_epochs=1", env=env)
    assert proc.returncode == 0 and summary["status"] == "completed", proc.stdout + proc.stderr
    seen = names.read_text().split()
    assert seen.count("FLODL_RUN_COORD") == 2, seen  # both ranks' children wrote theirs
    assert "FLODL_RUN_SECRET" not in seen


HANGS_IN_CHECKPOINT_FN = (
    "import time\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "def checkpoint_fn(epoch, model):\n"
    "    if epoch >= 1:\n"
    "        time.sleep(3600)\n"
)


@pytest.mark.apart  # its hang limits are in seconds (2 s): a loaded core must not stall a healthy rank
def test_every_rank_hung_in_a_save_fails_the_run_and_leaves_no_uncommitted_generation(tmp_path):
    """Pins a run whose every rank hangs in a save (checkpoint_fn from epoch 1 on; the writer
    lost, another survivor writes another generation, and hangs too): it was labelled
    shutdown_with_save while it said "no bundle", with the half-written generations g2 and g3
    left beside the bundle of g1. Now it ends failed, saying it did not save and what the save
    path still holds, and only the committed generation's files remain."""
    env = user_recipe(tmp_path, "hanging_save", HANGS_IN_CHECKPOINT_FN)
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=hanging_save", "cluster=cpu_pair",
                         "num_epochs=4", "checkpoint_every=1", "progress_timeout_secs=2", env=env)
    out = proc.stdout + proc.stderr
    stem = tmp_path / "run" / "checkpoint"
    assert proc.returncode == 1, out
    assert summary["status"] == "failed", summary
    assert summary["message"].startswith("all_ranks_lost: hung: its save ran for "), summary
    assert summary["message"].endswith(f"; not saved: no rank left to save; {stem} still holds the "
                                       "bundle of generation 1 (checkpoint, resume at epoch 2)")
    assert summary["checkpoint"] == str(stem) and read_meta(stem).generation == 1
    assert sorted(p.name for p in stem.parent.glob("checkpoint.g*")) == [
        "checkpoint.g1.optim.pt", "checkpoint.g1.optim.rank0.pt", "checkpoint.g1.optim.rank1.pt",
        "checkpoint.g1.pt"]
    assert "removed generation(s) g2, g3 of" in text_of(tmp_path / "run" / "events.jsonl")
