"""A byte-level GPT-style decoder trained on the interpreter's own standard library: the GPU workload.

The text is every `*.py` file under `sysconfig`'s stdlib directory (site-packages left out), read
as bytes in sorted order of relative path: every machine has it, nothing is downloaded. A fixed
hash of each file's relative path puts about 5% of the files in the held-out split. Eval is bits
per byte on that split, so lower is better (conf/recipe/byte_lm.yaml says `eval_direction: min`).
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

VOCAB = 256  # one token per byte value
EVAL_PERCENT = 5  # share of files, by the hash of their relative path, held out for eval
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages"})  # installed packages are not stdlib


# ---- data -----------------------------------------------------------------------------------

def is_eval_file(relative_path: str) -> bool:
    """Whether a file (POSIX path relative to the stdlib root) is held out. CRC-32 rather than
    `hash()`: the same on every run and machine, whatever PYTHONHASHSEED says."""
    return zlib.crc32(relative_path.encode()) % 100 < EVAL_PERCENT


def stdlib_files(root: Optional[Path] = None) -> List[Tuple[str, Path]]:
    """(relative POSIX path, path) of every stdlib `*.py` file, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]  # pruned: installed packages are many
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


@functools.lru_cache(maxsize=4)  # the launcher's recipe check and the run ask for the same split
def split_text(train: bool, max_bytes: Optional[int] = None) -> bytes:
    """The split's files concatenated in order; `max_bytes` keeps the first bytes of each split
    in proportion to its share (train: 95% of max_bytes, eval: 5%). Unreadable files are skipped."""
    chunks, total = [], 0
    share = (100 - EVAL_PERCENT) if train else EVAL_PERCENT
    cap = None if max_bytes is None else max(1, max_bytes * share // 100)
    for relative, path in stdlib_files():
        if is_eval_file(relative) == train:
            continue
        try:
            data = path.read_bytes()
        except OSError:  # a file removed or unreadable on this machine: it is not text we have
            continue
        chunks.append(data)
        total += len(data)
        if cap is not None and total >= cap:
            break
    text = b"".join(chunks)
    return text if cap is None else text[:cap]


def windows(text: bytes, seq_len: int) -> torch.Tensor:
    """uint8 [N, seq_len + 1]: non-overlapping windows (consecutive ones share one byte, the last
    target of one is the first input of the next), the tail that fills no window dropped."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    if len(data) < seq_len + 1:
        return torch.empty(0, seq_len + 1, dtype=torch.uint8)
    return data.unfold(0, seq_len + 1, seq_len).contiguous()


def train_dataset(seq_len: int = 256, max_bytes: Optional[int] = None, **_: object) -> TensorDataset:
    """One sample = one window of seq_len + 1 bytes, stored as uint8 (4x smaller than int32 on
    the device; train_step casts each batch)."""
    return TensorDataset(windows(split_text(True, max_bytes), seq_len))


def eval_dataset(seq_len: int = 256, max_bytes: Optional[int] = None, **_: object) -> TensorDataset:
    return TensorDataset(windows(split_text(False, max_bytes), seq_len))


# ---- model ----------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each residual."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, t, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_mlp(x))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes: learned positions, output head tied to the byte
    embedding. forward(bytes [b, t] long) -> logits [b, t, 256]; bf16 autocast inside when
    `amp` and the input is on CUDA (the caller computes the loss in float32)."""

    def __init__(self, seq_len: int, d_model: int, num_layers: int, num_heads: int,
                 mlp_ratio: int = 4, amp: bool = True):
        super().__init__()
        self.amp = amp
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, mlp_ratio) for _ in range(num_layers))
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.apply(_init)
        for block in self.blocks:  # GPT-2: residual projections scaled by 1/sqrt(2 * layers)
            for out in (block.proj, block.mlp[2]):
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * num_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp and idx.is_cuda):
            x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_out(x))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(device: torch.device, seq_len: int = 256, d_model: int = 512, num_layers: int = 8,
                num_heads: int = 8, mlp_ratio: int = 4, amp: bool = True, compile: object = False,
                compile_backend: str = "inductor", **_: object) -> nn.Module:
    """The model on `device`; `amp` (bf16 autocast) only takes effect on CUDA. `compile`: true
    returns it through torch.compile (the graph is built at the first step), "auto" does so on
    CUDA only (on the CPU inductor's C++ build costs more than it saves on a small model)."""
    if d_model % num_heads:
        raise ValueError(f"recipe.params.d_model={d_model} must be a multiple of "
                         f"recipe.params.num_heads={num_heads}")
    model = ByteGPT(seq_len, d_model, num_layers, num_heads, mlp_ratio, amp).to(device)
    return torch.compile(model, backend=compile_backend) if _compiles(compile, device) else model


def _compiles(compile: object, device: torch.device) -> bool:
    """Whether `recipe.params.compile` asks for torch.compile on `device`."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"recipe.params.compile must be true, false or auto, got {compile!r}")
    return compile is True or (compile == "auto" and torch.device(device).type == "cuda")


def build_optimizer(parameters, lr: float = 6e-4, weight_decay: float = 0.1, **_: object):
    """AdamW, betas (0.9, 0.95) as GPT training uses them; weight decay on matrices and
    embeddings only (biases and LayerNorm gains stay undecayed)."""
    params = list(parameters)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = bool(params) and all(p.is_cuda for p in params)  # one kernel for the whole step
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def build_scheduler(optimizer, warmup_steps: int = 100, **_: object):
    """Linear warmup over the first `warmup_steps` optimizer steps, then the constant lr."""
    warmup = max(1, warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))


# ---- steps ----------------------------------------------------------------------------------

def _nats(model: nn.Module, batch, reduction: str) -> torch.Tensor:
    """Cross-entropy of predicting each next byte of the windows in `batch`."""
    rows = (batch[0] if isinstance(batch, (list, tuple)) else batch).long()
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), rows[:, 1:].reshape(-1),
                           reduction=reduction)


def train_step(model: nn.Module, batch) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a batch of windows."""
    return _nats(model, batch, "mean")


def eval_step(model: nn.Module, batch) -> Tuple[float, int]:
    """(bits summed over every predicted byte, number of predicted bytes): eval = bits per byte."""
    rows = batch[0] if isinstance(batch, (list, tuple)) else batch
    bits = _nats(model, batch, "sum") / math.log(2)
    return bits.item(), rows.shape[0] * (rows.shape[1] - 1)

