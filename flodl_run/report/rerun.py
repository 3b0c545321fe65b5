"""A sweep rerun into the same `hydra.sweep.dir`: what each job does with what an earlier
attempt left in its directory. A completed run is kept and the job skipped, a stopped or
failed run with a bundle is resumed from it, and anything else is refused (exit 2) rather
than trained over: a rerun after a SIGTERM used to retrain every job and overwrite the
stopped job's bundle without a word.

Owns the reading of the earlier attempt and the decision; the CLI acts on it. Single runs
(`hydra.run.dir`) are not its business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

RUN_FILE = "run.yaml"
"""What the runner writes first into a run dir that passed its config checks: its presence
says an earlier attempt started there (Hydra's `.hydra/` and `cli.log` come before any check)."""


@dataclass(frozen=True)
class Earlier:
    """What an earlier attempt of a sweep job left in the job's directory."""

    status: Optional[str]
    """summary.json's status; None when there is none (a launcher killed outright)."""
    bundle: Optional[str]
    """The stem of its last bundle, when that bundle's meta is on disk."""
    overrides: Optional[List[str]]
    """The overrides it ran with (the sweep's entry for the job), None when unknown."""


@dataclass(frozen=True)
class Step:
    """What the job does: `fresh` (nothing there), `skip`, `resume` (from `bundle`) or
    `refuse` (`why` says what is there and what to do)."""

    action: str
    bundle: Optional[str] = None
    why: str = ""


def read_earlier(run_dir: Path, save_path: Optional[str],
                 overrides: Optional[List[str]]) -> Optional[Earlier]:
    """The earlier attempt in `run_dir`, None when no run started there. Its bundle is the one
    its summary names, else the job's own save_path (a launcher killed before its summary
    still leaves the bundles it saved)."""
    if not (run_dir / RUN_FILE).is_file():
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    status = summary.get("status") if isinstance(summary, dict) else None
    stems = [summary.get("checkpoint") if isinstance(summary, dict) else None,
             save_path or str(run_dir / "checkpoint")]
    bundle = next((str(s) for s in stems if s and Path(f"{s}.meta.json").is_file()), None)
    return Earlier(status=status, bundle=bundle, overrides=overrides)


def next_step(earlier: Optional[Earlier], overrides: Sequence[str], run_dir: Path) -> Step:
    """What a sweep job does in `run_dir` given the earlier attempt there. Overrides are
    compared without a resume of the job's own bundle (a requeue adds one: the same job)."""
    if earlier is None:
        return Step("fresh")
    remove = f"remove {run_dir} to train this job again"
    own = [o for o in overrides if not resumes_itself(o, run_dir)]
    if earlier.overrides is not None and earlier.overrides != own:
        return Step("refuse", why=(
            f"holds a run of other overrides ({' '.join(earlier.overrides) or 'none'}; this job: "
            f"{' '.join(own) or 'none'}): give this sweep its own hydra.sweep.dir, or {remove}"))
    if earlier.status == "completed":
        return Step("skip", why=f"holds this job's completed run: skipped ({remove})")
    ended = f"ended {earlier.status}" if earlier.status else "ended without a summary.json"
    if earlier.bundle is not None:
        return Step("resume", bundle=earlier.bundle,
                    why=f"holds this job's run that {ended}: resuming it from {earlier.bundle}")
    return Step("refuse", why=f"holds this job's run that {ended} with no bundle to resume: {remove}")


def resumes_itself(override: str, run_dir: Path) -> bool:
    """`resume_from=<run_dir>/<stem>`: a job resuming its own bundle (a requeue's override)."""
    key, _, value = override.partition("=")
    return key.lstrip("+") == "resume_from" and Path(value).parent == Path(run_dir)
