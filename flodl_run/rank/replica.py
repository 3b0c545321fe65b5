"""One model replica on one device: built from a recipe, stepped batch by batch, evaluated.

Owns the per-step mechanics every rank shares (LR scaling, gradient clipping, the scheduler,
eval on the replica's weights). It does not decide when to reduce or which data to train.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, ContextManager, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset

from flodl_run.config.schema import RecipeConfig
from flodl_run.contracts.recipe import Recipe, RecipeError, eager_module
from flodl_run.data.passes import BatchSource

EVAL_BATCH_SIZE = 512  # eval has no backward pass: larger batches cost nothing in accuracy


class Optimizers:
    """Several optimizers (a GAN's generator and discriminator) seen by the runtime as one: LR
    scaling and the schedule reach every param group, a state reset clears every optimizer's
    state, and a checkpoint holds each one's state dict in order."""

    def __init__(self, members: Sequence[torch.optim.Optimizer]):
        self.members = list(members)
        self.state = _States(self.members)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [group for member in self.members for group in member.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.members:
            member.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for member in self.members:
            member.step()

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [member.state_dict() for member in self.members]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for member, member_state in zip(self.members, state["optimizers"], strict=True):
            member.load_state_dict(member_state)


class _States:
    """`Optimizers.state`: what the runtime does to an optimizer's state (clear it), for all."""

    def __init__(self, members: List[torch.optim.Optimizer]):
        self.members = members

    def clear(self) -> None:
        for member in self.members:
            member.state.clear()


def as_one_optimizer(built: Any) -> Any:
    """What build_optimizer returned, as one optimizer: itself, or Optimizers over a tuple, list
    or dict (in its order) of them."""
    if isinstance(built, dict):
        return Optimizers(list(built.values()))
    if isinstance(built, (list, tuple)):
        return Optimizers(built)
    return built


class Precision:
    """recipe.amp for the built-in step: train_step under torch.autocast, and for fp16 a
    GradScaler (torch's AMP recipe: scale the loss, unscale before clipping, step through the
    scaler, which skips a step whose gradient overflowed and lowers the scale). The scaler is
    this rank's own: it is not averaged, and a resumed run starts it afresh (it settles within
    a few steps)."""

    def __init__(self, amp: str, device: torch.device):
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp)
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: Any) -> None:
        """Gradients back to their true size (before a clip or a finite check); fp16 only."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any) -> None:
        """The optimizer step (through the scaler under fp16, then its update)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class Replica:
    """Model, optimizer and scheduler of one rank, seeded identically on every rank.
    `optimizers` is what the recipe's build_optimizer returned (one optimizer, or a tuple, list
    or dict of them); `optimizer` is the same seen as one (Optimizers for several). `model` is
    what build_model returned (maybe compiled: steps and callbacks use it; compiled here under
    recipe.compile); `module` is the module under it, whose state dict bundles hold. `options`
    gives recipe.amp and recipe.compile."""

    def __init__(self, recipe: Recipe, device: torch.device, seed: int, lr_scale: float = 1.0,
                 max_grad_norm: Optional[float] = None, options: Optional[RecipeConfig] = None):
        options = options or RecipeConfig()  # recipe.amp and recipe.compile
        amp, compile_backend = options.amp.value, options.compile
        self.recipe = recipe
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.precision = Precision(amp, device)
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.model = recipe.call("build_model", device)
        if compile_backend and eager_module(self.model) is self.model:
            self.model = torch.compile(self.model, backend=compile_backend)
        self.module = eager_module(self.model)
        self.optimizers = recipe.call("build_optimizer", self.model.parameters(), model=self.model)
        self.optimizer = as_one_optimizer(self.optimizers)
        if recipe.build_scheduler and isinstance(self.optimizer, Optimizers):
            raise RecipeError("recipe.module", recipe.name, "must not define build_scheduler when "
                              "build_optimizer returns several optimizers (step their schedulers "
                              "in the loop)")
        if amp == "fp16" and isinstance(self.optimizer, Optimizers):
            raise RecipeError("recipe.amp", amp, "must be off or bf16 when build_optimizer returns "
                              "several optimizers (scale each loss in the recipe's loop)")
        for group in self.optimizer.param_groups:
            group["lr"] *= lr_scale  # before the scheduler captures its base LRs
        self.lr_scale = lr_scale
        self.scheduler = recipe.call("build_scheduler", self.optimizer) if recipe.build_scheduler else None
        self.steps = 0

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on `batch`; returns the loss, detached, on the device. Clips after
        backward, before step. Reading the loss (`float()`) waits for the device: callers sum
        the tensors and read them once per window or report, never per step. Training mode is
        set only when the model is not in it (a recipe's loop that left it in eval mode):
        `model.train()` walks every module, a cost per step (0.1-0.6 ms on ResNet-18 and GPT-2)
        a loop setting it once per epoch does not pay, and it undoes a submodule the recipe keeps
        in eval mode (a frozen backbone's BatchNorm); evaluate() restores the modes it found."""
        if not self.model.training:
            self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = self.recipe.train_step(self.model, batch)
        self.precision.backward(loss)
        if self.max_grad_norm is not None:
            self.precision.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        return loss.detach()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def evaluate(self, dataset: Dataset) -> float:
        """Recipe metric over `dataset`: sum of metric_sum / sum of count (eval_step), or the
        mean over batches of eval_fn's value (each batch weighs the same, as floDl averages).
        What eval_fn raises comes back as CallbackFailed. Every module is in eval mode during it,
        and in the mode it had before once it ends (a submodule the recipe keeps in eval mode
        stays so)."""
        source = BatchSource(dataset, self.device)
        total, count = 0.0, 0
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in source.batches(torch.arange(len(source)), EVAL_BATCH_SIZE):
                    if self.recipe.eval_fn is not None:
                        total += float(self.recipe.run_callback("eval_fn", self.model, batch))
                        count += 1
                        continue
                    metric_sum, n = self.recipe.eval_step(self.model, batch)
                    total += float(metric_sum)
                    count += int(n)
        finally:
            for module, training in modes:
                module.training = training
        return total / count if count else math.nan

    def rescale_lr(self, lr_scale: float) -> None:
        """Move to another LR factor (the cohort shrank): current and base LRs scale alike."""
        if lr_scale <= 0 or lr_scale == self.lr_scale:
            return
        ratio = lr_scale / self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] *= ratio
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]
        self.lr_scale = lr_scale

    def seek_schedule(self, global_step: int) -> None:
        """Put the LR schedule at the cohort's step count; no-op without one."""
        if self.scheduler is None:
            return
        self.scheduler.last_epoch = global_step
        closed_form = getattr(self.scheduler, "_get_closed_form_lr", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # get_lr() outside step() warns; the value is right
            lrs = closed_form() if closed_form else self.scheduler.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
