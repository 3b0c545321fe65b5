"""Pick space, augment/epoch_splits coverage, PickKeys and the epoch_splits rule."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import DataConfig, ExperimentConfig, RecipeConfig
from flodl_run.config.validate import epoch_splits_problem
from flodl_run.contracts.wire import Train
from flodl_run.control.dispatch import epoch_span
from flodl_run.data.picks import PickKey, PickSpace, Work, epoch_of, slice_works
from flodl_run.rank.jobs import BatchCutter


@pytest.mark.parametrize("num_samples,augment,splits", [(100, 1, 1), (100, 3, 1), (97, 2, 3),
                                                        (10, 4, 7)])
def test_every_sample_appears_exactly_augment_times_per_pass(num_samples, augment, splits):
    """Pins augment in dispatch's pick space: the epochs of one pass (all splits) together hold
    each sample exactly k times, and split spans are contiguous and cover the pass once."""
    space = PickSpace(num_samples, augment, splits, seed=5)
    for pass_index in range(2):
        counts: Counter = Counter()
        covered = 0
        for epoch in range(pass_index * splits, (pass_index + 1) * splits):
            span = epoch_span(epoch, num_samples, augment, splits)
            assert space.epoch_span(epoch) == (span.pass_index, span.start, span.end)
            assert span.start == covered
            covered = span.end
            picks = space.picks(span.pass_index, span.start, span.size)
            counts.update((picks % num_samples).tolist())
        assert covered == num_samples * augment
        assert counts == Counter({s: augment for s in range(num_samples)})


@pytest.mark.parametrize("picks,splits", [(100, 1), (100, 3), (7, 7), (1000, 6), (13, 4)])
def test_epoch_of_inverts_the_split_boundaries(picks, splits):
    """Pins epoch_of: every position maps to the epoch whose dispatch span holds it, including
    uneven splits (the transform keys a pick by that epoch)."""
    for pass_index in (0, 2):
        for e in range(splits):
            span = epoch_span(pass_index * splits + e, picks, 1, splits)
            positions = torch.arange(span.start, span.end)
            assert (epoch_of(positions, pass_index, picks, splits) == span.epoch).all()
            if span.size:
                assert epoch_of(span.start, pass_index, picks, splits) == span.epoch


def test_pick_keys_name_sample_repeat_epoch_and_seed():
    """Pins PickKey: sample = pick % N, repeat = pick // N, the epoch of the position, the seed;
    two spaces built alike name the same picks alike (a re-run keys identically)."""
    space, again = PickSpace(10, 3, 2, seed=9), PickSpace(10, 3, 2, seed=9)
    picks = space.picks(1, 4, 8)
    keys = space.keys(Work(picks % 10, 1, 4))
    assert [k.sample for k in keys] == (picks % 10).tolist()
    assert [k.repeat for k in keys] == (picks // 10).tolist()
    assert {k.epoch for k in keys} == {2} and {k.seed for k in keys} == {9}
    assert again.keys(Work(picks % 10, 1, 4)) == keys


def test_keys_refuse_rows_that_are_not_the_pass_permutation():
    """Pins the guard: keying rows that are not the plan's picks would hand the transform wrong
    keys silently."""
    space = PickSpace(10, 1, 1, seed=0)
    rows = space.picks(0, 0, 4)
    with pytest.raises(ValueError, match="not the pass's permutation"):
        space.keys(Work((rows + 1) % 10, 0, 0))


def test_seed_value_is_stable_and_spreads():
    """Pins seed_value: a fixed function of the four fields (not Python's salted hash), and
    neighbouring keys get different seeds."""
    key = PickKey(3, 1, 4, 0)
    assert key.seed_value() == PickKey(3, 1, 4, 0).seed_value()
    seeds = {PickKey(s, r, e, 0).seed_value()
             for s in range(20) for r in range(3) for e in range(3)}
    assert len(seeds) == 180 and all(0 <= s < 2**63 for s in seeds)


def _rank_batches(num_samples: int, augment: int, batch_size: int, order: Train):
    """The rank's own cut of a Train order into batches (what RankRunner queues)."""
    return BatchCutter(num_samples, augment, seed=3, batch_size=batch_size).cut(order)


def test_slice_works_match_the_ranks_cut_of_a_train_order():
    """Pins slice_works against the rank's BatchCutter: each slice is cut on its own into
    batch_size batches, so the data plane keys and prefetches exactly the rank's batches."""
    order = Train(window=0, epoch=0, slices=[(0, 5, 70), (1, 0, 33)], num_batches=5)
    batches = _rank_batches(50, 2, 32, order)
    works = slice_works(order.slices, batches, 32)
    assert works is not None and [len(w.indices) for w in works] == [32, 32, 6, 32, 1]
    space = PickSpace(50, 2, 1, seed=3)
    for work in works:
        assert len(space.keys(work)) == len(work.indices)
    assert slice_works(order.slices, batches[:-1], 32) is None


def test_epoch_splits_refused_beyond_the_batches_of_a_pass():
    """Pins the rule: 100 samples x augment 2 / batch 32 is 7 batches; 7 splits are fine, 8 are a
    problem naming data.epoch_splits."""
    ok = ExperimentConfig(batch_size=32, data=DataConfig(augment=2, epoch_splits=7))
    bad = ExperimentConfig(batch_size=32, data=DataConfig(augment=2, epoch_splits=8))
    assert epoch_splits_problem(100, ok) is None
    problem = epoch_splits_problem(100, bad)
    assert problem.key == "data.epoch_splits" and "7" in problem.rule


def test_an_empty_train_set_is_named_as_such():
    """Pins: an empty train set failed the ranks with `data.epoch_splits: must be <= the
    batches of one pass, 0`, naming a knob the user never set. The data plane now says the
    recipe's train_dataset is empty, naming recipe.module and the function, as the recipe's
    contract error it is: the rank prints it as one line, without our frames."""
    from torch.utils.data import TensorDataset

    from flodl_run.contracts.recipe import RecipeError, user_traceback
    from flodl_run.data.dataplane import DataPlane

    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    config = ExperimentConfig(recipe=RecipeConfig(module="my_recipe"))
    with pytest.raises(RecipeError) as raised:
        DataPlane(empty, torch.device("cpu"), config)
    assert str(raised.value) == ("recipe.module: must give a train_dataset with at least one sample "
                                 "(its train_dataset(**recipe.params) returned an empty one), got "
                                 "'my_recipe'"), raised.value
    assert user_traceback(raised.value) == ""


def test_materialize_refuses_too_many_splits_for_the_recipe():
    """Pins the launch-time check: the materializer loads the train set when epoch_splits > 1
    and reports the problem with the other config errors (exit 2 on the CLI)."""
    cfg = ExperimentConfig(batch_size=512, recipe=RecipeConfig(module="recipes.digits_mlp"),
                           data=DataConfig(epoch_splits=4))  # 1437 samples: 3 batches
    with pytest.raises(ConfigError, match="data.epoch_splits"):
        materialize(cfg)
