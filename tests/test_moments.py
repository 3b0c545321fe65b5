"""elche.reduce_optimizer_state: the inner optimizer's per-parameter float state (AdamW's
exp_avg and exp_avg_sq) rides the collective reduce with the parameters' work weights, its
`step` counters stay each rank's own, a retried round starts again from the pre-reduce
moments, and with the key off the reduce leaves the optimizer state alone."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.moments import FlatMoments
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.wire import Reduced, SyncNow
from flodl_run.observe.timeline import Recorder
from flodl_run.rank.reduce import CollectiveReduce, ReduceOptions
from tests.support import PAIR, _free_port, _run, start_ranks

STEPS = (3, 1)  # batches per rank since the last reduce; gamma 1: weights 3/4 and 1/4
KEYS = ("exp_avg", "exp_avg_sq")


def _trained(seed: int, steps: int) -> tuple:
    """A Linear (same init everywhere) and its AdamW after `steps` steps on rank-own data."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _state(model, optimizer) -> dict:
    return {(i, key): optimizer.state[p][key].clone() for i, p in enumerate(model.parameters())
            for key in (*KEYS, "step")}


def _shares(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_bind_rehomes_the_moments_into_one_buffer_the_optimizer_keeps_stepping():
    """Pins the re-homing: every exp_avg/exp_avg_sq becomes a view of one flat buffer (two
    tensors per parameter, the step counters left out, each starting on a 16-byte boundary),
    AdamW's next step updates that buffer in place (so a reduce of the buffer is a reduce of
    the state), an unchanged state binds to the same buffer again, and a cleared state binds
    to nothing, with another fingerprint."""
    model, optimizer = _trained(seed=1, steps=2)
    moments = FlatMoments(model, optimizer)
    (flat,) = moments.bind()
    views = [optimizer.state[p][k] for p in model.parameters() for k in KEYS]
    assert sum(v.numel() for v in views) == 2 * sum(p.numel() for p in model.parameters())
    assert all(_shares(v, flat) for v in views)
    assert all(v.data_ptr() % 16 == 0 for v in views)  # as fused and compiled kernels need
    assert flat.numel() == 8 + 8 + 4 + 4  # 6, 6, 2 and 2 floats, each rounded to 16 bytes
    layout = moments.fingerprint()
    assert layout != 0
    before = flat.clone()
    optimizer.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    assert not torch.equal(flat, before)
    assert moments.bind()[0] is flat and moments.fingerprint() == layout
    assert float(optimizer.state[next(model.parameters())]["step"]) == 3.0
    optimizer.state.clear()
    assert moments.bind() == [] and moments.fingerprint() == 0


def test_a_rehomed_state_saves_and_resumes_as_before():
    """Pins checkpoint/resume with the key on: the state dict of a re-homed AdamW saves no more
    than the moments (one shared storage, not a copy per view), loads into a fresh optimizer
    with equal values and step counters, and that optimizer's state binds (re-homed anew)."""
    import io

    model, optimizer = _trained(seed=2, steps=2)
    (flat,) = FlatMoments(model, optimizer).bind()
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    assert saved.tell() < flat.numel() * flat.element_size() + 8192
    resumed = torch.optim.AdamW(model.parameters(), lr=0.05)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert all(torch.equal(v, _state(model, optimizer)[k]) for k, v in _state(model, resumed).items())
    moments = FlatMoments(model, resumed)
    assert torch.equal(moments.bind()[0], flat)
    assert all(_shares(resumed.state[p][k], moments.buffers[0]) for p in model.parameters() for k in KEYS)


def _pair_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank `rank` of a Gloo pair: round 1 reduces with the key off, round 2 with it on, then
    round 2 is retried after the moments were overwritten (a retry must not average those)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, optimizer = _trained(seed=10 + rank, steps=STEPS[rank])
    trained = _state(model, optimizer)
    group = SimpleNamespace(alone=False, broken=lambda: False, fail=lambda: None,
                            collective=contextlib.nullcontext)
    replica = SimpleNamespace(seek_schedule=lambda step: None, optimizer=optimizer)
    flat = FlatParams(model)

    def reduce(moments):
        return CollectiveReduce(rank, replica, flat, OuterOptimizer(OuterConfig()), group,
                                Recorder(), ReduceOptions(1.0, track_start=True, moments=moments))
    fact, _ = reduce(None).run(SyncNow(round=1, global_step=4), STEPS[rank])
    off = _state(model, optimizer)
    on = reduce(FlatMoments(model, optimizer))
    fact2, _ = on.run(SyncNow(round=2, global_step=4), STEPS[rank])
    averaged = _state(model, optimizer)
    for p in model.parameters():
        for key in KEYS:
            optimizer.state[p][key].fill_(100.0)
    fact3, _ = on.run(SyncNow(round=2, global_step=4), 0)  # the coordinator redoes round 2
    torch.save({"trained": trained, "off": off, "averaged": averaged,
                "retried": _state(model, optimizer),
                "facts": [type(f).__name__ for f in (fact, fact2, fact3)]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_a_gloo_pair_ends_at_the_work_weighted_mean_of_its_moments(tmp_path):
    """Pins the moments' consensus: with the key off the reduce leaves each rank's AdamW state
    exactly as trained; with it on both ranks hold 3/4 x rank 0's + 1/4 x rank 1's exp_avg and
    exp_avg_sq (the parameters' weights for 3 and 1 batches), their own step counters (3 and
    1), and a retried round averages the pre-reduce moments again, not what they became."""
    start_ranks(_pair_worker, (_free_port(), str(tmp_path)), 2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    first, second = (r["trained"] for r in results)
    for rank, result in enumerate(results):
        assert result["facts"] == ["Reduced"] * 3
        assert all(torch.equal(result["off"][k], result["trained"][k]) for k in result["trained"])
        for (i, key), mine in result["trained"].items():
            if key == "step":
                assert float(result["averaged"][i, key]) == STEPS[rank]
                continue
            expected = 0.75 * first[i, key].double() + 0.25 * second[i, key].double()
            assert not torch.allclose(first[i, key], second[i, key])  # the mean is a real mix
            for phase in ("averaged", "retried"):
                assert torch.allclose(result[phase][i, key].double(), expected, rtol=1e-5, atol=1e-9)


def test_a_lone_rank_keeps_its_moments():
    """Pins the cohort of one: its reduce is the identity, with moments as without."""
    model, optimizer = _trained(seed=4, steps=2)
    trained = _state(model, optimizer)
    group = SimpleNamespace(alone=True, broken=lambda: False, fail=lambda: None)
    replica = SimpleNamespace(seek_schedule=lambda step: None, optimizer=optimizer)
    reduce = CollectiveReduce(0, replica, FlatParams(model), OuterOptimizer(OuterConfig()), group,
                              Recorder(), ReduceOptions(1.0, track_start=True,
                                                        moments=FlatMoments(model, optimizer)))
    fact, _ = reduce.run(SyncNow(round=1, global_step=2), 2)
    assert isinstance(fact, Reduced) and fact.weight == 2.0
    assert all(torch.equal(v, trained[k]) for k, v in _state(model, optimizer).items())


@pytest.mark.e2e
def test_nccl_cadence_with_the_moments_riding_completes(tmp_path):
    """Pins the key end to end on two CPU ranks (one 2.5x slower): an nccl_cadence run of the
    tiny recipe with SGD's momentum buffers in every reduce trains to the end and evaluates."""
    proc, summary = _run(tmp_path, *PAIR, "cluster.emulate_slowdown=[1.0,2.5]", "elche=nccl_cadence",
                         "elche.reduce_optimizer_state=true", "recipe=digits_mlp", "num_epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["status"] == "completed"
    assert summary["epochs"] and summary["epochs"][-1].get("eval") is not None
