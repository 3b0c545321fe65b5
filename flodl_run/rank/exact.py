"""nccl_sync's exact step: this rank's share of one global step, its gradient averaged with the
cohort inside backward by torch's DDP reducer, then the same optimizer step on every rank.

Owns the DDP wrapper over the current process group (rebuilt after every regroup), the
communication hook that weighs this rank's gradient by share / total, the micro-batches a large
share is cut into (synced on the last one only), the skip of a non-finite step, the compute time
each step took before its gradient was ready, and adopting a peer's state after a regroup. When
a step runs and which samples it has are the coordinator's; the group is RankGroup's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from flodl_run.averaging.flat import FlatParams
from flodl_run.contracts.recipe import RecipeError
from flodl_run.hardware.slowdown import Slowdown
from flodl_run.rank.ddp import all_reduce_flat_
from flodl_run.rank.group import RankGroup
from flodl_run.rank.replica import Replica
from flodl_run.rank.statecast import broadcast_state_


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a step: its place in the step and the step's arithmetic."""

    index: int
    count: int
    samples: int
    share: int
    """This rank's samples of the step (the micro-batches' sum)."""
    total: int
    """The step's samples over all ranks."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def micro_plan(shares: List[int], totals: List[int], micro_batch_size: int) -> List[Micro]:
    """The micro-batches of a window, in order: each step's share cut into pieces of at most
    `micro_batch_size` samples (as even as they come: 91 at 64 -> 46 + 45)."""
    plan: List[Micro] = []
    for share, total in zip(shares, totals):
        count = max(1, -(-share // micro_batch_size))
        base, extra = divmod(share, count)
        plan += [Micro(i, count, base + (1 if i < extra else 0), share, total) for i in range(count)]
    return plan


class _Hook:
    """The communication hook's state: this step's weight, what to do once this rank's gradient
    is complete (the last bucket is ready) before it goes out, and what the step's last
    micro-batch saw: DDP's forward ran (`forwarded`), the last bucket went out (`reduced`)."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.on_ready = None
        self.forwarded = False
        self.reduced = False


def _weighted_all_reduce(state, bucket):  # unannotated: DDP checks real annotations only
    """sum_r (share_r / total) * grad_r over the group: the step's mean gradient exactly.
    (state: _Hook, bucket: dist.GradBucket -> torch.futures.Future of the bucket)"""
    if bucket.is_last():
        state.reduced = True
        if state.on_ready is not None:
            state.on_ready()
    tensor = bucket.buffer()
    tensor.mul_(state.weight)
    work = dist.all_reduce(tensor, group=dist.group.WORLD, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _grad_versions(model: torch.nn.Module) -> Dict[str, int]:
    """The version of every gradient a parameter holds (one a backward accumulates into moves)."""
    return {name: p.grad._version for name, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _through(ddp: Optional[DistributedDataParallel], state: _Hook, split: bool) -> Iterator[None]:
    """While train_step runs, a call of the user's own model goes through `ddp`'s forward
    (its pre-forward prepares the reducer, its post-forward tells it what backward will see),
    as torch's composable `replicate` does it with hooks. So train_step receives the model
    itself (`model.config`, the model's own methods) and the reducer still sees every step.
    Only for the step: an eval or a callback calls the model with no collective behind it.

    With `split` (recipe.optimize_ddp) DDP is also marked active for the step, as its own
    forward does: a compiled model's graph, built in a step, is then split by dynamo at the
    reducer's bucket boundaries (torch's DDPOptimizer), so a bucket's all-reduce starts while
    the rest of the backward runs. Unmarked, the one graph's gradients reach the reducer as its
    backward ends. Not the default: on one H100 the split failed a compiled ResNet's backward in
    a two-rank run (a stride check in convolution_backward; docs/decisions.md)."""
    if ddp is None:
        yield
        return

    def before(module, args, kwargs):
        state.forwarded = True
        return ddp._pre_forward(*args, **kwargs)

    def after(module, args, output):
        return ddp._post_forward(output)

    handles = [ddp.module.register_forward_pre_hook(before, with_kwargs=True),
               ddp.module.register_forward_hook(after)]
    try:
        with ddp._inside_ddp_forward() if split else contextlib.nullcontext():
            yield
    finally:
        for handle in handles:
            handle.remove()


class ExactSync:
    """One rank's exact steps. `rebuild()` after every group join; `begin(micro)` before each
    micro-batch the loop trains, whose `step(batch)` is what `worker.step` runs."""

    def __init__(self, replica: Replica, flat: FlatParams, group: RankGroup, slowdown: Slowdown,
                 find_unused_parameters: bool = False, optimize_ddp: bool = False):
        self.replica, self.flat, self.group, self.slowdown = replica, flat, group, slowdown
        self.find_unused_parameters, self.optimize_ddp = find_unused_parameters, optimize_ddp
        self.device = replica.device
        self._hook = _Hook()
        self._grouped = _by_device_and_dtype(replica.model)  # the gradients' check, per group
        self.ddp: Optional[DistributedDataParallel] = None
        self._micro: Optional[Micro] = None
        self._began = 0.0
        self._events: List[Tuple[Any, Any]] = []  # CUDA: (step start, gradient ready) per step
        self.compute_ms = 0.0  # host-timed steps of the window (CPU, or a lone GPU rank)
        self.steps = 0  # optimizer steps taken (skipped ones included) in the window
        self.skipped = 0
        self._skipped_on_device: Optional[torch.Tensor] = None  # fused optimizers, lone rank
        self.failed: Optional[str] = None

    def rebuild(self) -> None:
        """Wrap the model in DDP over the group of this generation; alone, no wrapper (the
        step is the plain step on the whole of it). States are equal on every member (or were
        just made so), so DDP's initial broadcast is skipped."""
        self.ddp = None  # the old reducer's hooks go with it
        if self.group.alone:
            return
        cuda = self.device.type == "cuda"
        self.ddp = DistributedDataParallel(
            self.replica.model, device_ids=[self.device] if cuda else None, init_sync=False,
            gradient_as_bucket_view=True, find_unused_parameters=self.find_unused_parameters)
        self.ddp.register_comm_hook(self._hook, _weighted_all_reduce)

    def adopt_from(self, source: int) -> None:
        """After a regroup: every member takes the state of member `source` (new rank index),
        which completed a step the others did not."""
        broadcast_state_(self.replica, self.flat, source, self.device)

    def reset_window(self) -> None:
        """A window begins: counters to zero, the model in training mode (once per window, not per
        step: it walks every module)."""
        if not self.replica.model.training:  # evaluate() restores the modes it found
            self.replica.model.train()
        self.compute_ms, self.steps, self.skipped, self.failed = 0.0, 0, 0, None
        self._events, self._skipped_on_device = [], None

    def begin(self, micro: Micro) -> None:
        self._micro = micro

    # ---- the step ------------------------------------------------------------------------

    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one micro-batch; on the step's last one, the averaged
        gradient's optimizer step (skipped when it is non-finite). A broken collective is
        recorded in `failed` (the loop reports it) instead of raised into the recipe's loop."""
        micro = self._micro
        precision = self.replica.precision
        if micro.first:
            self.replica.optimizer.zero_grad(set_to_none=True)
            self._start_clock()
        sync = self.ddp is None or micro.last
        self._hook.forwarded = self._hook.reduced = False
        with (contextlib.nullcontext() if sync else self.ddp.no_sync()):
            with _through(self.ddp, self._hook, self.optimize_ddp), precision.autocast():
                loss = self.replica.recipe.train_step(self.replica.model, batch)
            scaled = loss * (micro.samples / micro.share) if micro.count > 1 else loss
            self._hook.weight = micro.share / micro.total
            self._hook.on_ready = self._gradient_ready if micro.last else None
            if not micro.last:
                precision.backward(scaled)
                return scaled.detach()  # a step's micro-batches sum to its share's mean loss
            try:
                # earlier micro-batches left gradients: which ones this backward reaches is
                # told by their versions (an accumulation is in place), for the error below
                held = _grad_versions(self.replica.model) if micro.count > 1 and self.ddp is not None else {}
                precision.backward(scaled)
                self._check_reduced(held)
                self._finish_step()
            except RuntimeError as exc:
                if self.ddp is None or not self._collective_broke(exc):
                    raise  # the recipe's own error: the rank fails as for any other
                return self._fail(scaled, exc)
        return scaled.detach()

    def _check_reduced(self, held: Dict[str, int]) -> None:
        """After the step's backward: DDP's reducer averaged the gradient, or this does. A
        train_step that reached the model's forward by another door (`model.forward(x)`, a
        method calling it) left the reducer out: the gradient is averaged here, exactly, in
        one flat all-reduce per dtype (no overlap with backward). A forward that went through
        DDP but left parameters without a gradient is the case torch DDP refuses too."""
        if self.ddp is None or self._hook.reduced:
            return
        if self._hook.forwarded:
            idle = [name for name, p in self.replica.model.named_parameters()
                    if p.requires_grad and (p.grad is None or held.get(name) == p.grad._version)]
            raise RecipeError("recipe.find_unused_parameters", self.find_unused_parameters,
                              "must be true for a model whose parameters do not all get a gradient "
                              f"in every step (none this step: {', '.join(idle[:4]) or 'unknown'}"
                              f"{', ...' if len(idle) > 4 else ''}), as torch DDP's flag")
        self._gradient_ready()
        grads = []
        for p in self.replica.model.parameters():
            if p.requires_grad:
                if p.grad is None:  # every rank sends the same layout
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        all_reduce_flat_(grads, self._hook.weight, None)

    def _finish_step(self) -> None:
        """Clip the averaged gradient, step unless it is non-finite (on every rank alike: the
        gradient is the same everywhere), then the schedule."""
        precision = self.replica.precision
        if self.ddp is None:
            self._gradient_ready()
            if _skips_on_device(self.replica.optimizer) and precision.scaler is None:
                return self._fused_step()
        precision.unscale_(self.replica.optimizer)
        nonfinite = _nonfinite(self._grouped)  # reads back: the all-reduce has landed
        if self.group.broken():  # the listener aborted the group: the result means nothing
            self.failed = "process group aborted"
            return
        if nonfinite:
            self.skipped += 1
            if precision.scaler is not None:
                precision.scaler.update()  # an overflow: the scale comes down
        else:
            if self.replica.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.replica.model.parameters(), self.replica.max_grad_norm)
            precision.step(self.replica.optimizer)
        if self.replica.scheduler is not None:
            self.replica.scheduler.step()
        self.replica.steps += 1
        self.steps += 1

    def _fused_step(self) -> None:
        """A lone rank whose optimizer is one of torch's fused ones: the skip happens on the
        device (the optimizer's own found_inf, as torch's GradScaler hands it), so the host never
        waits for the step; the count of skipped steps is read at the window's end."""
        optimizer = self.replica.optimizer
        found = _found_inf(self._grouped)
        if self.replica.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.replica.model.parameters(), self.replica.max_grad_norm)
        optimizer.found_inf, optimizer.grad_scale = found, None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        before = self._skipped_on_device
        self._skipped_on_device = found if before is None else before + found
        if self.replica.scheduler is not None:
            self.replica.scheduler.step()
        self.replica.steps += 1
        self.steps += 1

    def window_skipped(self) -> int:
        """Steps skipped in the window (reads the device's count: at the window's end)."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self.skipped + on_device

    def _collective_broke(self, exc: RuntimeError) -> bool:
        """The error came from the step's all-reduce (DDP's reducer re-raises the backend's
        error as a plain RuntimeError), not from the recipe's backward."""
        text = str(exc).lower()
        return (isinstance(exc, dist.DistError) or self.group.broken()
                or any(word in text for word in ("gloo", "nccl", "connection", "process group")))

    def _fail(self, loss: torch.Tensor, exc: Exception) -> torch.Tensor:
        self.failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.group.fail()  # Gloo: peers inside this step see our connections close now
        self.replica.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # ---- timing --------------------------------------------------------------------------

    def _start_clock(self) -> None:
        self._began = time.perf_counter()
        if self.device.type == "cuda" and self.ddp is not None:  # alone, the window's wall is it
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))

    def _gradient_ready(self) -> None:
        """This rank's gradient of the step is complete (before it goes out): the end of its
        compute. An emulated slower device sleeps here, so its peers wait in the all-reduce as
        they would for a slower GPU."""
        if self.slowdown.active:
            self.slowdown.after_step(self._began, self.device)
        if self._events:
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            self._events[-1] = (self._events[-1][0], ready)
        else:
            self.compute_ms += (time.perf_counter() - self._began) * 1000.0

    def window_compute_ms(self) -> Optional[float]:
        """The window's compute, waits at the all-reduce left out (reads the CUDA events:
        call once the device is done, at the window's end); None on a lone GPU rank, whose
        window wall is its compute (it waits for nobody)."""
        if self.device.type == "cuda" and not self._events:
            return None
        total = self.compute_ms
        for start, ready in self._events:
            if ready is not None:
                total += start.elapsed_time(ready)
        return total


def _skips_on_device(optimizer: Any) -> bool:
    """torch's fused optimizers take a found_inf tensor and skip the step on the device."""
    defaults = getattr(optimizer, "defaults", None)
    return isinstance(optimizer, torch.optim.Optimizer) and bool(defaults and defaults.get("fused"))


def _by_device_and_dtype(model: torch.nn.Module) -> List[List[torch.nn.Parameter]]:
    """The model's parameters grouped by device and dtype, as their gradients will be."""
    groups = {}
    for p in model.parameters():
        groups.setdefault((p.device, p.dtype), []).append(p)
    return list(groups.values())


def _found_inf(grouped: List[List[torch.nn.Parameter]]) -> torch.Tensor:
    """1.0 on the device when any gradient is NaN or inf, else 0.0 (nothing read back): one
    fused read-only pass per group, the gradients' norms (a norm is non-finite exactly when a
    gradient is)."""
    norms = []
    for params in grouped:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            norms.append(torch.stack(torch._foreach_norm(grads)).float().sum())
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.stack([n.to(norms[0].device) for n in norms]).sum()
    return (~torch.isfinite(total)).float()


def _nonfinite(grouped: List[List[torch.nn.Parameter]]) -> bool:
    """Any gradient NaN or inf, read back (the host waits for the step's gradient)."""
    return bool(_found_inf(grouped))
