"""Gradient accumulation with the cooperative loop: each batch is one optimizer step, computed
over `micro_batches` slices so the activations of only one slice are in memory at a time.

    .venv/bin/python -m flodl_run recipe=grad_accum cluster=cpu batch_size=256

For ElChe a batch is what the coordinator plans (`batch_size` samples) and one optimizer step:
it counts and times batches, and a window ends between two of them, never inside an
accumulation. The model, data and eval are recipes/synthetic_mlp's.
"""

from __future__ import annotations

import torch
from torch import nn

from recipes.synthetic_mlp import build_model, build_optimizer, eval_dataset, eval_step, train_dataset

__all__ = ["build_model", "build_optimizer", "eval_dataset", "eval_step", "train_dataset", "loop"]


def loop(worker, micro_batches: int = 4) -> None:
    """Per batch: zero the gradients, backward each slice's share of the batch's mean loss,
    clip (max_grad_norm) and step once, then the scheduler (if any), as the built-in step does."""
    model, opt = worker.model, worker.optimizer
    for x, y in worker.batches():
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = nn.functional.cross_entropy(model(xs), ys) * (len(xs) / len(x))
            loss.backward()  # gradients add up across slices: the batch's mean-loss gradient
            total += loss.detach()
        if worker.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), worker.max_grad_norm)
        opt.step()
        if worker.scheduler is not None:
            worker.scheduler.step()
        worker.report(total)
