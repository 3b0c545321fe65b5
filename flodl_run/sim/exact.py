"""The simulator's model of nccl_sync's exact path (`elche.sync_average=grads`): windows of
global steps, each split between the ranks by the runner's own planner (`elche.shares`), each
rank's step a fixed cost plus a cost per sample.

Owns the per-step cost of a simulated rank and the window loop of this path (values in,
records out). A rank's `ms_per_batch` is what a batch of `batch_size` samples costs it; the
fixed part is `sim.step_fixed_ms` on the fastest rank and the same fraction of every rank's
batch (an emulated slower device, like a slower GPU, is slower at both). A step lasts as long
as its slowest rank's compute, or as its all-reduce (`sim.sync_ms` and its per-rank part) when
that is longer: the all-reduce overlaps backward, and no step ends before it. The window
boundary's round trip costs one more reduce's wall, the overhead ElChe sees.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, List, Optional

import numpy as np

from flodl_run.config.schema import ElCheConfig
from flodl_run.elche.balancer import ElChe, ReduceReport
from flodl_run.elche.shares import SharePlanner, window_steps
from flodl_run.sim.rig import SimConfig, SimResult, SimRig, WindowRecord, _Totals, simulate


def fixed_fraction(sim: SimConfig, rank_ms: np.ndarray) -> float:
    """The share of a batch's time that does not depend on its samples (the same on every
    rank): sim.step_fixed_ms over the fastest rank's nominal ms per batch."""
    return sim.step_fixed_ms / float(rank_ms.min()) if len(rank_ms) else 0.0


def step_ms(ms_per_batch: np.ndarray, fraction: float, batch_size: int,
            shares: np.ndarray) -> np.ndarray:
    """Each rank's compute of one step of `shares` samples (0 for a rank without a share)."""
    fixed = fraction * ms_per_batch
    per_sample = (1.0 - fraction) * ms_per_batch / batch_size
    return np.where(shares > 0, fixed + per_sample * shares, 0.0)


def simulate_exact(sim: SimConfig, elche_config: ElCheConfig,
                   on_window: Optional[Callable[[WindowRecord], None]] = None) -> SimResult:
    """Run `sim.windows` exact windows of the rig: ElChe sets each window's steps, the planner
    its shares, and both hear the window's timings as the runner's coordinator tells them."""
    rig = SimRig(sim)
    ranks = list(range(rig.world_size))
    prior = [1.0 / ms for ms in rig.rank_ms] if sim.spec_prior else None
    elche = ElChe(elche_config, rig.world_size, epoch_batches=sim.epoch_batches, prior=prior,
                  reduce_ms=rig.sync_ms(rig.world_size) if sim.reduce_probe else None)
    planner = SharePlanner(elche_config.partition_ratios)
    fraction = fixed_fraction(sim, rig.rank_ms)
    global_batch = rig.world_size * sim.batch_size
    totals = _Totals(rig.world_size)
    records: List[WindowRecord] = []
    for window in range(sim.windows):
        plan = elche.plan()
        steps = window_steps(plan.anchor, elche.smoothed_ms(), ranks)
        shares = np.array(planner.plan([global_batch], ranks, elche.smoothed_ms())[0])
        compute = steps * step_ms(rig.ms_per_batch(window), fraction, sim.batch_size, shares)
        if window > 0:  # as the runner: a rank's first window carries one-time costs
            for rank in ranks:
                planner.observe(rank, steps, steps * int(shares[rank]), float(compute[rank]))
        sync_ms = rig.sync_ms(rig.world_size)
        # ElChe's unit: ms per batch of batch_size samples (exact.per_batch)
        per_batch = compute * sim.batch_size / (steps * shares)
        after = elche.on_reduce(ReduceReport(wall_ms=per_batch * steps, batches=[steps] * len(ranks),
                                             sync_ms=sync_ms, lr=rig.lr(window)))
        _account(totals, compute, steps, sync_ms, steps * global_batch // sim.batch_size)
        totals.anchors.append(after.anchor)
        record = WindowRecord(
            window=window, phase=plan.phase.label, anchor=plan.anchor, anchor_rank=plan.anchor_rank,
            batch_counts=[steps] * len(ranks), overhead=after.overhead, divergence=None,
            verdict=after.verdict.label, nudge_factor=after.nudge_factor,
            batches=steps * len(ranks), shares=shares.tolist())
        records.append(record)
        if on_window is not None:
            on_window(record)
    last = records[-1].shares if records else None
    summary = totals.summary(rig.rank_ms.tolist(), sim.batch_size)
    summary = replace(summary, shares=[s / global_batch for s in last] if last else None)
    return SimResult(records, summary, rig.rank_ms.tolist())


def _account(totals: _Totals, compute: np.ndarray, steps: int, sync_ms: float, batches: int) -> None:
    """A window's wall (each step as long as its slowest compute or its all-reduce, then the
    boundary's round trip), its batches, and each rank's wait inside its steps."""
    step_wall = max(float(compute.max()) / steps, sync_ms)
    totals.wall_ms += steps * step_wall + sync_ms
    totals.samples += batches
    totals.idle_ms += steps * step_wall - compute


def simulate_mode(sim: SimConfig, elche_config: ElCheConfig,
                  on_window: Optional[Callable[[WindowRecord], None]] = None) -> SimResult:
    """The rig under the config's mode: nccl_sync's exact path here, every other mode (and
    nccl_sync with elche.sync_average=params) in `rig.simulate`."""
    run = simulate_exact if elche_config.averages_gradients else simulate
    return run(sim, elche_config, on_window)
