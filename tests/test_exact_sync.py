"""nccl_sync averages gradients exactly: after a run on two real Gloo ranks the parameters match
a single process that trains on the same global batches in the same order.

Each run is one epoch of tests/exact_recipe.py (12 global steps of 64 samples, the last of 21)
on `cluster=cpu cluster.num_ranks=2`. The reference builds the same replica (seed, LR factor)
and steps it once per global batch on the whole batch. Each test also checks that the
comparison would catch the wrong arithmetic: equal weights where the shares are unequal, or
the replicas averaged after each rank's own step (floDl's variant), end elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from flodl_run.config.schema import lr_factor
from flodl_run.contracts.recipe import import_recipe as load_recipe
from flodl_run.data.passes import permutation
from flodl_run.rank.replica import Replica
from tests.support import PAIR, _run

pytestmark = pytest.mark.e2e

MODULE = "tests.exact_recipe"
GLOBAL_BATCH = 64  # two ranks x batch_size 32
SEED = 3


def _trained(tmp_path: Path, *overrides: str) -> Dict[str, torch.Tensor]:
    """Model state of the bundle a one-epoch nccl_sync run on two CPU ranks leaves."""
    proc, summary = _run(tmp_path, *PAIR, "elche=nccl_sync", "recipe=custom", f"recipe.module={MODULE}",
                         "num_epochs=1", "batch_size=32", f"seed={SEED}", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["status"] == "completed"
    meta = json.loads((tmp_path / "run" / "checkpoint.meta.json").read_text())
    model_file = tmp_path / "run" / f"checkpoint.g{meta['generation']}.pt"
    return torch.load(model_file, weights_only=True)


def _reference(optimizer: str, weights: Optional[List[float]] = None,
               shares: Optional[List[float]] = None) -> Dict[str, torch.Tensor]:
    """One process over the run's global batches in order. With `weights`, each global batch's
    gradient is the `weights`-weighted sum of the per-rank mean gradients of a split by
    `shares` (what a reducer with the wrong weights would compute)."""
    recipe = load_recipe(MODULE, {"optimizer": optimizer}, None, None)
    replica = Replica(recipe, torch.device("cpu"), SEED, lr_scale=lr_factor(2, 1.0))
    data = recipe.call("train_dataset")
    order = permutation(len(data), SEED, 0)
    for start in range(0, len(data), GLOBAL_BATCH):
        rows = order[start:start + GLOBAL_BATCH]
        if weights is None:
            replica.step(data[rows])
            continue
        _weighted_step(replica, recipe, [data[part] for part in _split(rows, shares)], weights)
    return replica.model.state_dict()


def _split(rows: torch.Tensor, shares: List[float]) -> List[torch.Tensor]:
    first = round(len(rows) * shares[0] / sum(shares))
    return [rows[:first], rows[first:]]


def _weighted_step(replica: Replica, recipe, batches: list, weights: List[float]) -> None:
    replica.optimizer.zero_grad(set_to_none=True)
    for batch, weight in zip(batches, weights):
        (recipe.train_step(replica.model, batch) * weight).backward()
    replica.optimizer.step()


def _matches(state: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(state[k], reference[k], rtol=1e-4, atol=1e-6) for k in reference)


def test_equal_shares_with_sgd_momentum_match_one_process(tmp_path):
    """Pins the exact path on a homogeneous pair: each rank's gradient of its 32 samples,
    averaged inside backward with weight 1/2, then one identical SGD-with-momentum step, is
    the full-batch step of one process (torch DDP's trajectory)."""
    state = _trained(tmp_path, "+recipe.params.optimizer=sgd")
    assert _matches(state, _reference("sgd"))


def test_unequal_shares_cut_into_micro_batches_match_one_process_and_not_equal_weights(tmp_path):
    """Pins the weight share / total and gradient accumulation in one run: with shares 3:1 of
    every step (48 and 16 samples) and elche.micro_batch_size=16, rank 0's share is three
    micro-batches (synced on the last only, each loss scaled by 16/48); AdamW's parameters match
    one process. The same split averaged with equal weights (DDP's plain mean over uneven
    batches) ends measurably elsewhere, so a weight that is off would fail here."""
    state = _trained(tmp_path, "+recipe.params.optimizer=adamw", "elche.partition_ratios=[3,1]",
                     "elche.micro_batch_size=16")
    assert _matches(state, _reference("adamw"))
    assert not _matches(state, _reference("adamw", weights=[0.5, 0.5], shares=[3, 1]))


def test_averaging_parameters_after_each_step_is_not_exact(tmp_path):
    """Pins why the default changed: floDl's variant (elche.sync_average=params) averages the
    replicas after each rank's own AdamW step, and ends away from one process's parameters
    (each replica's update is normalised by its own moments)."""
    state = _trained(tmp_path, "+recipe.params.optimizer=adamw", "elche.sync_average=params",
                     "elche.max_batch_diff=0")
    assert not _matches(state, _reference("adamw"))


def test_a_train_step_that_calls_forward_directly_is_still_averaged_exactly(tmp_path):
    """Pins the other door to the model: train_step gets the model itself, and one that calls
    `model.forward(x)` (as a model's own method does) passes DDP's hooks by, so the reducer never
    runs; the rank then averages the step's gradient itself with the same weights. Unequal
    shares with micro-batches, AdamW: still one process's parameters."""
    state = _trained(tmp_path, "+recipe.params.optimizer=adamw", "+recipe.params.door=forward",
                     "elche.partition_ratios=[3,1]", "elche.micro_batch_size=16")
    assert _matches(state, _reference("adamw"))


def test_fewer_samples_than_ranks_trains_and_logs_the_loss_of_the_rank_with_the_sample(tmp_path):
    """Pins nccl_sync on a train set of one sample and two ranks: rank 1's share of every step
    is empty, so its train_step's mean was NaN and every epoch logged loss nan. A batch of no
    sample now gives no loss: each epoch's loss is that of the sample, as one process sees it
    before its step (the model learns: the second epoch's is lower). The sub-epoch reports count
    the epoch's samples: they counted every rank's batch of a step and said 200%."""
    proc, summary = _run(tmp_path, *PAIR, "elche=nccl_sync", "recipe=synthetic_mlp",
                         "recipe.params.num_samples=2", "num_epochs=2", f"seed={SEED}",
                         "reports_per_epoch=2")
    assert proc.returncode == 0 and summary["status"] == "completed", proc.stderr[-3000:]
    assert summary["epochs"][0]["per_rank_batch_share"] == [1.0, 0.0]
    recipe = load_recipe("recipes.synthetic_mlp", {"num_samples": 2}, None, None)
    replica = Replica(recipe, torch.device("cpu"), SEED, lr_scale=lr_factor(2, 1.0))
    with torch.no_grad():
        first = recipe.call("train_step", replica.model, recipe.call("train_dataset")[0:1]).item()
    losses = [epoch["avg_loss"] for epoch in summary["epochs"]]
    assert losses[0] == pytest.approx(first, rel=1e-5), (losses, first)
    assert losses[1] < losses[0]
    assert "loss nan" not in proc.stdout
    said = [line.split("  ")[2] for line in proc.stdout.splitlines() if "  report " in line]
    assert said == ["100%", "100%"], proc.stdout  # one step an epoch: the epoch's one sample
