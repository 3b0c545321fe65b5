"""How nccl_sync should run a compiled model under torch DDP so that a bucket's gradient
all-reduce can start inside the backward: five ways of the same training step, each on its own
copy of the recipe's model (the same initial weights), the same batches, interleaved round by
round (A B C D E, A B C D E, ...) since a GPU's speed drifts within a call.

- solo: torch.compile(model), the plain step (zero_grad, forward, loss, backward, step).
- ddp_after: nccl_sync's default (flodl_run/rank/exact.py): DDP around the compiled module, the step
  calling the compiled module itself through `_through`'s pre/post-forward hooks, the weighted
  hook. Dynamo sees no active DDP: one graph, every bucket goes out once the backward has ended.
- ddp_split: ddp_after with the step's forward inside `DistributedDataParallel._inside_ddp_forward()`
  (as DDP's own forward runs it), so dynamo's DDPOptimizer splits the graph at bucket boundaries:
  nccl_sync with recipe.optimize_ddp=true.
- ddp_native: DDP(torch.compile(model)) called through DDP's own forward, the same hook
  (`--native compiled_ddp`: torch.compile(DDP(model))): what torch users do. train_step gets a
  callable that calls the wrapper and answers attributes from the model (`model.config`).
- compiled_autograd: optimize_ddp="python_reducer", the backward under compiled autograd: DDP's
  Python reducer all-reduces each parameter's gradient in a post-accumulate-grad hook, which
  compiled autograd traces into the backward graph. That reducer calls a comm hook per parameter
  as hook(state, (grad, param)), not with a GradBucket, so `--ca-hook param` (default) runs the
  same weighting as a functional all-reduce per gradient; `flodl` tries `_weighted_all_reduce`
  itself, `none` DDP's own average.

Per strategy: ms per step (each round times `--steps` steps as one block after `--warmup`; the
median of the rounds) and solo_ms / ms (the median of the rounds' ratios); the first step's
seconds (compile); graphs dynamo built, AOT graphs (a DDPOptimizer split compiles one per
piece), the pieces DDPOptimizer cut, graph breaks, graphs built after the first round; the last
loss and the largest parameter difference from solo after the same steps (from ddp_after with
more than one rank, where solo trains its own batch alone); buckets the hook saw in a step and
when the first one came, as a share of the backward call's host time (near 1.0: only after the
whole backward; on CUDA it is launch time, which still orders the all-reduce after the backward
kernels it waits on). A table, then one JSON line (also written to --out).

Each strategy compiles with a torch.compile of its own, isolated (torch.compile's
`isolate_recompiles`, or where torch lacks it a backend function of its own, which dynamo's
BACKEND_MATCH keeps apart): otherwise a strategy's first call finds the graph another strategy
built for the same model class (dynamo caches per code object, and a second instance passes the
guards) and ddp_split would run ddp_after's unsplit graph. No torch._dynamo.reset() between
strategies: it would drop every strategy's graphs, and later rounds would compile again. Two
things stay shared: automatic dynamic shapes are remembered per code object (with `--batch-size
32,9` the first strategy compiles static then dynamic, the later ones dynamic at once), and DDP
built for python_reducer sets inductor's `_fuse_ddp_communication` and has dynamo inline DDP's
module for good; so compiled_autograd always runs last in a round (strategies run in the order
above whatever --strategies lists), and `later` shows any graph built after the first round.

One GPU (a world-size-1 group on 127.0.0.1; on the GPU machine through tools/device_run.sh,
which installs hydra for the recipe's config):
    python3 tools/ddp_compile_probe.py --model byte_lm --device cuda --batch-size 256 --amp bf16 \\
        --steps 20 --warmup 3 --rounds 3 --out outputs/ddp_compile_probe/byte_lm.json
Two ranks: torchrun --nproc-per-node 2 --master-addr 127.0.0.1 tools/ddp_compile_probe.py ...
The CPU (gloo, aot_eager), small:
    .venv/bin/python tools/ddp_compile_probe.py --device cpu --model byte_lm --batch-size 8 \\
        --param seq_len=32 --param d_model=128 --param num_layers=4 --param num_heads=4 \\
        --param max_bytes=200000 --bucket-cap-mb 1 --steps 5 --warmup 2 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from flodl_run.config.compose import compose, to_experiment
from flodl_run.contracts.recipe import Recipe, import_recipe
from flodl_run.rank.exact import _Hook, _through, _weighted_all_reduce

STRATEGIES = ("solo", "ddp_after", "ddp_split", "ddp_native", "compiled_autograd")
DISTINCT_BATCHES = 8  # batches put on the device once, cycled: every strategy sees the same ones

Step = Callable[[Any], torch.Tensor]


@dataclass
class Result:
    """One strategy's figures, as the JSON line holds them."""

    ms: Optional[float] = None
    ratio_vs_solo: Optional[float] = None
    rounds_ms: List[float] = field(default_factory=list)
    compile_s: Optional[float] = None
    """The first step's seconds (dynamo, AOT and the backend's compile, then the step)."""
    warmup_s: Optional[float] = None
    """The first round's other warm-up steps (a recompile, e.g. for a second batch size)."""
    graphs: int = 0
    """Graphs dynamo built (counters["stats"]["unique_graphs"]), all rounds."""
    aot_graphs: int = 0
    """AOT autograd compiles: one per graph, one per piece of a DDPOptimizer split."""
    ddp_splits: List[int] = field(default_factory=list)
    """Pieces DDPOptimizer cut each graph it saw into (empty: it never ran)."""
    graph_breaks: int = 0
    break_reasons: List[str] = field(default_factory=list)
    recompiled_later: int = 0
    """Graphs built after the first round (should be 0)."""
    ca_graphs: int = 0
    """Backward graphs compiled autograd captured."""
    loss: Optional[float] = None
    max_param_diff_vs_solo: Optional[float] = None
    buckets: Optional[int] = None
    """Comm hook calls in the last step (DDP's buckets); None: not observed."""
    first_bucket_at: Optional[float] = None
    """When the first bucket reached the hook, as a share of the backward call's host time."""
    last_bucket_at: Optional[float] = None
    """The last one's (one graph: all buckets come in a burst after its backward, first ~ last)."""
    error: Optional[str] = None
    note: Optional[str] = None


@dataclass
class Trial:
    """One strategy built: its model (eager; the compiled wrappers share its parameters), the
    step, the dynamo config its calls run under, and where it is in the batches."""

    model: torch.nn.Module
    step: Step
    dynamo: Dict[str, Any]
    probe: Optional["_Probe"] = None
    cursor: int = 0


class _Probe:
    """The comm hook's state: flodl_run's `_Hook` (its weight) and the times each bucket
    reached the hook within the backward call."""

    def __init__(self, weight: float):
        self.hook = _Hook()
        self.hook.weight = weight
        self.calls: List[float] = []
        self.window = (0.0, 0.0)

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.clear()
        self.hook.forwarded = self.hook.reduced = False
        began = time.perf_counter()
        loss.backward()
        self.window = (began, time.perf_counter())

    def at(self, call: int) -> Optional[float]:
        """When bucket call `call` (0: the first, -1: the last) came, as a share of the
        backward call's host time."""
        began, ended = self.window
        if not self.calls or ended <= began:
            return None
        return (self.calls[call] - began) / (ended - began)


def _recorded_all_reduce(state, bucket):  # `bucket` by name, unannotated: DDP checks both
    """flodl_run's weighted all-reduce, its call time noted."""
    state.calls.append(time.perf_counter())
    return _weighted_all_reduce(state.hook, bucket)


def _per_param_all_reduce(state, bucket):
    """The python reducer's form of the same hook: it calls the hook per parameter with
    (grad, param) once the gradient is accumulated and expects the gradient replaced in place;
    a functional collective, so compiled autograd traces it into the backward graph."""
    import torch.distributed._functional_collectives as fcol

    grad, _ = bucket
    grad.copy_(fcol.all_reduce(grad * state.weight, "sum", dist.group.WORLD))


class _Called:
    """train_step's model for the strategies that call DDP's own forward: a call goes through
    the wrapper, every attribute is the model's own (a transformers step reads `model.config`,
    which DDP and torch.compile's wrappers do not have)."""

    def __init__(self, wrapper: Callable[..., Any], model: torch.nn.Module):
        self._wrapper, self._model = wrapper, model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapper(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


# ---- dynamo bookkeeping ---------------------------------------------------------------------

_SPLITS: List[int] = []
"""Pieces each DDPOptimizer.compile_fn call cut its graph into, in order."""


def _watch_ddp_optimizer() -> None:
    """Note how many pieces DDPOptimizer cut each graph into (it keeps its buckets as
    `self.buckets`); convert_frame builds one per graph it compiles while a DDP is active."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:
        return
    original = DDPOptimizer.compile_fn

    def compile_fn(self, *args: Any, **kwargs: Any) -> Any:
        compiled = original(self, *args, **kwargs)
        _SPLITS.append(len(getattr(self, "buckets", ())))
        return compiled

    DDPOptimizer.compile_fn = compile_fn


def _counts() -> Dict[str, Any]:
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "aot": counters["aot_autograd"]["total"],
            "ca": counters["compiled_autograd"]["captures"], "splits": len(_SPLITS),
            "breaks": dict(counters["graph_break"])}


def _account(result: Result, before: Dict[str, Any], first: bool) -> None:
    after = _counts()
    graphs = after["graphs"] - before["graphs"]
    result.graphs += graphs
    result.recompiled_later += 0 if first else graphs
    result.aot_graphs += after["aot"] - before["aot"]
    result.ca_graphs += after["ca"] - before["ca"]
    result.ddp_splits += _SPLITS[before["splits"]:]
    for reason, count in after["breaks"].items():
        added = count - before["breaks"].get(reason, 0)
        if added > 0:
            result.graph_breaks += added
            if len(result.break_reasons) < 4:
                result.break_reasons.append(str(reason).splitlines()[0][:160])


def _raise_recompile_limit() -> None:
    """Every strategy compiles the same model class's code: room for all their graphs."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))


def _compiler(backend: str, isolation: str) -> Callable[..., Any]:
    """torch.compile for one strategy, its graphs reached by no other strategy's calls."""
    kwargs: Dict[str, Any] = {}
    chosen: Any = backend
    if isolation == "region":
        kwargs["isolate_recompiles"] = True
    elif isolation == "backend":
        target = torch._dynamo.lookup_backend(backend)

        def own(gm: torch.fx.GraphModule, example_inputs: List[Any], **extra: Any) -> Any:
            return target(gm, example_inputs, **extra)

        own.__name__ = f"{backend}_own"
        chosen = own

    def compile_(target: Any, **extra: Any) -> Any:
        return torch.compile(target, backend=chosen, **kwargs, **extra)

    return compile_


def _isolation(asked: str) -> str:
    if asked != "auto":
        return asked
    return "region" if "isolate_recompiles" in inspect.signature(torch.compile).parameters else "backend"


def _compiled_autograd_missing() -> Optional[str]:
    """Why this torch cannot run the compiled_autograd strategy (None: it can)."""
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return "this torch has no torch._dynamo.compiled_autograd"
    if not hasattr(torch._dynamo.config, "compiled_autograd"):
        return "this torch has no torch._dynamo.config.compiled_autograd"
    if "python_reducer" not in getattr(torch._dynamo.utils, "_ddp_optimization_mode", ()):
        return "this torch's optimize_ddp has no python_reducer mode"
    if not (hasattr(compiled_autograd, "_enable") or hasattr(compiled_autograd, "enable")):
        return "this torch's compiled_autograd has no _enable/enable"
    return None


# ---- world, recipe, batches -----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_world(kind: str) -> Tuple[int, int, torch.device]:
    """(rank, world, device): torchrun's group from its environment, else a group of one on a
    free loopback port. NCCL on CUDA, Gloo on the CPU. A generous timeout: ranks compile at
    their first step while the other may wait in the all-reduce."""
    backend = "nccl" if kind == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=600)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return rank, world, device
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=timeout)
    return 0, 1, device


def load_recipe(name: str, device: torch.device, overrides: Dict[str, Any]) -> Tuple[Recipe, Any]:
    """The recipe as conf/recipe/<name>.yaml sets it up, `overrides` on its params; its own
    compile switch off (each strategy compiles the model itself)."""
    config, problems = to_experiment(compose([f"recipe={name}", "tracking=off", "cluster=solo",
                                              f"device={device.type}"]))
    if problems:
        raise SystemExit(f"recipe={name}: {problems}")
    params = dict(config.recipe.params) | overrides
    if "compile" in params:
        params["compile"] = False
    return import_recipe(config.recipe.module, params), config


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def make_batches(recipe: Recipe, sizes: List[int], rank: int, world: int,
                 device: torch.device) -> List[Any]:
    """DISTINCT_BATCHES batches in the order every strategy trains them, this rank's part of
    each (rank r takes the r-th slice of the step's samples), collated and on the device."""
    data = recipe.call("train_dataset")
    batches, start = [], 0
    for k in range(DISTINCT_BATCHES):
        size = sizes[k % len(sizes)]
        first = start + rank * size
        rows = [data[(first + i) % len(data)] for i in range(size)]
        batches.append(_to(torch.utils.data.default_collate(rows), device))
        start += size * world
    return batches


# ---- the strategies -------------------------------------------------------------------------

class Builder:
    """Builds each strategy's trial: a fresh model with the initial weights, its optimizer, its
    own torch.compile, DDP as the strategy wants it."""

    def __init__(self, args: argparse.Namespace, recipe: Recipe, device: torch.device, world: int,
                 initial: Dict[str, torch.Tensor], isolation: str):
        self.args, self.recipe, self.device, self.world = args, recipe, device, world
        self.initial, self.isolation = initial, isolation
        self.weight = 1.0 if world == 1 else 1.0 / world
        self.bf16 = args.amp == "bf16"

    def model(self) -> torch.nn.Module:
        model = self.recipe.call("build_model", self.device)
        model = getattr(model, "_orig_mod", model)
        model.load_state_dict(self.initial)
        return model.train()

    def optimizer(self, model: torch.nn.Module) -> Any:
        return self.recipe.call("build_optimizer", model.parameters(), model=model)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        """As nccl_sync wraps it (ExactSync.rebuild), with this probe's bucket cap."""
        cuda = self.device.type == "cuda"
        return DistributedDataParallel(module, device_ids=[self.device] if cuda else None,
                                       init_sync=False, gradient_as_bucket_view=True,
                                       bucket_cap_mb=self.args.bucket_cap_mb)

    def hooked(self, ddp: DistributedDataParallel) -> _Probe:
        probe = _Probe(self.weight)
        ddp.register_comm_hook(probe, _recorded_all_reduce)
        return probe

    def stepper(self, called: Any, optimizer: Any, backward: Callable[[torch.Tensor], None],
                around: Callable[[], Tuple[Any, ...]] = tuple) -> Callable[[Any], torch.Tensor]:
        """One step of a trial: train_step on `called` under autocast (inside the contexts
        `around` makes for each step), `backward` on the loss, the optimizer's step."""
        def step(batch: Any) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            with contextlib.ExitStack() as stack:
                for context in around():
                    stack.enter_context(context)
                with self.autocast():
                    loss = self.recipe.train_step(called, batch)
            backward(loss)
            optimizer.step()
            return loss.detach()
        return step

    def build(self, name: str) -> Trial:
        return getattr(self, name)(_compiler(self.args.backend, self.isolation))

    def solo(self, compile_: Callable[..., Any]) -> Trial:
        model = self.model()
        compiled, optimizer = compile_(model), self.optimizer(model)

        return Trial(model, self.stepper(compiled, optimizer, lambda loss: loss.backward()),
                     {"optimize_ddp": True})

    def _after(self, compile_: Callable[..., Any], split: bool) -> Trial:
        model = self.model()
        compiled, optimizer = compile_(model), self.optimizer(model)
        ddp = self.ddp(compiled)
        probe = self.hooked(ddp)
        # DDP's own forward marks itself active around the module's call; here around the step
        # (train_step's loss outside the compiled frame changes nothing: no frame of its own)
        marked = ddp._inside_ddp_forward if split else contextlib.nullcontext

        step = self.stepper(compiled, optimizer, probe.backward,
                            lambda: (_through(ddp, probe.hook, False), marked()))
        return Trial(model, step, {"optimize_ddp": True}, probe)

    def ddp_after(self, compile_: Callable[..., Any]) -> Trial:
        return self._after(compile_, split=False)

    def ddp_split(self, compile_: Callable[..., Any]) -> Trial:
        if not hasattr(DistributedDataParallel, "_inside_ddp_forward"):
            raise RuntimeError("this torch's DDP has no _inside_ddp_forward")
        return self._after(compile_, split=True)

    def ddp_native(self, compile_: Callable[..., Any]) -> Trial:
        model = self.model()
        optimizer = self.optimizer(model)
        if self.args.native == "compiled_ddp":  # torch.compile(DDP(model))
            ddp = self.ddp(model)
            called = _Called(compile_(ddp), model)
        else:  # DDP(torch.compile(model)): ddp_after's layout, through DDP's own forward
            ddp = self.ddp(compile_(model))
            called = _Called(ddp, model)
        probe = self.hooked(ddp)

        return Trial(model, self.stepper(called, optimizer, probe.backward), {"optimize_ddp": True},
                     probe)

    def compiled_autograd(self, compile_: Callable[..., Any]) -> Trial:
        missing = _compiled_autograd_missing()
        if missing:
            raise RuntimeError(missing)
        from torch._dynamo import compiled_autograd

        enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
        model = self.model()
        optimizer = self.optimizer(model)
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # DDP reads it when built
            ddp = self.ddp(model)
        if not getattr(ddp, "_use_python_reducer", False):
            raise RuntimeError("DDP built under optimize_ddp=python_reducer kept the C++ reducer")
        state = _Hook()  # traced into the backward graph: no timing of its calls here
        state.weight = self.weight
        if self.args.ca_hook == "param":
            ddp.register_comm_hook(state, _per_param_all_reduce)
        elif self.args.ca_hook == "flodl":
            ddp.register_comm_hook(state, _weighted_all_reduce)
        called = _Called(compile_(ddp), model)

        def backward_compiler(gm: torch.fx.GraphModule) -> Any:
            return compile_(gm, fullgraph=True)

        def step(batch: Any) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            # forward and backward both under it, as compiled_autograd._enable asks
            with enable(backward_compiler):
                with self.autocast():
                    loss = self.recipe.train_step(called, batch)
                loss.backward()
            optimizer.step()
            return loss.detach()

        return Trial(model, step, {"optimize_ddp": "python_reducer"}, None)


# ---- rounds ---------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(world: int, device: torch.device) -> None:
    """Ranks start a timed block together (not while the other still compiles)."""
    if world > 1:
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def run_round(trial: Trial, result: Result, batches: List[Any], args: argparse.Namespace,
              device: torch.device, world: int, first: bool) -> None:
    """Warm-up steps, then `args.steps` steps timed as one block (synchronised around it only).
    The first round's first step is timed alone: the compile."""

    def step() -> torch.Tensor:
        loss = trial.step(batches[trial.cursor % len(batches)])
        trial.cursor += 1
        return loss

    with torch._dynamo.config.patch(**trial.dynamo):
        warmup = args.warmup
        if first:
            _sync(device)
            began = time.perf_counter()
            step()
            _sync(device)
            result.compile_s = time.perf_counter() - began
            warmup -= 1
        began = time.perf_counter()
        for _ in range(max(0, warmup)):
            step()
        _sync(device)
        if first:
            result.warmup_s = time.perf_counter() - began
        _barrier(world, device)
        _sync(device)
        began = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        _sync(device)
        result.rounds_ms.append((time.perf_counter() - began) * 1000.0 / args.steps)
    result.loss = float(loss)
    if trial.probe is not None:
        result.buckets = len(trial.probe.calls)
        result.first_bucket_at, result.last_bucket_at = trial.probe.at(0), trial.probe.at(-1)


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    return "\n".join(text[:lines])


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    with torch.no_grad():
        return max(((a.float() - b.float()).abs().max().item()
                    for a, b in zip(model.parameters(), reference.parameters())), default=0.0)


def finish(results: Dict[str, Result], trials: Dict[str, Trial], world: int) -> Optional[str]:
    """Medians, ratios to solo, parameter differences; returns the reference's name."""
    solo = results.get("solo")
    for name, result in results.items():
        if result.rounds_ms:
            result.ms = statistics.median(result.rounds_ms)
        if solo is not None and solo.rounds_ms and result.rounds_ms:
            ratios = [s / m for s, m in zip(solo.rounds_ms, result.rounds_ms)]
            result.ratio_vs_solo = statistics.median(ratios)
    # with more ranks solo trains its own batch alone: compare with today's DDP path instead
    order = ["solo"] if world == 1 else [n for n in STRATEGIES if n != "solo"]
    reference = next((n for n in order if n in trials), None)
    if reference is not None:
        for name, trial in trials.items():
            results[name].max_param_diff_vs_solo = _max_diff(trial.model, trials[reference].model)
    return reference


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: Dict[str, Result]) -> str:
    head = (f"{'strategy':<18}{'ms':>9}{'solo/ms':>9}{'compile s':>10}{'graphs':>7}{'aot':>5}"
            f"{'split':>8}{'breaks':>7}{'later':>6}{'loss':>10}{'max diff':>10}{'buckets':>8}"
            f"{'1st at':>7}{'last':>6}  rounds ms")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        split = "+".join(str(n) for n in r.ddp_splits) or "-"
        lines.append(
            f"{name:<18}{_fmt(r.ms, '.2f'):>9}{_fmt(r.ratio_vs_solo, '.3f'):>9}"
            f"{_fmt(r.compile_s, '.1f'):>10}{r.graphs:>7}{r.aot_graphs:>5}{split:>8}{r.graph_breaks:>7}"
            f"{r.recompiled_later:>6}{_fmt(r.loss, '.5f'):>10}{_fmt(r.max_param_diff_vs_solo, '.2e'):>10}"
            f"{'-' if r.buckets is None else r.buckets:>8}{_fmt(r.first_bucket_at, '.2f'):>7}"
            f"{_fmt(r.last_bucket_at, '.2f'):>6}"
            f"  {' '.join(f'{t:.2f}' for t in r.rounds_ms)}")
        for text in ([r.note] if r.note else []) + [f"break: {b}" for b in r.break_reasons]:
            lines.append(f"    {text}")
        if r.error:
            lines += [f"    ERROR {line}" for line in r.error.splitlines()]
    return "\n".join(lines)


def _param(text: str) -> Tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param wants key=value, got {text!r}")
    return key, _value(value)


def _value(text: str) -> Any:
    """A --param value as the YAML would hold it: 128 -> int, 0.5 -> float, true/false/null."""
    words = {"true": True, "false": False, "null": None, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="byte_lm",
                        help="a conf/recipe name: byte_lm, zoo_resnet, zoo_gpt2")
    parser.add_argument("--param", type=_param, action="append", default=[],
                        help="key=value over the recipe's params (repeatable)")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (inductor on cuda, aot_eager on cpu)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them, every round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", default=None,
                        help="per rank; the recipe's own by default; a list (32,9) cycles sizes step by step")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default torch's 25 with a 1 MiB first bucket)")
    parser.add_argument("--amp", choices=("bf16", "off"), default=None,
                        help="autocast around the step; the recipe's amp by default")
    parser.add_argument("--native", choices=("ddp_compiled", "compiled_ddp"), default="ddp_compiled",
                        help="ddp_native as DDP(torch.compile(model)) or torch.compile(DDP(model))")
    parser.add_argument("--ca-hook", choices=("param", "flodl", "none"), default="param",
                        help="compiled_autograd's comm hook (see the module's docstring)")
    parser.add_argument("--isolation", choices=("auto", "region", "backend", "none"), default="auto",
                        help="how each strategy's graphs are kept from the others "
                             "(auto: region where torch.compile has isolate_recompiles, else backend)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traceback", action="store_true",
                        help="a failing strategy's whole traceback to stderr")
    parser.add_argument("--out", default=None, help="also write the JSON line's object here")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    chosen = {s.strip() for s in args.strategies.split(",") if s.strip()}
    unknown = sorted(chosen - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    args.strategies = [s for s in STRATEGIES if s in chosen]  # compiled_autograd last: see above
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse(argv)
    rank, world, device = join_world(args.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    recipe, config = load_recipe(args.model, device, dict(args.param))
    sizes = [int(s) for s in str(args.batch_size or config.batch_size).split(",")]
    if args.amp is None:
        args.amp = "bf16" if config.recipe.amp.value == "bf16" else "off"
    isolation = _isolation(args.isolation)
    _raise_recompile_limit()
    _watch_ddp_optimizer()

    torch.manual_seed(args.seed)
    first_model = recipe.call("build_model", device)
    first_model = getattr(first_model, "_orig_mod", first_model)
    initial = {k: v.detach().clone() for k, v in first_model.state_dict().items()}
    count = sum(p.numel() for p in first_model.parameters())
    del first_model
    batches = make_batches(recipe, sizes, rank, world, device)
    builder = Builder(args, recipe, device, world, initial, isolation)
    say(f"ddp_compile_probe: {args.model} ({count / 1e6:.2f} M parameters) on {device} x{world}, "
        f"torch {torch.__version__}, backend {args.backend}, batch {sizes}, amp {args.amp}, "
        f"bucket_cap_mb {args.bucket_cap_mb or 'default'}, isolation {isolation}, "
        f"{args.rounds} rounds of {args.warmup} + {args.steps} steps")
    if "ddp_split" in args.strategies and args.bucket_cap_mb is not None and args.bucket_cap_mb < 1:
        say("note: DDPOptimizer's first bucket is 1 MiB whatever DDP's cap: a cap under 1 MB fails its check")

    results = {name: Result() for name in args.strategies}
    trials: Dict[str, Trial] = {}
    if "compiled_autograd" in results:
        results["compiled_autograd"].note = {
            "param": "hook: the weighted all-reduce per gradient (the python reducer's hook form)",
            "flodl": "hook: flodl_run's _weighted_all_reduce (expects a GradBucket)",
            "none": "hook: none (DDP's python reducer averages itself)"}[args.ca_hook]
    for round_ in range(args.rounds):
        for name in args.strategies:  # interleaved: the machine's drift hits all alike
            result = results[name]
            if result.error:
                continue
            before = _counts()
            try:
                if round_ == 0:
                    trials[name] = builder.build(name)
                run_round(trials[name], result, batches, args, device, world, first=round_ == 0)
            except Exception as exc:  # one strategy's failure (a compile, a stride check) is a result
                result.error = _first_lines(exc)
                trials.pop(name, None)
                if args.traceback:
                    traceback.print_exc()
            finally:
                _account(result, before, first=round_ == 0)
        say(f"round {round_ + 1}: " + ", ".join(
            f"{n} {results[n].rounds_ms[-1]:.2f} ms" if len(results[n].rounds_ms) > round_ else f"{n} -"
            for n in args.strategies))
    reference = finish(results, trials, world)
    say(table(results))
    say(f"max diff: largest parameter difference from {reference or '(none ran)'} after the same steps; "
        "later: graphs built after round 1; 1st at / last: the first and last bucket's hook call as a share "
        "of the backward call's host time (one graph: a burst at its end)")
    line = {"model": args.model, "device": str(device), "device_name": _device_name(device),
            "torch": torch.__version__, "world": world, "backend": args.backend, "batch_size": sizes,
            "amp": args.amp, "bucket_cap_mb": args.bucket_cap_mb, "isolation": isolation,
            "native": args.native, "ca_hook": args.ca_hook, "params": dict(args.param),
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "diff_reference": reference, "parameters": count,
            "strategies": {name: asdict(r) for name, r in results.items()}}
    if rank == 0:
        print(json.dumps(line))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(line, fh, indent=1)
    dist.destroy_process_group()
    return line


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
