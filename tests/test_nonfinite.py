"""Non-finite values: a rank whose loss or parameters are NaN/inf gives weight 0 to the reduce,
the event is logged, and repeats stop the run as failed with the last finite consensus saved.
Averaging rules on real Gloo processes and plain tensors; the run rules end to end."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from flodl_run.averaging.central import CentralAverager, Snapshot, blend_
from flodl_run.averaging.collective import weighted_reduce_
from flodl_run.averaging.flat import FlatParams
from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig
from flodl_run.contracts.checkpoint import bundle_files, check_resume, load_tensors, read_meta
from tests.support import REPO, _free_port, _model, _run, start_ranks


def _poisoned_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(seed=100 + rank)
    if rank == 1:  # NaN in a weight and inf in a running statistic
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
            model[1].running_mean[0] = float("inf")
    flat = FlatParams(model)
    outcome = weighted_reduce_(flat, 5, 1.0)
    torch.save({"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "finite": outcome.finite, "weight": outcome.weight},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_a_non_finite_rank_gives_weight_0_to_the_collective_and_adopts_the_consensus(tmp_path):
    """Rule: in a collective reduce a rank with NaN/inf parameters or float buffers contributes
    zeros (not 0 x NaN), reports itself non-finite, and ends with the others' consensus: here
    rank 0's own replica, bit for bit, on both ranks."""
    start_ranks(_poisoned_worker, (2, _free_port(), str(tmp_path)), 2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["finite"] for r in results] == [True, False]
    assert results[1]["weight"] == 0.0
    own = _model(seed=100).state_dict()
    for result in results:
        for name in ("0.weight", "0.bias", "2.weight", "1.running_mean", "1.running_var"):
            assert torch.equal(result["state"][name], own[name]), name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_check_sees_every_element_and_float_buffer(bad):
    """Rule: the one device-side check catches NaN, inf and -inf anywhere in the parameters
    (here the last element) and in the float buffers (BatchNorm statistics)."""
    from flodl_run.averaging import collective

    model = _model(seed=1)
    flat = FlatParams(model)
    assert bool(collective.all_finite(flat))
    with torch.no_grad():
        flat.buffers[0][-1] = bad
    assert not bool(collective.all_finite(flat))
    with torch.no_grad():
        flat.buffers[0][-1] = 0.0
        model[1].running_var[-1] = bad
    assert not bool(collective.all_finite(flat))


def _snap(rank: int, steps: int, value: float, finite: bool = True) -> Snapshot:
    return Snapshot(rank, steps, [torch.full((4,), value)], torch.full((2,), value), finite)


def test_a_non_finite_snapshot_gives_weight_0_to_the_central_consensus():
    """Rule: the coordinator's consensus skips a snapshot that holds NaN or that its rank (or
    its loss) marked non-finite; divergence and float buffers come from the finite ones only."""
    averager = CentralAverager(OuterOptimizer(OuterConfig()), 1.0, None)
    snaps = [_snap(0, 2, 1.0), _snap(1, 6, 3.0), _snap(2, 4, float("nan"), finite=False)]
    result = averager.reduce(snaps)
    assert result.nonfinite == [2] and result.weights == [2.0, 6.0, 0.0]
    assert torch.allclose(result.params[0], torch.full((4,), 2.5))
    assert torch.allclose(result.float_buffers, torch.full((2,), 2.0))
    assert result.divergence == 0.6  # |1 - 2.5| / 2.5: rank 2's NaN does not count
    assert averager.reduce([_snap(0, 3, 1.0, finite=False)]) is None  # nothing finite: no update


def test_a_full_blend_replaces_a_nan_replica():
    """Rule: the update that replaces a non-finite replica (blend 1.0) leaves no NaN behind
    (lerp at weight 1 would: NaN + 1 x (x - NaN) is NaN)."""
    local = [torch.tensor([float("nan"), 1.0, float("inf")])]
    blend_(local, [torch.tensor([2.0, 3.0, 4.0])], 1.0)
    assert torch.equal(local[0], torch.tensor([2.0, 3.0, 4.0]))


NAN_RECIPE = (
    "import os\n"
    "from recipes.digits_mlp import *  # noqa: F401,F403\n"
    "from recipes import digits_mlp\n"
    "STEPS = [0]\n"
    "def train_step(model, batch):\n"
    "    STEPS[0] += 1\n"
    "    loss = digits_mlp.train_step(model, batch)\n"
    "    bad = os.environ['RANK'] == '1' and STEPS[0] >= {first} and STEPS[0] <= {last}\n"
    "    return loss * float('nan') if bad else loss\n"
)


def _nan_run(tmp_path, first: int, last: int, *overrides: str, tracking: str = "off"):
    pkg = tmp_path / "userpkg"
    pkg.mkdir(parents=True)
    (pkg / "nan_recipe.py").write_text(NAN_RECIPE.format(first=first, last=last))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(REPO)]))
    return _run(tmp_path, "recipe=custom", "recipe.module=nan_recipe", "cluster=cpu_pair",
                "num_epochs=1", "batch_size=32", *overrides, env=env, tracking=tracking)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_one_nan_step_is_absorbed_and_logged(tmp_path, mode):
    """Rule: one NaN loss on rank 1 makes it give weight 0 once (collective: its parameters are
    zeroed in the reduce; cpu_async: its replica is replaced although windows trained on NaN
    are still in flight); the event is logged once (rank_nonfinite, summary.nonfinite), the run
    completes with a model that learned (eval far above chance), and the bundle verifies."""
    proc, summary = _nan_run(tmp_path, 5, 5, f"elche={mode}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert summary["status"] == "completed"
    assert [(e["rank"], e["what"]) for e in summary["nonfinite"]] == [(1, "loss")], summary["nonfinite"]
    assert "rank_nonfinite" in out
    assert summary["final_eval"] > 0.35  # chance is 0.1; a NaN consensus scores about that
    stem = summary["checkpoint"]
    assert check_resume(read_meta(stem), 2, 0, stem) == []


@pytest.mark.e2e
def test_a_nan_gradient_on_one_rank_makes_every_rank_skip_that_step(tmp_path):
    """Rule (nccl_sync, gradients averaged): rank 1's NaN loss at one step poisons that step's
    averaged gradient on every rank, so every rank skips it (as torch's GradScaler does) and the
    replicas stay identical and finite; it is logged once as the step's, the run completes and
    learns, and the bundle verifies."""
    proc, summary = _nan_run(tmp_path, 5, 5, "elche=nccl_sync")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert summary["status"] == "completed"
    assert [(e["rank"], e["what"]) for e in summary["nonfinite"]] == [(None, "gradient x1")]
    assert "every rank skipped them" in out
    assert summary["final_eval"] > 0.35
    stem = summary["checkpoint"]
    meta = read_meta(stem)
    assert check_resume(meta, 2, 0, stem) == []
    model = load_tensors(bundle_files(stem, meta)["model"])
    assert all(bool(torch.isfinite(t).all()) for t in model.values())


@pytest.mark.e2e
def test_a_rank_that_stays_nan_fails_the_run_and_saves_the_finite_consensus(tmp_path, mlflow_db):
    """Rule (coordinator mode): rank 1 NaN at every step from its 3rd on gives weight 0 at each
    reduce; after max_nonfinite=2 such reduces in a row the run stops failed (exit 1), saves
    the finite consensus (reason nonfinite), and summary.json and MLflow say why."""
    db = f"tracking.uri=sqlite:///{mlflow_db}"
    proc, summary = _nan_run(tmp_path, 3, 10**9, "elche=cpu_cadence", "max_nonfinite=2", db,
                             tracking="mlflow")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert summary["status"] == "failed" and "non-finite" in summary["message"], summary["message"]
    assert len(summary["nonfinite"]) == 2 and {e["rank"] for e in summary["nonfinite"]} == {1}
    stem = summary["checkpoint"]
    meta = read_meta(stem)
    assert meta.save_reason == "nonfinite" and check_resume(meta, 2, 0, stem) == []
    model = load_tensors(bundle_files(stem, meta)["model"])
    assert all(bool(torch.isfinite(t).all()) for t in model.values())
    import mlflow

    run = mlflow.MlflowClient(db.split("=", 1)[1]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FAILED" and "non-finite" in run.data.tags["last_event"]
