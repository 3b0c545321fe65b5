"""A tiny GAN trained with the manual per-rank API (flodl_run.rank.ddp), started by torchrun.

    torchrun --nproc-per-node=2 recipes/tiny_gan.py --steps 200

Each rank draws its own real and noise batches; gradients of the discriminator and of the
generator are averaged separately, step by step, with different batch counts per rank to show
the weighted variant. Prints the final losses and a parameter checksum per rank (equal on
every rank when the sync is right).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from flodl_run.rank.ddp import Ddp


def _real_batch(n: int, gen: torch.Generator) -> torch.Tensor:
    """Samples of a 2-D ring: what the generator must learn to imitate."""
    angle = torch.rand(n, generator=gen) * 6.2832
    radius = 2.0 + 0.1 * torch.randn(n, generator=gen)
    return torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different init per rank: sync_params must make them equal
    gen_net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    disc = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    g_ddp, d_ddp = Ddp.wrap(gen_net), Ddp.wrap(disc)
    g_opt = torch.optim.Adam(gen_net.parameters(), lr=1e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    data_gen = torch.Generator().manual_seed(1000 + rank)
    counts = [1 + r for r in range(world)]  # rank r's batch is (1 + r) x larger: weight it so
    n = args.batch * counts[rank]
    for _ in range(args.steps):
        fake = gen_net(torch.randn(n, 4, generator=data_gen))
        d_opt.zero_grad()
        d_loss = bce(disc(_real_batch(n, data_gen)), torch.ones(n, 1)) + \
            bce(disc(fake.detach()), torch.zeros(n, 1))
        d_loss.backward()
        d_ddp.weighted_all_reduce_gradients(counts)
        d_opt.step()
        g_opt.zero_grad()
        g_loss = bce(disc(fake), torch.ones(n, 1))
        g_loss.backward()
        g_ddp.all_reduce_gradients()
        g_opt.step()
    checksum = sum(float(p.detach().double().sum()) for p in [*gen_net.parameters(), *disc.parameters()])
    # One write per line: under torchrun the ranks share one unbuffered stdout, where print's
    # separate write of the newline let the other rank's line land in the middle of ours.
    print(f"rank {rank}: d_loss {d_loss.item():.4f} g_loss {g_loss.item():.4f} "
          f"checksum {checksum:.10f} pid {os.getpid()}\n", end="", flush=True)
    dist.barrier()  # leave together: fewer of Gloo's teardown aborts (see tests/test_ddp_manual.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
