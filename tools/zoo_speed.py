"""The solo path (`flodl_run.train`, `cluster=solo`, in this process) against a careful user's own
loop over the same zoo recipe: the same model, optimizer, train_step and autocast, every sample
on the device once, batches by index, each epoch in the solo path's order (a model whose work
depends on its batches, zoo_unused's auxiliary head, then does the same work in both). The two
alternate in one process (A B, then B A, ...), since a machine's speed drifts within a call, and
each one's median training ms per epoch is compared (the first epoch, warm-up and compile, left
out; the eval, which both run after the epochs the config evaluates, left out of both).

    python3 tools/zoo_speed.py zoo_frozen --device cuda --epochs 6 --rounds 3 [--compiled] [--profile]

Prints one JSON line last: ours_ms and own_loop_ms (medians of the rounds' median epochs), ratio
(own / ours, the median of the rounds' ratios: 1.0 is as fast as the own loop), every round's
figures, and Python's collections during each loop. With --profile, one
more epoch-run of each under cProfile first prints where the host's time went in each.

--split adds two halfway loops to each round, to tell which half of the solo path costs what it
costs over the own loop: `plane` is the own loop fed by the solo path's data plane
(DataPlane.batches, resident on the device after the first batch), `replica` is the own loop's
feed with the solo path's step (Replica.step: autocast, the scaler, the optimizer). Their
figures join the JSON line as plane_ms and replica_ms (medians of the rounds) and own over each.

--phases clocks each call of the solo path's delivery (DataPlane._deliver) and step
(Replica.step) and of the own loop's step, and adds their median calls (ours_delivery_us,
ours_step_us, own_step_us; with their mean, 95th percentile, the gap between two calls and an
epoch's first calls: see Phases) to the JSON line: what a step of each costs the host, and what
the loop does between two steps.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import flodl_run
from flodl_run.config.compose import compose, to_experiment
from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts.recipe import import_recipe
from flodl_run.data.passes import permutation


def experiment(name: str, device: torch.device, epochs: int, backend: Optional[str],
               extra: List[str] = ()) -> ExperimentConfig:
    overrides = [f"recipe={name}", f"num_epochs={epochs}", "tracking=off", "cluster=solo",
                 f"device={device.type}"] + ([f"recipe.compile={backend}"] if backend else [])
    overrides += list(extra)
    config, problems = to_experiment(compose(overrides))
    if problems:
        raise SystemExit(f"bad overrides {overrides}: {problems}")
    return config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def own_loop(config: ExperimentConfig, device: torch.device, backend: Optional[str],
             half: str = "") -> List[float]:
    """A careful user's loop over the recipe; its ms per epoch (training only). `half`: "plane"
    takes its batches from the solo path's data plane, "replica" steps through its Replica."""
    cfg = config.recipe
    recipe = import_recipe(cfg.module, cfg.params)
    torch.manual_seed(config.seed)
    model = recipe.call("build_model", device)
    if backend and not hasattr(model, "_orig_mod"):
        model = torch.compile(model, backend=backend)
    optimizer = recipe.call("build_optimizer", model.parameters(), model=model)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.amp.value)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp.value == "fp16" else None
    data = recipe.call("train_dataset")
    if half == "plane":
        return _plane_fed(config, recipe, data, model, optimizer, dtype, scaler, device)
    if half == "replica":
        return _replica_stepped(config, recipe, data, device)
    take = _rows_on_device(data, device)
    evaluate = _own_eval(config, recipe, model, device)
    model.train()
    times = []
    for epoch in range(config.num_epochs):
        order = permutation(len(data), config.seed, epoch).to(device)
        _sync(device)
        began = time.perf_counter()
        for start in range(0, len(data), config.batch_size):
            _own_step(recipe, model, optimizer, dtype, scaler, device,
                      take(order[start:start + config.batch_size]))
        _sync(device)
        times.append((time.perf_counter() - began) * 1000.0)
        evaluate(epoch)
    return times


def _own_eval(config: ExperimentConfig, recipe, model, device: torch.device) -> Callable[[int], None]:
    """The careful user's eval after the epochs the solo path evaluates (untimed in both, as the
    solo path's eval is left out of its epochs): the eval set on the device once, the recipe's
    eval_step (or eval_fn) under no_grad in eval mode, then back to training. Without it the own
    loop would skip work whose wake (a GPU that idled through the eval) the solo path's next
    steps feel."""
    every = config.eval_every_epochs
    if every is None or not recipe.has_eval:  # as the solo path decides
        return lambda epoch: None
    from flodl_run.rank.replica import EVAL_BATCH_SIZE

    data = recipe.call("eval_dataset")
    take = _rows_on_device(data, device)
    step = recipe.eval_step or recipe.eval_fn

    def evaluate(epoch: int) -> None:
        if (epoch + 1) % every:
            return
        model.eval()
        with torch.no_grad():
            for start in range(0, len(data), EVAL_BATCH_SIZE):
                step(model, take(slice(start, start + EVAL_BATCH_SIZE)))
        model.train()

    return evaluate


def _rows_on_device(data, device: torch.device) -> Callable[[torch.Tensor], Any]:
    """The careful user's feed: every sample collated and moved to the device once; the
    returned function indexes a batch out of it (a dict or a list of fields, as collated)."""
    rows = torch.utils.data.default_collate([data[i] for i in range(len(data))])
    if isinstance(rows, dict):
        rows = {k: v.to(device) for k, v in rows.items()}
        return lambda i: {k: v[i] for k, v in rows.items()}
    rows = [v.to(device) for v in rows]
    return lambda i: [v[i] for v in rows]


def _own_step(recipe, model, optimizer, dtype, scaler, device: torch.device, batch) -> None:
    """The careful user's step: torch's AMP recipe when a scaler is given."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = recipe.train_step(model, batch)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _timed_epochs(config: ExperimentConfig, device: torch.device, n: int,
                  epoch: Callable[[torch.Tensor], None]) -> List[float]:
    times = []
    for k in range(config.num_epochs):
        order = permutation(n, config.seed, k)
        _sync(device)
        began = time.perf_counter()
        epoch(order)
        _sync(device)
        times.append((time.perf_counter() - began) * 1000.0)
    return times


def _plane_fed(config, recipe, data, model, optimizer, dtype, scaler, device) -> List[float]:
    """The own loop's step on the batches of the solo path's data plane."""
    from flodl_run.data.dataplane import DataPlane

    plane = DataPlane(data, device, config, recipe.transform)
    model.train()

    def epoch(order: torch.Tensor) -> None:
        for batch in plane.batches(order, config.batch_size):
            _own_step(recipe, model, optimizer, dtype, scaler, device, batch)

    return _timed_epochs(config, device, len(data), epoch)


def _replica_stepped(config, recipe, data, device) -> List[float]:
    """The own loop's batches (rows on the device, indexed) through the solo path's step."""
    from flodl_run.rank.replica import Replica

    replica = Replica(recipe, device, config.seed, max_grad_norm=config.max_grad_norm, options=config.recipe)
    take = _rows_on_device(data, device)
    replica.model.train()

    def epoch(order: torch.Tensor) -> None:
        order = order.to(device)
        for start in range(0, len(data), config.batch_size):
            replica.step(take(order[start:start + config.batch_size]))

    return _timed_epochs(config, device, len(data), epoch)


DELIVERY: List[str] = []
"""The solo path's delivery, data wait and eval per epoch, last run (resident after the first step)."""


def ours(config: ExperimentConfig, run_dir: str) -> List[float]:
    """The solo path's ms per epoch (its training, its eval left out)."""
    result = flodl_run.train(config, run_dir=run_dir)
    DELIVERY[:] = [f"{e.per_rank_delivery[0]} {e.per_rank_data_starve_ms[0]:.1f} ms, "
                   f"eval {e.eval_ms or 0:.1f} ms" for e in result.summary.epochs]
    return [e.epoch_ms - (e.eval_ms or 0.0) for e in result.summary.epochs]


class Phases:
    """A clock around a few calls: the solo path's delivery (DataPlane._deliver) and step
    (Replica.step), the own loop's step. `tag` names the loop running now (ours, own,
    plane, replica), so a call is kept as `<tag>_<what>` (ours_step, own_step, plane_delivery).
    `report` gives, in microseconds, per kept name:

    - `_us`: the median call (the first epoch's compile does not weigh in);
    - `_mean_us`, `_p95_us`: over the calls after the first tenth (a slow call now and then
      weighs on an epoch as much as on the mean, and the median misses it);
    - `_gap_us`, `_gap_mean_us`: from a call's end to the next one's start within an epoch
      (every loop makes `per_epoch` calls of each an epoch): for a step, what the loop does
      between two steps (its feed and bookkeeping);
    - `_head_us`: the mean of an epoch's first HEAD calls, against `_mean_us`: whether an
      epoch's first steps cost more (after our eval and epoch close, say).
    """

    HEAD = 5

    def __init__(self):
        self.tag = "ours"
        self.calls: Dict[str, List[Tuple[float, float]]] = {}

    def wrap(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.setdefault(f"{self.tag}_{what}", []).append((began, time.perf_counter()))

        setattr(owner, name, timed)

    def report(self, per_epoch: int) -> Dict[str, float]:
        out = {}
        for label, calls in sorted(self.calls.items()):
            durations = [end - began for began, end in calls]
            later = sorted(durations[len(durations) // 10:])
            inner = [calls[k][0] - calls[k - 1][1] for k in range(1, len(calls)) if k % per_epoch]
            head = [d for k, d in enumerate(durations) if k % per_epoch < self.HEAD]
            us = {"": statistics.median(durations), "_mean": statistics.fmean(later),
                  "_p95": later[int(0.95 * (len(later) - 1))], "_gap": statistics.median(inner or [0.0]),
                  "_gap_mean": statistics.fmean(inner or [0.0]), "_head": statistics.fmean(head)}
            out |= {f"{label}{key}_us": round(v * 1e6, 1) for key, v in us.items()}
        return out


def clock_phases() -> Phases:
    from flodl_run.data.dataplane import DataPlane
    from flodl_run.rank.replica import Replica

    phases = Phases()
    phases.wrap(DataPlane, "_deliver", "delivery")
    phases.wrap(Replica, "step", "step")
    phases.wrap(sys.modules[__name__], "_own_step", "step")
    return phases


class Collections:
    """Python's garbage collections while it is on: count and ms by generation."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._began = 0.0

    def __call__(self, phase: str, info: Dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._began) * 1000.0

    def during(self, fn: Callable[[], List[float]]) -> List[float]:
        gc.callbacks.append(self)
        try:
            return fn()
        finally:
            gc.callbacks.remove(self)


def profiled(label: str, fn: Callable[[], List[float]]) -> None:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(f"---- {label}: where the host's time went (cProfile, tottime) ----\n{text.getvalue()}")


def traced(label: str, fn: Callable[[], List[float]], device: torch.device) -> None:
    """torch.profiler over one run: host time by op, and the device's busy time, so a loop
    that is host-bound (the device idles between launches) shows against one that is not."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        epochs = fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=48)
    print(f"---- {label}: torch.profiler, epochs {[round(t, 1) for t in epochs]} ----\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--out", default="outputs/zoo_speed")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--split", action="store_true", help="also the plane-fed and replica-stepped halves")
    parser.add_argument("--phases", action="store_true",
                        help="also our delivery and step calls and the own step's, and the gaps between (us)")
    parser.add_argument("overrides", nargs="*", help="more overrides (recipe.params.hidden=8)")
    args = parser.parse_intermixed_args()
    device = torch.device(args.device)
    backend = ("inductor" if device.type == "cuda" else "aot_eager") if args.compiled else None
    config = experiment(args.name, device, args.epochs, backend, args.overrides)
    run_dir = f"{args.out}/{args.name}-{int(args.compiled)}"
    if args.profile:
        profiled("own loop", lambda: own_loop(config, device, backend))
        profiled("solo path", lambda: ours(config, f"{run_dir}/profile"))
    if args.trace:
        traced("own loop", lambda: own_loop(config, device, backend), device)
        traced("solo path", lambda: ours(config, f"{run_dir}/trace"), device)
    phases = clock_phases() if args.phases else Phases()  # unwrapped: its tag is all it keeps
    samples = len(import_recipe(config.recipe.module, config.recipe.params).call("train_dataset"))
    per_epoch = -(-samples // config.batch_size)  # each loop's steps (and deliveries) an epoch
    mine, theirs = [], []
    halves: Dict[str, List[List[float]]] = {"plane": [], "replica": []} if args.split else {}
    gc_ours, gc_own = Collections(), Collections()

    def own() -> List[float]:
        phases.tag = "own"
        return gc_own.during(lambda: own_loop(config, device, backend))

    for k in range(args.rounds):  # the machine's speed drifts within a call: A B B A A B ...
        own_first = k % 2 == 0  # which loop runs first alternates, so neither always runs second
        if own_first:
            theirs.append(own())
        for half, runs in halves.items():
            phases.tag = half
            runs.append(own_loop(config, device, backend, half))
        phases.tag = "ours"
        mine.append(gc_ours.during(lambda: ours(config, f"{run_dir}/{k}")))
        if not own_first:
            theirs.append(own())
    split = {}
    for half, runs in halves.items():
        part = summary(runs, theirs)
        split |= {f"{half}_ms": part["ours_ms"], f"own_over_{half}": part["ratio"],
                  f"{half}_rounds_ms": part["ours_rounds_ms"]}
    print(json.dumps(summary(mine, theirs) | split | {
        "delivery": DELIVERY, "gc_ours": {"count": gc_ours.count, "ms": gc_ours.ms},
        "gc_own": {"count": gc_own.count, "ms": gc_own.ms}} | phases.report(per_epoch)))


def summary(mine: List[List[float]], theirs: List[List[float]]) -> Dict:
    """Each round's median epoch (its first left out) for both loops, and own / ours as the
    median of the rounds' ratios: a round's two runs ran next to each other, so the machine's
    drift over the call falls out of each ratio."""
    ours_by_round = [statistics.median(run[1:] or run) for run in mine]
    own_by_round = [statistics.median(run[1:] or run) for run in theirs]
    ratios = [own / ours for own, ours in zip(own_by_round, ours_by_round)]
    return {"ours_ms": statistics.median(ours_by_round), "own_loop_ms": statistics.median(own_by_round),
            "ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
            "ours_rounds_ms": [round(t, 1) for t in ours_by_round],
            "own_rounds_ms": [round(t, 1) for t in own_by_round]}


if __name__ == "__main__":
    main()
