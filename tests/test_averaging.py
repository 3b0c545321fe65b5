"""Collective consensus on real processes: 2 CPU ranks over Gloo, one thread each."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flodl_run.averaging.collective import CollectiveError, consensus_weight, weighted_reduce_
from flodl_run.averaging.flat import FlatParams, relative_distance
from tests.support import _free_port, _model, start_ranks

START_SEED = 99


def _worker(rank: int, world: int, port: int, steps: list, gamma: float, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(seed=100 + rank)
    flat = FlatParams(model)
    start = FlatParams(_model(seed=START_SEED)).buffers  # where every rank's window began
    outcome = weighted_reduce_(flat, steps[rank], gamma, start=start)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "divergence": outcome.divergence, "applied": outcome.applied,
                "cosine": outcome.cosine, "magnitude": outcome.magnitude},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _run(tmp_path, steps, gamma=1.0):
    start_ranks(_worker, (len(steps), _free_port(), steps, gamma, str(tmp_path)), len(steps))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(steps))]


def _reference(steps, gamma):
    """Float64 consensus of the same initial replicas."""
    models = [_model(seed=100 + r) for r in range(len(steps))]
    weights = [consensus_weight(n, gamma) for n in steps]
    total = sum(weights)
    movers = [1.0 if n > 0 else 0.0 for n in steps]
    ref = {}
    for name, _ in models[0].named_parameters():
        ref[name] = sum(w * dict(m.named_parameters())[name].double()
                        for w, m in zip(weights, models)) / total
    for name in ("1.running_mean", "1.running_var"):
        ref[name] = sum(mv * m.state_dict()[name].double() for mv, m in zip(movers, models)) / sum(movers)
    return ref, models


@pytest.mark.e2e
@pytest.mark.parametrize("steps,gamma", [([3, 7], 1.0), ([1, 10], 0.5), ([0, 4], 1.0)])
def test_weighted_consensus_matches_float64_reference(tmp_path, steps, gamma):
    """Pins the work-weighted mean w_k = n_k**gamma (pre-scaled SUM all-reduce) to < 1e-6 relative error,
    the buffer rule (float buffers equal among ranks that stepped, integer buffers local) and equal
    results on every rank."""
    results = _run(tmp_path, steps, gamma)
    ref, models = _reference(steps, gamma)
    for rank, result in enumerate(results):
        state = result["state"]
        for name, expected in ref.items():
            err = (state[name].double() - expected).norm() / max(float(expected.norm()), 1.0)
            assert err < 1e-6, (rank, name, float(err))
        assert int(state["1.num_batches_tracked"]) == 10 + 100 + rank
    for name in ref:
        assert torch.equal(results[0]["state"][name], results[1]["state"][name])


@pytest.mark.e2e
def test_divergence_is_distance_to_consensus(tmp_path):
    """Pins delta_k = ||theta_k_before - consensus|| / ||consensus|| over all parameters."""
    steps = [2, 6]
    results = _run(tmp_path, steps)
    ref, models = _reference(steps, 1.0)
    names = [n for n, _ in models[0].named_parameters()]
    consensus = [ref[n] for n in names]
    for rank, result in enumerate(results):
        before = [dict(models[rank].named_parameters())[n].detach().double() for n in names]
        expected = relative_distance(before, consensus)
        assert result["divergence"] == pytest.approx(expected, rel=1e-5)
        assert result["divergence"] > 0


@pytest.mark.e2e
def test_divergence_splits_into_cosine_and_magnitude_of_the_window_updates(tmp_path):
    """Pins the divergence's breakdown: with u = theta_k_before - start (rank k's window update)
    and v = consensus - start, the reduce reports cos(u, v) and ||u|| / ||v||, and they rebuild
    the divergence: ||u - v|| / ||consensus|| = ||v|| sqrt(m^2 + 1 - 2 m cos) / ||consensus||."""
    steps = [2, 6]
    results = _run(tmp_path, steps)
    ref, models = _reference(steps, 1.0)
    names = [n for n, _ in models[0].named_parameters()]
    start_model = dict(_model(seed=START_SEED).named_parameters())
    start = torch.cat([start_model[n].detach().double().reshape(-1) for n in names])
    consensus = torch.cat([ref[n].reshape(-1) for n in names])
    v = consensus - start
    for rank, result in enumerate(results):
        before = torch.cat([dict(models[rank].named_parameters())[n].detach().double().reshape(-1)
                            for n in names])
        u = before - start
        assert result["cosine"] == pytest.approx(float(u @ v / (u.norm() * v.norm())), rel=1e-5)
        assert result["magnitude"] == pytest.approx(float(u.norm() / v.norm()), rel=1e-5)
        m, cos = result["magnitude"], result["cosine"]
        rebuilt = float(v.norm()) * (m * m + 1 - 2 * m * cos) ** 0.5 / float(consensus.norm())
        assert result["divergence"] == pytest.approx(rebuilt, rel=1e-4)


@pytest.mark.e2e
def test_all_zero_weights_skip_the_reduce(tmp_path):
    """Pins 'skip the reduce if all weights are 0': parameters stay each rank's own."""
    results = _run(tmp_path, [0, 0])
    assert not results[0]["applied"] and not results[1]["applied"]
    for rank, result in enumerate(results):
        own = _model(seed=100 + rank).state_dict()
        assert torch.equal(result["state"]["0.weight"], own["0.weight"])


def test_flat_params_are_views_the_optimizer_updates():
    """Pins that re-homing parameters into flat buffers keeps training working (optimizer steps
    write through to the buffer the reduce uses)."""
    model = _model(seed=1)
    flat = FlatParams(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = flat.buffers[0].clone()
    model.train()
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    assert not torch.equal(before, flat.buffers[0])
    assert flat.num_params == sum(p.numel() for p in model.parameters())


def test_flat_views_start_on_16_byte_boundaries_with_zero_gaps():
    """Pins the layout compiled and fused GPU kernels need: a parameter of odd size must not
    push the next one's view off a 16-byte boundary (CUDA faults with "misaligned address"),
    values survive the re-homing, and the gaps stay zero through a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1),
                                torch.nn.Embedding(7, 3).to(torch.bfloat16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatParams(model)
    assert [b.dtype for b in flat.buffers] == [torch.float32, torch.bfloat16]
    for p in model.parameters():
        assert p.data_ptr() % 16 == 0, p.shape
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert flat.num_params == 3 * 5 + 5 + 5 + 1 + 7 * 3
    assert flat.numel == (16 + 8 + 8 + 4) + 24  # float32 rounds to 4 elements, bfloat16 to 8
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(4, 3))).sum().backward()
    opt.step()
    used = torch.zeros(flat.buffers[0].numel(), dtype=torch.bool)
    for p in list(model.parameters())[:4]:
        start = (p.data_ptr() - flat.buffers[0].data_ptr()) // 4
        used[start:start + p.numel()] = True
    assert torch.count_nonzero(flat.buffers[0][~used]) == 0


def _dying_peer_worker(rank: int, port: int, out_dir: str) -> None:
    import datetime
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone before the reduce's first all-reduce (the weights)
    time.sleep(0.5)
    model = _model(seed=100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        weighted_reduce_(FlatParams(model), 5, 1.0)
        raised = "nothing"
    except CollectiveError:
        raised = "CollectiveError"
    except Exception as exc:  # noqa: BLE001 - the test reports what leaked
        raised = type(exc).__name__
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.save({"raised": raised, "same": same}, os.path.join(out_dir, "rank0.pt"))
    os._exit(0)  # the group's peer is gone: no orderly teardown


@pytest.mark.e2e
def test_a_peer_dead_before_the_weights_all_reduce_is_a_collective_error(tmp_path):
    """Pins the CI failure of a SIGKILLed host: the first all-reduce of a reduce (the weights)
    failing must surface as CollectiveError (the rank reports ReduceFailed and the round is
    retried among survivors), not as a RuntimeError that kills the survivor, and must leave the
    replica untouched."""
    start_ranks(_dying_peer_worker, (_free_port(), str(tmp_path)), 2)
    result = torch.load(tmp_path / "rank0.pt")
    assert result == {"raised": "CollectiveError", "same": True}
