"""The weighted consensus among ranks over torch.distributed (NCCL on CUDA, Gloo on CPU).

The weighted average: all-reduce [w_k, moved_k], pre-scale each rank's flat buffers by w_k / sum w,
all-reduce SUM; float buffers equal-weighted among the ranks that stepped. Owns one reduce on
one rank; when to reduce is the coordinator's call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from flodl_run.averaging.flat import FlatParams, alignment, divergence_parts, ratio


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or timed out); the replica was restored."""


def consensus_weight(steps: int, gamma: float) -> float:
    """w_k = 0 if n_k == 0 else n_k ** gamma."""
    return 0.0 if steps <= 0 else float(steps) ** gamma


@dataclass(frozen=True)
class ReduceOutcome:
    applied: bool
    """False when every weight was 0 (nobody trained): parameters untouched."""
    weight: float
    total_weight: float
    divergence: float
    """This rank's ||theta_before - consensus|| / ||consensus||."""
    scratch: Optional[List[torch.Tensor]]
    """Pre-reduce parameters (for a retry after a rank death)."""
    finite: bool = True
    """False: this rank's parameters held NaN/inf, so it contributed weight 0 (and adopted the
    consensus of the others, when any)."""
    cosine: Optional[float] = None
    """Cosine between this rank's window update and the consensus's (None without a start)."""
    magnitude: Optional[float] = None
    """||this rank's window update|| / ||the consensus's|| (None without a start)."""


def weighted_reduce_(flat: FlatParams, steps: int, gamma: float,
                     group: Optional[dist.ProcessGroup] = None,
                     broken: Callable[[], bool] = lambda: False,
                     start: Optional[List[torch.Tensor]] = None, measure: bool = True,
                     lined_up: Callable[[], None] = lambda: None) -> ReduceOutcome:
    """Replace this rank's parameters and float buffers by the cohort's consensus, in place.
    `broken()` true after the collectives completed (another thread aborted the group while
    they waited on a dead peer): their results are garbage, so the replica is restored.
    `start`: the parameters the window began from, for the divergence's cosine/magnitude.
    `measure` False: no divergence (NaN) and no breakdown, one pass and one read fewer.
    `lined_up()` is called once the weights' all-reduce was read back (every peer had arrived)."""
    device = flat.buffers[0].device
    finite = all_finite(flat)  # stays on the device: read once, with the all-reduced meta
    meta = torch.tensor([consensus_weight(steps, gamma), 1.0 if steps > 0 else 0.0],
                        dtype=torch.float64, device=device).mul_(finite)
    mine = meta.clone()
    try:
        dist.all_reduce(meta, group=group)
        # one read: the totals, this rank's own weight and its finiteness (waits for the result)
        total_weight, movers, weight, moved, ok = torch.cat([meta, mine, finite.reshape(1)]).tolist()
        ok = bool(ok)
        lined_up()
        if broken():
            raise CollectiveError("the process group was aborted")
    except Exception as exc:  # a peer died before anything moved: the replica is untouched
        raise CollectiveError(str(exc)) from exc
    if total_weight <= 0.0:
        return ReduceOutcome(False, weight, 0.0, 0.0, None, ok)
    scratch = flat.clone()
    stats = flat.flat_float_buffers().clone() if flat.float_buffers else None
    try:
        for buf in flat.buffers:  # weight 0 contributes zeros (0 x NaN would be NaN)
            buf.zero_() if weight == 0.0 else buf.mul_(weight / total_weight)
            dist.all_reduce(buf, group=group)
        _reduce_float_buffers_(flat, moved / movers, group)
        if measure:
            parts = divergence_parts(scratch, flat.buffers, start).tolist()  # waits for the result
        elif device.type == "cuda":  # broken() below speaks of collectives that have completed
            torch.cuda.current_stream(device).synchronize()
        if broken():
            raise CollectiveError("the process group was aborted")
    except Exception as exc:  # a peer died mid-reduce: leave this replica as it was
        flat.copy_(scratch)
        if stats is not None:
            flat.load_float_buffers_(stats)
        raise CollectiveError(str(exc)) from exc
    if not measure:
        return ReduceOutcome(True, weight, total_weight, float("nan"), scratch, ok)
    cosine, magnitude = alignment(*parts[2:]) if start is not None else (None, None)
    return ReduceOutcome(True, weight, total_weight, ratio(parts[0], parts[1]), scratch, ok,
                         cosine, magnitude)


def _reduce_float_buffers_(flat: FlatParams, share: float, group: Optional[dist.ProcessGroup]) -> None:
    """Running statistics: equal weight among ranks that stepped, never gamma-weighted."""
    if not flat.float_buffers:
        return
    device = flat.buffers[0].device
    stats = flat.flat_float_buffers().to(device)
    stats.zero_() if share == 0.0 else stats.mul_(share)
    dist.all_reduce(stats, group=group)
    flat.load_float_buffers_(stats)


def all_finite(flat: FlatParams) -> torch.Tensor:
    """One device-side check that no parameter or float buffer holds NaN/inf (a 0-dim bool
    tensor: reading it is the caller's one host sync). min/max propagate NaN and show an inf,
    so one aminmax pass per buffer decides it with no scratch the size of the model (on one
    CPU thread, 2 ms for 10 M floats against 47 ms for isfinite().all())."""
    tensors = [t for t in list(flat.buffers) + list(flat.float_buffers)
               if t.numel() and t.is_floating_point()]
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=flat.buffers[0].device)
    extremes = [x.float() for t in tensors for x in torch.aminmax(t.reshape(-1))]
    return torch.isfinite(torch.stack(extremes)).all()
