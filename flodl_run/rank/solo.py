"""In-process training on one device: the path of `cluster=solo` and of hosts with 0-1 GPU.

Owns the epoch loop of a single replica (permutation per pass, batches, eval cadence, epoch
records, the recipe's callbacks at the moments a run of ranks calls them), and its bundle:
written when the run completes and every `checkpoint_every` epochs, read back by
`resume_from`. It reports through an Observer and never prints (a raising callback is logged).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Generator, Iterator, List, Optional, Tuple

import torch

from flodl_run.config.compose import dotted_items
from flodl_run.config.schema import ExperimentConfig
from flodl_run.config.validate import batch_size_warning
from flodl_run.contracts import checkpoint
from flodl_run.contracts.recipe import CallbackFailed, Recipe
from flodl_run.contracts.scalars import drain, roll_up
from flodl_run.contracts.summary import CHECKPOINT_FAILED, EpochRecord, Summary
from flodl_run.data.dataplane import DataPlane
from flodl_run.data.passes import num_batches, permutation
from flodl_run.hardware.devices import cpu_training_warning
from flodl_run.hardware.slowdown import slowdown_for
from flodl_run.observe.observer import Observer
from flodl_run.rank.replica import Replica
from flodl_run.rank.worker import Loss, Worker, run_loop

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """A stop request was seen between two batches: `trained` samples of `epoch` are in."""

    def __init__(self, epoch: int, trained: int):
        super().__init__(f"stopped in epoch {epoch}")
        self.epoch, self.trained = epoch, trained


@dataclass
class TrainResult:
    """What a finished (or stopped) run hands back: the trained model and its summary."""

    model: torch.nn.Module
    summary: Summary


def resolve_device(spec: str) -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


class SoloTrainer:
    """One replica trained over the whole data set, epoch by epoch."""

    def __init__(self, config: ExperimentConfig, recipe: Recipe,
                 observer: Optional[Observer] = None):
        self.config = config
        self.recipe = recipe
        self.observer = observer or Observer()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cluster.threads_per_rank:
            torch.set_num_threads(config.cluster.threads_per_rank)
        # the bench's solo runs at each rank's speed
        self.slowdown = slowdown_for(config.cluster.emulate_slowdown,
                                     config.cluster.emulate_jitter, 0, config.seed)
        self.replica = Replica(recipe, self.device, config.seed, max_grad_norm=config.max_grad_norm,
                               options=config.recipe)
        count = sum(p.numel() for p in self.replica.model.parameters())
        warning = cpu_training_warning(recipe.name, count) if self.device.type == "cpu" else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.train_source = DataPlane(recipe.call("train_dataset"), self.device, config,
                                      recipe.transform)
        warning = batch_size_warning(len(self.train_source), config, 1)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.eval_data = recipe.call("eval_dataset") if recipe.has_eval else None
        self.summary = Summary(mode="solo", outer="none", world_size=1,
                               devices=[device_name(self.device)])
        self.mlflow_run_id: Optional[str] = None
        """The tracked run, recorded in the bundle so a resume can link to it."""
        self._epoch_s = 0.0  # the epochs' time, evals included (what samples_per_s divides by)
        self._trained = 0  # epochs whose training the replica holds: where a resume starts
        self._samples = 0
        self._reported: Optional[Loss] = None  # what the loop reported for the batch in hand
        self.stop_reason: Optional[str] = None  # a SIGINT/SIGTERM asked to stop (request_stop)
        self.closing: Optional[str] = None
        """What the trainer is in while the replica holds the `_trained` epochs whole and no
        batch is in hand (`the eval of epoch 3`, `the close of epoch 3`, `the final eval`)."""
        self.at_once: Optional[str] = None  # what a stop at once saved (stop_at_once)
        self.let_go: Optional[str] = None  # why the stop's grace let the trainer's close go
        self._open_record: Optional[EpochRecord] = None  # an epoch in its eval: not yet recorded
        self._saving = False
        self._resume_epoch = -1  # where resume_from starts ...
        self._resume_uncovered: List[List[int]] = []  # ... and what of that epoch it trains

    @property
    def total_epochs(self) -> int:
        return self.config.num_epochs * self.config.data.epoch_splits

    def request_stop(self, reason: str) -> None:
        """Stop after the batch in hand and save what the replica trained, the rest of the
        epoch listed uncovered (a signal handler calls this; a second signal calls
        `stop_at_once`, then raises KeyboardInterrupt)."""
        self.stop_reason = reason

    def stop_at_once(self) -> None:
        """Before the run ends at once (a second signal, or an epoch's close that outlasted the
        stop's grace; the caller raises KeyboardInterrupt next, in this thread): in an epoch's
        close (its eval, its callbacks, the final eval) the replica holds the epochs trained
        whole, so they are saved first, that epoch recorded without its eval. An in-process
        eval that hung used to save nothing. In a batch, or in a save, nothing is saved."""
        where = self.closing
        if where is None or self._saving:
            return
        if self._open_record is not None:
            self.summary.epochs.append(self._open_record)
            self._open_record = None
        saved = self._save_bundle("graceful_shutdown", self._trained)
        said = f"saved {self.summary.checkpoint}" if saved else \
            "not saved (the disk refused it)" if self.config.save_path else "not saved (no save_path)"
        self.at_once = f"in {where}: {said}"

    def run(self) -> TrainResult:
        """Train every epoch, then the final eval. A stop request saves what was trained and
        marks the summary interrupted; Ctrl-C (KeyboardInterrupt) marks it interrupted and
        re-raises; a recipe callback that raises ends the run failed, with a bundle."""
        start = time.perf_counter()
        first = self._restore() if self.config.resume_from else 0
        self.observer.on_start(self.total_epochs, self._whole_batches(0), 1)
        if self.config.resume_from:  # the resumed epoch's progress counts on from the bundle's
            self.observer.on_resume(first, self._batches_before(first))
        self._trained = first
        try:
            try:
                self._run_loop(first)
                self.summary.final_eval = self._final_eval()
                self.summary.status = "completed"
            except _Stopped as stopped:
                self._graceful_stop(stopped)
        except KeyboardInterrupt:  # a second signal (or one outside the launcher's handler)
            self.summary.status = "interrupted"
            reason = f"{self.stop_reason}; {self.let_go}" if self.let_go else self.stop_reason
            self.summary.message = (f"{reason} (stopped at once {self.at_once})" if self.at_once
                                    else f"{self.stop_reason} (stopped at once: not saved)"
                                    if self.stop_reason else "stopped by SIGINT")
            raise
        except CallbackFailed as failure:
            self._fail_callback(failure, self._trained)
        finally:
            self._finish(time.perf_counter() - start)
        if self.summary.status == "completed":
            try:  # outside wall_s, as before bundles
                self._save_bundle("checkpoint", self.total_epochs)
            except CallbackFailed as failure:
                self._fail_callback(failure, self.total_epochs)
        return TrainResult(self.replica.model, self.summary)

    def _run_loop(self, first: int) -> None:
        """The recipe's loop (or the built-in one) over every epoch's batches; epochs close
        (eval, callbacks, checkpoints) between two batches, as on a rank."""
        worker = Worker(self.replica, lambda: self._epochs(first), self._report, 0, 1)
        run_loop(self.recipe, worker)
        if self._trained < self.total_epochs:
            raise RuntimeError("the recipe's loop returned before worker.batches() ended "
                               "(a loop must consume every batch of the run)")

    def _report(self, loss: Loss) -> None:
        self._reported = loss if self._reported is None else self._reported + loss

    def _epochs(self, first: int) -> Iterator[Any]:
        for epoch in range(first, self.total_epochs):
            record = yield from self._train_epoch(epoch)
            self.summary.epochs.append(record)
            self._open_record, self.closing = None, f"the close of epoch {epoch + 1}"
            self._close_epoch(record)

    def _close_epoch(self, record: EpochRecord) -> None:
        """After the epoch's eval, in a multi-rank run's order: epoch_fn, the observers,
        eval_result_fn and metrics_fn, then checkpoint_every (and checkpoint_fn)."""
        self.recipe.run_callback("epoch_fn", record.epoch, self.replica.model)
        self.observer.on_epoch(record)
        self.recipe.report_epoch(record)
        self._maybe_checkpoint(record.epoch + 1)

    def _fail_callback(self, failure: CallbackFailed, epoch: int) -> None:
        """A recipe callback raised: log its traceback once, save the replica (resume at
        `epoch`; no callback runs during this save) and mark the run failed."""
        log.error("%s", failure.describe().rstrip())
        self.summary.status = "failed"
        try:
            written = self._save_bundle("callback_failed", epoch)
            saved = f"saved {self.summary.checkpoint}" if written else \
                "not saved (the disk refused it)" if self.config.save_path else "not saved (no save_path)"
        except Exception as exc:  # a non-finite replica is refused: the earlier bundle stays
            saved = f"the save failed: {type(exc).__name__}: {exc}"
        self.summary.message = f"{failure}; {saved}"

    def _graceful_stop(self, stopped: _Stopped) -> None:
        """Save what the replica trained (resume at the stopped epoch, its untrained positions
        listed; at the next epoch when none is left) and mark the run interrupted."""
        pass_index, ranges = self._epoch_ranges(stopped.epoch)
        uncovered, skip = [], stopped.trained
        for start, end in ranges:  # the epoch's positions were trained in this order
            done = min(skip, end - start)
            skip -= done
            if start + done < end:
                uncovered.append([pass_index, start + done, end])
        epoch = stopped.epoch if uncovered else stopped.epoch + 1
        saved = self._save_bundle("graceful_shutdown", epoch, uncovered, trained=stopped.trained)
        said = ""
        if self.config.save_path:
            said = f"; saved {self.summary.checkpoint}" if saved else "; not saved (the disk refused it)"
        self.summary.status, self.summary.message = "interrupted", f"{self.stop_reason}{said}"

    def _epoch_ranges(self, epoch: int) -> Tuple[int, List[Tuple[int, int]]]:
        """The pass epoch `epoch` belongs to and the positions of its permutation it covers
        (epoch_splits cuts a pass into slices); a resumed epoch only what its bundle left
        uncovered."""
        splits = self.config.data.epoch_splits
        whole = self._whole_range(epoch)
        if epoch == self._resume_epoch and self._resume_uncovered:
            for i, (_, start, end) in enumerate(self._resume_uncovered):
                if start < whole[0] or end > whole[1]:
                    raise ValueError(f"resume_from: coverage.uncovered.{i} {self._resume_uncovered[i]} "
                                     f"is not within epoch {epoch} (samples {whole[0]}-{whole[1]}): "
                                     "an edited or damaged bundle")
            return epoch // splits, [(start, end) for _, start, end in self._resume_uncovered]
        return epoch // splits, [whole]

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        """The samples of epoch `epoch`, in the order they are trained."""
        pass_index, ranges = self._epoch_ranges(epoch)
        n = len(self.train_source) * self.config.data.augment
        order = permutation(n, self.config.seed, pass_index) % len(self.train_source)
        return torch.cat([order[start:end] for start, end in ranges])

    def _batches_in_epoch(self, epoch: int) -> int:
        return num_batches(len(self._epoch_indices(epoch)), self.config.batch_size)

    def _whole_range(self, epoch: int) -> Tuple[int, int]:
        """The positions of its pass's permutation epoch `epoch` covers whole (epoch_splits
        cuts a pass into slices)."""
        splits = self.config.data.epoch_splits
        n = len(self.train_source) * self.config.data.augment
        part = epoch % splits
        return part * n // splits, (part + 1) * n // splits

    def _whole_batches(self, epoch: int) -> int:
        """The batches of epoch `epoch` whole (a resumed one's included)."""
        start, end = self._whole_range(epoch)
        return num_batches(end - start, self.config.batch_size)

    def _batches_before(self, epoch: int) -> int:
        """The batches of `epoch` a resumed bundle holds (none unless it resumes that epoch
        in part)."""
        if epoch != self._resume_epoch or not self._resume_uncovered:
            return 0
        return max(0, self._whole_batches(epoch) - self._batches_in_epoch(epoch))

    def _train_epoch(self, epoch: int) -> Generator[Any, None, EpochRecord]:
        """Hand the loop each batch of the epoch; returns the epoch's record."""
        indices = self._epoch_indices(epoch)
        losses = _LossReader(self.observer, epoch, self._batches_before(epoch))
        began = time.perf_counter()
        trained, total, batch_size = 0, indices.shape[0], self.config.batch_size
        # what runs between two steps is host time a small model's step feels: kept to a minimum
        slowdown = self.slowdown if self.slowdown.active else None
        self.closing = None  # from here a batch may be in hand
        for batch in self.train_source.batches(indices, batch_size, epoch=epoch):
            step_began = time.perf_counter()
            self._reported = None
            yield batch
            if self._reported is not None:
                losses.add(self._reported)
            if slowdown is not None:
                slowdown.after_step(step_began, self.device)
            trained = min(trained + batch_size, total)
            if self.stop_reason is not None:  # between two batches: the replica is whole
                raise _Stopped(epoch, trained)
        losses.flush()
        self._trained = epoch + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host clock only after the queued work is done
        compute_s = time.perf_counter() - began
        self._samples += len(indices)
        record = EpochRecord(  # without its eval until the eval returns (a stop may not wait)
            epoch=epoch,
            avg_loss=losses.mean,
            eval=None,
            epoch_ms=compute_s * 1000.0,
            per_rank_throughput=[len(indices) / compute_s if compute_s > 0 else 0.0],
            per_rank_batch_share=[1.0],
            samples=len(indices),
            scalars=roll_up(drain(), self.config.scalar_reductions),
            **self.train_source.stats.take_epoch(),
        )
        self._open_record, self.closing = record, f"the eval of epoch {epoch + 1}"
        eval_began = time.perf_counter()
        record.eval = self._maybe_eval(epoch)  # timed into epoch_ms, as a distributed epoch's eval is
        record.eval_ms = (time.perf_counter() - eval_began) * 1000.0
        record.epoch_ms += record.eval_ms
        self._epoch_s += compute_s + record.eval_ms / 1000.0
        return record

    def _maybe_eval(self, epoch: int) -> Optional[float]:
        every = self.config.eval_every_epochs
        if self.eval_data is None or every is None or (epoch + 1) % every:
            return None
        return self.replica.evaluate(self.eval_data)

    def _final_eval(self) -> Optional[float]:
        if self.eval_data is None:
            return None
        last = self.summary.epochs[-1].eval if self.summary.epochs else None
        if last is not None:
            return last
        self.closing = "the final eval"
        score = self.replica.evaluate(self.eval_data)
        if self.summary.epochs:
            self.recipe.run_callback("eval_result_fn", self.summary.epochs[-1].epoch, score)
        return score

    def _finish(self, wall_s: float) -> None:
        self.summary.wall_s = wall_s
        self.summary.samples_per_s = self._samples / self._epoch_s if self._epoch_s else 0.0

    def _maybe_checkpoint(self, epochs_done: int) -> None:
        """`checkpoint_every`: a bundle every n epochs (the last one is saved by run())."""
        every = self.config.checkpoint_every
        if every and epochs_done % every == 0 and epochs_done < self.total_epochs:
            self._save_bundle("checkpoint", epochs_done)

    def _save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]] = (),
                     trained: int = 0) -> bool:
        """The bundle a multi-rank run writes, for a world of one: model, optimizer (also as
        rank 0's own), meta. `epoch` is where a resume starts, `uncovered` what of it the
        weights do not include (none listed: all of it), `trained` its samples they do. A disk
        that refuses the files is said (CHECKPOINT_FAILED) and the run goes on: False, the
        previous generation stays the bundle, what was written of this one is removed."""
        stem = self.config.save_path
        if not stem:
            return False
        generation: Optional[int] = None
        self._saving = True  # a stop at once does not save over it
        try:
            generation = checkpoint.next_generation(stem)
            self._write_generation(stem, generation, reason, epoch, uncovered, trained)
        except OSError as exc:
            checkpoint.discard(stem, generation)
            why = f"{type(exc).__name__}: {exc}"
            self.observer.on_event(CHECKPOINT_FAILED,
                                   f"{reason}: {checkpoint.unwritten(stem, generation, why)}")
            return False
        finally:
            self._saving = False
        checkpoint.prune(stem, generation)
        self.summary.checkpoint = stem
        self.observer.on_event("checkpoint", f"{reason}: {stem} (resume at epoch {epoch + 1})")
        if reason == "checkpoint" and epoch > 0:  # the epoch the saved weights end with
            self.recipe.run_callback("checkpoint_fn", epoch - 1, self.replica.model)
        return True

    def _write_generation(self, stem: str, generation: int, reason: str, epoch: int,
                          uncovered: List[List[int]], trained: int) -> None:
        """Generation `generation`'s files, then the meta that makes it the bundle."""
        writer = checkpoint.BundleWriter(checkpoint.generation_stem(stem, generation))
        writer.write_model(self.replica.module.state_dict())  # a NaN replica never replaces a finite bundle
        optim = self.replica.optimizer.state_dict()  # device tensors load anywhere: map_location
        writer.write_optimizer(optim)
        writer.write_optimizer(optim, rank=0)
        steps = sum(self._batches_in_epoch(e) for e in range(epoch))
        steps += num_batches(trained, self.config.batch_size)
        meta = checkpoint.BundleMeta(
            schema_version=checkpoint.SCHEMA_VERSION, epoch=epoch, global_step=steps, sync_round=0,
            world_size_at_save=1, save_reason=reason, elche_state={},
            coverage=checkpoint.Coverage.of_run(self.config, epoch, uncovered),
            config=checkpoint.config_record(dotted_items(self.config)),
            mlflow_run_id=self.mlflow_run_id, generation=generation, files=writer.files)
        checkpoint.save_meta(stem, meta)  # the atomic step: this generation is now the bundle

    def _restore(self) -> int:
        """Load `resume_from`'s model and optimizer; returns the epoch to start at."""
        stem = self.config.resume_from
        meta = checkpoint.read_meta(stem)
        files = checkpoint.bundle_files(stem, meta)
        self.replica.module.load_state_dict(checkpoint.load_tensors(files["model"]))
        self.replica.optimizer.load_state_dict(checkpoint.load_tensors(files["optim"]))
        self.observer.on_event("resume", f"resuming {stem} at epoch {meta.epoch + 1}")
        self._resume_epoch, self._resume_uncovered = meta.epoch, meta.coverage.uncovered
        return meta.epoch


class _LossReader:
    """Keeps the epoch's losses on the device and reads them in batches: reading a loss waits
    for the GPU, so once per READ_EVERY batches (and at the epoch's end) keeps the host ahead.
    The losses in hand are summed when read (one stack and one sum), not as each arrives: an
    add per batch is one more launch on a small model's step."""

    READ_EVERY = 50

    def __init__(self, observer: Observer, epoch: int, before: int = 0):
        self.observer, self.epoch = observer, epoch
        self.before = before  # batches of the epoch a resumed bundle holds: progress counts on
        self.pending: List[Loss] = []
        self.count = 0
        self.total = 0.0

    def add(self, loss: Loss) -> None:
        self.pending.append(loss)
        if len(self.pending) == self.READ_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        tensors = [x for x in self.pending if isinstance(x, torch.Tensor)]
        chunk = sum(float(x) for x in self.pending if not isinstance(x, torch.Tensor))
        if tensors:
            chunk += float(torch.stack([t.reshape(()).float() for t in tensors]).sum())
        self.total += chunk
        self.count += len(self.pending)
        self.observer.on_batch(self.epoch, self.before + self.count, chunk / len(self.pending))
        self.pending = []

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def train_solo(config: ExperimentConfig, recipe: Recipe,
               observer: Optional[Observer] = None) -> TrainResult:
    return SoloTrainer(config, recipe, observer).run()


