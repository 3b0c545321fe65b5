"""A sim sweep's comparison (`python -m flodl_run.sim -m elche=a,b ...`): one row per job, its
overrides and its summary (samples/s, x ideal, reduces to settle, mean idle), written as
comparison.md and comparison.csv in the sweep dir when the sweep ends.

Owns only that table. `SimSweepCallback` is named in conf/sim.yaml; Hydra calls its methods by
name, so this module does not import Hydra. Outside a sweep it does nothing.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rich.console import Console

from flodl_run.report.sweep import UnusedHooks, job_entry

COLUMNS = (("job", "job"), ("overrides", "overrides"), ("samples/s", "samples_per_s"),
           ("x ideal", "ratio_to_ideal"), ("reduces to settle", "reduces_to_settle"),
           ("mean idle", "mean_idle"))


def job_row(num: int, overrides: List[str], run_dir: Path) -> Dict[str, Any]:
    """One job's row: its summary from sim.json (blank figures when it wrote none)."""
    row: Dict[str, Any] = {"job": num, "overrides": " ".join(overrides)}
    try:
        summary = json.loads((run_dir / "sim.json").read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return row
    idle = summary.get("idle_fraction") or []
    row.update({k: summary.get(k) for k in ("samples_per_s", "ratio_to_ideal", "reduces_to_settle")})
    row["mean_idle"] = statistics.fmean(idle) if idle else None
    return row


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def to_markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_shown(r.get(k)) for _, k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: List[Dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([k for _, k in COLUMNS])
    writer.writerows([[r.get(k) for _, k in COLUMNS] for r in rows])
    return out.getvalue()


class SimSweepCallback(UnusedHooks):
    """Hydra callback (`hydra.callbacks.sweep` in conf/sim.yaml): collects the jobs of a sweep
    and writes their comparison at its end; in single runs it does nothing."""

    def __init__(self) -> None:
        self.dir: Optional[Path] = None
        self.jobs: List[Tuple[int, List[str], Path]] = []

    def on_multirun_start(self, config: Any, **_: Any) -> None:
        self.dir, self.jobs = Path(str(config.hydra.sweep.dir)).resolve(), []

    def on_job_start(self, config: Any, **_: Any) -> None:
        if self.dir is not None:
            self.jobs.append(job_entry(config))

    def on_multirun_end(self, config: Any, **_: Any) -> None:
        if self.dir is None:
            return
        rows = [job_row(*job) for job in self.jobs]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "comparison.md").write_text(to_markdown(rows))
        (self.dir / "comparison.csv").write_text(to_csv(rows))
        # printed, not logged: after the jobs, Hydra's own log handler would print it again
        Console().print(f"sweep: wrote {self.dir}/: comparison.md, comparison.csv", markup=False,
                        highlight=False, soft_wrap=True)
