"""Per-rank delivery modes in a real two-rank run, CPU only."""

from __future__ import annotations

import os

import pytest

from tests.support import _run


@pytest.mark.e2e
def test_two_cpu_ranks_choose_different_modes_in_one_run(tmp_path):
    """Pins the issue's done-criterion: in one real run, rank 0 (a simulated device the set fits)
    goes resident while rank 1 (too small a device) streams, and summary.json says so per rank
    and per epoch with its data-starve ms."""
    env = dict(os.environ, FLODL_RUN_SIM_DEVICE_BYTES_0="1e9",
               FLODL_RUN_SIM_DEVICE_BYTES_1="100000")  # digits: 1437 x 264 B = 379 kB
    proc, summary = _run(tmp_path, "cluster=cpu", "cluster.num_ranks=2", "num_epochs=2",
                         "eval_every_epochs=2", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = summary["epochs"][-1]
    assert last["per_rank_delivery"] == ["resident", "streaming"]
    assert last["per_rank_cache_hit_rate"][0]["vram"] == 1.0
    starve = last["per_rank_data_starve_ms"]
    assert len(starve) == 2 and all(ms >= 0 for ms in starve)


def test_epoch_splits_make_finer_epochs_with_eval_and_data_metrics_in_process():
    """Pins epoch_splits in a run: one pass in 3 splits is 3 epochs, each evaluated and each
    carrying the rank's data metrics (solo: resident on CPU, all rows from the device tier,
    which on a CPU is RAM: it said `"vram": 1.0`)."""
    from flodl_run.config.schema import DataConfig, ExperimentConfig
    from flodl_run.contracts.recipe import import_recipe as load_recipe
    from flodl_run.rank.solo import SoloTrainer

    recipe = load_recipe("recipes.synthetic_mlp", {"num_samples": 2000, "hidden": 32, "depth": 1})
    config = ExperimentConfig(num_epochs=1, device="cpu",
                              data=DataConfig(epoch_splits=3, augment=2))
    summary = SoloTrainer(config, recipe).run().summary
    assert [e.epoch for e in summary.epochs] == [0, 1, 2]
    assert all(e.eval is not None for e in summary.epochs)
    assert all(e.per_rank_delivery == ["resident"] for e in summary.epochs)
    assert all(e.per_rank_cache_hit_rate == [{"vram": 0.0, "ram": 1.0, "disk": 0.0}] for e in summary.epochs)


def test_an_in_process_epoch_reports_its_eval_time_inside_its_epoch_time():
    """Pins solo epochs' eval_ms, reported 0 while the eval ran outside epoch_ms: an evaluated
    epoch now reports its eval's time, inside epoch_ms (as a distributed epoch does), and the
    rest of epoch_ms is the training the throughput is counted over; an epoch without an eval
    reports none; the summary's samples_per_s divides by the epochs' time, as the bench's
    training rate expects of every summary."""
    from flodl_run.config.schema import ExperimentConfig
    from flodl_run.contracts.recipe import import_recipe as load_recipe
    from flodl_run.rank.solo import SoloTrainer

    recipe = load_recipe("recipes.synthetic_mlp", {"num_samples": 2000, "hidden": 32, "depth": 1})
    config = ExperimentConfig(num_epochs=2, device="cpu", eval_every_epochs=2)
    summary = SoloTrainer(config, recipe).run().summary
    first, second = summary.epochs
    assert first.eval is None and first.eval_ms < 1.0
    assert second.eval is not None and 0.0 < second.eval_ms < second.epoch_ms
    train_s = (second.epoch_ms - second.eval_ms) / 1000.0
    assert second.per_rank_throughput[0] == pytest.approx(second.samples / train_s, rel=1e-6)
    epochs_s = (first.epoch_ms + second.epoch_ms) / 1000.0  # per second of epoch time, as distributed
    assert summary.samples_per_s == pytest.approx((first.samples + second.samples) / epochs_s, rel=1e-6)
