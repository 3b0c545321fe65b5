"""Hugging Face transformers' GPT-2 built from a config, on the standard library's source as
bytes: train_step returns the model's output (a ModelOutput whose `.loss` the runtime takes),
the output head is tied to the input embedding, and the steps read `model.config` as
transformers users do (so they need the model itself, not a wrapper).

Eval is the mean next-byte loss in nats on held-out files (lower is better).
"""

from __future__ import annotations

import os
from typing import Tuple

# Built from a config: nothing is fetched from the Hub, and offline mode keeps it that way.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from recipes.zoo.data import text_windows  # noqa: E402


def train_dataset(seq_len: int = 64, max_bytes: int = 48_000, **_: object) -> TensorDataset:
    return text_windows(train=True, seq_len=seq_len, max_bytes=max_bytes)


def eval_dataset(seq_len: int = 64, max_bytes: int = 48_000, **_: object) -> TensorDataset:
    return text_windows(train=False, seq_len=seq_len, max_bytes=max_bytes)


def build_model(device: torch.device, seq_len: int = 64, n_layer: int = 2, n_head: int = 2,
                n_embd: int = 64, dropout: float = 0.0, **_: object) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 over bytes (256 tokens), `seq_len` positions. `dropout`
    (GPT-2's default is 0.1) is off by default: a run then follows its torch DDP reference step
    for step, whatever random streams each runtime draws."""
    config = GPT2Config(vocab_size=256, n_positions=seq_len, n_layer=n_layer, n_head=n_head,
                        n_embd=n_embd, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(device)


def build_optimizer(parameters, lr: float = 3e-3, weight_decay: float = 0.01, **_: object):
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


def train_step(model: GPT2LMHeadModel, batch):
    """The model's output; with `labels` it carries the mean next-token loss (the model shifts)."""
    (ids,) = batch
    ids = ids[:, : model.config.n_positions]  # a window longer than the context would not fit
    return model(input_ids=ids, labels=ids)


def eval_step(model: GPT2LMHeadModel, batch) -> Tuple[float, int]:
    """(next-token loss summed in nats, number of predicted tokens): eval = mean token loss."""
    (ids,) = batch
    logits = model(input_ids=ids).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, model.config.vocab_size), ids[:, 1:].reshape(-1),
                           reduction="sum")
    return loss.item(), ids[:, 1:].numel()
