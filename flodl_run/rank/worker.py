"""The cooperative tier: a recipe's own loop body runs inside each rank, the coordinator keeps
its authority.

A recipe may define `loop(worker)` (or name one with recipe.loop). The rank calls it once per
run. `worker.batches()` yields the batches the coordinator planned for this rank, one per step;
between two of them the rank does what it is told (ends the window, reduces, applies the
update, evaluates, saves), so the loop never sees the protocol. Without a loop the rank runs
`builtin_loop`: the recipe's train_step on every batch. This module owns the handle the loop
sees; the rank owns the batches and what happens between them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Union

import torch

from flodl_run.contracts.recipe import Recipe
from flodl_run.rank.replica import Replica

Loss = Union[torch.Tensor, float]


class Worker:
    """What a loop sees of its rank.

    - `model`: the replica's model (the reduce averages every parameter and float buffer of it).
    - `optimizer`: what the recipe's build_optimizer returned (one optimizer, or a tuple, list or
      dict of them); the runtime scales their LRs, resets their state (outer.reset_inner_state,
      a non-finite replica) and checkpoints them as it does one optimizer.
    - `scheduler`: the recipe's scheduler or None; a loop steps it once per batch, as the
      built-in step does (the rank re-seeks it to the cohort's step at each reduce).
    - `batches()`: the coordinator's plan, one batch per yield, until the run ends.
    - `report(loss)`: the batch's loss, for the window's mean loss.
    - `step(batch)`: the built-in step (train_step, clip, optimizer and scheduler step).
    """

    def __init__(self, replica: Replica, batches: Callable[[], Iterator[Any]],
                 report: Callable[[Loss], None], rank: int, world_size: int,
                 step: Optional[Callable[[Any], torch.Tensor]] = None):
        self.replica = replica
        self.model = replica.model
        self.optimizer = replica.optimizers
        self.scheduler = replica.scheduler
        self.device = replica.device
        self.max_grad_norm = replica.max_grad_norm
        self.rank, self.world_size = rank, world_size
        self._batches, self._report = batches, report
        self._step = step if step is not None else replica.step
        self._handed_out = False

    def batches(self) -> Iterator[Any]:
        """The batches this rank trains, as the recipe's dataset gives them (on the device), one
        optimizer step each: ElChe counts and times batches, so a loop that accumulates
        gradients splits a batch into micro-batches rather than stepping every k batches. Ends
        when the coordinator stops the run. One iterator per run: a second call is an error."""
        if self._handed_out:
            raise RuntimeError("worker.batches() is one iterator per run: call it once")
        self._handed_out = True
        return self._batches()

    def report(self, loss: Loss) -> None:
        """Add `loss` (a tensor on the device, or a float) to the current batch's loss. It is
        summed on the device and read once per window, so reporting costs no device sync;
        several reports in one batch add up."""
        if isinstance(loss, torch.Tensor):
            self._report(loss.detach() if loss.requires_grad else loss)
        else:
            self._report(float(loss))

    def step(self, batch: Any) -> torch.Tensor:
        """The built-in step on `batch` (see Replica.step; under nccl_sync's exact path one
        micro-batch of the global step, see rank.exact); returns the loss on the device."""
        return self._step(batch)


def builtin_loop(worker: Worker) -> None:
    """The loop a recipe without one runs: train_step on every batch the coordinator plans."""
    for batch in worker.batches():
        worker.report(worker.step(batch))


def run_loop(recipe: Recipe, worker: Worker) -> None:
    """The recipe's loop (with the recipe's params it takes, as every recipe function), or the
    built-in one."""
    if recipe.loop is not None:
        recipe.call("loop", worker)
    else:
        builtin_loop(worker)
