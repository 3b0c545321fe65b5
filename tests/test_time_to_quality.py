"""Time to quality: the training seconds at which an entry's eval first reached torch DDP's
final eval (the bench), or the first job's (a sweep's comparison), and the ratio to the
reference's own time. Pure arithmetic over summaries: no process is started here."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flodl_run.bench.peers import PeerRank
from flodl_run.bench.report import RecipeBench, RunOutcome, bench_document, tables, to_markdown
from flodl_run.control.dispatch import EpochPool, epoch_span
from flodl_run.data.passes import permutation
from flodl_run.report.compare import JobOutcome, rows
from flodl_run.report.compare import to_markdown as comparison_markdown
from flodl_run.report.quality import NOT_REACHED, eval_points, speedup, time_to_bar

META = {"command": "c", "machine": "m", "rig": "r", "runs": "x", "load_average": [0.0, 0.0]}


def _summary(evals, epoch_ms=1000.0, eval_ms=0.0, status="completed"):
    return {"status": status, "samples_per_s": 10.0, "final_eval": evals[-1],
            "epochs": [{"epoch": i, "avg_loss": 1.0, "eval": e, "epoch_ms": epoch_ms,
                        "eval_ms": eval_ms} for i, e in enumerate(evals)]}


def test_time_to_bar_is_the_first_point_that_reaches_it_in_the_recipes_direction():
    """Pins the rule: the first point at or past the bar, >= for max (accuracy) and <= for min
    (bits per byte); a later dip does not undo it; the max rule on a loss-like series would
    stop at the first point, which is the bug the direction prevents."""
    accuracy = [(1.0, 0.50), (2.0, 0.71), (3.0, 0.69), (4.0, 0.75)]
    assert time_to_bar(accuracy, 0.70, "max") == 2.0
    assert time_to_bar(accuracy, 0.75) == 4.0  # equal counts as reached
    bits = [(1.0, 2.9), (2.0, 2.4), (3.0, 1.9)]
    assert time_to_bar(bits, 2.0, "min") == 3.0
    assert time_to_bar(bits, 2.0, "max") == 1.0


def test_time_to_bar_at_the_first_point_never_reached_and_without_a_bar():
    """Pins the edge values: reached at the very first eval gives that eval's time, a bar no
    point reaches gives "not reached" (a word, never a number), no bar or no eval gives None."""
    points = [(0.5, 0.8), (1.0, 0.9)]
    assert time_to_bar(points, 0.6) == 0.5
    assert time_to_bar(points, 0.95) == NOT_REACHED
    assert time_to_bar(points, None) is None
    assert time_to_bar([], 0.6) is None


def test_eval_points_count_training_time_only_and_add_a_trailing_final_eval():
    """Pins the clock: each point is cumulative epoch time less the evals inside it (eval_ms),
    and a final eval taken after a last epoch that scored none is a point at the end."""
    summary = _summary([0.5, None], epoch_ms=1500.0, eval_ms=500.0)
    summary["final_eval"] = 0.8
    assert eval_points(summary) == [(1.0, 0.5), (2.0, 0.8)]
    assert eval_points(_summary([0.5, 0.6])) == [(1.0, 0.5), (2.0, 0.6)]  # final = last: once


def test_speedup_is_the_reference_time_over_the_entrys():
    """Pins the ratio's direction (higher is sooner) and its words: an entry that never reached
    the bar is "not reached", an unknown time (a failed run, no bar) is None."""
    assert speedup(4.0, 2.0) == 2.0 and speedup(4.0, 4.0) == 1.0
    assert speedup(4.0, NOT_REACHED) == NOT_REACHED
    assert speedup(None, 2.0) is None and speedup(4.0, None) is None
    assert speedup(NOT_REACHED, 2.0) is None


def _outcome(name, kind, evals, epoch_ms=1000.0, status="completed", recipe="r"):
    return RunOutcome(name, recipe, kind, kind, "none", 1.0, _summary(evals, epoch_ms, status=status))


def test_bench_times_every_entry_to_ddps_final_eval():
    """Pins the bench's headline: the bar is torch_ddp's final eval (0.72, which DDP reached
    at 3 s: its second-to-last eval already did), DDP is 1.00, an entry there at 1.5 s is 2.00,
    one that never got there shows "not reached" in bench.md and the terminal, a failed entry
    has no figure; the caption names the bar."""
    outcomes = [_outcome("torch_ddp", "torch_ddp", [0.5, 0.6, 0.72, 0.72]),
                _outcome("nccl_cadence", "flodl_run", [0.6, 0.73, 0.8], epoch_ms=750.0),
                _outcome("cpu_async", "flodl_run", [0.5, 0.6, 0.7]),
                _outcome("cpu_sync", "flodl_run", [0.9], status="failed")]
    doc = bench_document([RecipeBench("r", 0.9, [1.0, 1.0])], outcomes, META)
    by_name = {e["name"]: e for e in doc["entries"]}
    assert by_name["torch_ddp"]["time_to_ddp_quality_s"] == 3.0
    assert by_name["torch_ddp"]["x_ddp_to_quality"] == 1.0
    assert by_name["nccl_cadence"]["time_to_ddp_quality_s"] == 1.5
    assert by_name["nccl_cadence"]["x_ddp_to_quality"] == 2.0
    assert by_name["cpu_async"]["x_ddp_to_quality"] == NOT_REACHED
    assert by_name["cpu_sync"]["x_ddp_to_quality"] is None
    assert by_name["nccl_cadence"]["time_to_target_s"] == NOT_REACHED  # the fixed target stays
    assert doc["recipes"][0]["quality_bar"] == 0.72
    assert doc["recipes"][0]["quality_source"] == "torch_ddp"
    md = to_markdown(doc)
    assert "| nccl_cadence | completed | 2.00 | 1.50 |" in md
    assert "| cpu_async | completed | not reached | not reached |" in md
    assert "quality bar: torch_ddp's final eval, >= 0.7200" in md
    caption = str(tables(doc)[0].caption)
    assert "torch_ddp's final eval, >= 0.7200, which DDP first reached after 3.00 s" in caption


def test_without_ddp_the_bar_is_the_declared_target_and_no_ratio_is_given():
    """Pins the fallback: with no completed torch_ddp entry (not run, or failed) the bar is the
    recipe's declared target, in its direction (min here), the time to it is given, the ratio
    to DDP is not (no DDP time), and the caption says so."""
    for ddp in ([], [_outcome("torch_ddp", "torch_ddp", [2.1], status="failed")]):
        outcomes = ddp + [_outcome("nccl_sync", "flodl_run", [2.9, 2.4, 1.9])]
        recipe = RecipeBench("r", 2.0, [1.0, 1.0], eval_direction="min")
        doc = bench_document([recipe], outcomes, META)
        entry = doc["entries"][-1]
        assert entry["time_to_ddp_quality_s"] == 3.0 and entry["x_ddp_to_quality"] is None
        assert doc["recipes"][0]["quality_source"] == "target_eval"
        assert "no completed torch_ddp entry, so the declared target eval <= 2.0000" in \
            str(tables(doc)[0].caption)


def test_ddp_peer_steps_train_the_samples_of_nccl_syncs_steps():
    """Pins the peers' deal: in every epoch (here 3 per pass, data.epoch_splits as the bench's
    evals_per_epoch sets it) DDP's global step j (the union of every rank's batch j) is the set
    of pass positions nccl_sync's step j trains (its windows take world x batch positions from
    the front of the epoch's span), all ranks run the same steps, and an epoch loses fewer
    than world samples. So on a homogeneous rig both follow one trajectory up to float order
    and time to quality compares speed alone."""
    world, batch, num, splits = 3, 4, 70, 3
    config = SimpleNamespace(seed=7, batch_size=batch, data=SimpleNamespace(epoch_splits=splits))
    order = permutation(num, config.seed, 1).tolist()
    for epoch in range(splits, 2 * splits):  # the second pass
        rows = [PeerRank._my_rows(SimpleNamespace(config=config, num_samples=num,
                                                  world_size=world, rank=r,
                                                  device=torch.device("cpu")), epoch).tolist()
                for r in range(world)]
        span = epoch_span(epoch, num, 1, splits)
        assert len({len(r) for r in rows}) == 1 and span.size - world < sum(map(len, rows))
        pool = EpochPool.whole(span)
        for step in range(-(-len(rows[0]) // batch)):
            ddp = [x for mine in rows for x in mine[step * batch:(step + 1) * batch]]
            exact = {order[p] for _, start, n in pool.take(world * batch)
                     for p in range(start, start + n)}
            assert set(ddp) <= exact and len(exact) - len(ddp) < world, (epoch, step)
            assert len(ddp) == len(set(ddp)) and (len(exact) == len(ddp) or step), (epoch, step)


def _job(tmp_path, num, evals, epoch_ms=1000.0, status="completed"):
    run_dir = tmp_path / str(num)
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps(_summary(evals, epoch_ms, status=status)))
    return JobOutcome.read(num, [f"seed={num}"], run_dir)


def test_sweep_times_each_job_to_the_first_jobs_final_eval(tmp_path):
    """Pins the comparison's rule: the bar is job #0's final eval, job #0 is 1.0, a job there
    in half the time 2.0, one that never got there "not reached"; the note names the bar; a
    first job that failed gives no bar at all rather than another job's."""
    jobs = [_job(tmp_path, 0, [0.5, 0.7]), _job(tmp_path, 1, [0.7, 0.9]),
            _job(tmp_path, 2, [0.5, 0.6])]
    table = rows(jobs)
    assert [r["time_to_quality_s"] for r in table] == [2.0, 1.0, NOT_REACHED]
    assert [r["x_first_to_quality"] for r in table] == [1.0, 2.0, NOT_REACHED]
    assert "the final eval of job #0, the sweep's first, >= 0.7" in comparison_markdown(jobs)
    (tmp_path / "f").mkdir()
    failed = [_job(tmp_path / "f", 0, [0.9], status="failed"), _job(tmp_path / "f", 1, [0.7])]
    assert [r["time_to_quality_s"] for r in rows(failed)] == [None, None]
    assert "`time to quality s`: none" in comparison_markdown(failed)


@pytest.mark.parametrize("direction", ["max", "min"])
def test_ddp_itself_is_one_in_either_direction(direction):
    """Pins DDP = 1.00 whatever the direction: its own final eval is reached by its own series."""
    evals = [0.5, 0.7, 0.6] if direction == "max" else [2.5, 2.0, 2.2]
    doc = bench_document([RecipeBench("r", None, [1.0, 1.0], eval_direction=direction)],
                         [_outcome("torch_ddp", "torch_ddp", evals)], META)
    assert doc["entries"][0]["x_ddp_to_quality"] == 1.0
    assert doc["entries"][0]["time_to_ddp_quality_s"] == 2.0
