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

from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import ExperimentConfig, RecipeConfig
from flodl_run.contracts.checkpoint import bundle_files, read_meta
from flodl_run.contracts.recipe import Recipe, RecipeError
from flodl_run.contracts.recipe import import_recipe as load_recipe
from flodl_run.rank.replica import Optimizers, Replica, as_one_optimizer
from flodl_run.rank.worker import Worker, run_loop
from tests.support import REPO, _run

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


SMALL_WINDOWS = ("elche.anchor=4", "elche.max_anchor=8")
"""Windows of at most 8 batches of the anchor rank: several reduces per epoch in every mode
(ElChe's default windows grow past an epoch of these tiny runs)."""


def _loop_run(tmp_path: Path, pkg: Path, recipe: str, *overrides: str, env_extra=None):
    """A 2-rank CPU run of a watched recipe (callbacks on rank 1, a checkpoint every epoch):
    (process, summary, notes)."""
    log = tmp_path / "notes.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(REPO)]), **(env_extra or {}))
    proc, summary = _run(tmp_path, "cluster=cpu", "cluster.threads_per_rank=1", "num_epochs=2",
                         "checkpoint_every=1", "epoch_callback_policy=rank:1", "batch_size=8",
                         "recipe=custom", f"recipe.module={recipe}", f"+recipe.params.log={log}",
                         *SMALL[recipe], *overrides, env=env)
    notes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, summary, notes


@pytest.fixture(scope="module")
def gan_cpu_sync(pkg, tmp_path_factory):
    """The gan_watched loop under cpu_sync (2 epochs, a bundle each): one of the every-mode
    runs, and the bundle the resume test continues from. (process, summary, notes)"""
    return _loop_run(tmp_path_factory.mktemp("gan_cpu_sync"), pkg, "gan_watched", "elche=cpu_sync",
                     *SMALL_WINDOWS)


def _model_file(stem: str) -> Path:
    return bundle_files(stem, read_meta(stem))["model"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["gan_watched", "accum_watched"])
def test_a_recipes_loop_trains_under_the_coordinator_in_every_mode(tmp_path, pkg, recipe, mode,
                                                                   request):
    """Rule: with a recipe's own loop, every mode still works as with the built-in step: the
    loop runs once in each rank and is handed every sample the epochs trained, exactly once;
    the weights change between its batches (never more often than reduces happened: two
    reduces may fall between two batches at an epoch's tail, and the run's last reduce comes
    after the last batch), and outside cpu_async every rank ends holding the bundle's weights
    (the last reduce made them the consensus); eval and checkpoint_fn run on the elected rank
    only (rank:1), one eval per epoch."""
    if (recipe, mode) == ("gan_watched", "cpu_sync"):  # shared with the resume test
        proc, summary, notes = request.getfixturevalue("gan_cpu_sync")
    else:
        proc, summary, notes = _loop_run(tmp_path, pkg, recipe, f"elche={mode}", *SMALL_WINDOWS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["mode"] == mode
    ends = sorted((n for n in notes if n["what"] == "loop_end"), key=lambda n: n["worker_rank"])
    assert [(n["rank"], n["worker_rank"]) for n in ends] == [("0", 0), ("1", 1)], notes
    assert sum(n["samples"] for n in ends) == sum(e["samples"] for e in summary["epochs"])
    assert all(n["batches"] > 0 for n in ends)
    syncs = summary["syncs"]
    assert syncs >= 2 * 2  # at least two windows per epoch
    last_after_the_loop = 0 if mode == "cpu_async" else 1  # the run's last reduce
    assert all(0 < n["changed"] <= syncs - last_after_the_loop for n in ends), (ends, syncs)
    saved = torch.load(_model_file(summary["checkpoint"]))
    saved_sum = float(torch.cat([t.flatten() for t in saved.values()]).double().sum())
    if mode != "cpu_async":  # the run ends with a reduce: every rank holds the saved consensus
        assert [n["weights"] for n in ends] == [saved_sum] * 2
    assert [n["rank"] for n in notes if n["what"] == "eval"] == ["1"] * 2  # one eval batch per epoch
    assert [(n["rank"], n["epoch"]) for n in notes if n["what"] == "checkpoint_fn"] == [("1", 0), ("1", 1)]
    for epoch in summary["epochs"]:
        assert epoch["avg_loss"] > 0 and epoch["eval"] is not None


@pytest.mark.e2e
def test_a_raising_loop_fails_the_run_once_per_rank_with_its_own_frame(tmp_path, pkg):
    """Rule: a loop that raises fails the run as a raising train_step does: exit 1, status
    failed naming the user's exception, each rank prints it once with the loop's own frame,
    and no internal error follows."""
    proc, summary, notes = _loop_run(tmp_path, pkg, "gan_watched", "elche=cpu_cadence",
                                     "+recipe.params.raise_at=3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert summary["status"] == "failed"
    assert "ValueError: the loop gives up at batch 3" in summary["message"]
    for rank in (0, 1):
        printed = [line for line in out.splitlines() if line.startswith(f"[rank {rank}]")]
        assert sum("Traceback" in line for line in printed) <= 1, out
    frames = [line for line in out.splitlines() if line.startswith("[rank") and 'File "' in line]
    assert frames and any("in counted" in f for f in frames), out
    assert "AttributeError" not in out and "Exception in thread" not in out, out
    assert not [n for n in notes if n["what"] == "loop_end"]


@pytest.mark.e2e
def test_a_rank_killed_mid_window_is_survived_with_a_loop(tmp_path, pkg):
    """Rule: with a recipe's loop, a rank SIGKILLed mid-run (after its 20th batch, as the
    built-in step's fault tests do; its windows here are 10 batches or more) is survived as with
    the built-in step: the run completes, lists the dead rank, and the survivor's loop is handed
    the rest, so every sample of every epoch is trained."""
    proc, summary, notes = _loop_run(tmp_path, pkg, "gan_watched", "elche=nccl_cadence",
                                     env_extra={"FLODL_RUN_FAULT": "1:20:SIGKILL"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["dead_ranks"] == [1]
    assert [e["samples"] for e in summary["epochs"]] == [512, 512]
    ends = [n for n in notes if n["what"] == "loop_end"]
    assert [n["worker_rank"] for n in ends] == [0]  # the killed rank's loop never ended
    assert ends[0]["samples"] > 512 and summary["epochs"][-1]["per_rank_batch_share"] == [1.0, 0.0]


@pytest.mark.e2e
def test_a_loop_run_resumes_where_its_bundle_ends(tmp_path, pkg, gan_cpu_sync):
    """Rule: a run of a recipe with several optimizers resumes: the bundle holds both
    optimizers' state (the generator's Adam and the discriminator's), the resumed run starts at
    the bundle's epoch with the saved weights and its loop trains only the remaining epoch."""
    first, summary, _ = gan_cpu_sync  # 2 epochs; resumed to 3
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    stem = summary["checkpoint"]
    optim = torch.load(bundle_files(stem, read_meta(stem))["optim"])
    assert len(optim["optimizers"]) == 2 and all(o["state"] for o in optim["optimizers"])
    proc, resumed, notes = _loop_run(tmp_path / "b", pkg, "gan_watched", "elche=cpu_sync",
                                     *SMALL_WINDOWS, "num_epochs=3", f"resume_from={stem}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert resumed["status"] == "completed"
    assert [e["epoch"] for e in resumed["epochs"]] == [2]
    ends = [n for n in notes if n["what"] == "loop_end"]
    assert sum(n["samples"] for n in ends) == 512 and len(ends) == 2


# ---- in-process and pure -------------------------------------------------------------------------


def _solo_loop(tmp_path: Path, monkeypatch, pkg: Path, **params):
    import flodl_run
    from flodl_run.config.schema import ClusterConfig, Topology, TrackingConfig, TrackingKind

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(pkg))
    log = tmp_path / "notes.jsonl"
    config = ExperimentConfig(
        num_epochs=2, batch_size=16, cluster=ClusterConfig(topology=Topology.solo),
        tracking=TrackingConfig(kind=TrackingKind.off),
        recipe=RecipeConfig(module="gan_watched", params={"log": str(log), "num_samples": 256, **params}))
    result = flodl_run.train(config, run_dir=str(tmp_path / "run"))
    return result.summary, [json.loads(line) for line in log.read_text().splitlines()]


def test_solo_runs_the_loop_once_over_every_epoch(tmp_path, monkeypatch, pkg):
    """Rule: an in-process run calls the recipe's loop once, hands it every batch of every
    epoch (epochs close between two batches: one eval each), and averages what it reported."""
    summary, notes = _solo_loop(tmp_path, monkeypatch, pkg)
    assert summary.status == "completed"
    ends = [n for n in notes if n["what"] == "loop_end"]
    assert len(ends) == 1 and (ends[0]["batches"], ends[0]["samples"]) == (2 * 16, 2 * 256)
    assert ends[0]["changed"] == 0  # nothing but the loop touches a lone replica's weights
    assert [n["what"] for n in notes].count("eval") == 2
    assert all(e.avg_loss > 0 for e in summary.epochs)


def test_a_loop_that_returns_early_is_an_error():
    """Rule: a loop that stops taking batches before the run ends is an error naming the rule
    (the coordinator would otherwise wait forever for the rest of the window)."""
    from flodl_run.config.schema import ClusterConfig, Topology
    from flodl_run.rank.solo import SoloTrainer

    def loop(worker):
        for _ in worker.batches():
            break

    recipe = _gan_recipe(loop=loop)
    config = ExperimentConfig(num_epochs=1, cluster=ClusterConfig(topology=Topology.solo))
    with pytest.raises(RuntimeError, match="returned before worker.batches"):
        SoloTrainer(config, recipe).run()


def _gan_recipe(**fns) -> Recipe:
    from recipes import tiny_gan_loop as gan

    return Recipe(build_model=gan.build_model, build_optimizer=gan.build_optimizer, train_step=None,
                  train_dataset=gan.train_dataset, params={"num_samples": 64}, **fns)


def test_several_optimizers_are_one_to_the_runtime():
    """Rule: a tuple (or dict) of optimizers is seen as one: LR scaling reaches every param
    group, a state reset clears each optimizer, and the state dict round-trips each in order."""
    replica = Replica(_gan_recipe(), torch.device("cpu"), seed=0, lr_scale=2.0)
    g_opt, d_opt = replica.optimizers
    assert isinstance(replica.optimizer, Optimizers) and replica.optimizer.members == [g_opt, d_opt]
    assert [g["lr"] for g in replica.optimizer.param_groups] == [2e-3, 2e-3]
    replica.rescale_lr(3.0)
    assert g_opt.param_groups[0]["lr"] == pytest.approx(3e-3) == d_opt.param_groups[0]["lr"]
    worker = Worker(replica, lambda: iter([(torch.randn(8, 2),)]), lambda loss: None, 0, 1)
    from recipes.tiny_gan_loop import loop

    loop(worker)
    saved = replica.optimizer.state_dict()
    assert g_opt.state and d_opt.state
    replica.optimizer.state.clear()
    assert not g_opt.state and not d_opt.state
    replica.optimizer.load_state_dict(saved)
    assert len(g_opt.state) == len(saved["optimizers"][0]["state"]) > 0
    assert as_one_optimizer({"g": g_opt, "d": d_opt}).members == [g_opt, d_opt]
    assert as_one_optimizer(g_opt) is g_opt


def test_a_scheduler_with_several_optimizers_is_refused():
    """Rule: build_scheduler with several optimizers is a recipe error naming the rule (the
    runtime's schedule seeking works on one optimizer; the loop steps its own schedulers)."""
    recipe = _gan_recipe(build_scheduler=lambda optimizer: None)
    with pytest.raises(RecipeError, match="several optimizers"):
        Replica(recipe, torch.device("cpu"), seed=0)


def test_report_sums_device_losses_without_reading_them():
    """Rule: report() keeps tensors as tensors (detached, no read of the value: no device sync),
    adds several reports of one batch, and takes floats; batches() is one iterator per run."""
    reported: list = []
    replica = Replica(_gan_recipe(), torch.device("cpu"), seed=0)
    worker = Worker(replica, lambda: iter([]), reported.append, 0, 1)
    loss = (torch.ones(()) * torch.nn.Parameter(torch.ones(()))).sum()
    worker.report(loss)
    worker.report(0.5)
    assert isinstance(reported[0], torch.Tensor) and not reported[0].requires_grad
    assert reported[1] == 0.5
    list(worker.batches())
    with pytest.raises(RuntimeError, match="call it once"):
        worker.batches()


def test_builtin_loop_steps_and_reports_every_batch():
    """Rule: without a recipe loop, run_loop is the built-in step on every batch, reporting
    each batch's loss."""
    from recipes import digits_mlp

    recipe = load_recipe("recipes.digits_mlp")
    assert recipe.loop is None
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    data = digits_mlp.train_dataset()
    batches = [tuple(t[i:i + 16] for t in data.tensors) for i in (0, 16, 32)]
    reported: list = []
    run_loop(recipe, Worker(replica, lambda: iter(batches), reported.append, 0, 1))
    assert len(reported) == 3 and replica.steps == 3


def test_recipe_loop_is_found_by_name_or_in_the_module(tmp_path, monkeypatch):
    """Rule: the loop is the module's `loop`, or recipe.loop: `fn` of the module or
    `pkg.module.fn`; a name that is not a function is a config error on recipe.loop; a module
    with neither train_step nor a loop is refused on recipe.module."""
    (tmp_path / "loopy.py").write_text(
        "from recipes.tiny_gan_loop import build_model, build_optimizer, train_dataset\n"
        "def other(worker):\n    pass\n")
    (tmp_path / "elsewhere.py").write_text("def my_loop(worker):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_recipe("recipes.tiny_gan_loop").loop.__name__ == "loop"
    assert load_recipe("loopy", loop="other").loop.__name__ == "other"
    assert load_recipe("loopy", loop="elsewhere.my_loop").loop.__name__ == "my_loop"
    with pytest.raises(RecipeError) as err:
        load_recipe("loopy")
    assert err.value.key == "recipe.module" and "train_step, or a loop" in err.value.rule
    with pytest.raises(ConfigError) as bad:
        materialize(ExperimentConfig(recipe=RecipeConfig(module="loopy", loop="elsewhere.nope")))
    assert [(p.key, p.value) for p in bad.value.problems] == [("recipe.loop", "elsewhere.nope")]


def test_build_optimizer_gets_the_model_only_when_it_names_it():
    """Rule: `model` reaches build_optimizer only when it declares it; a build_optimizer whose
    **kwargs forward the params to torch (as a user's may) never receives it (SGD would raise
    on an unexpected `model`)."""
    def forwarding(parameters, **params):
        return torch.optim.SGD(parameters, **params)

    recipe = Recipe(build_model=lambda device: torch.nn.Linear(2, 1), build_optimizer=forwarding,
                    train_step=None, train_dataset=None, params={"lr": 0.1})
    assert Replica(recipe, torch.device("cpu"), seed=0).optimizer.param_groups[0]["lr"] == 0.1
    assert isinstance(Replica(_gan_recipe(), torch.device("cpu"), seed=0).optimizer, Optimizers)
