"""The coordinator backend's math against float64 references, and against
the collective backend on the same inputs (2 real Gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flodl_run.averaging.central import CentralAverager, Snapshot, blend_
from flodl_run.averaging.collective import weighted_reduce_
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig, OuterKind
from tests.support import _free_port, _model, start_ranks


def _snap(rank, steps, seed, n=30, buffers=3):
    g = torch.Generator().manual_seed(seed)
    return Snapshot(rank, steps, [torch.randn(n, generator=g)], torch.randn(buffers, generator=g))


@pytest.mark.parametrize("steps,gamma", [([3, 7, 0], 1.0), ([1, 4, 9], 0.5)])
def test_central_consensus_and_buffers_match_float64(steps, gamma):
    """Pins w_k = n_k**gamma weighting, the float-buffer mean over ranks that stepped only, and
    D = max relative distance to the consensus."""
    snaps = [_snap(r, n, seed=10 + r) for r, n in enumerate(steps)]
    result = CentralAverager(OuterOptimizer(OuterConfig()), gamma, None).reduce(snaps)
    w = [0.0 if n == 0 else n ** gamma for n in steps]
    ref = sum(wk * s.params[0].double() for wk, s in zip(w, snaps)) / sum(w)
    assert (result.params[0].double() - ref).norm() / ref.norm() < 1e-6
    movers = [s.float_buffers.double() for s in snaps if s.steps > 0]
    assert torch.allclose(result.float_buffers.double(), sum(movers) / len(movers), atol=1e-6)
    dists = [float((s.params[0].double() - ref).norm() / ref.norm()) for s in snaps]
    assert result.divergence == pytest.approx(max(dists), rel=1e-5)


def test_cosine_and_magnitude_measure_each_update_from_what_ranks_adopted_last_round():
    """Pins the coordinator backend's divergence breakdown (asked for after the update went
    out): none on the first round (no start known), then per rank cos(u, v) and ||u|| / ||v||
    with u = snapshot - last round's result and v = consensus - last round's result."""
    averager = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None)
    first = averager.reduce([_snap(0, 2, seed=1), _snap(1, 3, seed=2)])
    start = first.params[0].double().clone()
    assert averager.breakdown() == {}
    snaps = [_snap(0, 2, seed=3), _snap(1, 5, seed=4)]
    averager.reduce(snaps)
    breakdown = averager.breakdown()
    consensus = (2 * snaps[0].params[0].double() + 5 * snaps[1].params[0].double()) / 7
    v = consensus - start
    for s in snaps:
        u = s.params[0].double() - start
        cosine, magnitude = breakdown[s.rank]
        assert cosine == pytest.approx(float(u @ v / (u.norm() * v.norm())), rel=1e-5)
        assert magnitude == pytest.approx(float(u.norm() / v.norm()), rel=1e-5)


def test_consensus_built_in_a_given_buffer_is_the_same_consensus():
    """Pins `out=` (the coordinator's shared-memory slab): the consensus lands in the given
    tensors, bit-equal to the one built in fresh tensors, and the snapshots stay untouched."""
    snaps = [_snap(r, n, seed=20 + r) for r, n in enumerate([2, 5])]
    kept = [s.params[0].clone() for s in snaps]
    fresh = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None).reduce(snaps)
    out = [torch.full((30,), float("nan"))]
    built = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None).reduce(snaps, out=out)
    assert built.params[0].data_ptr() == out[0].data_ptr()
    assert torch.equal(out[0], fresh.params[0]) and built.divergence == fresh.divergence
    assert all(torch.equal(s.params[0], k) for s, k in zip(snaps, kept))


def test_nobody_trained_means_no_update():
    """Pins 'skip the reduce if all weights are 0'."""
    snaps = [_snap(r, 0, seed=r) for r in range(2)]
    assert CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None).reduce(snaps) is None


def test_easgd_center_and_replica_blend_step_by_step():
    """Pins EASGD: center_{t+1} = (1-a) center_t + a m_t (the updated center is sent),
    and each replica blends local <- (1-a) local + a center_{t+1}; a = 1 is plain overwrite."""
    a = 0.5
    avg = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, a)
    center = torch.zeros(30)
    avg.seed_center([center])
    for t in range(3):
        snaps = [_snap(r, 2 + r, seed=100 * t + r) for r in range(2)]
        m = (2 * snaps[0].params[0] + 3 * snaps[1].params[0]) / 5
        center = (1 - a) * center + a * m
        result = avg.reduce(snaps)
        assert torch.allclose(result.params[0], center, atol=1e-6), t
        local = [snaps[0].params[0].clone() + 1.0]  # it kept training during the round trip
        expected = (1 - a) * local[0] + a * center
        blend_(local, result.params, a)
        assert torch.allclose(local[0], expected, atol=1e-6)
    overwritten = [torch.ones(30)]
    blend_(overwritten, [center], 1.0)
    assert torch.equal(overwritten[0], center)


def _collective_worker(rank, world, port, kind, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    flat = FlatParams(_model(seed=100 + rank))
    outer = OuterOptimizer(OuterConfig(kind=kind, lr=0.7, momentum=0.9))
    for round_ in range(3):
        with torch.no_grad():
            flat.buffers[0].add_(_noise(rank, round_, flat.numel))
        weighted_reduce_(flat, steps=2 + rank, gamma=1.0)
        outer.step_(flat.buffers)
    torch.save(flat.buffers[0].clone(), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _noise(rank, round_, n):
    return 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(1000 * round_ + rank))


@pytest.mark.e2e
@pytest.mark.parametrize("kind", [OuterKind.slowmo, OuterKind.diloco])
def test_outer_on_the_coordinator_equals_the_collective_backend(tmp_path, kind):
    """Pins that SlowMo/DiLoCo run once on the coordinator give what the replicated collective
    path gives, over three rounds of unequal work."""
    start_ranks(_collective_worker, (2, _free_port(), kind, str(tmp_path)), 2)
    collective = torch.load(tmp_path / "rank0.pt")
    assert torch.equal(collective, torch.load(tmp_path / "rank1.pt"))
    avg = CentralAverager(OuterOptimizer(OuterConfig(kind=kind, lr=0.7, momentum=0.9)), 1.0, None)
    params = [FlatParams(_model(seed=100 + r)).buffers[0].clone() for r in range(2)]
    for round_ in range(3):
        snaps = [Snapshot(r, 2 + r, [params[r] + _noise(r, round_, params[r].numel())], torch.empty(0))
                 for r in range(2)]
        result = avg.reduce(snaps)
        params = [result.params[0].clone() for _ in range(2)]
    assert torch.allclose(params[0], collective, rtol=1e-5, atol=1e-6)
