"""The zoo's data sets: deterministic, built on this machine (nothing is downloaded).

Images are scikit-learn's bundled digits (recipes.digits_mlp's split), text is the interpreter's
own standard library (recipes.byte_lm's split by file), and the encoder's sequences are synthetic
with a label a model can learn from every token. Samples are tuples of tensors, or dicts of tensors where the
ecosystem's models take keyword batches (`model(**batch)`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from recipes.byte_lm import split_text, windows
from recipes.digits_mlp import _digits

PAD, CLS, FIRST_TOKEN = 0, 1, 3  # the encoder's special tokens (2 unused); ordinary ones from 3
SEQUENCE_SEEDS = {True: 1, False: 2}  # fixed per split: the eval set must not move with the run


class Columns(Dataset):
    """Named columns of one length; sample i is {name: column[i]}, as a Hugging Face dataset in
    torch format yields it (torch's default collate stacks them back into a dict of batches)."""

    def __init__(self, **columns: torch.Tensor):
        lengths = {len(column) for column in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns must have one length, got {sorted(lengths)}")
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


def digits(train: bool, num_samples: Optional[int] = None) -> TensorDataset:
    """(pixels [64] in [0, 1], label) rows of the bundled digits; the first `num_samples` of the
    split (it is already shuffled) when given."""
    return _first(_digits(train=train), num_samples)


def digit_images(train: bool, size: int, num_samples: Optional[int] = None) -> TensorDataset:
    """(image [3, size, size], label): the 8x8 digits resized bilinearly and repeated over three
    channels, the input an RGB vision model expects."""
    images, labels = _first(_digits(train=train, image=True), num_samples).tensors
    resized = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return TensorDataset(resized.expand(-1, 3, -1, -1).contiguous(), labels)


def text_windows(train: bool, seq_len: int, max_bytes: int) -> TensorDataset:
    """(ids [seq_len] int64,): windows of the standard library's source, one token per byte;
    held-out files for eval (recipes.byte_lm's split), `max_bytes` of text in all."""
    rows = windows(split_text(train, max_bytes), seq_len - 1)  # seq_len bytes a window
    return TensorDataset(rows.long())


def majority_sequences(train: bool, num_samples: int, vocab_size: int, max_len: int) -> Columns:
    """{input_ids, attention_mask, labels}: CLS, 3 to max_len - 2 tokens, PAD after; label 1 when
    most of the tokens are from the upper half of the vocabulary. Each row draws its tokens from
    one half with probability 0.7, so the classes are balanced and the label takes every token
    under the mask into account (the accuracy climbs within tens of steps, without a plateau)."""
    gen = torch.Generator().manual_seed(SEQUENCE_SEEDS[train])
    lengths = torch.randint(4, max_len, (num_samples,), generator=gen)
    upper_share = torch.where(torch.rand(num_samples, generator=gen) < 0.5, 0.3, 0.7)
    is_upper = torch.rand(num_samples, max_len, generator=gen) < upper_share[:, None]
    middle = (FIRST_TOKEN + vocab_size) // 2
    ids = torch.where(is_upper, torch.randint(middle, vocab_size, (num_samples, max_len), generator=gen),
                      torch.randint(FIRST_TOKEN, middle, (num_samples, max_len), generator=gen))
    mask = (torch.arange(max_len) < lengths[:, None]).long()
    is_token = mask.bool() & (torch.arange(max_len) > 0)  # position 0 is CLS
    labels = (2 * (is_upper & is_token).sum(1) > is_token.sum(1)).long()
    ids = ids.masked_fill(mask == 0, PAD)
    ids[:, 0] = CLS
    return Columns(input_ids=ids, attention_mask=mask, labels=labels)


def _first(dataset: TensorDataset, num_samples: Optional[int]) -> TensorDataset:
    return dataset if num_samples is None else TensorDataset(*(t[:num_samples] for t in dataset.tensors))
