"""Checkpoint orchestration on the coordinator: which rank writes what and when, the meta it
records, and the trajectory a resume restores. The bundle format itself lives in
`flodl_run.contracts.checkpoint`; what a run does after a save that ends it is the coordinator's.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, NoReturn, Optional, Set, Tuple

import zmq

from flodl_run.averaging.central import CentralAverager
from flodl_run.averaging.frames import as_frame, dtype_names
from flodl_run.config.compose import dotted_items
from flodl_run.contracts import checkpoint
from flodl_run.contracts.checkpoint import (
    BundleMeta,
    Coverage,
    NotWritten,
    load_tensors,
    read_meta,
    save_meta,
)
from flodl_run.contracts.recipe import CallbackFailed
from flodl_run.contracts.summary import CHECKPOINT_FAILED
from flodl_run.contracts.wire import CheckpointSaved, SaveCheckpoint
from flodl_run.control.context import Members, RunContext, Trajectory
from flodl_run.control.modes import easgd_center
from flodl_run.control.runstate import RunAborted
from flodl_run.elche.balancer import ElChe

log = logging.getLogger(__name__)


class Saving:
    """Bundles out (save) and in (restore).

    Owns: the writing of bundle generations (which rank writes the model, which only its
    optimizer, the outer state written here, the meta and the pruning of older generations),
    and the tracked run's id recorded in them (`run_id`).
    Given: the run context (its balance: ElChe's state goes into the meta, a restore seats a
    restored ElChe there; its stop request: a deadline waits for a save); the membership (who
    is alive, the callback rank that writes the model, the save's deadline); the central
    averager whose outer state and EASGD center are kept here (None: the ranks average among
    themselves); and the round book's `trajectory()` (global step and
    round)."""

    def __init__(self, ctx: RunContext, *, members: Members, averager: Optional[CentralAverager],
                 trajectory: Trajectory):
        self.ctx, self.members, self.averager, self._trajectory = ctx, members, averager, trajectory
        self.config, self.world_size = ctx.config, ctx.world_size
        self.balance, self.stop = ctx.balance, ctx.stop
        self.summary, self.observer = ctx.summary, ctx.observer
        self.run_id: Optional[str] = None
        """The tracked run, recorded in bundles so a resume can link to it."""

    @property
    def alive(self) -> Set[int]:
        return self.members.alive

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]:
        """Write a new generation (the callback rank the model and optimizer, every rank its
        own optimizer, the coordinator the outer state), then the meta naming it and its
        checksums; older generations go only after that. A stop deadline waits for the save.
        `epoch` is where a resume starts; `uncovered` what of it the weights do not include."""
        stem = self.config.save_path
        if not stem:
            return None
        with self.stop.while_saving(f"the {reason} save of {stem}"):
            try:  # checkpoint_fn: the epoch the saved weights end with
                hook = (epoch if uncovered else epoch - 1) if reason == "checkpoint" else None
                generation, files = self._write_generation(stem, hook)
            except CallbackFailed as failure:
                self.fail_callback(failure, epoch, uncovered)
            except RunAborted as aborted:
                self._say_what_stays(aborted, stem)
            except NotWritten as exc:
                return self._unwritten(reason, stem, *exc.args)
            except OSError as exc:  # this process could not look for the next generation (EMFILE)
                return self._unwritten(reason, stem, None, f"{type(exc).__name__}: {exc}")
            try:  # the meta is the commit point: after it, this generation is the bundle
                self._write_outer(stem, generation, files)
                save_meta(stem, self._bundle_meta(reason, epoch, uncovered, generation, files))
            except OSError as exc:  # this process's disk: the outer state or the meta
                return self._unwritten(reason, stem, generation, f"{type(exc).__name__}: {exc}")
        checkpoint.prune(stem, generation)
        self.summary.checkpoint = stem
        self.observer.on_event("checkpoint", f"{reason}: {stem} (resume at epoch {epoch + 1})")
        return stem

    @staticmethod
    def _say_what_stays(aborted: RunAborted, stem: str) -> NoReturn:
        """A save cut short (a second stop signal, every rank lost): re-raise, naming the
        bundle `stem` still holds (the generation being written never became current)."""
        raise RunAborted(aborted.status, f"{aborted.reason}; {checkpoint.still_held(stem)}") from None

    def _write_outer(self, stem: str, generation: int, files: Dict[str, str]) -> None:
        """The outer state this process keeps, when there is one, into `generation` (its
        checksum added to `files`)."""
        center = easgd_center(self.averager)
        if self.averager is not None and self.averager.outer.active or center is not None:
            writer = checkpoint.BundleWriter(checkpoint.generation_stem(stem, generation))
            writer.write_outer(dict(self.averager.outer.state_dict(), center=center))
            files.update(writer.files)

    def _unwritten(self, reason: str, stem: str, generation: Optional[int], why: str) -> None:
        """A save the disk refused: an output failure, never the run's end. What was written
        of `generation` goes, the previous generation stays the bundle, and the event says
        so (the run's end line lists it)."""
        checkpoint.discard(stem, generation)
        self.observer.on_event(CHECKPOINT_FAILED, f"{reason}: {checkpoint.unwritten(stem, generation, why)}")
        return None

    def _write_generation(self, stem: str, hook: Optional[int]) -> Tuple[int, Dict[str, str]]:
        """Ranks write a fresh generation's files (the writer then runs checkpoint_fn(hook, model)
        unless `hook` is None); a writer lost meanwhile is replaced by another survivor writing
        yet another generation (half-written ones are pruned later)."""
        while self.alive:
            generation = checkpoint.next_generation(stem)
            data = checkpoint.generation_stem(stem, generation)
            writer = self.members.callback_rank()
            try:
                files = self._ranks_save(data, writer, hook)
            except NotWritten as exc:
                raise NotWritten(generation, *exc.args) from None
            if writer in self.alive:
                return generation, files
        raise RunAborted("failed", f"every rank was lost while saving {stem}")

    def _ranks_save(self, data: str, writer: int, hook: Optional[int] = None) -> Dict[str, str]:
        """Order the save of generation stem `data`; the files the survivors wrote, by name."""
        center = easgd_center(self.averager)
        for rank in sorted(self.alive):
            if rank != writer:  # the others keep their own optimizer state (momentum differs)
                self.ctx.send(rank, SaveCheckpoint(data, write_model=False))
        if center is not None:  # under EASGD the model of record is the center
            self.ctx.send(writer, SaveCheckpoint(data, dtype_names(center), epoch=hook),
                       [as_frame(p) for p in center])
        else:
            self.ctx.send(writer, SaveCheckpoint(data, epoch=hook))
        files: Dict[str, str] = {}
        answered: Set[int] = set()
        refused: List[str] = []  # the ranks whose disk refused their files
        began, late = time.monotonic(), False
        deadline = began + self.members.orders.limit_s("save")
        while not self.alive <= answered:
            saved = self.ctx.next(expect=CheckpointSaved, deadline=deadline)
            if saved is None:  # past the limit: the ranks that did not answer are hung
                late = self.members.overdue("save", self.alive - answered, began) or late
            if saved is None or saved.stem != data:
                continue
            answered.add(saved.rank)
            if saved.error and not saved.disk:
                raise RunAborted("failed", f"rank {saved.rank} could not save {data}: {saved.error}")
            if saved.error:
                refused.append(f"rank {saved.rank}: {saved.error}")
            files.update(saved.files)
        if not late:  # a hang is not a measure of how long a save takes
            self.members.orders.took("save", time.monotonic() - began)
        if refused:  # every rank answered: none writes this generation any more
            raise NotWritten("; ".join(refused))
        return files

    def _bundle_meta(self, reason: str, epoch: int, uncovered: List[List[int]], generation: int,
                     files: Dict[str, str]) -> BundleMeta:
        global_step, round_ = self._trajectory.trajectory()
        return BundleMeta(
            schema_version=checkpoint.SCHEMA_VERSION, epoch=epoch, global_step=global_step,
            sync_round=round_, world_size_at_save=self.world_size, save_reason=reason,
            elche_state=self.balance.export_state(),
            coverage=Coverage.of_run(self.config, epoch, uncovered),
            config=checkpoint.config_record(dotted_items(self.config)),
            mlflow_run_id=self.run_id, generation=generation, files=files)

    def restore(self, stem: str, epoch_batches: int) -> BundleMeta:
        """Continue a bundle's trajectory: ElChe (no warm-up re-run) and the outer state here;
        the caller resumes epoch, step and round from the meta returned."""
        meta = read_meta(stem)
        self.balance.elche = ElChe.from_state(self.config.elche, meta.elche_state,
                                              world_size=self.world_size, epoch_batches=epoch_batches)
        self.balance.elche.rejoin_all()  # a rank the saved run lost is a fresh one now
        self.balance.restore_shares(meta.elche_state)
        outer_file = checkpoint.bundle_files(stem, meta)["outer"]
        if self.averager is not None and outer_file.is_file():
            state = load_tensors(outer_file)
            self.averager.outer.load_state_dict(state)
            if state.get("center") is not None:
                self.averager.center = state["center"]
        self.observer.on_event("resume", f"resuming {stem} at epoch {meta.epoch + 1} "
                                         f"({meta.elche_state.get('phase')}, step {meta.global_step})")
        return meta

    def fail_callback(self, failure: CallbackFailed, epoch: int, uncovered: List[List[int]]) -> NoReturn:
        """A recipe callback raised: save what the ranks hold (resume at `epoch`; no callback
        runs during this save), then end the run failed. A callback of this process has its
        traceback logged here; a rank printed its own."""
        if failure.rank is None:
            log.error("%s", failure.describe().rstrip())
        try:
            stem = self.save_bundle("callback_failed", epoch, uncovered)
            saved = f"saved {stem}" if stem else "not saved (no save_path)"
        except (RunAborted, zmq.ZMQError) as exc:
            saved = f"the save failed: {exc}"
        raise RunAborted("failed", f"{failure}; {saved}")

    def graceful_stop(self, epoch: int, uncovered: List[List[int]]) -> None:
        """SIGINT/SIGTERM at a reduce boundary: save what the consensus holds, then stop."""
        stem = self.save_bundle("graceful_shutdown", epoch, uncovered)
        raise RunAborted("interrupted", f"{self.stop.reason}; saved {stem}" if stem else self.stop.reason)
