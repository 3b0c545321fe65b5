"""`python -m flodl_run.sim.measured RUN_DIR...`: the sim's rig numbers from real runs.

Owns reading a run dir into what `sim.` needs: each rank's ms per batch (summary.json's last
epoch throughput and run.yaml's batch size), the reduce's wall (summary.json's avg_sync_ms)
and, when the run recorded `timeline=true`, each rank's window noise (the relative std of its
per-window ms per batch). It trains nothing and changes no file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# The first window carries one-time costs (allocations, kernel selection): not noise.
SKIP_WINDOWS = 1


@dataclass(frozen=True)
class Measured:
    """What one run says about its rig."""

    run_dir: str
    ms_per_batch: List[float]
    """Per rank: batch_size x 1000 / samples per s of the last epoch."""
    sync_ms: float
    """Mean wall of one reduce (0 for a solo run)."""
    noise: Optional[List[float]]
    """Per rank: std / mean of its per-window ms per batch; None without a timeline."""


def ms_per_batch(summary: dict, batch_size: int) -> List[float]:
    """Each rank's ms per batch in the run's last epoch (the first carries the warm-up)."""
    return [batch_size * 1000.0 / rate for rate in summary["epochs"][-1]["per_rank_throughput"]]


def window_noise(events: Sequence[dict]) -> List[float]:
    """Per rank (trace process 1, 2, ...): std / mean over windows of the window's ms per
    batch, its first batch (the fill) left out. Window totals are exact on a GPU (steps are host
    time), so each window's steps are summed, not read one by one."""
    ends: Dict[int, List[float]] = {}
    steps: Dict[int, List[dict]] = {}
    for e in events:
        if e.get("name") == "window_end":
            ends.setdefault(e["pid"], []).append(e["ts"])
        elif e.get("name") == "step":
            steps.setdefault(e["pid"], []).append(e)
    return [_spread(_window_ms(steps[pid], sorted(ends.get(pid, []))))
            for pid in sorted(steps) if pid > 0]


def _window_ms(steps: List[dict], ends: List[float]) -> List[float]:
    windows: List[List[float]] = [[] for _ in range(len(ends) + 1)]
    for s in sorted(steps, key=lambda s: s["ts"]):
        windows[sum(1 for t in ends if t <= s["ts"])].append(s["dur"] / 1000.0)
    return [sum(w[1:]) / (len(w) - 1) for w in windows[SKIP_WINDOWS:] if len(w) >= 2]


def _spread(values: List[float]) -> float:
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) / statistics.fmean(values)


def measure(run_dir: Path) -> Measured:
    """Read one run dir (summary.json, run.yaml, timeline.json when present)."""
    from omegaconf import OmegaConf

    summary = json.loads((run_dir / "summary.json").read_text())
    batch_size = int(OmegaConf.load(run_dir / "run.yaml").batch_size)
    timeline = run_dir / "timeline.json"
    noise = None
    if timeline.exists():
        noise = window_noise(json.loads(timeline.read_text())["traceEvents"])
    return Measured(str(run_dir), ms_per_batch(summary, batch_size),
                    float(summary.get("avg_sync_ms") or 0.0), noise)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print one line per run dir: ms per batch per rank, reduce ms, window noise per rank."""
    parser = argparse.ArgumentParser(prog="python -m flodl_run.sim.measured",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        m = measure(run_dir)
        noise = "-" if m.noise is None else " ".join(f"{x:.3f}" for x in m.noise)
        print(f"{m.run_dir}: ms_per_batch {' '.join(f'{x:.2f}' for x in m.ms_per_batch)} | "
              f"sync_ms {m.sync_ms:.2f} | noise {noise}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
