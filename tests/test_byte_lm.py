"""recipes/byte_lm: the byte-level transformer on the interpreter's stdlib source.

A small configuration learns on the CPU in seconds; the split is deterministic and held-out by
file; the shipped size is GPU-sized (counted on the meta device, never allocated).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from flodl_run.contracts.checkpoint import load_model
from flodl_run.contracts.recipe import import_recipe as load_recipe
from tests.support import LOCKSTEP, _run

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(seq_len=32, d_model=64, num_layers=2, num_heads=4, max_bytes=120_000, lr=3e-3,
             warmup_steps=10)
ONE_LAYER = dict(d_model=32, num_layers=1, num_heads=2, seq_len=32, max_bytes=20000)
"""The least model that is still the recipe's ByteGPT, for what compiling it must keep: tracing
and compiling cost CPU in proportion to the graph (a layer of SMALL more cost about 1
CPU-second in each test that compiles)."""


@pytest.fixture(autouse=True)
def _repo_recipes_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


@pytest.fixture
def one_thread():
    """Two intra-op threads on a shared 2-core machine spin against each other (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _unigram_bits(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Bits per byte on held_out of the byte frequencies of train (add-one smoothed): the best a
    model that ignores context can do."""
    counts = torch.bincount(train[:, 1:].reshape(-1).long(), minlength=256).double() + 1
    log2p = torch.log2(counts / counts.sum())
    return float(-log2p[held_out[:, 1:].reshape(-1).long()].mean())


def test_small_model_beats_the_unigram_baseline_on_held_out_files(one_thread):
    """Pins that the recipe learns: one epoch of a 0.1 M-parameter model on 120 KB takes held-out
    bits per byte from about 8 (uniform) to at least 0.5 bits under the unigram baseline (byte
    frequencies of the train text, about 4.9 bits here; measured 4.17 after one epoch, 4.0 with
    seeds 1 and 2, and 3.8 after two: the second epoch cost 3 CPU-seconds and pinned nothing
    more, as one thread on one seed computes the same bits each run)."""
    torch.manual_seed(0)
    recipe = load_recipe("recipes.byte_lm", SMALL)
    train = recipe.call("train_dataset").tensors[0]
    held_out = recipe.call("eval_dataset").tensors[0]
    model = recipe.call("build_model", torch.device("cpu"))
    optimizer = recipe.call("build_optimizer", model.parameters())
    scheduler = recipe.call("build_scheduler", optimizer)
    for rows in train[torch.randperm(len(train))].split(32):
        loss = recipe.train_step(model, (rows,))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    with torch.no_grad():
        bits, count = recipe.eval_step(model, (held_out,))
    assert count == held_out.shape[0] * 32
    baseline = _unigram_bits(train, held_out)
    assert 4.0 < baseline < 6.0  # Python source: not uniform (8), not trivially predictable
    assert bits / count < baseline - 0.5, (bits / count, baseline)


def test_split_is_deterministic_and_holds_out_whole_files():
    """Pins the split: the same bytes on every call, about 5% of the files held out by a fixed
    hash of their path (CRC-32, not the salted hash()), and no held-out file's text in a train
    window, so eval measures generalisation to unseen files."""
    from recipes import byte_lm

    files = byte_lm.stdlib_files()
    held = [rel for rel, _ in files if byte_lm.is_eval_file(rel)]
    assert len(files) > 100 and 0.02 < len(held) / len(files) < 0.10
    assert [rel for rel, _ in files] == sorted(rel for rel, _ in files)
    assert not any("site-packages" in rel for rel, _ in files)
    byte_lm.split_text.cache_clear()
    train = byte_lm.split_text(True, 400_000)
    assert train == byte_lm.split_text.__wrapped__(True, 400_000)  # uncached re-read: same bytes
    held_text = byte_lm.split_text(False)
    train_files = [p.read_bytes() for rel, p in files if not byte_lm.is_eval_file(rel)]
    assert train == b"".join(train_files)[:380_000]  # 95% of max_bytes, files in path order
    eval_file = next(p.read_bytes() for rel, p in files if rel in held and p.stat().st_size > 2000)
    assert eval_file in held_text
    middle = len(eval_file) // 2  # past any license header that files may share
    probe = eval_file[middle:middle + 400]  # a held-out passage: in no train window (nor train text)
    assert probe not in b"".join(train_files)


def test_windows_are_uint8_and_shift_by_one_byte_into_targets():
    """Pins the sample layout the data plane holds resident: uint8 [N, seq_len + 1], windows
    stepping by seq_len, so each window's last byte (a target) is the next window's first input
    and every byte of the text but the tail is predicted exactly once."""
    from recipes import byte_lm

    rows = byte_lm.windows(bytes(range(200)) * 2, seq_len=16)
    assert rows.dtype == torch.uint8 and rows.shape == ((400 - 1) // 16, 17)
    assert rows[0].tolist() == list(range(17)) and rows[1, 0] == rows[0, -1]
    assert byte_lm.windows(b"short", seq_len=16).shape == (0, 17)


def test_shipped_size_is_gpu_sized_and_the_head_is_tied():
    """Pins the default configuration (conf/recipe/byte_lm.yaml) at >= 20 M parameters, counted
    on the meta device (nothing allocated), with the output head sharing the byte embedding."""
    params = yaml.safe_load((REPO / "conf" / "recipe" / "byte_lm.yaml").read_text())["params"]
    recipe = load_recipe("recipes.byte_lm", params)
    with torch.device("meta"):
        model = recipe.call("build_model", torch.device("meta"))
    assert model.head.weight is model.tok.weight
    total = sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once
    assert total >= 20_000_000, total
    assert params["seq_len"] >= 256 and params["amp"] is True


def test_optimizer_decays_matrices_only():
    """Pins AdamW's two groups: matrices and embeddings decay, biases and LayerNorm gains do not
    (decaying gains toward zero would shrink every normalised activation)."""
    recipe = load_recipe("recipes.byte_lm", SMALL)
    model = recipe.call("build_model", torch.device("cpu"))
    optimizer = recipe.call("build_optimizer", model.parameters())
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


# byte_lm_cpu cut further for the runner's tests; compiled through AOTAutograd without
# inductor's C++ build (30-40 s per graph on a cold cache here, against about 2 s): the graphs,
# the `_orig_mod` wrapper and the backward the runner sees are the same.
TINY = ("recipe=byte_lm_cpu", "recipe.params.d_model=32", "recipe.params.num_layers=1",
        "recipe.params.num_heads=2", "recipe.params.seq_len=32", "recipe.params.max_bytes=60000",
        "recipe.params.lr=0.01", "recipe.params.warmup_steps=5")
COMPILED = ("recipe.params.compile=true", "recipe.params.compile_backend=aot_eager")


@pytest.fixture(scope="module")
def dynamo():
    """torch.compile's machinery, imported once (about 2.5 CPU-seconds, most of what compiling
    a tiny model costs): being module-scoped puts the tests that compile in this process on
    one pytest worker."""
    import torch._dynamo  # noqa: F401

    return torch._dynamo


def _eager_keys(**params) -> list:
    with torch.device("meta"):
        model = load_recipe("recipes.byte_lm", params).call("build_model", torch.device("meta"))
    return list(model.state_dict())


def test_compile_auto_compiles_on_cuda_only():
    """Pins `recipe.params.compile`: true compiles anywhere, auto only on a CUDA device (on the
    CPU inductor's build costs more than it saves), false never; another value fails naming
    the key and the value."""
    from recipes.byte_lm import _compiles

    assert _compiles("auto", torch.device("cuda", 0)) and not _compiles("auto", torch.device("cpu"))
    assert _compiles(True, "cpu") and not _compiles(False, "cuda")
    with pytest.raises(ValueError, match="recipe.params.compile must be true, false or auto, got 'yes'"):
        _compiles("yes", "cpu")


def test_the_gpu_recipe_defaults_to_a_batch_that_fills_a_gpu():
    """Pins the careful user's GPU setup: recipe=byte_lm runs batch 256 per rank compiled on
    CUDA (compile: auto), unless the command line sets batch_size; byte_lm_cpu keeps 32 eager."""
    from flodl_run.config.compose import compose, to_experiment

    def resolved(*overrides):
        return to_experiment(compose(list(overrides)))[0]

    gpu, cpu = resolved("recipe=byte_lm"), resolved("recipe=byte_lm_cpu")
    assert (gpu.batch_size, gpu.recipe.params["compile"]) == (256, "auto")
    assert (cpu.batch_size, cpu.recipe.params["compile"]) == (32, False)
    assert resolved("recipe=byte_lm", "batch_size=64").batch_size == 64


@pytest.mark.e2e
def test_a_compiled_model_trains_exactly_on_two_cpu_ranks_and_saves_eager_keys(tmp_path):
    """Pins a compiled model through the ranks: torch DDP's reducer around it and the flat
    parameter buffers under it (nccl_sync, a homogeneous pair: an emulated slow rank would
    also sleep in proportion to each graph build); one epoch, eval below the 8 bits of a uniform guess,
    and a bundle whose model file has the eager model's keys (it loads into an eager run). The
    other modes write the same flat buffers (the next test); one run, as each costs about 9
    CPU-seconds more than an eager one, most of it importing torch._dynamo and tracing on each rank."""
    proc, summary = _run(tmp_path, *TINY, *COMPILED, *LOCKSTEP, "num_epochs=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert 0 < summary["final_eval"] < 7.5, summary["final_eval"]
    assert yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())["recipe"]["eval_direction"] == "min"
    tiny = {k.split(".")[-1]: yaml.safe_load(v) for k, v in (o.split("=") for o in TINY[1:])}
    assert list(load_model(summary["checkpoint"])) == _eager_keys(**tiny)


def test_a_compiled_model_saves_eager_keys_and_computes_with_the_flat_buffers(one_thread, dynamo):
    """Pins what the runner needs of a compiled model: the module under the wrapper
    (eager_module, whose state dict bundles hold) has the eager model's keys, without the
    `_orig_mod.` prefix, and the same Parameter objects; and after FlatParams re-homes them,
    the compiled graph computes with what an average or a blend (the cadence and async modes)
    writes into the flat buffers, not with a copy taken when it compiled, and its steps land
    there."""
    from flodl_run.averaging.flat import FlatParams
    from flodl_run.contracts.recipe import eager_module
    from recipes.byte_lm import ByteGPT

    torch.manual_seed(0)
    recipe = load_recipe("recipes.byte_lm", dict(ONE_LAYER, compile=True, compile_backend="aot_eager"))
    model = recipe.call("build_model", torch.device("cpu"))
    assert not isinstance(model, ByteGPT) and isinstance(eager_module(model), ByteGPT)
    assert list(model.state_dict())[0].startswith("_orig_mod.")
    assert list(eager_module(model).state_dict()) == _eager_keys(**ONE_LAYER)
    assert list(model.parameters()) == list(eager_module(model).parameters())
    flat = FlatParams(model)
    optimizer = recipe.call("build_optimizer", model.parameters())
    rows = recipe.call("train_dataset").tensors[0][:8]
    before = flat.clone()
    recipe.train_step(model, (rows,)).backward()
    optimizer.step()
    assert not torch.equal(before[0], flat.buffers[0])  # the step wrote into the flat buffer
    flat.copy_(before)  # what a reduce does: the consensus copied into the buffers
    inputs = rows[:, :-1].long()
    with torch.no_grad():
        for _ in range(2):  # the consensus, then a blend that halves it
            assert torch.allclose(model(inputs), eager_module(model)(inputs), atol=1e-6)
            flat.buffers[0].mul_(0.5)


def test_bundles_move_between_compiled_and_eager_runs(tmp_path, monkeypatch, one_thread, dynamo):
    """Pins resume across compile: an eager in-process epoch, a compiled run resuming it (the
    launcher's shape check and the load see the eager keys), then an eager run resuming the
    compiled run's bundle; each continues where the bundle ends."""
    import flodl_run
    from flodl_run.config.schema import (
        ClusterConfig,
        ExperimentConfig,
        RecipeConfig,
        Topology,
        TrackingConfig,
        TrackingKind,
    )

    monkeypatch.chdir(tmp_path)
    params = dict(ONE_LAYER, amp=False)

    def run(epochs: int, name: str, compiled: bool, resume_from=None):
        config = ExperimentConfig(
            num_epochs=epochs, save_path=str(tmp_path / name), resume_from=resume_from,
            cluster=ClusterConfig(topology=Topology.solo), tracking=TrackingConfig(kind=TrackingKind.off),
            recipe=RecipeConfig(module="recipes.byte_lm", params=dict(
                params, compile=compiled, compile_backend="aot_eager")))
        return flodl_run.train(config, run_dir=str(tmp_path / f"{name}_run")).summary

    first = run(1, "eager", False)
    second = run(2, "compiled", True, resume_from=first.checkpoint)
    third = run(3, "eager_again", False, resume_from=second.checkpoint)
    assert [s.status for s in (first, second, third)] == ["completed"] * 3
    assert [[e.epoch for e in s.epochs] for s in (first, second, third)] == [[0], [1], [2]]
    assert list(load_model(second.checkpoint)) == _eager_keys(**params)
