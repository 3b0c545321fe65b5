"""recipe.eval_direction: a loss-like eval (min) is reached and ranked the other way round.

Time-to-target in the bench, the sweep's comparison table and review all follow it; a recipe
that says nothing keeps the accuracy-like default (max).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flodl_run.bench.report import (
    NOT_REACHED,
    RecipeBench,
    RunOutcome,
    bench_document,
    time_to_target,
    to_markdown,
)
from flodl_run.config.schema import EvalDirection, ExperimentConfig, RecipeConfig
from flodl_run.config.validate import validate
from flodl_run.report.compare import JobOutcome, rows
from flodl_run.report.compare import to_markdown as comparison_markdown

REPO = Path(__file__).resolve().parents[1]


def _summary(evals, epoch_ms=1000.0):
    return {"status": "completed", "samples_per_s": 10.0, "final_eval": evals[-1],
            "epochs": [{"epoch": i, "avg_loss": 1.0, "eval": e, "epoch_ms": epoch_ms}
                       for i, e in enumerate(evals)]}


def test_min_direction_reaches_the_target_from_above():
    """Pins time-to-target for a loss-like eval: the first eval <= target counts (bits per byte
    2.9 -> 2.4 -> 1.9 reaches 2.0 at the third epoch), where the max rule would count the first
    epoch as reached because 2.9 >= 2.0."""
    summary = _summary([2.9, 2.4, 1.9])
    assert time_to_target(summary, 2.0, "min") == pytest.approx(3.0)
    assert time_to_target(summary, 2.0) == pytest.approx(1.0)  # default max: >=
    assert time_to_target(summary, 1.5, "min") == NOT_REACHED
    final_only = {"status": "completed", "final_eval": 1.8, "epochs": [
        {"epoch": 0, "avg_loss": 1.0, "eval": None, "epoch_ms": 500.0}]}
    assert time_to_target(final_only, 2.0, "min") == pytest.approx(0.5)
    assert time_to_target(final_only, 1.5, "min") == NOT_REACHED


def test_bench_document_uses_the_recipe_direction():
    """Pins the bench path from RecipeBench to bench.json and bench.md: entries of a min recipe
    get their time-to-target by <=, the recipe record carries its direction, and the markdown
    says which way the target is reached."""
    outcome = RunOutcome("solo@1.0", "byte_lm", "solo", "solo", "none", 5.0, _summary([3.0, 1.9]))
    doc = bench_document([RecipeBench("byte_lm", 2.0, [1.0], eval_direction="min")], [outcome],
                         {"command": "c", "machine": "m", "rig": "r", "runs": "x",
                          "load_average": [0.0, 0.0]})
    assert doc["entries"][0]["time_to_target_s"] == pytest.approx(2.0)
    assert doc["recipes"][0]["eval_direction"] == "min"
    assert "target eval <= 2.0000" in to_markdown(doc)


def _job(tmp_path: Path, num: int, final_eval, direction) -> JobOutcome:
    run_dir = tmp_path / str(num)
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(_summary([final_eval])))
    if direction is not None:
        (run_dir / "run.yaml").write_text(f"recipe:\n  module: m\n  eval_direction: {direction}\n")
    return JobOutcome.read(num, [f"seed={num}"], run_dir)


def test_sweep_comparison_ranks_by_the_direction_in_run_yaml(tmp_path):
    """Pins the sweep table: each job's direction is read from its run.yaml; with min the lowest
    final eval ranks 1 (ties share a rank), a job without run.yaml (it failed before writing
    one) does not break the ranking, and the note says lower is better."""
    jobs = [_job(tmp_path, 0, 2.5, "min"), _job(tmp_path, 1, 1.5, "min"),
            _job(tmp_path, 2, 2.5, None), _job(tmp_path, 3, 3.0, "min")]
    assert jobs[0].eval_direction is EvalDirection.min and jobs[2].eval_direction is None
    assert [r["eval_rank"] for r in rows(jobs)] == [2, 1, 2, 4]
    assert "lower is better (recipe.eval_direction=min)" in comparison_markdown(jobs)


def test_sweep_comparison_defaults_to_max_and_refuses_to_rank_mixed_directions(tmp_path):
    """Pins: without any direction the highest eval ranks 1 (accuracy); jobs whose recipes
    disagree on the direction get no rank rather than a meaningless one."""
    accuracy = [_job(tmp_path / "a", 0, 0.9, None), _job(tmp_path / "a", 1, 0.95, None)]
    assert [r["eval_rank"] for r in rows(accuracy)] == [2, 1]
    mixed = [_job(tmp_path / "b", 0, 0.9, "max"), _job(tmp_path / "b", 1, 1.9, "min")]
    assert [r["eval_rank"] for r in rows(mixed)] == [None, None]
    assert "disagree on recipe.eval_direction" in comparison_markdown(mixed)


def test_direction_rule_names_the_key():
    """Pins the rule for Python callers (the CLI's own check rejects other words first): a value
    other than max or min is a config problem naming recipe.eval_direction; the strings are
    accepted as the enum."""
    report = validate(ExperimentConfig(recipe=RecipeConfig(eval_direction="lower")))
    assert [str(p) for p in report.problems] == ["recipe.eval_direction: must be max or min, got 'lower'"]
    assert validate(ExperimentConfig(recipe=RecipeConfig(eval_direction="min"))).ok


def test_review_shows_the_direction_of_byte_lm(monkeypatch):
    """Pins that review shows which way a recipe's eval goes: byte_lm's preset says min, the
    default recipe max."""
    from flodl_run import review

    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.chdir(REPO)
    shown, _ = review.materialized(["recipe=byte_lm", "recipe.params.max_bytes=20000"])
    assert shown["recipe.eval_direction"] == "min"
    assert review.materialized([])[0]["recipe.eval_direction"] == "max"
