"""Checkpoint bundles and resume, end to end with real ranks over Gloo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from flodl_run.contracts.checkpoint import (
    SCHEMA_VERSION,
    BundleError,
    bundle_files,
    load_model,
    paths,
    read_meta,
)
from tests.support import LOCKSTEP, PAIR, _live_ranks, _run, start_cli

pytestmark = pytest.mark.e2e


@pytest.fixture
def lockstep_bundle(lockstep_run) -> str:
    """The bundle of the suite's clean lockstep epoch (nccl_sync, homogeneous pair): resumed
    by two tests, copied and damaged by another."""
    return str(Path(lockstep_run["run_dir"]) / "checkpoint")


CADENCE = (*PAIR, "elche=nccl_cadence", "outer=slowmo", "elche.anchor=2", "elche.max_anchor=4")


@pytest.fixture(scope="module")
def cadence_pair(tmp_path_factory, migrated_mlflow_db) -> tuple:
    """Two epochs of CADENCE (nccl_cadence with slowmo, an anchor that lets ElChe reach Stable)
    tracked into a local store: (run dir, summary, the tracking.uri override). One test reads
    its bundle, another resumes from it."""
    root = tmp_path_factory.mktemp("cadence")
    shutil.copyfile(migrated_mlflow_db, root / "mlflow.db")
    db = f"tracking.uri=sqlite:///{root / 'mlflow.db'}"
    proc, summary = _run(root, *CADENCE, "num_epochs=2", db, tracking="mlflow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "run", summary, db


def test_clean_end_writes_a_complete_bundle(cadence_pair):
    """Pins the bundle layout and meta fields of a clean end, and that the saved
    model is the consensus the run evaluated."""
    run_dir, summary, _ = cadence_pair
    stem = summary["checkpoint"]
    assert stem == str(run_dir / "checkpoint")
    meta = read_meta(stem)
    files = bundle_files(stem, meta)
    assert all(files[k].is_file() for k in ("model", "optim", "outer"))
    assert files["model"].name == f"checkpoint.g{meta.generation}.pt"
    assert set(meta.files) == {f"checkpoint.g{meta.generation}.{part}.pt"
                               for part in ("optim", "outer", "optim.rank0", "optim.rank1")} | \
        {files["model"].name}
    assert sorted(p.name for p in Path(stem).parent.glob("checkpoint.*")) == \
        sorted([*meta.files, "checkpoint.meta.json"])  # older generations removed
    assert (meta.schema_version, meta.epoch, meta.world_size_at_save) == (SCHEMA_VERSION, 2, 2)
    assert meta.save_reason == "checkpoint" and meta.coverage.uncovered == []
    assert meta.global_step > 0 and meta.sync_round == summary["syncs"]
    assert meta.elche_state["phase"] == summary["phase"]
    assert meta.config["elche.mode"] == "nccl_cadence"
    assert set(torch.load(files["outer"], weights_only=True)) == {"prev", "velocity"}


def test_resume_continues_the_trajectory_and_matches_an_uninterrupted_run(tmp_path, lockstep_bundle):
    """Pins resume: the second half starts at the saved epoch, and 1+1 epochs end on the same
    weights as 2 straight epochs (nccl_sync, homogeneous: each global step's mean gradient, so
    the weights match whatever shares the measured speeds gave each run)."""
    stem = lockstep_bundle
    second, resumed = _run(tmp_path / "b", *LOCKSTEP, "num_epochs=2", f"resume_from={stem}")
    assert second.returncode == 0, second.stdout + second.stderr
    assert [e["epoch"] for e in resumed["epochs"]] == [1]
    straight, full = _run(tmp_path / "c", *LOCKSTEP, "num_epochs=2")
    assert straight.returncode == 0
    a = load_model(tmp_path / "b" / "run" / "checkpoint")
    b = load_model(tmp_path / "c" / "run" / "checkpoint")
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=1e-5), name
    # the step count continues (23 global steps an epoch); the rounds continue from the bundle's
    # (how many windows an epoch takes follows the measured speeds, so only the sum is fixed)
    assert read_meta(tmp_path / "b" / "run" / "checkpoint").global_step == \
        read_meta(tmp_path / "c" / "run" / "checkpoint").global_step == 46
    assert read_meta(tmp_path / "b" / "run" / "checkpoint").sync_round == \
        read_meta(stem).sync_round + resumed["syncs"]
    # the split planner's fit is saved and restored: the resumed run's first epoch plans from
    # both ranks' step costs (a fresh planner has none until a window past its first is timed)
    assert sorted(read_meta(stem).elche_state["shares"]["fit"]["points"]) == ["0", "1"]
    said = [json.loads(line) for line in (tmp_path / "b" / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "step_costs" and e["message"].startswith("epoch 2:") for e in said), said


def test_resume_keeps_the_elche_phase_and_links_the_mlflow_runs(tmp_path, cadence_pair):
    """Pins 'no warm-up re-run': a run that reached Stable resumes for one more epoch;
    restarted from Probe it would end in Warmup after a few reduces, continued it stays Stable
    or beyond; the new MLflow run carries resumed_from_run_id."""
    _, before, db = cadence_pair
    stem = before["checkpoint"]
    saved = read_meta(stem)
    assert saved.elche_state["phase"] in ("stable", "mature"), saved.elche_state["phase"]
    assert saved.mlflow_run_id == before["mlflow_run_id"]
    second, after = _run(tmp_path / "b", *CADENCE, "num_epochs=3", db, f"resume_from={stem}",
                         tracking="mlflow")
    assert second.returncode == 0, second.stdout + second.stderr
    assert after["epochs"][0]["epoch"] == 2
    assert after["phase"] in ("stable", "mature") and after["anchor_trajectory"]
    import mlflow

    run = mlflow.MlflowClient(db.split("=", 1)[1]).get_run(after["mlflow_run_id"])
    assert run.data.tags["resumed_from_run_id"] == before["mlflow_run_id"]


def test_unusable_bundles_exit_2_naming_the_problem(tmp_path, lockstep_bundle):
    """Pins clear errors instead of a traceback or a silent fresh start: corrupt meta, wrong
    world size, wrong seed, newer schema, and a mixed bundle (weights that are not the ones its
    meta records)."""
    saved = Path(lockstep_bundle)
    (tmp_path / "copy").mkdir()
    for part in saved.parent.glob(saved.name + ".*"):  # damaged below: a copy of the shared bundle
        shutil.copy(part, tmp_path / "copy" / part.name)
    stem = str(tmp_path / "copy" / saved.name)
    cases = [("cluster.num_ranks=3", "saved by 2 ranks"), ("seed=7", "seed 0")]
    for override, expected in cases:
        proc, _ = _run(tmp_path / override.replace("=", "_"), *LOCKSTEP, override, f"resume_from={stem}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert expected in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    model = bundle_files(stem, read_meta(stem))["model"]
    pristine = model.read_bytes()
    model.write_bytes(pristine[:-1] + bytes([pristine[-1] ^ 1]))  # one bit of another save
    proc, _ = _run(tmp_path / "mixed", *LOCKSTEP, f"resume_from={stem}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "checksum" in out and "Traceback" not in out, out
    model.write_bytes(pristine)
    meta_file = paths(stem)["meta"]
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(dict(meta, schema_version=99)))
    proc, _ = _run(tmp_path / "newer", *LOCKSTEP, f"resume_from={stem}")
    assert proc.returncode == 2 and "newer" in proc.stdout + proc.stderr
    meta_file.write_text("{ not json")
    proc, _ = _run(tmp_path / "corrupt", *LOCKSTEP, f"resume_from={stem}")
    assert proc.returncode == 2 and "corrupt" in proc.stdout + proc.stderr
    try:
        read_meta(stem)
    except BundleError as exc:
        assert "corrupt" in str(exc)


def test_sigint_saves_a_graceful_bundle(tmp_path):
    """Pins SIGINT: the launcher saves at the next reduce boundary (reason graceful_shutdown),
    marks the summary interrupted, exits 130 and leaves no rank behind."""
    run_dir = tmp_path / "run"
    proc = start_cli("tracking=off", f"hydra.run.dir={run_dir}", *PAIR, "elche=nccl_cadence",
                     "num_epochs=500")
    for line in proc.stdout:
        if line.startswith("epoch 2/"):
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert _live_ranks(run_dir) == []
    meta = read_meta(str(run_dir / "checkpoint"))
    assert meta.save_reason == "graceful_shutdown" and meta.epoch >= 2
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


def test_a_bundle_of_the_unsuffixed_layout_still_resumes(tmp_path, lockstep_bundle):
    """Pins the schema 1 decision end to end: a bundle written before generations (checkpoint.pt,
    checkpoint.optim.rank<k>.pt ..., meta without generation or checksums) resumes, and the
    new run's own bundle uses the generation layout."""
    saved = Path(lockstep_bundle)
    meta = read_meta(lockstep_bundle)
    old = tmp_path / "old"
    old.mkdir()
    prefix = f"{saved.name}.g{meta.generation}."
    for name in meta.files:
        shutil.copy(saved.parent / name, old / name.replace(prefix, f"{saved.name}."))
    raw = json.loads(paths(lockstep_bundle)["meta"].read_text())
    del raw["generation"], raw["files"], raw["meta_sha256"]
    paths(old / saved.name)["meta"].write_text(json.dumps(dict(raw, schema_version=1)))
    assert paths(old / saved.name)["model"].is_file()
    proc, summary = _run(tmp_path / "b", *LOCKSTEP, "num_epochs=2", f"resume_from={old / saved.name}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [e["epoch"] for e in summary["epochs"]] == [1]
    assert read_meta(summary["checkpoint"]).generation >= 1


def test_a_save_path_is_held_by_one_run_and_a_second_is_refused_naming_the_holder(tmp_path):
    """Pins two runs on one save_path: one's prune deleted the other's temp file
    (FileNotFoundError .ckpt.g2.optim.rank1.pt.<pid>.tmp), metas named files that were gone and
    generations went backwards, with no lock and no warning. The save_path is now locked by
    the run writing it; a second run is a config error (exit 2) naming the key and the holder,
    and the lock (and its file) goes when the first run lets go."""
    from flodl_run.config.materialize import ConfigError
    from flodl_run.launch.launcher import _lock_save_path

    save_path = str(tmp_path / "bundles" / "ckpt")
    first = _lock_save_path(save_path, tmp_path / "run_a")
    try:
        with pytest.raises(ConfigError) as refused:
            _lock_save_path(save_path, tmp_path / "run_b")
        assert str(refused.value).count("save_path: is being written by another run "
                                        f"(pid {os.getpid()}, run dir {tmp_path / 'run_a'})") == 1
    finally:
        first.release()
    assert not (tmp_path / "bundles" / ".ckpt.lock").exists()
    _lock_save_path(save_path, tmp_path / "run_b").release()


def test_prune_leaves_a_temp_file_whose_writer_still_runs(tmp_path):
    """Pins: prune deleted every temp file of an older generation, including one another live
    process was writing (its save then failed with FileNotFoundError). A temp file of a live
    writer stays; one whose writer is gone (an interrupted save) is removed with its generation."""
    from flodl_run.contracts.checkpoint import prune

    stem = tmp_path / "ckpt"
    gone = _exited_pid()
    files = {"old": tmp_path / "ckpt.g1.pt", "dead": tmp_path / f".ckpt.g1.optim.pt.{gone}.tmp",
             "live": tmp_path / f".ckpt.g1.optim.rank1.pt.{os.getppid()}.tmp",
             "kept": tmp_path / "ckpt.g2.pt"}
    for path in files.values():
        path.write_bytes(b"x")
    prune(stem, keep=2)
    assert {name for name, path in files.items() if path.exists()} == {"live", "kept"}


def _exited_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
