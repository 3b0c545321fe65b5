"""Recipe callbacks: where each runs (launcher process or callback rank), in which order per
epoch, eval_fn's per-batch mean, and a callback that raises failing the run with a bundle."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import ElCheConfig, ExperimentConfig, RecipeConfig
from flodl_run.contracts.checkpoint import read_meta
from flodl_run.contracts.recipe import CallbackFailed, Recipe, RecipeError
from flodl_run.contracts.recipe import import_recipe as load_recipe
from flodl_run.contracts.summary import EpochRecord
from flodl_run.contracts.wire import Evaluate, SaveCheckpoint, new_secret
from flodl_run.control.coordinator import Coordinator
from flodl_run.observe.observer import Observer
from flodl_run.rank.replica import EVAL_BATCH_SIZE, Replica
from tests import fakes
from tests.fakes import FakeRank, drive
from tests.support import _run

REPO = Path(__file__).resolve().parents[1]

# Every callback notes what ran, where (pid, RANK) and for which epoch into `log`.
NOTING_RECIPE = '''
import json, os
from recipes.digits_mlp import build_model, build_optimizer, eval_dataset, train_dataset, train_step


def _note(log, what, epoch=None, **extra):
    with open(log, "a") as f:
        f.write(json.dumps({"what": what, "epoch": epoch, "pid": os.getpid(),
                            "rank": os.environ.get("RANK"), **extra}) + "\\n")


def eval_fn(model, batch, log):
    x, y = batch
    _note(log, "eval_fn")
    return (model(x).argmax(1) == y).float().mean().item()


def epoch_fn(epoch, model, log, epoch_fn_fails_at=-1):
    _note(log, "epoch_fn", epoch)
    if epoch == epoch_fn_fails_at:
        raise ValueError(f"epoch_fn refuses epoch {epoch}")


def checkpoint_fn(epoch, model, log):
    _note(log, "checkpoint_fn", epoch)


def eval_result_fn(epoch, value, log):
    _note(log, "eval_result_fn", epoch, value=value)


def metrics_fn(metrics, log, metrics_fn_fails_at=-1):
    _note(log, "metrics_fn", metrics["epoch"], eval=metrics["eval"], avg_loss=metrics["avg_loss"])
    if metrics["epoch"] == metrics_fn_fails_at:
        raise KeyError("metrics_fn refuses")
'''

EPOCH = ["eval_fn", "epoch_fn", "eval_result_fn", "metrics_fn"]
"""One epoch's callbacks in the order they run (the eval set of digits is one eval batch)."""


def _notes(log: Path) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _write_recipe(folder: Path, name: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(NOTING_RECIPE)
    return name


# ---- the contract (pure) ---------------------------------------------------------------------


def test_eval_step_and_eval_fn_together_are_a_config_error(tmp_path, monkeypatch):
    """Rule: a recipe defining both eval_step and eval_fn is refused (recipe.module, the rule),
    never silently resolved by a precedence."""
    (tmp_path / "both_evals.py").write_text(
        "from recipes.digits_mlp import *  # noqa\n"
        "def eval_fn(model, batch):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as err:
        load_recipe("both_evals")
    assert err.value.key == "recipe.module" and "eval_step or eval_fn, not both" in err.value.rule
    with pytest.raises(ConfigError) as config_error:  # what the CLI turns into exit 2
        materialize(ExperimentConfig(recipe=RecipeConfig(module="both_evals")))
    assert [p.key for p in config_error.value.problems] == ["recipe.module"]


def test_eval_fn_alone_is_an_eval():
    """Rule: eval_dataset with eval_fn (no eval_step) is a recipe with an eval."""
    recipe = Recipe(build_model=None, build_optimizer=None, train_step=None, train_dataset=None,
                    eval_dataset=lambda: None, eval_fn=lambda model, batch: 1.0)
    assert recipe.has_eval


def test_eval_fn_is_averaged_per_batch_not_per_sample():
    """Rule: the eval value of eval_fn is the plain mean of its per-batch values (floDl's
    average), not weighted by batch size: 700 rows in batches of 512 and 188 whose values are
    the batch lengths give (512 + 188) / 2 = 350."""
    seen = []

    def eval_fn(model, batch, scale=1.0):
        seen.append(len(batch[0]))
        return len(batch[0]) * scale

    recipe = Recipe(build_model=lambda device: torch.nn.Linear(2, 1),
                    build_optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
                    train_step=None, train_dataset=None, eval_fn=eval_fn, params={"scale": 2.0})
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    data = TensorDataset(torch.zeros(700, 2), torch.zeros(700))
    assert seen == [] and replica.evaluate(data) == 700.0  # recipe params reach eval_fn
    assert seen == [EVAL_BATCH_SIZE, 700 - EVAL_BATCH_SIZE]


def test_report_epoch_runs_eval_result_fn_then_metrics_fn_with_the_summary_fields():
    """Rule: the launcher's callbacks of an epoch run eval_result_fn first (only when the epoch
    was scored), then metrics_fn with the epoch as summary.json records it (a plain dict)."""
    calls = []
    recipe = Recipe(build_model=None, build_optimizer=None, train_step=None, train_dataset=None,
                    eval_result_fn=lambda epoch, value: calls.append(("eval", epoch, value)),
                    metrics_fn=lambda metrics: calls.append(("metrics", metrics)))
    scored = EpochRecord(3, 0.5, 0.9, 10.0, [1.0, 2.0], [0.4, 0.6])
    recipe.report_epoch(scored)
    recipe.report_epoch(EpochRecord(4, 0.4, None, 10.0, [1.0], [1.0]))
    assert calls[0] == ("eval", 3, 0.9) and calls[1] == ("metrics", asdict(scored))
    assert [c[0] for c in calls] == ["eval", "metrics", "metrics"]
    assert type(calls[1][1]) is dict and calls[1][1]["per_rank_batch_share"] == [0.4, 0.6]


def test_a_raising_callback_becomes_callback_failed_with_the_users_frames():
    """Rule: what a callback raises comes back as CallbackFailed naming the callback and the
    user's exception, and its report shows the user's frame (not only flodl_run's)."""
    def epoch_fn(epoch, model):
        raise ValueError(f"bad epoch {epoch}")

    recipe = Recipe(build_model=None, build_optimizer=None, train_step=None, train_dataset=None,
                    epoch_fn=epoch_fn)
    with pytest.raises(CallbackFailed) as failed:
        recipe.run_callback("epoch_fn", 7, None)
    assert str(failed.value) == "epoch_fn raised ValueError: bad epoch 7"
    report = failed.value.describe()
    assert "in epoch_fn" in report and report.count("Traceback") == 1
    assert recipe.run_callback("metrics_fn", {}) is None  # an absent callback is a no-op


# ---- the coordinator against scripted ranks ------------------------------------------------------


class _NotingRank(FakeRank):
    """A scripted rank that keeps every Evaluate and SaveCheckpoint order it answered."""

    def __init__(self, *args):
        super().__init__(*args)
        self.callback_orders: list = []

    def _answer(self, order):
        if isinstance(order, (Evaluate, SaveCheckpoint)):
            self.callback_orders.append(order)
        return super()._answer(order)


class _NotingObserver(Observer):
    def __init__(self):
        self.events: list = []

    def on_event(self, kind: str, message: str) -> None:
        self.events.append(message)


def _coordinate(recipe: Recipe, tmp_path: Path, mode: str = "nccl_sync", batch_size: int = 32,
                max_anchor: Optional[int] = None, **run):
    elche = ElCheConfig.preset(mode)
    if max_anchor is not None:
        elche = replace(elche, max_anchor=max_anchor)
    config = ExperimentConfig(elche=elche, batch_size=batch_size,
                              save_path=str(tmp_path / "ck"), epoch_callback_policy="rank:0", **run)
    secret = new_secret()
    coord = Coordinator(config, 2, secret)
    coord.recipe = recipe
    return drive(coord, [_NotingRank(r, 2, coord.address, secret, 0.2, batch_size, mode)
                         for r in range(2)])


def _bare(**callbacks) -> Recipe:
    return Recipe(build_model=None, build_optimizer=None, train_step=None, train_dataset=None,
                  **callbacks)


@pytest.mark.coordinator
def test_epoch_fn_is_ordered_every_epoch_even_without_an_eval(tmp_path):
    """Rule: with epoch_fn and no per-epoch eval (eval_every_epochs null) the callback rank alone
    is told each epoch to run epoch_fn without scoring (no eval recorded), the final eval comes
    after, and only the end-of-run save asks for checkpoint_fn (with the last epoch)."""
    summary, ranks = _coordinate(_bare(epoch_fn=lambda epoch, model: None), tmp_path,
                                 num_epochs=2, eval_every_epochs=None)
    assert summary.status == "completed" and [e.eval for e in summary.epochs] == [None, None]
    evaluates = [(o.epoch, o.score, o.epoch_fn) for o in ranks[0].callback_orders
                 if isinstance(o, Evaluate)]
    assert evaluates == [(0, False, True), (1, False, True), (1, True, False)]
    assert [o.epoch for o in ranks[0].callback_orders if isinstance(o, SaveCheckpoint)] == [1]
    assert all(isinstance(o, SaveCheckpoint) and not o.write_model for o in ranks[1].callback_orders)


@pytest.mark.coordinator
def test_checkpoint_fn_gets_the_last_epoch_the_saved_weights_include(tmp_path):
    """Rule: checkpoint_fn's epoch is the last epoch the bundle's weights include: the epoch in
    progress for a mid-epoch checkpoint_at_epoch save, the epoch just closed for
    checkpoint_every and the end of the run. The anchor is held at its start (10 batches) so
    every epoch has several windows: on a loaded machine the reduces' cost grows it, and a
    first window that hands out the whole epoch makes the mid-epoch save an epoch's end (the
    next test's rule)."""
    summary, ranks = _coordinate(_bare(checkpoint_fn=lambda epoch, model: None), tmp_path,
                                 mode="nccl_cadence", batch_size=4, max_anchor=10, num_epochs=3,
                                 checkpoint_every=2, checkpoint_at_epoch=1)
    assert summary.status == "completed" and summary.syncs > 3 * 2  # several reduces per epoch
    saves = [o for o in ranks[0].callback_orders if isinstance(o, SaveCheckpoint)]
    assert [o.epoch for o in saves] == [1, 1, 2]  # at epoch 1 (mid), after epoch 1, at the end


@pytest.mark.coordinator
def test_a_mid_epoch_save_whose_first_window_took_the_whole_epoch_resumes_at_the_next(tmp_path,
                                                                                      monkeypatch):
    """Rule: when the first window of checkpoint_at_epoch's epoch hands out the whole epoch (one
    batch per rank here), the save after its reduce covers the epoch: checkpoint_fn gets that
    epoch and the bundle resumes at the next one, not at the start of the epoch it includes."""
    monkeypatch.setattr(fakes, "NUM_SAMPLES", 8)  # two batches of 4: one window per epoch
    observer = _NotingObserver()
    config = ExperimentConfig(elche=ElCheConfig.preset("nccl_cadence"), batch_size=4, num_epochs=3,
                              save_path=str(tmp_path / "ck"), epoch_callback_policy="rank:0",
                              checkpoint_at_epoch=1)
    secret = new_secret()
    coord = Coordinator(config, 2, secret, observer=observer)
    coord.recipe = _bare(checkpoint_fn=lambda epoch, model: None)
    summary, ranks = drive(coord, [_NotingRank(r, 2, coord.address, secret, 0.2, 4, "nccl_cadence")
                                   for r in range(2)])
    assert summary.status == "completed" and summary.syncs == 3  # one reduce per epoch
    saves = [o.epoch for o in ranks[0].callback_orders if isinstance(o, SaveCheckpoint)]
    assert saves == [1, 2]  # after epoch 1's only window, at the end
    assert any(text.startswith("checkpoint:") and text.endswith("(resume at epoch 3)")
               for text in observer.events), observer.events


@pytest.mark.coordinator
def test_metrics_fn_raising_in_the_launcher_fails_a_multi_rank_run_with_a_bundle(tmp_path, caplog):
    """Rule: a launcher-side callback raising ends a multi-rank run failed after its epoch, with
    a callback_failed bundle that resumes at the next epoch (saved with no checkpoint_fn), and
    the user's traceback logged once."""
    def metrics_fn(metrics):
        raise RuntimeError(f"no room for epoch {metrics['epoch']}")

    summary, ranks = _coordinate(_bare(metrics_fn=metrics_fn, checkpoint_fn=lambda e, m: None),
                                 tmp_path, num_epochs=3)
    assert summary.status == "failed" and len(summary.epochs) == 1
    assert summary.message == f"metrics_fn raised RuntimeError: no room for epoch 0; saved {tmp_path / 'ck'}"
    meta = read_meta(str(tmp_path / "ck"))
    assert (meta.save_reason, meta.epoch) == ("callback_failed", 1)
    assert [o.epoch for o in ranks[0].callback_orders if isinstance(o, SaveCheckpoint)] == [None]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "in metrics_fn" in errors[0], errors


# ---- in-process --------------------------------------------------------------------------------


def _solo(tmp_path: Path, monkeypatch, name: str, **params):
    import flodl_run
    from flodl_run.config.schema import ClusterConfig, Topology, TrackingConfig, TrackingKind

    monkeypatch.chdir(tmp_path)
    log = tmp_path / "notes.jsonl"
    config = ExperimentConfig(
        num_epochs=2, cluster=ClusterConfig(topology=Topology.solo),
        tracking=TrackingConfig(kind=TrackingKind.off),
        recipe=RecipeConfig(module=_write_recipe(tmp_path, name), params={"log": str(log), **params}))
    return flodl_run.train(config, run_dir=str(tmp_path / "run")), log


def test_solo_runs_every_callback_in_its_one_process_in_the_epoch_order(tmp_path, monkeypatch):
    """Rule: an in-process run calls all five callbacks in its own process, per epoch eval_fn,
    epoch_fn, eval_result_fn, metrics_fn, and checkpoint_fn once the end bundle is written;
    eval_result_fn and metrics_fn get the epoch's eval (eval_fn's mean)."""
    result, log = _solo(tmp_path, monkeypatch, "noting_solo")
    notes = _notes(log)
    assert result.summary.status == "completed"
    assert [n["what"] for n in notes] == EPOCH * 2 + ["checkpoint_fn"]
    assert [n["epoch"] for n in notes if n["what"] != "eval_fn"] == [0, 0, 0, 1, 1, 1, 1]
    assert {n["pid"] for n in notes} == {os.getpid()}
    evals = [e.eval for e in result.summary.epochs]
    assert [n["value"] for n in notes if n["what"] == "eval_result_fn"] == evals
    assert [n["eval"] for n in notes if n["what"] == "metrics_fn"] == evals


def test_solo_metrics_fn_raising_fails_the_run_with_a_bundle(tmp_path, monkeypatch, caplog):
    """Rule: a callback raising in-process ends the run failed (not re-raised) with a bundle
    saved as callback_failed where a resume continues, and logs the user's traceback once."""
    result, log = _solo(tmp_path, monkeypatch, "noting_solo_fails", metrics_fn_fails_at=0)
    assert result.summary.status == "failed"
    assert result.summary.message.startswith("metrics_fn raised KeyError: 'metrics_fn refuses'; saved")
    meta = read_meta(result.checkpoint)
    assert (meta.save_reason, meta.epoch) == ("callback_failed", 1)
    assert [n["what"] for n in _notes(log)] == EPOCH  # nothing ran after the failure
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "in metrics_fn" in errors[0] and "Traceback" in errors[0]


# ---- two ranks over Gloo -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_fails_at_epoch_1(tmp_path_factory):
    """A cpu_pair run (callback rank 1, a checkpoint every epoch) whose epoch_fn raises at
    epoch 1: (launcher pid, exit code, output, summary, notes, run dir)."""
    root = tmp_path_factory.mktemp("pair_callbacks")
    name = _write_recipe(root / "pkg", "noting_pair")
    log, run_dir = root / "notes.jsonl", root / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "pkg"), str(REPO)]))
    proc, summary = _run(root, "cluster=cpu_pair", "num_epochs=3", "checkpoint_every=1",
                         "epoch_callback_policy=rank:1", "recipe=custom", f"recipe.module={name}",
                         f"+recipe.params.log={log}", "+recipe.params.epoch_fn_fails_at=1", env=env)
    return proc.pid, proc.returncode, proc.stdout + proc.stderr, summary, _notes(log), run_dir


@pytest.mark.e2e
def test_pair_runs_launcher_callbacks_in_the_launcher_and_the_rest_on_the_callback_rank(
        pair_fails_at_epoch_1):
    """Rule: metrics_fn and eval_result_fn run in the launcher's process; eval_fn, epoch_fn and
    checkpoint_fn on the rank epoch_callback_policy chose (rank:1), in the epoch order eval_fn,
    epoch_fn, eval_result_fn, metrics_fn, then checkpoint_fn after the epoch's checkpoint."""
    launcher, _, out, summary, notes, _ = pair_fails_at_epoch_1
    assert [n["what"] for n in notes] == EPOCH + ["checkpoint_fn", "eval_fn", "epoch_fn"], out
    for note in notes:
        if note["what"] in ("metrics_fn", "eval_result_fn"):
            assert (note["pid"], note["rank"]) == (launcher, None), note
        else:
            assert note["pid"] != launcher and note["rank"] == "1", note
    assert [n["epoch"] for n in notes if n["what"] not in ("eval_fn",)] == [0, 0, 0, 0, 1]
    assert next(n["value"] for n in notes if n["what"] == "eval_result_fn") == summary["epochs"][0]["eval"]


@pytest.mark.e2e
def test_pair_epoch_fn_raising_fails_the_run_once_with_a_bundle(pair_fails_at_epoch_1):
    """Rule: a callback raising on the callback rank ends the run failed with exit 1, the
    user's exception printed once (rank 1, then its traceback with the recipe's frame), and a
    bundle saved as callback_failed that resumes after the epoch that was trained."""
    _, code, out, summary, _, run_dir = pair_fails_at_epoch_1
    assert code == 1, out
    assert summary["status"] == "failed"
    assert summary["message"].startswith("rank 1: epoch_fn raised ValueError: epoch_fn refuses epoch 1")
    assert out.count("Traceback") == 1 and out.count("in epoch_fn") == 1, out
    assert "[rank 1] rank 1: epoch_fn raised ValueError: epoch_fn refuses epoch 1" in out, out
    assert summary["checkpoint"] == str(run_dir / "checkpoint") and summary["dead_ranks"] == []
    meta = read_meta(summary["checkpoint"])
    assert (meta.save_reason, meta.epoch) == ("callback_failed", 2)
