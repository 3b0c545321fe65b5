"""Hydra multirun sweeps: one MLflow parent run, each job a child, the comparison at the end;
sweeps whose jobs run in other processes (submitit's local executor, one host's groups)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
from pathlib import Path

import pytest

from flodl_run.report.compare import JobOutcome, rows, to_csv
from flodl_run.report.sweep import _parent_status, read_jobs, write_job
from tests.support import run_cli, start_cli, text_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_two_job_sweep_gives_one_parent_two_children_and_the_comparison(tmp_path, mlflow_db):
    """Pins `python -m flodl_run -m a,b`: exactly one parent run holding comparison.md/.csv/.png,
    two FINISHED children tagged with its id, and the same files in the multirun directory.
    One epoch a job: the table's figures (final loss, samples/s) need only one."""
    import mlflow

    db, sweep_dir = mlflow_db, tmp_path / "multirun"
    proc = run_cli("-m", "elche=nccl_sync,nccl_cadence", "cluster=solo", "num_epochs=1",
                   f"tracking.uri=sqlite:///{db}", f"hydra.sweep.dir={sweep_dir}", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert parent.info.status == "FINISHED" and {c.info.status for c in children} == {"FINISHED"}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.md", "comparison.csv", "comparison.png"} <= artifacts
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [r["overrides"] for r in table] == ["elche=nccl_sync", "elche=nccl_cadence"]
    assert {r["mlflow_run_id"] for r in table} == {c.info.run_id for c in children}
    assert all(float(r["final_loss"]) > 0 and float(r["samples_per_s"]) > 0 for r in table)
    assert (sweep_dir / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert "| elche=nccl_sync |" in (sweep_dir / "comparison.md").read_text()
    # the sweep names what it wrote, and each run says it trained in-process
    assert proc.stdout.count(f"sweep: wrote {sweep_dir}/: comparison.md, comparison.csv, comparison.png"
                             f" | mlflow parent run {parent.info.run_id} in sqlite:///{db}") == 1
    assert sorted(c.info.run_name for c in children) == ["solo-digits_mlp", "solo-digits_mlp"]


def _job(tmp_path: Path, num: int, overrides, summary) -> JobOutcome:
    run_dir = tmp_path / str(num)
    run_dir.mkdir()
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return JobOutcome.read(num, overrides, run_dir)


def _summary(losses, epoch_ms=1000.0, status="completed"):
    return {"status": status, "epochs": [{"avg_loss": x, "eval": None, "epoch_ms": epoch_ms}
                                         for x in losses],
            "final_eval": 0.9, "wall_s": 5.0, "samples_per_s": 100.0, "mlflow_run_id": None}


def test_comparison_compares_at_the_last_common_epoch_and_survives_a_crashed_job(tmp_path):
    """Pins the table's figures: loss at the last epoch every job finished, loss drop per
    training second, only the differing overrides, and a job without summary.json shown as
    failed (which makes the parent FAILED) rather than breaking the table."""
    jobs = [_job(tmp_path, 0, ["elche=a", "seed=1"], _summary([2.0, 1.0, 0.5])),
            _job(tmp_path, 1, ["elche=b", "seed=1"], _summary([2.0, 1.5], epoch_ms=500.0)),
            _job(tmp_path, 2, ["elche=c", "seed=1"], None)]
    table = rows(jobs)
    assert [r["overrides"] for r in table] == ["elche=a", "elche=b", "elche=c"]
    assert [r["loss_at_epoch_n"] for r in table] == [1.0, 1.5, None]
    assert table[0]["loss_drop_per_s"] == (2.0 - 0.5) / 3.0
    assert table[1]["loss_drop_per_s"] == (2.0 - 1.5) / 1.0
    assert table[2]["status"] == "failed" and table[2]["final_loss"] is None
    assert to_csv(jobs).splitlines()[3].startswith("2,elche=c,failed,")
    assert _parent_status([j.status for j in jobs]) == "FAILED"
    assert _parent_status(["completed", "interrupted"]) == "KILLED"
    assert _parent_status(["completed", "completed"]) == "FINISHED"


# ---- sweeps whose jobs run in other processes --------------------------------------------------


def _header(log: Path) -> dict:
    """A rank log's first line as the launcher wrote it: its cores, store port and coordinator."""
    match = re.search(r"cores (\S+), store port (\d+), coordinator (\S+),", text_of(log))
    assert match, text_of(log)[:300]
    return {"cores": match.group(1), "store": match.group(2), "coordinator": match.group(3)}


def _span(sweep_dir: Path, job: str) -> tuple:
    """(start, end) of a job: when it left its entry in the sweep dir (Hydra's on_job_start,
    before the run imports anything) and when it wrote its summary."""
    return ((sweep_dir / ".jobs" / f"{job}.json").stat().st_mtime,
            (sweep_dir / job / "summary.json").stat().st_mtime)


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two core groups need two cores")
def test_a_group_sweep_runs_its_jobs_at_once_on_disjoint_cores_and_ports(tmp_path):
    """Pins `-m hydra/launcher=gpu_groups` on a CPU host: two jobs of two CPU ranks each train at
    the same time, every rank of one job pinned to cores no rank of the other may use (the
    kernel's affinity of the rank processes), and no store or coordinator port shared."""
    sweep_dir = tmp_path / "multirun"
    proc = run_cli("-m", "hydra/launcher=gpu_groups", "seed=1,2", "cluster=cpu", "cluster.num_ranks=2",
                   "num_epochs=2", "tracking=off", f"hydra.sweep.dir={sweep_dir}", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [(r["overrides"], r["status"]) for r in table] == [("seed=1", "completed"),
                                                               ("seed=2", "completed")]
    heads = {job: [_header(sweep_dir / job / "ranks" / f"rank{k}.log") for k in (0, 1)]
             for job in ("0", "1")}
    cores = {job: {h["cores"] for h in hs} for job, hs in heads.items()}
    assert len(cores["0"]) == len(cores["1"]) == 1 and cores["0"] != cores["1"]

    def core_set(text: str) -> set:
        return {c for part in text.split(",") for c in range(int(part.split("-")[0]),
                                                             int(part.split("-")[-1]) + 1)}
    assert not core_set(*cores["0"]) & core_set(*cores["1"])
    for key in ("store", "coordinator"):
        assert {h[key] for h in heads["0"]}.isdisjoint({h[key] for h in heads["1"]})
    (start0, end0), (start1, end1) = _span(sweep_dir, "0"), _span(sweep_dir, "1")
    assert start0 < end1 and start1 < end0  # side by side, not one after the other


@pytest.mark.e2e
def test_a_local_submitit_job_stopped_by_its_notice_is_requeued_and_resumes(tmp_path, mlflow_db):
    """Pins `-m hydra/launcher=slurm_local` (submitit's local executor): the parent run is made
    before the job starts and the job's run is its child; the scheduler's notice (submitit's
    SIGUSR2, sent to the job's process as the executor does before a timeout) stops the
    in-process run, submitit requeues it through the checkpoint hook and the requeued job resumes
    from the job's last bundle; one comparison row, the resumed run's, without the resume.
    The job sends the notice to its own process from its epoch_fn at epoch 1 (the process and
    the signal are the executor's; the moment is known): the run was 30 epochs long so that a
    notice sent from here after its first epoch found it still training, and the requeued job
    then trained the other 28 (about half the test's CPU); 3 leave it one."""
    import mlflow

    sweep_dir, stop_file = tmp_path / "multirun", tmp_path / "stop"
    stop_file.touch()  # the job's epoch_fn(1) sends its own process the notice, once
    launcher = start_cli("-m", "hydra/launcher=slurm_local", "seed=3", "cluster=solo", "num_epochs=3",
                         "recipe=custom", "recipe.module=tests.stopping_recipe",
                         f"+recipe.params.stop_file={stop_file}", "+recipe.params.stop_signal=SIGUSR2",
                         f"tracking.uri=sqlite:///{mlflow_db}", f"hydra.sweep.dir={sweep_dir}")
    out, _ = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, out[-3000:]
    cli = text_of(sweep_dir / "0" / "cli.log")
    assert f"resumed from {sweep_dir / '0' / 'checkpoint'} at epoch" in cli, cli[-2000:]
    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("mode") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.info.status for c in children) == ["FINISHED", "KILLED"]
    finished = next(c.info.run_id for c in children if c.info.status == "FINISHED")
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [(r["status"], r["mlflow_run_id"]) for r in table] == [("completed", finished)]
    assert "resume_from" not in (sweep_dir / "comparison.md").read_text()


def test_a_job_entry_drops_only_the_resume_its_requeue_added(tmp_path):
    """Pins the comparison's view of a requeued job: its `resume_from` of its own run dir's
    bundle is left out of its overrides (the same sweep point), a resume_from of another
    run's bundle stays, and the second attempt's entry replaces the first."""
    run_dir = tmp_path / "0"
    write_job(tmp_path, (0, ["seed=1"], run_dir))
    write_job(tmp_path, (0, ["seed=1", f"resume_from={run_dir / 'checkpoint'}"], run_dir))
    write_job(tmp_path, (1, ["seed=2", "resume_from=/elsewhere/checkpoint"], tmp_path / "1"))
    assert read_jobs(tmp_path) == [(0, ["seed=1"], run_dir),
                                   (1, ["seed=2", "resume_from=/elsewhere/checkpoint"], tmp_path / "1")]


def test_groups_share_out_devices_and_cores_disjointly_and_refuse_an_empty_share():
    """Pins the group plan: n_jobs equal, disjoint shares of the GPUs and of the cores (what
    does not divide is left unused), and a share that would be empty is a config error naming
    hydra.launcher.n_jobs."""
    from flodl_run.config.materialize import ConfigError
    from hydra_plugins.flodl_run_launchers.groups import Group, plan_groups

    assert plan_groups(2, ["a", "b", "c", "d"], [0, 1, 2, 3, 4]) == [
        Group(["a", "b"], [0, 1]), Group(["c", "d"], [2, 3])]
    assert plan_groups(2, [], [0, 1]) == [Group([], [0]), Group([], [1])]
    with pytest.raises(ConfigError, match=r"hydra.launcher.n_jobs: must be <= the cores this process "
                                          r"may use \(2\), got 3"):
        plan_groups(3, [], [0, 1])
    with pytest.raises(ConfigError, match=r"hydra.launcher.n_jobs: must be <= the GPUs to share"):
        plan_groups(3, ["a", "b"], list(range(8)))


def test_the_stop_signal_is_named_by_the_environment_and_ignored_by_ranks():
    """Pins the launcher/rank agreement on the scheduler's notice: FLODL_RUN_STOP_SIGNAL names
    it with or without SIG, unknown or unset is none, and a rank's ignore leaves it ignored."""
    from flodl_run.contracts.signals import ignore_stop_signal, stop_signal

    assert stop_signal({"FLODL_RUN_STOP_SIGNAL": "USR2"}) is signal.SIGUSR2
    assert stop_signal({"FLODL_RUN_STOP_SIGNAL": "SIGUSR1"}) is signal.SIGUSR1
    assert stop_signal({"FLODL_RUN_STOP_SIGNAL": "NOPE"}) is None and stop_signal({}) is None
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        ignore_stop_signal({"FLODL_RUN_STOP_SIGNAL": "USR2"})
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.e2e
def test_a_group_sweep_with_more_jobs_than_cores_exits_2_before_any_job(tmp_path):
    """Pins the group launcher's refusal: n_jobs above the cores to share is a config error
    naming hydra.launcher.n_jobs (exit 2, no traceback), and no job starts or leaves a comparison."""
    sweep_dir = tmp_path / "multirun"
    cores = len(os.sched_getaffinity(0))
    proc = run_cli("-m", "hydra/launcher=gpu_groups", f"hydra.launcher.n_jobs={cores + 1}", "seed=1,2",
                   "cluster=cpu", "tracking=off", f"hydra.sweep.dir={sweep_dir}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"hydra.launcher.n_jobs: must be <= the cores this process may use ({cores}), got {cores + 1}"
            in proc.stderr)
    assert "Traceback" not in proc.stderr and not (sweep_dir / "comparison.md").exists()


def test_a_group_job_runs_on_its_slots_cores_and_gpus_and_frees_the_slot(tmp_path):
    """Pins InGroup: the job's process runs on its group's cores (and gets them back after),
    a GPU group turns cluster=auto into local_gpus on the group's devices while an explicit
    cluster=cpu keeps its topology, and two jobs at once never hold the same slot."""
    from omegaconf import OmegaConf

    from flodl_run.config.schema import ExperimentConfig
    from hydra_plugins.flodl_run_launchers.groups import Group, InGroup, take_slot

    before, core = os.sched_getaffinity(0), min(os.sched_getaffinity(0))
    seen = []
    job = InGroup(lambda cfg: seen.append((os.sched_getaffinity(0), OmegaConf.to_container(cfg.cluster))),
                  [Group(["GPU-a", "GPU-b"], [core])], tmp_path)
    job(OmegaConf.structured(ExperimentConfig))
    cpu = OmegaConf.structured(ExperimentConfig)
    cpu.cluster.topology = "cpu"
    job(cpu)
    assert seen[0][0] == {core} and os.sched_getaffinity(0) == before
    assert (str(seen[0][1]["topology"]), seen[0][1]["devices"]) == ("Topology.local_gpus", ["GPU-a", "GPU-b"])
    assert (str(seen[1][1]["topology"]), seen[1][1]["devices"]) == ("Topology.cpu", [])
    first, held = take_slot(tmp_path / "slots", 2)
    second, other = take_slot(tmp_path / "slots", 2)
    assert (first, second) == (0, 1)
    held.close()
    other.close()


def _attempt(run_dir: Path, status=None, bundle: bool = False) -> None:
    """What an earlier attempt of a job leaves: run.yaml, maybe a summary and a bundle's meta."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.yaml").write_text("seed: 1\n")
    stem = run_dir / "checkpoint"
    if bundle:
        Path(f"{stem}.meta.json").write_text("{}")
    if status is not None:
        (run_dir / "summary.json").write_text(json.dumps(
            {"status": status, "checkpoint": str(stem) if bundle else None}))


def test_a_rerun_sweep_job_skips_resumes_or_refuses_what_its_earlier_attempt_left(tmp_path):
    """Pins the sweep rerun rule: a job whose dir holds no started run trains; a completed run
    is skipped; a stopped or failed run (or a launcher killed before its summary) with a bundle
    resumes from it; one with no bundle, or a dir holding another sweep point's run, is refused
    naming the dir (a rerun used to retrain every job and overwrite the stopped one's bundle)."""
    from flodl_run.report.rerun import next_step, read_earlier

    def step(run_dir, overrides=("seed=1",), earlier=("seed=1",)):
        found = read_earlier(run_dir, None, None if earlier is None else list(earlier))
        return next_step(found, list(overrides), run_dir)

    (tmp_path / "hydra_only" / ".hydra").mkdir(parents=True)  # Hydra's files come before any check
    assert step(tmp_path / "hydra_only").action == "fresh"
    _attempt(tmp_path / "done", "completed", bundle=True)
    assert step(tmp_path / "done").action == "skip"
    for status in ("interrupted", "failed", "shutdown_with_save", None):
        _attempt(tmp_path / str(status), status, bundle=True)
        resumed = step(tmp_path / str(status))
        assert (resumed.action, resumed.bundle) == ("resume", str(tmp_path / str(status) / "checkpoint"))
    _attempt(tmp_path / "nothing", "interrupted")
    refused = step(tmp_path / "nothing")
    assert refused.action == "refuse" and f"remove {tmp_path / 'nothing'}" in refused.why
    other = step(tmp_path / "done", overrides=["seed=2"])
    assert other.action == "refuse" and "other overrides (seed=1; this job: seed=2)" in other.why
    own_bundle = f"resume_from={tmp_path / 'done' / 'checkpoint'}"
    requeued = step(tmp_path / "done", overrides=["seed=1", own_bundle])
    assert requeued.action == "skip" and step(tmp_path / "done", earlier=None).action == "skip"


def test_a_rerun_job_keeps_the_entry_of_another_sweep_points_run(tmp_path, monkeypatch):
    """Pins the comparison of a refused rerun job: the entry an earlier attempt left stays when
    this job's overrides differ (its row still describes the run in the dir), and is remembered
    for the job either way."""
    from omegaconf import OmegaConf

    from flodl_run.report import sweep
    from flodl_run.report.sweep import SweepCallback, earlier_overrides

    monkeypatch.setattr(sweep, "_joined", None)  # the hook joins the sweep: not for later tests
    monkeypatch.setattr(sweep, "_earlier", {})
    run_dir = tmp_path / "0"
    write_job(tmp_path, (0, ["seed=1"], run_dir))

    def start(overrides):
        SweepCallback().on_job_start(OmegaConf.create({"hydra": {
            "job": {"num": 0}, "overrides": {"task": overrides}, "sweep": {"dir": str(tmp_path)},
            "runtime": {"output_dir": str(run_dir)}}}))

    start(["seed=2"])
    assert read_jobs(tmp_path) == [(0, ["seed=1"], run_dir)] and earlier_overrides(run_dir) == ["seed=1"]
    start(["seed=1", f"resume_from={run_dir / 'checkpoint'}"])  # a requeue: the same job
    assert read_jobs(tmp_path) == [(0, ["seed=1"], run_dir)] and earlier_overrides(run_dir) == ["seed=1"]


@pytest.mark.e2e
def test_a_sweep_rerun_after_a_sigterm_skips_the_done_job_and_resumes_the_stopped_one(tmp_path):
    """Pins a sweep rerun into its hydra.sweep.dir: the job that completed is skipped with a
    line saying so (its files untouched), the job a SIGTERM stopped resumes from its own
    bundle, and the comparison lists both completed. A rerun used to retrain every job and
    overwrite the stopped job's bundle without a word."""
    sweep_dir, stop_file = tmp_path / "multirun", tmp_path / "stop"
    stop_file.touch()  # job 1's epoch_fn(1) SIGTERMs its own run once (tests/stopping_recipe.py)
    args = ("-m", "num_epochs=1,3", "recipe=custom", "recipe.module=tests.stopping_recipe",
            f"+recipe.params.stop_file={stop_file}", "cluster=solo", "tracking=off",
            f"hydra.sweep.dir={sweep_dir}")
    first = run_cli(*args, timeout=240)
    assert first.returncode == 130, first.stdout[-3000:] + first.stderr[-3000:]
    stopped = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert (stopped["status"], stopped["checkpoint"]) == ("interrupted", str(sweep_dir / "1" / "checkpoint"))
    done = {p.name: p.stat().st_mtime_ns for p in (sweep_dir / "0").iterdir()
            if p.is_file() and p.name != "cli.log"}
    second = run_cli(*args, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"{sweep_dir / '0'} holds this job's completed run: skipped" in second.stdout, second.stdout
    assert f"resuming it from {sweep_dir / '1' / 'checkpoint'}" in second.stdout
    assert f"resumed from {sweep_dir / '1' / 'checkpoint'} at epoch" in text_of(sweep_dir / "1" / "cli.log")
    assert {p.name: p.stat().st_mtime_ns for p in (sweep_dir / "0").iterdir()
            if p.is_file() and p.name != "cli.log"} == done
    assert "holds this job's completed run: skipped" in text_of(sweep_dir / "0" / "cli.log")
    table = list(csv.DictReader(io.StringIO((sweep_dir / "comparison.csv").read_text())))
    assert [r["status"] for r in table] == ["completed", "completed"]
