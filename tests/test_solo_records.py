"""What an in-process (solo) run keeps when something goes wrong mid-run: the recipe raising in
a later epoch, or a disk that cannot take a checkpoint. End to end: the CLI as a subprocess."""

from __future__ import annotations

import pytest

from flodl_run.contracts.checkpoint import read_meta
from tests.support import _run, user_recipe

pytestmark = pytest.mark.e2e

RAISES_IN_THIRD_EPOCH = (
    "from recipes import digits_mlp\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "closed = []\n"
    "def epoch_fn(epoch, model):\n"
    "    closed.append(epoch)\n"
    "def train_step(model, batch):\n"
    "    if len(closed) == 2:\n"
    "        raise ValueError('the recipe broke in epoch 3')\n"
    "    return digits_mlp.train_step(model, batch)\n"
)


def test_a_recipe_error_in_a_solo_run_keeps_what_the_run_did(tmp_path):
    """Pins: any exception out of a solo run replaced its summary with an empty one (epochs [],
    checkpoint null, wall_s 0) although two epochs had trained and a valid bundle was on disk.
    Now the summary keeps the epochs done, the checkpoint written and the wall time, and says
    the recipe's error."""
    env = user_recipe(tmp_path, "late_raising", RAISES_IN_THIRD_EPOCH)
    stem = tmp_path / "bundle"
    proc, summary = _run(tmp_path, "recipe=custom", "recipe.module=late_raising", "cluster=solo",
                         "num_epochs=4", "checkpoint_every=1", f"save_path={stem}", env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and summary["status"] == "failed", out
    assert summary["message"] == "ValueError: the recipe broke in epoch 3", summary["message"]
    assert [e["epoch"] for e in summary["epochs"]] == [0, 1], summary["epochs"]
    assert summary["checkpoint"] == str(stem) and read_meta(stem).epoch == 2
    assert summary["wall_s"] > 0 and summary["mode"] == "solo"
