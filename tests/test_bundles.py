"""Checkpoint bundles as one unit: generations, checksums, durable renames, and a stop that
waits for a save. Real files and real sockets; no ranks (the end-to-end runs live in
test_checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time

import pytest
import torch
import zmq

from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts import checkpoint
from flodl_run.contracts.checkpoint import (
    BundleMeta,
    Coverage,
    bundle_files,
    check_resume,
    generation_stem,
    load_model,
    next_generation,
    paths,
    prune,
    read_meta,
    save_meta,
    save_tensors,
)
from flodl_run.contracts.wire import Channel, CheckpointSaved, connect_dealer, new_secret
from flodl_run.control.coordinator import Coordinator
from flodl_run.control.runstate import RunAborted


def _meta(generation: int, files: dict) -> BundleMeta:
    return BundleMeta(schema_version=checkpoint.SCHEMA_VERSION, epoch=1, global_step=10, sync_round=2,
                      world_size_at_save=2, save_reason="checkpoint", elche_state={"phase": "probe"},
                      coverage=Coverage(0, 8, 1, 1), config={}, mlflow_run_id=None,
                      generation=generation, files=files)


def _save(stem: str, value: float) -> int:
    """One complete save the way the coordinator makes it: a fresh generation, then the meta."""
    generation = next_generation(stem)
    data = generation_stem(stem, generation)
    files = {}
    for name, state in (("model", {"w": torch.full((3,), value)}), ("optim", {"state": {}})):
        path = paths(data)[name]
        files[path.name] = save_tensors(path, state)
    save_meta(stem, _meta(generation, files))
    prune(stem, generation)
    return generation


def test_an_interrupted_save_leaves_the_previous_bundle_current_and_whole(tmp_path):
    """Rule: a save cut short (new weights written, meta not yet) changes nothing a resume
    sees: the meta still names the previous generation, whose files are intact and verify;
    the next save skips the half-written generation, and completing it removes the rest."""
    stem = str(tmp_path / "checkpoint")
    first = _save(stem, 1.0)
    half = paths(generation_stem(stem, first + 1))
    save_tensors(half["model"], {"w": torch.full((3,), 2.0)})  # the cut: no optim, no meta
    meta = read_meta(stem)
    assert meta.generation == first and check_resume(meta, 2, 0, stem) == []
    assert torch.equal(load_model(stem)["w"], torch.full((3,), 1.0))
    second = _save(stem, 3.0)
    assert second == first + 2  # never rewrites the half-written generation's names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*read_meta(stem).files, "checkpoint.meta.json"])
    assert torch.equal(load_model(stem)["w"], torch.full((3,), 3.0))


def test_a_mixed_or_damaged_bundle_is_refused_naming_the_file_and_what_to_do(tmp_path):
    """Rule: resume checks every file against the checksum its meta records; a file swapped
    for another save's (new weights beside old meta) or truncated is refused, with advice."""
    stem = str(tmp_path / "checkpoint")
    _save(stem, 1.0)
    meta = read_meta(stem)
    model = bundle_files(stem, meta)["model"]
    torch.save({"w": torch.full((3,), 9.0)}, model)  # another save's weights under this name
    problems = check_resume(meta, 2, 0, stem)
    assert len(problems) == 1 and str(model) in problems[0] and "checksum" in problems[0]
    assert "drop resume_from" in problems[0]
    model.unlink()
    assert "missing" in check_resume(meta, 2, 0, stem)[0]


def test_a_schema_1_bundle_still_loads_unverified(tmp_path):
    """Rule (docs/decisions.md): bundles from before generations (unsuffixed files, meta without
    generation or checksums) still resume; their model and optimizer must exist."""
    stem = str(tmp_path / "old")
    torch.save({"w": torch.ones(2)}, paths(stem)["model"])
    raw = json.loads(json.dumps(dataclasses.asdict(_meta(0, {}))))
    del raw["generation"], raw["files"]
    paths(stem)["meta"].write_text(json.dumps(dict(raw, schema_version=1)))
    meta = read_meta(stem)
    assert meta.generation == 0 and bundle_files(stem, meta)["model"] == paths(stem)["model"]
    assert check_resume(meta, 2, 0, stem) == [f"{paths(stem)['optim']} is missing"]
    torch.save({"state": {}}, paths(stem)["optim"])
    assert check_resume(meta, 2, 0, stem) == []
    assert torch.equal(load_model(stem)["w"], torch.ones(2))
    _save(stem, 5.0)  # the first new save replaces the old layout
    assert not paths(stem)["model"].exists() and not paths(stem)["optim"].exists()


def test_every_bundle_file_is_fsynced_before_and_after_its_rename(tmp_path, monkeypatch):
    """Rule: a rename is durable only when the file was fsynced before it and its directory
    after it; both happen for tensors and for the meta."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    save_tensors(tmp_path / "a.pt", {"w": torch.ones(1)})
    save_meta(str(tmp_path / "a"), _meta(1, {}))
    assert events == ["file", "rename", "dir"] * 2


def test_non_finite_weights_are_never_written():
    """Rule: a model holding NaN or inf is refused before any file is touched."""
    with pytest.raises(ValueError, match=r"model\[layer.weight\].*non-finite"):
        checkpoint.require_finite({"layer.weight": torch.tensor([1.0, float("nan")])}, "the model")
    checkpoint.require_finite({"steps": torch.tensor([3]), "w": torch.ones(2)}, "the model")


@pytest.mark.coordinator
def test_a_stop_deadline_never_cuts_a_save_in_half():
    """Rule: SIGTERM/SIGINT past the stop deadline aborts a wait at once, except while a bundle
    is being written: the save's answers are still taken (then the run stops)."""
    secret = new_secret()
    coord = Coordinator(ExperimentConfig(), 2, secret)
    rank = connect_dealer(zmq.Context.instance(), coord.address, secret, linger_ms=0)
    try:
        coord.request_stop("interrupted by SIGTERM")
        coord.stop.deadline = time.monotonic() - 1.0
        Channel(rank, secret).send(CheckpointSaved(0, "stem"))
        coord.stop.saving = "the checkpoint save of stem"
        saved = coord._next(expect=CheckpointSaved)
        assert isinstance(saved, CheckpointSaved) and saved.rank == 0
        coord.stop.saving = None
        with pytest.raises(RunAborted, match="SIGTERM"):
            coord._next(expect=CheckpointSaved)
    finally:
        rank.close()
        coord.channel.socket.close()


def _edited(stem: str, edit) -> None:
    """Edit the meta's JSON as a user would, with or without fixing its own checksum."""
    meta_path = paths(stem)["meta"]
    raw = json.loads(meta_path.read_text())
    edit(raw)
    meta_path.write_text(json.dumps(raw))


@pytest.mark.parametrize("edit,field", [
    (lambda raw: raw.update(epoch=-3), "epoch must be >= 0, got -3"),
    (lambda raw: raw.update(epoch="abc"), "epoch must be an integer, got 'abc'"),
    (lambda raw: raw["coverage"].update(uncovered=[[0, 900, 100]]), "coverage.uncovered.0 must be"),
    (lambda raw: raw.pop("elche_state"), "elche_state is missing"),
    (lambda raw: raw.update(save_reason="because"), "save_reason must be one of"),
    (lambda raw: raw.update(global_step=10**40), "global_step must be at most 9223372036854775807"),
])
def test_a_meta_is_validated_like_a_config_naming_the_field(tmp_path, edit, field):
    """Pins edited metas: `epoch=-3` trained and then raised ZeroDivisionError,
    `epoch='abc'` a TypeError, a stripped elche_state a KeyError, out-of-range uncovered
    ranges gave empty batches, `global_step=10**40` an OverflowError; all exit 1 after the
    ranks started. Now read_meta refuses the meta naming the field and the rule (a
    BundleError: exit 2, before any rank starts), its checksum recomputed or not."""
    stem = str(tmp_path / "checkpoint")
    _save(stem, 1.0)
    _edited(stem, lambda raw: (edit(raw), raw.update(meta_sha256=checkpoint.meta_digest(raw))))
    with pytest.raises(checkpoint.BundleError, match=field.replace("[", r"\[").replace("(", r"\(")):
        read_meta(stem)


def test_a_meta_carries_its_own_checksum(tmp_path):
    """Pins: a meta had no checksum of its own, so a valid-looking edit went unnoticed. save_meta
    records the SHA-256 of the rest of the meta, and read_meta refuses a meta that does not
    match it."""
    stem = str(tmp_path / "checkpoint")
    _save(stem, 1.0)
    assert len(json.loads(paths(stem)["meta"].read_text())["meta_sha256"]) == 64
    _edited(stem, lambda raw: raw.update(global_step=11))
    with pytest.raises(checkpoint.BundleError, match="does not match the checksum it records"):
        read_meta(stem)


def test_a_meta_without_its_checksum_is_refused(tmp_path):
    """Pins: removing `meta_sha256` from a schema 3 meta turned its check off, and an edit
    (`epoch=20`) was accepted. A schema 3 meta always records it: one without is an edited
    meta (exit 2), named as such."""
    stem = str(tmp_path / "checkpoint")
    _save(stem, 1.0)
    _edited(stem, lambda raw: (raw.update(epoch=20), raw["coverage"].update(epoch=20),
                               raw.pop("meta_sha256")))
    with pytest.raises(checkpoint.BundleError, match="meta_sha256 is missing"):
        read_meta(stem)


@pytest.mark.parametrize("key,value,said", [
    ("anchor", -5, "elche_state.anchor must be an integer >= 1, got -5"),
    ("phase", "zzz", "elche_state.phase must be one of probe, "),
    ("alive", [True], "elche_state.alive must be a list of 2 (one per rank), got [True]"),
])
def test_an_elche_state_elche_cannot_take_is_a_resume_problem(key, value, said):
    """Pins: a meta's elche_state with `anchor=-5` (clamped silently to 1), `phase='zzz'` or
    `alive=[True]` for two ranks (carried into the next bundle) was accepted. Each is now a
    resume problem naming the key, the value and the rule (exit 2, before any rank starts)."""
    from flodl_run.config.schema import ElCheConfig
    from flodl_run.elche.balancer import ElChe
    from flodl_run.launch.launcher import LaunchPlan, _trajectory_problems

    state = json.loads(json.dumps(ElChe(ElCheConfig(), 2).export_state()))
    state[key] = value
    meta = dataclasses.replace(_meta(1, {}), elche_state=state)
    problems = _trajectory_problems(ExperimentConfig(num_epochs=3), LaunchPlan(world_size=2, in_process=False,
                                                                         gpus=[]), meta)
    assert len(problems) == 1 and said in problems[0], problems


def test_resuming_at_or_past_num_epochs_says_how_to_extend_the_run(tmp_path):
    """Pins: resuming an epoch-4 bundle with num_epochs=3 "completed" with 0 samples and wrote
    a bundle labelled epoch 3 holding four epochs of training. It is now a resume problem
    (exit 2) that names num_epochs and how to extend the run; an elche_state ElChe cannot
    restore is one too (it was a KeyError after the ranks started)."""
    from flodl_run.launch.launcher import LaunchPlan, _trajectory_problems

    meta = dataclasses.replace(_meta(1, {}), epoch=4, coverage=Coverage(0, 8, 1, 4))
    plan = LaunchPlan(world_size=2, in_process=False, gpus=[])
    problems = _trajectory_problems(ExperimentConfig(num_epochs=3), plan, meta)
    assert problems[0] == ("the bundle has trained 4 epochs and this run ends at num_epochs=3: "
                           "to train on, resume with num_epochs=<larger than 4>")
    assert problems[1] == "elche_state.world_size is missing"


def test_the_end_of_a_run_drops_the_generations_no_meta_names(tmp_path):
    """Pins the tidy-up after the ranks are gone: the generations newer than the meta's (saves
    whose writers were all lost left g2 and g3 beside the bundle) go; the committed one, its
    meta and its checksums stay. With no meta every generation goes (none was committed); a
    meta that cannot be read leaves everything."""
    stem = str(tmp_path / "checkpoint")
    committed = _save(stem, 1.0)
    for generation in (committed + 1, committed + 2):
        save_tensors(paths(generation_stem(stem, generation))["model"], {"w": torch.zeros(3)})
    assert checkpoint.drop_uncommitted(stem) == [committed + 1, committed + 2]
    kept = {f"checkpoint.g{committed}.pt", f"checkpoint.g{committed}.optim.pt", "checkpoint.meta.json"}
    assert {p.name for p in tmp_path.iterdir()} == kept
    assert checkpoint.verify(stem, read_meta(stem)) == []
    meta = tmp_path / "checkpoint.meta.json"
    meta.write_text("{not json")
    assert checkpoint.drop_uncommitted(stem) == [] and len(list(tmp_path.glob("checkpoint.g*"))) == 2
    meta.unlink()
    assert checkpoint.drop_uncommitted(stem) == [committed] and not list(tmp_path.glob("checkpoint.g*"))
