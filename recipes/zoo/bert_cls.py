"""Hugging Face transformers' BERT with a classification head, built from a config: dict batches
passed as `model(**batch)`, variable-length sequences padded under an attention mask, the pooler
over the first token, a ModelOutput with `.loss`, and non-persistent buffers (the embeddings'
int64 `position_ids` and `token_type_ids`, left out of the state dict).

The task is synthetic (are most of the padded sequence's tokens from the upper half of the
vocabulary?); eval is held-out accuracy.
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

# Built from a config: nothing is fetched from the Hub, and offline mode keeps it that way.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

from recipes.zoo.data import PAD, Columns, majority_sequences  # noqa: E402

VOCAB_SIZE = 100


def train_dataset(num_train: int = 1024, max_len: int = 32, **_: object) -> Columns:
    return majority_sequences(train=True, num_samples=num_train, vocab_size=VOCAB_SIZE, max_len=max_len)


def eval_dataset(max_len: int = 32, **_: object) -> Columns:
    return majority_sequences(train=False, num_samples=256, vocab_size=VOCAB_SIZE, max_len=max_len)


def build_model(device: torch.device, max_len: int = 32, hidden_size: int = 64, num_layers: int = 2,
                dropout: float = 0.0, **_: object) -> BertForSequenceClassification:
    """A randomly initialised BERT (two heads, intermediate 2x hidden) and a two-class head.
    `dropout` (BERT's default is 0.1) is off by default, as in zoo.gpt2."""
    config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=2, intermediate_size=2 * hidden_size,
                        max_position_embeddings=max_len, pad_token_id=PAD, num_labels=2,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(config).to(device)


def build_optimizer(parameters, lr: float = 2e-3, weight_decay: float = 0.01, **_: object):
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


def train_step(model: BertForSequenceClassification, batch: Dict[str, torch.Tensor]):
    """The model's output; `labels` in the batch make it carry the cross-entropy loss."""
    return model(**batch)


def eval_step(model: BertForSequenceClassification, batch: Dict[str, torch.Tensor]) -> Tuple[float, int]:
    """Correct predictions and batch size: eval = accuracy."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return (logits.argmax(dim=-1) == batch["labels"]).sum().item(), len(batch["labels"])
