"""A tiny GAN with its own loop: two optimizers, trained by flodl_run's ranks.

    .venv/bin/python -m flodl_run recipe=tiny_gan_loop cluster=cpu elche=cpu_cadence

The generator learns to imitate samples of a 2-D ring. The runtime does not know it is a GAN:
`loop` alternates a discriminator and a generator step on each batch of real samples the
coordinator plans for this rank, and the reduces at the window ends average both networks
(one model holds them). Eval is how far generated samples fall from the ring (lower is better).
recipes/tiny_gan.py trains the same GAN with the manual per-rank API instead.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

RADIUS = 2.0


class Gan(nn.Module):
    """Both networks in one module: the reduce averages every parameter of the model."""

    def __init__(self, noise_dim: int, hidden: int):
        super().__init__()
        self.noise_dim = noise_dim
        self.generator = nn.Sequential(nn.Linear(noise_dim, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))


def _ring(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(n, generator=gen) * 2 * math.pi
    radius = RADIUS + 0.1 * torch.randn(n, generator=gen)
    return torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)


def train_dataset(num_samples: int = 4096, data_seed: int = 7, **_: object) -> TensorDataset:
    return TensorDataset(_ring(num_samples, data_seed))


def eval_dataset(num_samples: int = 4096, data_seed: int = 7, **_: object) -> TensorDataset:
    return TensorDataset(_ring(max(num_samples // 4, 1), data_seed + 1))


def build_model(device: torch.device, noise_dim: int = 4, hidden: int = 32, **_: object) -> Gan:
    return Gan(noise_dim, hidden).to(device)


def build_optimizer(parameters, model: Gan, lr: float = 1e-3, **_: object):
    """Two optimizers, one per network (`model` is passed to build_optimizer when it asks)."""
    betas = (0.5, 0.999)
    return (torch.optim.Adam(model.generator.parameters(), lr=lr, betas=betas),
            torch.optim.Adam(model.discriminator.parameters(), lr=lr, betas=betas))


def loop(worker) -> None:
    """One discriminator step and one generator step per batch of real samples; reports their
    summed loss (a device tensor: reporting waits for nothing)."""
    model = worker.model
    g_opt, d_opt = worker.optimizer
    bce = nn.BCEWithLogitsLoss()
    noise = torch.Generator(device=worker.device).manual_seed(1000 + worker.rank)  # own per rank
    for (real,) in worker.batches():
        ones = torch.ones(len(real), 1, device=real.device)
        zeros = torch.zeros(len(real), 1, device=real.device)
        z = torch.randn(len(real), model.noise_dim, generator=noise, device=real.device)
        fake = model.generator(z)
        d_opt.zero_grad(set_to_none=True)
        d_loss = bce(model.discriminator(real), ones) + bce(model.discriminator(fake.detach()), zeros)
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad(set_to_none=True)
        g_loss = bce(model.discriminator(fake), ones)
        g_loss.backward()
        g_opt.step()
        worker.report(d_loss.detach() + g_loss.detach())


def eval_fn(model: Gan, batch) -> float:
    """Mean distance of generated samples from the ring (fixed noise: comparable across epochs)."""
    (real,) = batch
    z = torch.randn(len(real), model.noise_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = model.generator(z.to(real.device))
    return float((fake.norm(dim=1) - RADIUS).abs().mean())
