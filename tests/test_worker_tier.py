"""The cooperative worker tier: a recipe's own loop inside each rank, with the coordinator still
sizing windows, ordering reduces, electing the eval rank, surviving faults and resuming.

End to end, the example loops (recipes/tiny_gan_loop.py, recipes/grad_accum.py) run wrapped in
a watcher that counts what the loop saw and notes where eval and checkpoint_fn ran."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flodl_run.checkpoint import read_meta
from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import ExperimentConfig, RecipeConfig
from flodl_run.recipe import Recipe, RecipeError, load_recipe
from flodl_run.replica import Optimizers, Replica, as_one_optimizer
from flodl_run.worker import Worker, builtin_loop, run_loop
from tests.test_distributed_cli import REPO, _run

MODES = ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]

WATCH = '''
import json, os
import torch


def note(log, what, **fields):
    with open(log, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), "rank": os.environ.get("RANK"),
                            **fields}) + "\\n")


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def watched(example_loop, worker, log, raise_at=-1):
    """Run `example_loop`, counting the batches and samples it was handed and how often the
    weights changed between two of its batches (something other than the loop: a reduce)."""
    seen = {"batches": 0, "samples": 0, "changed": 0}
    batches = worker.batches

    def counted():
        after = None
        for batch in batches():
            if after is not None and not torch.equal(_weights(worker.model), after):
                seen["changed"] += 1
            if seen["batches"] == raise_at:
                raise ValueError(f"the loop gives up at batch {raise_at}")
            seen["batches"] += 1
            seen["samples"] += len(batch[0])
            yield batch
            after = _weights(worker.model)

    worker.batches = counted
    example_loop(worker)
    note(log, "loop_end", worker_rank=worker.rank, weights=float(_weights(worker.model).double().sum()),
         **seen)
'''

GAN = '''
from recipes import tiny_gan_loop
from recipes.tiny_gan_loop import build_model, build_optimizer, eval_dataset, train_dataset
from watch import note, watched


def loop(worker, log, raise_at=-1):
    watched(tiny_gan_loop.loop, worker, log, raise_at)


def eval_fn(model, batch, log):
    note(log, "eval")
    return tiny_gan_loop.eval_fn(model, batch)


def checkpoint_fn(epoch, model, log):
    note(log, "checkpoint_fn", epoch=epoch)
'''

ACCUM = '''
from recipes import grad_accum
from recipes.grad_accum import build_model, build_optimizer, eval_dataset, train_dataset
from watch import note, watched


def loop(worker, log, micro_batches=4):
    watched(lambda w: grad_accum.loop(w, micro_batches), worker, log)


def eval_fn(model, batch, log):
    note(log, "eval")
    correct, count = grad_accum.eval_step(model, batch)
    return correct / count


def checkpoint_fn(epoch, model, log):
    note(log, "checkpoint_fn", epoch=epoch)
'''

SMALL = {"gan_watched": ["+recipe.params.num_samples=512"],
         "accum_watched": ["+recipe.params.num_samples=640", "+recipe.params.hidden=32",
                           "+recipe.params.depth=2"]}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    """A folder holding the watcher and the two watched example recipes."""
    folder = tmp_path_factory.mktemp("loops")
    for name, text in (("watch", WATCH), ("gan_watched", GAN), ("accum_watched", ACCUM)):
        (folder / f"{name}.py").write_text(text)
    return folder


def _loop_run(tmp_path: Path, pkg: Path, recipe: str, *overrides: str, env_extra=None):
    """A 2-rank CPU run of a watched recipe (callbacks on rank 1, a checkpoint every epoch):
    (process, summary, notes)."""
    log = tmp_path / "notes.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(REPO)]), **(env_extra or {}))
    proc, summary = _run(tmp_path, "cluster=cpu", "cluster.threads_per_rank=1", "num_epochs=2",
                         "checkpoint_every=1", "epoch_callback_policy=rank:1", "batch_size=8", "recipe=custom",
                         f"recipe.module={recipe}", f"+recipe.params.log={log}", *SMALL[recipe],
                         *overrides, env=env)
    notes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, summary, notes


def _model_file(stem: str) -> Path:
    from flodl_run.checkpoint import bundle_files

    return bundle_files(stem, read_meta(stem))["model"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["gan_watched", "accum_watched"])
def test_a_recipes_loop_trains_under_the_coordinator_in_every_mode(tmp_path, pkg, recipe, mode):
    """Rule: with a recipe's own loop, every mode still works as with the built-in step: the
    loop runs once in each rank and is handed every sample the epochs trained, exactly once;
    the weights change between its batches (never more often than reduces happened: two
    reduces may fall between two batches at an epoch's tail, and the run's last reduce comes
    after the last batch), and outside cpu_async every rank ends holding the bundle's weights
    (the last reduce made them the consensus); eval and checkpoint_fn run on the elected rank only (rank:1), one eval per epoch."""
    proc, summary, notes = _loop_run(tmp_path, pkg, recipe, f"elche={mode}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["mode"] == mode
    ends = sorted((n for n in notes if n["what"] == "loop_end"), key=lambda n: n["worker_rank"])
    assert [(n["rank"], n["worker_rank"]) for n in ends] == [("0", 0), ("1", 1)], notes
    assert sum(n["samples"] for n in ends) == sum(e["samples"] for e in summary["epochs"])
    assert all(n["batches"] > 0 for n in ends)
    syncs = summary["syncs"]
    assert syncs >= 4  # several windows per run
    last_after_the_loop = 0 if mode == "cpu_async" else 1  # the run's last reduce
    assert all(0 < n["changed"] <= syncs - last_after_the_loop for n in ends), (ends, syncs)
    saved = torch.load(read_meta(summary["checkpoint"]) and _model_file(summary["checkpoint"]))
    saved_sum = float(torch.cat([t.flatten() for t in saved.values()]).double().sum())
    if mode != "cpu_async":  # the run ends with a reduce: every rank holds the saved consensus
        assert [n["weights"] for n in ends] == [saved_sum] * 2
    assert [n["rank"] for n in notes if n["what"] == "eval"] == ["1"] * 2  # one eval batch per epoch
    assert [(n["rank"], n["epoch"]) for n in notes if n["what"] == "checkpoint_fn"] == [("1", 0), ("1", 1)]
    for epoch in summary["epochs"]:
        assert epoch["avg_loss"] > 0 and epoch["eval"] is not None
