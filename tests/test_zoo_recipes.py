"""The zoo's recipes (recipes/zoo/, conf/recipe/zoo_*.yaml) train in plain torch, and each still
has the property it is in the zoo for.

Each recipe is loaded with its shipped YAML's params through the recipe contract, stepped three
times the way a user's loop steps it (backward on `out.loss` when the step returns a ModelOutput),
and checked: a finite loss, every trainable parameter moved. The runner's modes are tested
elsewhere; these pin the models themselves, so a zoo entry cannot quietly lose its BatchNorm,
its tied embeddings or its unused branch and still pass the matrix.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

from flodl_run.contracts.recipe import eager_module
from flodl_run.contracts.recipe import import_recipe as load_recipe

REPO = Path(__file__).resolve().parents[1]
ZOO = sorted(p.stem.removeprefix("zoo_") for p in (REPO / "conf" / "recipe").glob("zoo_*.yaml"))
BATCH = 8  # small: the properties do not depend on it, and the suite's CPU time does


@pytest.fixture(autouse=True)
def one_thread():
    """Two intra-op threads on a shared 2-core machine spin against each other (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spec(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "recipe" / f"zoo_{name}.yaml").read_text())


def _load(name: str):
    spec = _spec(name)
    return load_recipe(spec["module"], spec.get("params") or {})


def _batches(recipe, num_batches: int, batch_size: int = BATCH) -> list:
    """The first batches of the train set, collated as the runner collates them."""
    loader = DataLoader(recipe.call("train_dataset"), batch_size=batch_size, shuffle=False)
    return [batch for batch, _ in zip(loader, range(num_batches))]


def _loss(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _step(recipe):
    """The recipe's own train_step (its params bound), without the runtime's check of what it
    returns: these tests step in plain torch."""
    return inspect.unwrap(recipe.train_step)


def _train(recipe, model: nn.Module, batches: list) -> list:
    """One optimizer step per batch, as a user's own loop does; the losses as floats."""
    optimizer = recipe.call("build_optimizer", model.parameters(), model=model)
    losses = []
    for batch in batches:
        loss = _loss(_step(recipe)(model, batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _built(name: str):
    torch.manual_seed(0)
    recipe = _load(name)
    return recipe, recipe.call("build_model", torch.device("cpu"))


def _snapshot(model: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in eager_module(model).named_parameters()}


def test_the_zoo_is_complete():
    """Pins: a zoo entry dropped (its YAML deleted or renamed) without anyone noticing."""
    assert ZOO == ["amp", "bert_cls", "checkpointed", "compiled", "frozen", "gpt2", "resnet", "unused"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_recipe_trains_in_plain_torch(name):
    """Pins: a zoo recipe whose loss is not finite, or whose trainable parameters do not move
    in three optimizer steps, in plain torch (before any runner mode is involved)."""
    recipe, model = _built(name)
    before = _snapshot(model)
    trainable = {n for n, p in eager_module(model).named_parameters() if p.requires_grad}
    losses = _train(recipe, model, _batches(recipe, 3))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    moved = {n for n, p in eager_module(model).named_parameters() if not torch.equal(p, before[n])}
    assert moved == trainable, f"{name}: did not move: {sorted(trainable - moved)}"


@pytest.mark.parametrize("name", ZOO)
def test_zoo_recipe_yaml_says_when_to_choose_it(name):
    """Pins: a zoo option without the "Choose ... when" comment --help shows, or not pointing
    at its own module."""
    text = (REPO / "conf" / "recipe" / f"zoo_{name}.yaml").read_text()
    assert text.startswith("# Choose") and _spec(name)["module"] == f"recipes.zoo.{name}"


def test_resnet_keeps_batchnorm_buffers_float_and_counted():
    """Pins the ResNet's reason to be here: float running stats that training moves, and an
    integer `num_batches_tracked` counting the steps (the buffers a flat float buffer must
    carry, and must not turn into floats)."""
    recipe, model = _built("resnet")
    buffers = dict(model.named_buffers())
    _train(recipe, model, _batches(recipe, 3))
    counts = [b for n, b in buffers.items() if n.endswith("num_batches_tracked")]
    stats = [b for n, b in buffers.items() if n.endswith(("running_mean", "running_var"))]
    assert counts and all(b.dtype == torch.int64 and b.item() == 3 for b in counts)
    assert stats and all(b.dtype == torch.float32 for b in stats)
    assert not torch.equal(model.bn1.running_mean, torch.zeros_like(model.bn1.running_mean))


def test_gpt2_returns_a_model_output_with_tied_embeddings():
    """Pins the causal LM's reasons: train_step returns transformers' ModelOutput (the runtime
    takes `.loss`), and the output head is the input embedding, one Parameter under two names,
    still one after training."""
    from transformers.utils import ModelOutput

    recipe, model = _built("gpt2")
    (batch,) = _batches(recipe, 1)
    out = _step(recipe)(model, batch)
    assert isinstance(out, ModelOutput) and out.loss.dim() == 0
    assert model.lm_head.weight is model.transformer.wte.weight
    _train(recipe, model, _batches(recipe, 2))
    assert model.lm_head.weight is model.transformer.wte.weight
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


class _Wrapper(nn.Module):
    """What torch DDP does to a model: forward passes through, attributes do not."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_gpt2_steps_read_the_models_config():
    """Pins: the GPT-2 steps reading `model.config` as transformers users do (the nccl_sync
    failure seen with wrapped models needs a step that does): given a wrapper, both fail on `config`."""
    recipe, model = _built("gpt2")
    (batch,) = _batches(recipe, 1)
    for step in (_step(recipe), recipe.eval_step):
        with pytest.raises(AttributeError, match="config"):
            step(_Wrapper(model), batch)


def test_bert_takes_padded_dict_batches_through_its_pooler():
    """Pins the encoder's reasons: a dict batch (`model(**batch)`) with real padding under the
    attention mask, which reaches the model (the tokens under it change nothing), a pooler that
    training reaches, and non-persistent int64 buffers that the
    state dict leaves out."""
    recipe, model = _built("bert_cls")
    batches = _batches(recipe, 3)
    assert isinstance(batches[0], dict) and set(batches[0]) == {"input_ids", "attention_mask", "labels"}
    assert all((b["attention_mask"] == 0).any() for b in batches)
    pooler = model.bert.pooler.dense.weight.detach().clone()
    _train(recipe, model, batches)
    assert not torch.equal(model.bert.pooler.dense.weight, pooler)
    padded = batches[0]["attention_mask"] == 0
    other_padding = {**batches[0], "input_ids": batches[0]["input_ids"].masked_fill(padded, 5)}
    logits = [_step(recipe)(model, b).logits for b in (batches[0], other_padding)]
    torch.testing.assert_close(*logits)  # the mask reaches the model: what is under it is not seen
    hidden = {n for n, b in model.named_buffers() if n not in model.state_dict()}
    assert {"bert.embeddings.position_ids", "bert.embeddings.token_type_ids"} <= hidden


def test_frozen_backbone_never_moves_and_the_optimizer_never_sees_it():
    """Pins the frozen model's reasons: `requires_grad=False` parameters keep their values
    through training, the optimizer holds only the trainable ones, and the frozen weights are
    the same whatever the run's seed (every rank builds the same "pretrained" backbone)."""
    recipe, model = _built("frozen")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("backbone.") for n in frozen)
    optimizer = recipe.call("build_optimizer", model.parameters())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    _train(recipe, model, _batches(recipe, 3))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    torch.manual_seed(1)
    other = recipe.call("build_model", torch.device("cpu"))
    assert all(torch.equal(p, frozen[n]) for n, p in other.named_parameters() if n in frozen)


def test_unused_parameters_get_no_gradient_on_some_steps():
    """Pins the unused-parameter model's reason: on a batch whose first label is odd its
    decoder takes no part (grad None, what torch DDP needs `find_unused_parameters` for), on an
    even one it does; and its YAML asks the runtime for find_unused_parameters."""
    recipe, model = _built("unused")
    assert _spec("unused")["find_unused_parameters"] is True
    batches = _batches(recipe, 16)
    odd = next(b for b in batches if b[1][0] % 2 == 1)
    even = next(b for b in batches if b[1][0] % 2 == 0)
    for batch, used in ((odd, False), (even, True)):
        model.zero_grad(set_to_none=True)
        _step(recipe)(model, batch).backward()
        assert all((p.grad is not None) == used for p in model.decoder.parameters())
        assert all(p.grad is not None for p in model.classifier.parameters())


def test_checkpointed_blocks_recompute_in_backward(monkeypatch):
    """Pins the checkpointed model's reason: each block runs under non-reentrant
    torch.utils.checkpoint while training (its forward runs again in backward), and plainly in
    eval."""
    import recipes.zoo.checkpointed as module

    calls = []
    real = module.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(module, "checkpoint", spy)
    recipe, model = _built("checkpointed")
    forwards = []
    for block in model.blocks:  # on a layer inside: the recompute stops once it has what backward needs
        block.body[1].register_forward_pre_hook(lambda *_: forwards.append(1))
    (batch,) = _batches(recipe, 1)
    _step(recipe)(model, batch).backward()
    assert calls == [False] * len(model.blocks) and len(forwards) == 2 * len(model.blocks)
    model.eval()
    forwards.clear()
    with torch.no_grad():
        recipe.eval_step(model, batch)
    assert len(calls) == len(model.blocks) and len(forwards) == len(model.blocks)


def test_amp_recipe_asks_for_fp16_and_trains_under_autocast_with_a_grad_scaler():
    """Pins the AMP model's reason: its YAML asks for `amp: fp16`, and its plain train_step runs
    as the runtime will run it (torch's AMP recipe: autocast fp16, then a GradScaler), here on
    the CPU: fp16 activations, fp32 parameters, finite losses, parameters moved."""
    assert _spec("amp")["amp"] == "fp16"
    recipe, model = _built("amp")
    optimizer = recipe.call("build_optimizer", model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    before = _snapshot(model)
    for x, y in _batches(recipe, 3):
        with torch.autocast("cpu", dtype=torch.float16):
            assert model(x).dtype == torch.float16
            loss = _step(recipe)(model, (x, y))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.isfinite(loss) and loss.dtype == torch.float32
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 and not torch.equal(p, before[n]) for n, p in params.items())


def test_compiled_model_is_a_compile_wrapper_with_batchnorm_updated_inside():
    """Pins the compiled model's reason: build_model returns torch.compile's wrapper (backend
    aot_eager from its YAML), whose eager module holds the parameters under plain keys, and
    BatchNorm's running stats are updated from inside the compiled graph."""
    assert _spec("compiled")["params"]["backend"] == "aot_eager"
    recipe, model = _built("compiled")
    eager = eager_module(model)
    assert eager is not model and isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert not any(k.startswith("_orig_mod.") for k in eager.state_dict())
    _train(recipe, model, _batches(recipe, 3))
    assert eager[1].num_batches_tracked.item() == 3
