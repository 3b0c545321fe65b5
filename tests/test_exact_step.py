"""The exact step of a lone rank (no partner, no DDP): a non-finite gradient skips the step,
on the device for torch's fused optimizers (their own found_inf) and through one read for the
others; a finite one steps as the plain step does."""

from __future__ import annotations

import pytest
import torch

from flodl_run.contracts.recipe import import_recipe as load_recipe
from flodl_run.hardware.slowdown import Slowdown
from flodl_run.rank.exact import ExactSync, Micro
from flodl_run.rank.group import RankGroup
from flodl_run.rank.replica import Replica


def _lone(fused: bool) -> ExactSync:
    recipe = load_recipe("tests.exact_recipe", {"optimizer": "adamw"}, None, None)
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    if fused:
        replica.optimizer = replica.optimizers = torch.optim.AdamW(replica.model.parameters(), fused=True)
    group = RankGroup(0, torch.device("cpu"), 5.0)
    group.alone = True
    exact = ExactSync(replica, None, group, Slowdown(1.0))
    exact.rebuild()
    exact.reset_window()
    return exact


def _step(exact: ExactSync, x: torch.Tensor) -> None:
    exact.begin(Micro(0, 1, len(x), len(x), len(x)))
    exact.step((x, torch.zeros(len(x), dtype=torch.long)))


@pytest.mark.parametrize("fused", [True, False])
def test_a_lone_rank_skips_a_non_finite_step_and_takes_a_finite_one(fused):
    """Pins the skip without a partner: a NaN input leaves every parameter as it was and counts
    one skipped step (read at the window's end); the next finite step moves them."""
    exact = _lone(fused)
    before = [p.detach().clone() for p in exact.replica.model.parameters()]
    _step(exact, torch.full((8, 12), float("nan")))
    assert all(torch.equal(a, p) for a, p in zip(before, exact.replica.model.parameters()))
    assert exact.window_skipped() == 1 and exact.steps == 1
    _step(exact, torch.randn(8, 12))
    assert not all(torch.equal(a, p) for a, p in zip(before, exact.replica.model.parameters()))
    assert exact.window_skipped() == 1 and exact.steps == 2


def _adopting_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 0 takes two AdamW steps, rank 1 none (its optimizer has no state yet, as after a
    death inside the first step's all-reduce); then both adopt rank 0's state."""
    import os

    import torch.distributed as dist

    from flodl_run.averaging.flat import FlatParams
    from flodl_run.rank.statecast import broadcast_state_

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    recipe = load_recipe("tests.exact_recipe", {"optimizer": "adamw"}, None, None)
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    flat = FlatParams(replica.model)
    data = recipe.call("train_dataset")
    for step in range(2 if rank == 0 else 0):
        replica.step(data[torch.arange(step * 16, step * 16 + 16)])
    broadcast_state_(replica, flat, 0, torch.device("cpu"))
    replica.step(data[torch.arange(32, 48)])  # the same next step on both
    torch.save({"params": [p.detach().clone() for p in replica.model.parameters()],
                "steps": replica.steps}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_a_survivor_behind_by_a_step_adopts_the_leaders_state(tmp_path):
    """Pins the regroup's adoption: the member that completed a step the other did not hands
    over parameters, the optimizer's state (created on the way when the other had none) and
    its step count, so both take the next step identically."""
    from tests.support import _free_port, start_ranks

    start_ranks(_adopting_worker, (2, _free_port(), str(tmp_path)), 2)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert zero["steps"] == one["steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(zero["params"], one["params"]))


def _compiled_worker(rank: int, world: int, port: int, out_dir: str, split: bool) -> None:
    """Two exact steps of a compiled model (aot_eager) big enough for two of DDP's buckets,
    this rank's half of each 32-sample step, split at the buckets or not (recipe.optimize_ddp);
    what dynamo built and the parameters after."""
    import os

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from flodl_run.config.schema import RecipeConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    params = {"hidden": 600, "middle": True}
    recipe = load_recipe("tests.exact_recipe", params, None, None)
    replica = Replica(recipe, torch.device("cpu"), seed=0, options=RecipeConfig(compile="aot_eager"))
    group = RankGroup(rank, torch.device("cpu"), 30.0)
    exact = ExactSync(replica, None, group, Slowdown(1.0), optimize_ddp=split)
    exact.rebuild()
    exact.reset_window()
    data = recipe.call("train_dataset")
    for step in range(2):
        rows = torch.arange(step * 32 + rank * 16, step * 32 + rank * 16 + 16)
        exact.begin(Micro(0, 1, 16, 16, 32))
        exact.step(data[rows])
    torch.save({"graphs": counters["stats"]["unique_graphs"], "pieces": counters["aot_autograd"]["total"],
                "params": [p.detach().clone() for p in replica.module.parameters()]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_with_optimize_ddp_a_compiled_model_is_split_at_ddps_buckets_and_stays_exact(tmp_path):
    """Pins recipe.optimize_ddp: the step marks DDP active, so dynamo cuts the one graph it
    captures into one compiled piece per bucket (a bucket's reduce can start while the pieces
    before it still run backward), and the two ranks' halves still make exactly the plain step
    over the whole batch. (Unmarked, the same run compiles one piece: checked when this landed.)"""
    from tests.support import _free_port, start_ranks

    start_ranks(_compiled_worker, (2, _free_port(), str(tmp_path), True), 2)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert zero["graphs"] == 1 and zero["pieces"] >= 2, (zero["graphs"], zero["pieces"])
    recipe = load_recipe("tests.exact_recipe", {"hidden": 600, "middle": True}, None, None)
    plain = Replica(recipe, torch.device("cpu"), seed=0)
    data = recipe.call("train_dataset")
    for step in range(2):
        plain.step(data[torch.arange(step * 32, step * 32 + 32)])
    for ours, theirs, reference in zip(zero["params"], one["params"], plain.module.parameters()):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, reference.detach(), rtol=1e-5, atol=1e-6)


class _MarkedDdp:
    """What `_through` uses of torch's DDP, noting whether the step ran with DDP marked active."""

    def __init__(self):
        self.module = torch.nn.Linear(2, 1)
        self.marked = []
        self._active = False

    def _pre_forward(self, *args, **kwargs):
        self.marked.append(self._active)
        return args, kwargs

    def _post_forward(self, output):
        return output

    def _inside_ddp_forward(self):
        import contextlib

        @contextlib.contextmanager
        def active():
            self._active = True
            try:
                yield
            finally:
                self._active = False
        return active()


@pytest.mark.parametrize("split", [False, True])
def test_the_step_marks_ddp_active_only_with_optimize_ddp(split):
    """Pins recipe.optimize_ddp's default off: a compiled model stays one graph unless asked
    (torch's split failed a compiled ResNet's backward on a GPU), and the config's default is off."""
    from flodl_run.config.schema import RecipeConfig
    from flodl_run.rank.exact import _Hook, _through

    ddp = _MarkedDdp()
    with _through(ddp, _Hook(), split):
        ddp.module(torch.ones(1, 2))
    ddp.module(torch.ones(1, 2))  # after the step: no hook, no marker
    assert ddp.marked == [split]
    assert RecipeConfig().optimize_ddp is False
