"""Checkpoint bundles: one generation of files plus the meta that makes it current.

A save writes `S.g<n>.pt`, `S.g<n>.optim.pt`, `S.g<n>.optim.rank<k>.pt`, `S.g<n>.outer.pt`
(each to a temp file, fsynced, renamed, directory fsynced), then `S.meta.json` last: it names
generation n and the SHA-256 of every file, and its atomic rename is the one step that makes
the new generation current. Only then are older generations removed, so an interrupted save
leaves the previous bundle whole. Bundles of schema 1 (unsuffixed files, no checksums) still
load, unverified. Owns the layout, the writes (`BundleWriter` for a generation's files, which
every writer of a bundle uses: a rank's share, the coordinator's outer state, the solo trainer;
`save_meta` for the keyword-built `BundleMeta` that commits them), the meta schema and the
checks a resume makes before anything trains; who saves when, and which rank writes what, is
the coordinator's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from flodl_run.contracts.savelock import SaveLock, SavePathTaken  # noqa: F401  (re-exported)

SCHEMA_VERSION = 3
"""3: the meta carries its own checksum (`meta_sha256`); 2: generations and file checksums."""
SAVE_REASONS = ("checkpoint", "graceful_shutdown", "max_failure_exceeded", "single_survivor",
                "all_ranks_lost", "reduce_stall", "nonfinite", "callback_failed")
_HASH_CHUNK = 1 << 20
_WHAT_TO_DO = "resume from an intact copy of the bundle, or drop resume_from to start afresh"


class BundleError(Exception):
    """A bundle cannot be resumed from; the message says why (the CLI exits 2)."""


@dataclass
class Coverage:
    """What training the saved weights include: epochs before `epoch` fully; of `epoch`, all but
    the `uncovered` (pass, start, end) ranges of the permutation."""

    seed: int
    batch_size: int
    epoch_splits: int
    epoch: int
    uncovered: List[List[int]] = field(default_factory=list)

    @classmethod
    def of_run(cls, config: Any, epoch: int, uncovered: Sequence[Sequence[int]]) -> "Coverage":
        """A save's coverage under the run's `config` (its seed, batch_size, data.epoch_splits)."""
        return cls(config.seed, config.batch_size, config.data.epoch_splits, epoch,
                   [list(u) for u in uncovered])


def config_record(items: Dict[str, Any]) -> Dict[str, Any]:
    """The run's config as a meta records it: its dotted items, every value as JSON has it."""
    return json.loads(json.dumps(items, default=str))


@dataclass(kw_only=True)
class BundleMeta:
    """What makes a generation the bundle, built by keyword: where a resume starts and what
    the weights cover, the run's config and ElChe state, and the files with their checksums."""

    schema_version: int
    epoch: int
    """The epoch to (re)start at when resuming."""
    global_step: int
    sync_round: int
    world_size_at_save: int
    save_reason: str
    elche_state: Dict[str, Any]
    coverage: Coverage
    config: Dict[str, Any]
    mlflow_run_id: Optional[str] = None
    generation: int = 0
    """Which files are this bundle's: `S.g<generation>.*` (0: schema 1, unsuffixed `S.*`)."""
    files: Dict[str, str] = field(default_factory=dict)
    """File name (in the stem's directory) -> SHA-256 of its bytes, for every file of the
    generation (empty for schema 1 bundles: nothing to verify)."""
    meta_sha256: str = ""
    """SHA-256 of this meta's own JSON without this field (`meta_digest`); empty before schema 3."""


def paths(stem: str | Path) -> Dict[str, Path]:
    """The files named after `stem`. The meta lives at the bundle's stem; the tensors under its
    generation's stem (`generation_stem`)."""
    stem = str(stem)
    return {"model": Path(stem + ".pt"), "optim": Path(stem + ".optim.pt"),
            "outer": Path(stem + ".outer.pt"), "meta": Path(stem + ".meta.json")}


def rank_optim_path(stem: str | Path, rank: int) -> Path:
    """Each rank's own optimizer state (momentum differs per replica); `S.optim.pt` is the
    callback rank's, used when a rank's own file is absent."""
    return Path(f"{stem}.optim.rank{rank}.pt")


def generation_stem(stem: str | Path, generation: int) -> str:
    """Where generation n's tensors live: `S.g<n>` (generation 0: `S` itself, schema 1)."""
    return f"{stem}.g{generation}" if generation else str(stem)


def bundle_files(stem: str | Path, meta: "BundleMeta") -> Dict[str, Path]:
    """The current generation's model, optim and outer files (the meta read from `stem`)."""
    files = paths(generation_stem(stem, meta.generation))
    del files["meta"]
    return files


def rank_optim_file(stem: str | Path, meta: "BundleMeta", rank: int) -> Path:
    """The optimizer state rank `rank` resumes from: its own when saved, else the callback
    rank's."""
    own = rank_optim_path(generation_stem(stem, meta.generation), rank)
    return own if own.is_file() else bundle_files(stem, meta)["optim"]


def load_model(stem: str | Path) -> Dict[str, torch.Tensor]:
    """The consensus model's state dict of the bundle at `stem` (whichever generation is current)."""
    return load_tensors(bundle_files(stem, read_meta(stem))["model"])


def _generations(stem: str | Path) -> Dict[int, List[Path]]:
    """Generation -> the files of that generation found beside `stem` (temp files included)."""
    stem = Path(stem)
    pattern = re.compile(r"\.?" + re.escape(stem.name) + r"\.g(\d+)\.")
    found: Dict[int, List[Path]] = {}
    if stem.parent.is_dir():
        for entry in stem.parent.iterdir():
            match = pattern.match(entry.name)
            if match:
                found.setdefault(int(match.group(1)), []).append(entry)
    return found


def next_generation(stem: str | Path) -> int:
    """A generation no file beside `stem` uses yet (never the current one, nor a half-written
    one left by an interrupted save)."""
    return max(_generations(stem), default=0) + 1


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX: the entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write: Callable[[Path], None]) -> str:
    """Write through a temp file: fsync it, rename it over `path`, fsync the directory. Returns
    the SHA-256 of what was written (read back from the page cache while syncing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                digest.update(chunk)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    return digest.hexdigest()


def save_tensors(path: Path, state: Any) -> str:
    """torch.save, atomically and durably; returns the file's SHA-256. A write the disk refuses
    raises its OSError (ENOSPC, EFBIG)."""
    return _atomic(path, lambda tmp: _torch_save(state, tmp))


def _torch_save(state: Any, tmp: Path) -> None:
    """torch.save through a file of ours: torch's own writer reported a full disk as
    `RuntimeError: ... unexpected pos 1024 vs 918`; through a Python file the OSError behind
    it is at hand."""
    with open(tmp, "wb") as out:
        try:
            torch.save(state, out)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise


class BundleWriter:
    """The files of one generation (`data_stem`, the generation's stem), each written atomically
    with its SHA-256 kept by name in `files`: the one way a bundle's files are written. A rank
    writes its share of a generation, the coordinator its outer state; the coordinator's meta,
    or the solo trainer's, then names every file (`save_meta`, the commit point)."""

    def __init__(self, data_stem: str | Path):
        self.data_stem = str(data_stem)
        self.files: Dict[str, str] = {}
        """File name -> SHA-256, of what this writer wrote."""

    def write_model(self, state: Any) -> None:
        """The model's state dict; non-finite weights are refused (ValueError), never written."""
        require_finite(state, "the model")
        self._write(paths(self.data_stem)["model"], state)

    def write_optimizer(self, state: Any, rank: Optional[int] = None) -> None:
        """The optimizer state: the bundle's (the callback rank's), or rank `rank`'s own."""
        path = paths(self.data_stem)["optim"] if rank is None else rank_optim_path(self.data_stem, rank)
        self._write(path, state)

    def write_outer(self, state: Any) -> None:
        """The outer optimizer's state (and the EASGD center, when there is one)."""
        self._write(paths(self.data_stem)["outer"], state)

    def _write(self, path: Path, state: Any) -> None:
        self.files[path.name] = save_tensors(path, state)


class NotWritten(Exception):
    """A generation's files could not be written (a rank's disk, full or over a size limit)."""


def discard(stem: str | Path, generation: Optional[int]) -> None:
    """Remove what a failed save wrote of `generation` (the meta never named it): the space
    goes back to the next save. Best effort: what stays (no descriptor left to list the
    directory) goes with the next save's prune."""
    if generation is None:
        return
    try:
        for path in _generations(stem).get(generation, []):
            if not _written_by_another_live_process(path):
                path.unlink(missing_ok=True)
    except OSError:
        pass


def drop_uncommitted(stem: str | Path) -> List[int]:
    """Remove the generations newer than the one the meta names (every generation when there is
    no meta): what saves that never committed left, a writer lost mid-save (each loss starts
    another generation) or every rank lost. Call when nothing writes there any more (the run's
    ranks are gone). A meta that cannot be read leaves everything as it is. Returns the
    generations removed."""
    try:
        current = read_meta(stem).generation if paths(stem)["meta"].exists() else 0
    except (BundleError, OSError):
        return []
    try:
        dropped = sorted(g for g in _generations(stem) if g > current)
    except OSError:
        return []
    for generation in dropped:
        discard(stem, generation)
    return dropped


def still_held(stem: str | Path) -> str:
    """What `stem` holds now, for a save that did not happen or was cut short."""
    try:
        meta = read_meta(stem)
    except (BundleError, OSError):
        return f"no bundle at {stem}"
    return (f"{stem} still holds the bundle of generation {meta.generation} ({meta.save_reason}, "
            f"resume at epoch {meta.epoch + 1})")


def unwritten(stem: str | Path, generation: Optional[int], why: str) -> str:
    """What a failed save says: which generation (None: the next, not yet numbered), why, and
    what the bundle still holds."""
    try:
        meta = read_meta(stem)
        kept = (f"the bundle stays intact at generation g{meta.generation} (resume at epoch "
                f"{meta.epoch + 1})")
    except (BundleError, OSError):
        kept = "no earlier bundle there" if not paths(stem)["meta"].exists() else \
            "the bundle stays as it was"
    which = "the next generation" if generation is None else f"generation g{generation}"
    return f"could not write {which} of {stem} ({why}); {kept}"


def require_finite(state: Any, what: str) -> None:
    """Refuse to save non-finite weights: a bundle never holds NaN or inf (ValueError)."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel() and \
                not bool(torch.isfinite(torch.stack(torch.aminmax(state.reshape(-1)))).all()):
            raise ValueError(f"{what} holds non-finite values (NaN or inf); not saved")
    elif isinstance(state, dict):
        for key, value in state.items():
            require_finite(value, f"{what}[{key}]")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            require_finite(value, f"{what}[{i}]")


def save_meta(stem: str | Path, meta: BundleMeta) -> None:
    """The commit point of a save: after this rename, `meta.generation` is the bundle. The
    meta is written with its own checksum."""
    record = asdict(meta)
    record["meta_sha256"] = meta_digest(record)
    text = json.dumps(record, indent=2, default=str) + "\n"
    _atomic(paths(stem)["meta"], lambda tmp: tmp.write_text(text))


def meta_digest(record: Dict[str, Any]) -> str:
    """SHA-256 of a meta's JSON (keys sorted, `meta_sha256` left out)."""
    rest = {k: v for k, v in record.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()


_TEMP = re.compile(r"\.(\d+)\.tmp$")


def prune(stem: str | Path, keep: int) -> None:
    """Remove every generation but `keep` (older ones, and half-written ones of interrupted
    saves), and schema 1 files, once the meta names `keep`. A temp file whose writer (the pid
    in its name) still runs is not ours to remove: its writer removes or renames it."""
    legacy = [p for k, p in paths(stem).items() if k != "meta"]
    legacy += Path(stem).parent.glob(Path(stem).name + ".optim.rank*.pt")
    doomed = legacy + [f for g, files in _generations(stem).items() if g != keep for f in files
                       if not _written_by_another_live_process(f)]
    for path in doomed:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _written_by_another_live_process(path: Path) -> bool:
    match = _TEMP.search(path.name)
    return match is not None and int(match.group(1)) != os.getpid() and pid_alive(int(match.group(1)))


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (another user's included). A zombie does not: it
    has exited, and only waits for its parent to collect its status. (A launcher killed by
    SIGKILL stays one until its parent reaps it; its ranks took it for alive meanwhile, and one
    that left in that window, on its broken output pipe, left what its recipe started.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process holds that pid
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone meanwhile; or no /proc here, as on macOS
    except (OSError, IndexError):
        return True  # unreadable: kill(0) is all we know


def load_tensors(path: Path) -> Any:
    """torch.load(weights_only=True): a bundle never runs code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except Exception as exc:  # truncated, corrupt, or not a weights-only file
        raise BundleError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def read_meta(stem: str | Path) -> BundleMeta:
    path = paths(stem)["meta"]
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: corrupt ({exc})") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise BundleError(f"{path}: schema_version {version!r} is newer than this flodl_run "
                          f"reads ({SCHEMA_VERSION})")
    if version >= 3 and not raw.get("meta_sha256"):  # removing it used to turn the check off
        raise BundleError(f"{path}: meta_sha256 is missing: a schema 3 meta records its own "
                          f"checksum; an edited meta ({_WHAT_TO_DO})")
    if raw.get("meta_sha256") and raw["meta_sha256"] != meta_digest(raw):
        raise BundleError(f"{path}: does not match the checksum it records (meta_sha256): an "
                          f"edited or damaged meta ({_WHAT_TO_DO})")
    problems = meta_problems(raw)
    if problems:
        raise BundleError(f"{path}: " + "; ".join(problems))
    raw["coverage"] = Coverage(**raw["coverage"])
    return BundleMeta(**raw)


_COUNTS = {"epoch": 0, "global_step": 0, "sync_round": 0, "world_size_at_save": 1, "generation": 0}
_COVERAGE_COUNTS = {"seed": None, "batch_size": 1, "epoch_splits": 1, "epoch": 0}
_TABLES = ("elche_state", "config", "files")


def meta_problems(raw: Dict[str, Any]) -> List[str]:
    """What is wrong with a meta's fields, each naming the field, its value and the rule (as a
    config's problems do): read before any rank starts, so that an edited meta is a bad
    bundle (exit 2), not an internal error after the ranks started."""
    known = dataclasses.fields(BundleMeta)
    problems = [f"{f.name} is missing" for f in known if f.name not in raw
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    problems += [f"{key} is not a field of a bundle meta"
                 for key in sorted(set(raw) - {f.name for f in known})]
    for key, low in _COUNTS.items():
        problems += _count_problems(key, raw.get(key, 0), low)
    if raw.get("save_reason") not in SAVE_REASONS:
        problems.append(f"save_reason must be one of {', '.join(SAVE_REASONS)}, "
                        f"got {raw.get('save_reason')!r}")
    problems += [f"{key} must be a mapping, got {raw[key]!r}" for key in _TABLES
                 if key in raw and not isinstance(raw[key], dict)]
    if isinstance(raw.get("files"), dict):
        problems += [f"files.{name} must be a SHA-256 (64 hex digits), got {digest!r}"
                     for name, digest in raw["files"].items() if not _is_sha256(digest)]
    coverage = raw.get("coverage")
    if not isinstance(coverage, dict):
        return problems + [f"coverage must be a mapping, got {coverage!r}"]
    for key, low in _COVERAGE_COUNTS.items():
        problems += _count_problems(f"coverage.{key}", coverage.get(key), low)
    if coverage.get("epoch") != raw.get("epoch"):
        problems.append(f"coverage.epoch must equal epoch ({raw.get('epoch')!r}), "
                        f"got {coverage.get('epoch')!r}")
    return problems + _uncovered_problems(coverage.get("uncovered", []))


MAX_COUNT = 2**63 - 1  # torch's int64: `global_step=10**40` raised OverflowError, exit 1


def _count_problems(key: str, value: Any, low: Optional[int]) -> List[str]:
    if not isinstance(value, int) or isinstance(value, bool):
        return [f"{key} must be an integer, got {value!r}"]
    if abs(value) > MAX_COUNT:
        return [f"{key} must be at most {MAX_COUNT} in size, got {value}"]
    return [f"{key} must be >= {low}, got {value}"] if low is not None and value < low else []


def _uncovered_problems(uncovered: Any) -> List[str]:
    """coverage.uncovered: [pass, start, end] ranges of the permutation, start < end."""
    if not isinstance(uncovered, list):
        return [f"coverage.uncovered must be a list of [pass, start, end], got {uncovered!r}"]
    problems = []
    for i, span in enumerate(uncovered):
        ok = isinstance(span, list) and len(span) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in span)
        if not ok or span[1] >= span[2]:
            problems.append(f"coverage.uncovered.{i} must be [pass, start, end] with integers "
                            f">= 0 and start < end, got {span!r}")
    return problems


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(stem: str | Path, meta: BundleMeta) -> List[str]:
    """Every file the meta names exists with the recorded checksum, and model and optimizer
    are among them: a mixed or damaged bundle is refused, never half-loaded."""
    if meta.generation == 0:  # schema 1: nothing recorded to check against
        return []
    directory = Path(stem).parent
    files = bundle_files(stem, meta)
    problems = [f"{files[k]} is not part of the bundle its meta names"
                for k in ("model", "optim") if files[k].name not in meta.files]
    for name, expected in sorted(meta.files.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing ({_WHAT_TO_DO})")
        elif sha256_of(path) != expected:
            problems.append(f"{path} does not match the checksum its meta records: a damaged or "
                            f"mixed bundle ({_WHAT_TO_DO})")
    return problems


def check_resume(meta: BundleMeta, world_size: Optional[int], seed: int, stem: str) -> List[str]:
    """Reasons this run cannot continue the bundle (empty when it can)."""
    problems = []
    if world_size is not None and world_size != meta.world_size_at_save:
        problems.append(f"the bundle was saved by {meta.world_size_at_save} ranks, this run has "
                        f"{world_size}")
    if seed != meta.coverage.seed:
        problems.append(f"the bundle was trained with seed {meta.coverage.seed}, this run has {seed}")
    if meta.generation == 0:
        files = bundle_files(stem, meta)
        problems += [f"{files[name]} is missing" for name in ("model", "optim")
                     if not files[name].is_file()]
    else:
        problems += verify(stem, meta)
    return problems
