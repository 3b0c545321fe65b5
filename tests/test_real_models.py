"""What the ecosystem's models need from the built-in step, in this process: a model's output
with a `.loss` is the loss, an unreduced loss is named with its shape, and recipe.amp trains
under autocast with a GradScaler that skips an overflowing step as torch's AMP recipe does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl_run.config.schema import Amp, RecipeConfig
from flodl_run.contracts.recipe import NotALoss, Recipe, loss_of
from flodl_run.rank.replica import Replica


def test_a_model_output_or_a_dict_with_a_loss_is_the_loss():
    """Pins the ecosystem's return value: transformers' ModelOutput (`outputs.loss`, what
    Accelerate and Lightning users return) and a dict with "loss" both give the tensor; the
    NotALoss message was cut mid-word and told them to return `loss.item()`'s tensor."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    loss = torch.tensor(2.5, requires_grad=True)
    assert loss_of(CausalLMOutputWithCrossAttentions(loss=loss, logits=torch.ones(2, 3))) is loss
    assert loss_of({"loss": loss, "logits": None}) is loss
    with pytest.raises(NotALoss) as caught:
        loss_of(CausalLMOutputWithCrossAttentions(logits=torch.ones(2, 3)), " (r.py:7)")
    message = str(caught.value)
    assert "got CausalLMOutputWithCrossAttentions whose loss is None: pass the labels" in message
    assert "loss.item()" not in message


def test_an_unreduced_loss_is_named_with_its_shape_and_the_recipe_line():
    """Pins `reduction="none"`: torch's `grad can be implicitly created only for scalar outputs`
    came with torch's frames only; the message now names train_step's file and line and the
    loss's shape, and says how to reduce it."""
    with pytest.raises(NotALoss) as caught:
        loss_of(torch.ones(4, 2, requires_grad=True), " (my_recipe.py:12)")
    assert str(caught.value) == ("train_step (my_recipe.py:12) must return a scalar loss, got a "
                                 "tensor of shape [4, 2]: reduce it (loss.mean(), or the loss "
                                 "function's reduction='mean')")
    assert loss_of(torch.ones(1, requires_grad=True).sum()).numel() == 1


def _recipe(seen: list) -> Recipe:
    def build_model(device, **_):
        return nn.Linear(4, 2).to(device)

    def build_optimizer(parameters, **_):
        return torch.optim.SGD(parameters, lr=0.1)

    def train_step(model, batch):
        out = model(batch)
        seen.append(out.dtype)
        return out.float().pow(2).mean()

    return Recipe(build_model=build_model, build_optimizer=build_optimizer, train_step=train_step,
                  train_dataset=lambda **_: None)


@pytest.mark.parametrize("amp, dtype", [(Amp.fp16, torch.float16), (Amp.bf16, torch.bfloat16)])
def test_recipe_amp_runs_train_step_under_autocast(amp, dtype):
    """Pins recipe.amp on the built-in step: the model's matmul runs in the asked dtype (on the
    CPU here, as on a GPU), the parameters stay float32 and move, and fp16 brings a scaler."""
    seen: list = []
    replica = Replica(_recipe(seen), torch.device("cpu"), seed=0, options=RecipeConfig(amp=amp))
    before = replica.model.weight.detach().clone()
    replica.step(torch.randn(8, 4))
    assert seen == [dtype]
    assert replica.model.weight.dtype == torch.float32
    assert not torch.equal(before, replica.model.weight)
    assert (replica.precision.scaler is not None) == (amp is Amp.fp16)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    """Pins the GradScaler's part: a step whose scaled gradient overflows leaves the parameters
    as they were and halves the scale, as torch's AMP recipe does (without it an fp16 run
    would step on inf)."""
    replica = Replica(_recipe([]), torch.device("cpu"), seed=0, options=RecipeConfig(amp=Amp.fp16))
    scaler = replica.precision.scaler
    before = replica.model.weight.detach().clone()
    scale = scaler.get_scale()
    replica.step(torch.full((8, 4), 3e4))  # fp16 overflows: the gradient is inf
    assert torch.equal(before, replica.model.weight)
    assert scaler.get_scale() == scale / 2
    replica.step(torch.randn(8, 4))
    assert not torch.equal(before, replica.model.weight)


def test_the_step_and_the_eval_leave_a_submodule_kept_in_eval_mode_alone():
    """Pins the modes around the built-in step and the eval: a submodule the recipe keeps in eval
    mode (a frozen backbone's BatchNorm, set in build_model as fine-tuning recipes do) stays
    so through steps and evals, its running statistics unmoved, and the eval runs every module
    in eval mode. The step walked every module with model.train() each time, which undid it
    (and cost 0.1-0.6 ms a step on ResNet-18 and GPT-2)."""
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.backbone(x))

    modes: list = []

    def build_model(device, **_):
        model = Frozen().to(device)
        model.backbone.eval()
        return model

    def train_step(model, batch):
        modes.append(("step", model.training, model.head.training, model.backbone[1].training))
        return model(batch).pow(2).mean()

    def eval_step(model, batch):
        modes.append(("eval", model.training, model.head.training, model.backbone[1].training))
        return model(batch[0]).sum(), len(batch[0])

    recipe = Recipe(build_model=build_model, train_dataset=lambda **_: None,
                    build_optimizer=lambda params, **_: torch.optim.SGD(params, lr=0.1),
                    train_step=train_step, eval_step=eval_step)
    replica = Replica(recipe, torch.device("cpu"), seed=0)
    replica.step(torch.randn(8, 4))
    replica.evaluate(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    replica.step(torch.randn(8, 4))
    assert modes == [("step", True, True, False), ("eval", False, False, False), ("step", True, True, False)]
    assert torch.equal(replica.model.backbone[1].running_mean, torch.zeros(4))
