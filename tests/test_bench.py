"""`python -m flodl_run.bench`: the plan of runs, the figures, and the smallest bench end to
end. Timings are never asserted: speed targets live in the benchmark."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from flodl_run.bench.report import (
    ENTRY_KEYS,
    NOT_REACHED,
    RecipeBench,
    RunOutcome,
    bench_document,
    median_run,
    time_to_target,
)
from flodl_run.bench.run import (
    BenchConfig,
    BenchRecipe,
    BenchRunConfig,
    Rig,
    check,
    localsgd_period,
    plan,
)
from flodl_run.config.schema import ClusterConfig, Mode, OuterKind, Topology
from flodl_run.contracts.summary import Summary
from tests.support import _pair_rig, _summary, cadence_bench_jobs, run_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ('bench.recipes=[{name:synthetic_mlp,overrides:["recipe.params.num_samples=512",'
        '"recipe.params.hidden=32","recipe.params.depth=1"]}]')
SUMMARY_KEYS = {f.name for f in dataclasses.fields(Summary)}


def run_bench(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return run_module("flodl_run.bench", f"hydra.run.dir={tmp_path}", "tracking=off", *overrides,
                      cwd=ROOT, env=env, timeout=240)


def test_plan_runs_solo_at_each_speed_then_peers_then_modes_by_outer():
    """Pins the entry names of bench.json and what each run is given: the bare solo loop at
    each distinct rank speed and the runner's own solo path, on one rank's threads (not the
    rig's cluster overrides), torch DDP, every mode x outer and torch local SGD last (its
    period may come from nccl_cadence), on the rig with its command-line cluster overrides."""
    cfg = BenchRunConfig(bench=BenchConfig(
        recipes=[BenchRecipe(overrides=["recipe.params.hidden=64", "batch_size=16"])],
        modes=[Mode.nccl_cadence, Mode.cpu_async], outers=[OuterKind.none, OuterKind.diloco]))
    jobs = plan(cfg, _pair_rig())
    assert [j.name for j in jobs] == ["solo@1.0", "solo@2.5", "runner_solo@1.0", "torch_ddp",
                                      "nccl_cadence", "nccl_cadence+diloco", "cpu_async",
                                      "cpu_async+diloco", "torch_localsgd"]
    assert [j.kind for j in jobs[:4]] == ["solo", "solo", "runner_solo", "torch_ddp"]
    assert jobs[0].command(Path("d"))[2:5] == ["flodl_run.bench.peers", "--peer", "solo"]
    assert jobs[2].command(Path("d"))[2] == "flodl_run"  # the runner's own path
    slow = jobs[1].overrides
    assert "cluster=solo" in slow and "cluster.emulate_slowdown=[2.5]" in slow
    assert "cluster.threads_per_rank=1" in slow and "cluster.emulate_slowdown=[1.0,2.5]" not in slow
    for job in jobs[3:]:
        assert "cluster=cpu_pair" in job.overrides
        assert "cluster.emulate_slowdown=[1.0,2.5]" in job.overrides
        assert "tracking=off" in job.overrides and "recipe.params.hidden=64" in job.overrides
        # the recipe's batch_size override replaces the bench's (Hydra refuses a key twice)
        assert [o for o in job.overrides if o.startswith("batch_size=")] == ["batch_size=16"]
    assert "elche=cpu_async" in jobs[7].overrides and "outer=diloco" in jobs[7].overrides
    assert jobs[-1].period is None  # resolved from nccl_cadence's run before it starts


def test_evals_per_epoch_splits_every_runs_epochs_and_one_leaves_them_whole():
    """Pins the sub-epoch evals of time to quality: bench.evals_per_epoch=3 gives every run (the
    peers' too) data.epoch_splits=3, so each scores 3 times a pass; a user's own
    data.epoch_splits in bench.overrides wins; 1 adds nothing (runs keep their whole epochs)."""
    def splits(bench):
        jobs = plan(BenchRunConfig(bench=bench), _pair_rig())
        return {j.name: [o for o in j.overrides if o.startswith("data.epoch_splits")] for j in jobs}

    assert set(map(tuple, splits(BenchConfig(modes=[Mode.nccl_sync], evals_per_epoch=3)).values())) \
        == {("data.epoch_splits=3",)}
    mine = BenchConfig(modes=[Mode.nccl_sync], evals_per_epoch=3, overrides=["data.epoch_splits=2"])
    assert splits(mine)["torch_ddp"] == ["data.epoch_splits=2"]
    assert set(map(tuple, splits(BenchConfig(modes=[Mode.nccl_sync])).values())) == {()}


def test_localsgd_period_is_cadence_mean_local_steps_per_reduce():
    """Pins torch_localsgd's default period: nccl_cadence's batches per rank per reduce in the
    same round (samples / batch / world / syncs, rounded, >= 1); 8 without a completed run."""
    cadence = {"status": "completed", "syncs": 10, "world_size": 2,
               "epochs": [{"samples": 6400}, {"samples": 6400}]}
    assert localsgd_period(cadence, batch_size=64) == 10  # 12800 / 64 / 2 / 10
    assert localsgd_period(dict(cadence, syncs=1000), batch_size=64) == 1
    assert localsgd_period(dict(cadence, status="failed"), batch_size=64) == 8
    assert localsgd_period(None, batch_size=64) == 8


def test_ideal_sums_solo_rates_per_rank_and_ratios_use_it():
    """Pins the ideal (sum over the rig's ranks of the solo rate at that rank's speed, so a
    homogeneous pair counts solo@1.0 twice), the ratios to it and to the torch peers, and the
    runner's solo path set against the bare loop at its speed."""
    outcomes = [RunOutcome("solo@1.0", "r", "solo", "solo", "none", 1.0,
                           _summary([0.5], samples_per_s=300.0)),
                RunOutcome("torch_ddp", "r", "torch_ddp", "torch_ddp", "none", 1.0,
                           _summary([0.5], samples_per_s=200.0)),
                RunOutcome("nccl_sync", "r", "flodl_run", "nccl_sync", "none", 1.0,
                           _summary([0.5], samples_per_s=540.0)),
                RunOutcome("torch_localsgd", "r", "torch_localsgd", "torch_localsgd", "none", 1.0,
                           _summary([0.5], samples_per_s=450.0)),
                RunOutcome("runner_solo@1.0", "r", "runner_solo", "solo", "none", 1.0,
                           _summary([0.5], samples_per_s=285.0))]
    doc = bench_document([RecipeBench("r", None, [1.0, 1.0])], outcomes, {})
    assert doc["ideal_samples_per_s"] == 600.0
    sync = doc["entries"][2]
    assert set(sync) == set(ENTRY_KEYS)
    assert sync["ratio_to_ideal"] == pytest.approx(0.9)
    assert sync["ratio_to_torch_ddp"] == pytest.approx(2.7)
    assert sync["ratio_to_torch_localsgd"] == pytest.approx(1.2)
    assert doc["entries"][4]["ratio_to_ideal"] == pytest.approx(0.95)  # 285 / solo@1.0's 300
    missing = bench_document([RecipeBench("r", None, [1.0, 2.5])], outcomes, {})
    assert missing["ideal_samples_per_s"] is None
    assert missing["entries"][2]["ratio_to_ideal"] is None


def test_an_entry_is_its_median_run_and_keeps_every_rate():
    """Pins bench.repeats: the entry is the run with the median samples/s among the completed
    runs, and it lists every run's rate (None for a run that failed)."""
    runs = [RunOutcome("nccl_sync", "r", "flodl_run", "nccl_sync", "none", 1.0,
                       _summary([0.5], samples_per_s=rate, status=status))
            for rate, status in ((100.0, "completed"), (300.0, "completed"), (900.0, "failed"),
                                 (200.0, "completed"))]
    chosen = median_run(runs)
    assert chosen.summary["samples_per_s"] == 200.0
    assert chosen.repeats == [100.0, 300.0, None, 200.0]


def test_time_to_target_is_cumulative_training_time_or_not_reached():
    """Pins time-to-target: training seconds (cumulative epoch_ms) at the first eval >= target;
    "not reached" is a value; no target gives None."""
    summary = _summary([0.5, 0.72, 0.69, 0.75], epoch_ms=1500.0)
    assert time_to_target(summary, 0.7) == pytest.approx(3.0)
    assert time_to_target(summary, 0.9) == NOT_REACHED
    assert time_to_target(summary, None) is None


def test_check_reports_every_problem_with_its_key():
    """Pins the config rules that are the bench's own (exit 2 names the dotted key)."""
    cfg = BenchRunConfig(bench=BenchConfig(epochs=0, evals_per_epoch=0, batch_size=0,
                                           recipes=[], outers=[], timeout_s=0))
    one_rank = Rig("solo", (), ClusterConfig(topology=Topology.solo), 1)
    keys = [p.key for p in check(cfg, one_rank)]
    assert keys == ["bench.epochs", "bench.evals_per_epoch", "bench.batch_size", "bench.timeout_s",
                    "bench.recipes", "bench.outers", "cluster"]


def test_one_gpu_rank_may_run_modes_against_solo_but_not_the_torch_peers():
    """Pins what a one-rank rig may bench: the modes through rank processes (a mode's overhead
    against the solo path, e.g. nccl_sync on one GPU), never in-process (cluster=solo, or
    cluster=auto on a host with one GPU), and the torch peers only from two ranks on."""
    one_gpu = Rig("local_gpus", ("cluster.devices=[0]",),
                  ClusterConfig(topology=Topology.local_gpus, devices=["0"]), 1)
    solo = Rig("solo", (), ClusterConfig(topology=Topology.solo), 1)
    modes_only = BenchRunConfig(bench=BenchConfig(modes=[Mode.nccl_sync], torch_ddp=False,
                                                  torch_localsgd=False))
    assert check(modes_only, one_gpu) == []
    assert [(p.key, p.value) for p in check(modes_only, solo)] == [("cluster", "solo")]
    auto_one_gpu = Rig("auto", (), ClusterConfig(), 1, ("GPU-0",), in_process=True)
    assert [(p.key, p.value) for p in check(modes_only, auto_one_gpu)] == [("cluster", "auto")]
    with_ddp = BenchRunConfig(bench=BenchConfig(modes=[], torch_localsgd=False))
    (problem,) = check(with_ddp, one_gpu)
    assert problem.key == "cluster" and "bench.torch_ddp=false" in problem.rule


@pytest.mark.e2e
def test_bad_override_exits_2_before_any_run(tmp_path):
    """Pins: a typo in a run's overrides fails the whole bench in seconds, naming the run and
    the key, instead of after the runs before it trained."""
    done = run_bench(tmp_path, 'bench.overrides=["elche.anchor=0"]', "bench.modes=[nccl_sync]",
                     TINY)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "synthetic_mlp/nccl_sync: elche.anchor: must be >= 1" in done.stdout + done.stderr
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.e2e
def test_smallest_bench_end_to_end(tmp_path):
    """Pins the harness end to end on its smallest configuration: the bare solo loop, the
    runner's solo, torch DDP, one mode and torch local SGD on a homogeneous 2-rank CPU rig
    (which modes and outers a bench plans is the plan test's; each mode runs as the CLI does),
    one epoch of a tiny recipe; bench.json has the issue's schema and one completed entry per
    run, bench.md and the plot are written, and the peers' summary.json has the runner's
    keys; local SGD averages every nccl_cadence's mean local steps. bench.evals_per_epoch=2
    scores every run twice in its one epoch, and each entry is timed to DDP's final eval (DDP
    itself 1.00, in the terminal's headline column too)."""
    done = run_bench(tmp_path, "cluster=cpu", "bench.epochs=1", "bench.batch_size=32",
                     "bench.evals_per_epoch=2", "bench.modes=[nccl_cadence]", TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert {"ideal_samples_per_s", "entries"} <= set(doc)
    names = [e["name"] for e in doc["entries"]]
    assert names == ["solo@1.0", "runner_solo@1.0", "torch_ddp", "nccl_cadence", "torch_localsgd"]
    for e in doc["entries"]:
        assert set(e) == set(ENTRY_KEYS) and e["status"] == "completed", e
        assert e["samples_per_s"] > 0 and e["final_eval"] is not None
        assert isinstance(e["time_to_target_s"], float) or e["time_to_target_s"] == NOT_REACHED
        assert [p["eval"] is not None for p in e["epochs"]] == [True, True], e["name"]
        assert e["x_ddp_to_quality"] == NOT_REACHED or e["x_ddp_to_quality"] > 0, e["name"]
        assert len(e["idle_fraction"]) == (2 if e["kind"] == "flodl_run" else 0)
    solo, ddp, cadence, lsgd = (doc["entries"][i] for i in (0, 2, 3, 4))
    assert doc["ideal_samples_per_s"] == pytest.approx(2 * solo["samples_per_s"])
    assert ddp["ratio_to_torch_ddp"] == pytest.approx(1.0) and ddp["syncs"] > 0
    assert ddp["x_ddp_to_quality"] == 1.0 and doc["recipes"][0]["quality_bar"] == ddp["final_eval"]
    ddp_row = next(line for line in done.stdout.splitlines() if line.startswith(" torch_ddp "))
    assert ddp_row.split("\u2502")[2].strip() == "1.00"  # the headline: x DDP to quality
    assert "quality bar: torch_ddp's final eval" in done.stdout
    assert lsgd["ratio_to_torch_localsgd"] == pytest.approx(1.0)
    cadence_summary = json.loads(Path(cadence["run_dir"], "summary.json").read_text())
    period = localsgd_period(cadence_summary, 32)
    assert lsgd["syncs"] > 0 and f"--period {period}" in lsgd["command"]
    for peer in (solo, ddp, lsgd):
        assert set(json.loads(Path(peer["run_dir"], "summary.json").read_text())) == SUMMARY_KEYS
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "| nccl_cadence | completed |" in (tmp_path / "bench.md").read_text()
    log = (tmp_path / "cli.log").read_text()  # was empty: the bench printed without logging
    assert "bench: 5 runs x 1 | rig cluster=cpu" in log and "[5/5] synthetic_mlp torch_localsgd ..." in log
    assert " torch_localsgd " in log and f"wrote {tmp_path / 'bench.json'}" in log
    assert done.stdout.count("bench: 5 runs") == 1  # the terminal shows each line once


def test_mlflow_parent_with_one_child_per_entry(tmp_path, mlflow_db):
    """Pins the bench's MLflow layout: one parent run (tag mode=bench, bench files attached) and
    one child per entry carrying mlflow.parentRunId, its per-epoch metrics (step = epoch) and
    its bench figures; a failed entry's child ends FAILED."""
    from mlflow import MlflowClient

    from flodl_run.bench.track import make_bench_tracker
    from flodl_run.config.schema import TrackingConfig, TrackingKind

    outcomes = []
    for name, status in (("solo@1.0", "completed"), ("torch_ddp", "completed"),
                         ("nccl_cadence", "failed")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        summary = dict(_summary([0.5, 0.6]), status=status)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        kind = "solo" if "solo" in name else "torch_ddp" if "ddp" in name else "flodl_run"
        outcomes.append(RunOutcome(name, "r", kind, "solo", "none", 2.0, summary, str(run_dir),
                                   "python ..."))
    doc = bench_document([RecipeBench("r", 0.55, [1.0])], outcomes, {})
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    uri = f"sqlite:///{mlflow_db}"
    tracker = make_bench_tracker(TrackingConfig(kind=TrackingKind.mlflow, uri=uri))
    tracker.start({"epochs": 2}, {"name": "bench test"})
    tracker.log_entries(doc["entries"], [o.summary for o in outcomes])
    tracker.finish([tmp_path / "bench.json"], "FAILED")
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("mode") == "bench")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FAILED"
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["bench.json"]
    assert sorted(c.data.tags["entry"] for c in children) == ["nccl_cadence", "solo@1.0",
                                                              "torch_ddp"]
    solo = next(c for c in children if c.data.tags["entry"] == "solo@1.0")
    assert solo.info.status == "FINISHED" and solo.data.metrics["time_to_target_s"] == 2.0
    assert solo.data.metrics["time_to_ddp_quality_s"] == 2.0  # DDP's final eval 0.6, at 2 s
    assert solo.data.metrics["x_ddp_to_quality"] == 1.0
    assert solo.data.params["time_to_ddp_quality"] == "2.0"
    assert [m.step for m in client.get_metric_history(solo.info.run_id, "eval")] == [0, 1]
    cadence = next(c for c in children if c.data.tags["entry"] == "nccl_cadence")
    assert cadence.info.status == "FAILED"


def test_bench_deadline_adds_the_deadline_variant_next_to_the_count_entry():
    """Pins `bench.deadline=[mode]`: one more run of the mode with elche.window_end=deadline,
    named `<mode>+deadline`, after the mode's own (count) entry; the count entry keeps the
    default window end."""
    jobs = cadence_bench_jobs(deadline=[Mode.nccl_cadence])
    assert [j.name for j in jobs] == ["nccl_cadence", "nccl_cadence+deadline"]
    assert "elche.window_end=deadline" in jobs[1].overrides
    assert not any(o.startswith("elche.window_end") for o in jobs[0].overrides)
    assert "elche=nccl_cadence" in jobs[1].overrides and jobs[1].mode == "nccl_cadence"


def _children(pid: int) -> list:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.e2e
def test_a_ctrl_c_stops_the_forked_run_in_hand_and_the_bench_ends_interrupted(tmp_path):
    """Pins the bench's runs on a CPU rig: each is forked from the bench's launch server (the
    bench's one child, the run the server's), and a Ctrl-C in the terminal (SIGINT to the whole
    process group) stops the run in hand while the server stays to report its exit: the bench
    ends with 130, says it was interrupted, writes bench.json with that entry, and leaves
    neither the server nor the run behind."""
    import signal
    import sys
    import time

    from tests.support import wait_for

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bench = subprocess.Popen(
        [sys.executable, "-m", "flodl_run.bench", f"hydra.run.dir={tmp_path}", "tracking=off",
         "cluster=cpu", "bench.epochs=5000", "bench.modes=[nccl_cadence]", TINY],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        log = tmp_path / "synthetic_mlp" / "solo@1.0" / "output.log"
        wait_for("the first run started", lambda: log.exists() and _children(bench.pid)
                 and _children(_children(bench.pid)[0]), timeout_s=120)
        (server,) = _children(bench.pid)
        (run,) = _children(server)
        time.sleep(1.0)  # into its epochs
        os.killpg(bench.pid, signal.SIGINT)
        out, _ = bench.communicate(timeout=90)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert bench.returncode == 130, out[-3000:] + "\n--- solo@1.0's output:\n" + log.read_text()[-2000:]
    entries = json.loads((tmp_path / "bench.json").read_text())["entries"]
    assert [e["name"] for e in entries] == ["solo@1.0"] and entries[0]["status"] != "completed"
    assert not Path(f"/proc/{run}").exists() and not Path(f"/proc/{server}").exists()
