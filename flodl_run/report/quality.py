"""Time to quality: the training seconds at which a run's eval first reached a bar (another
run's final eval, or a declared target), and the ratio of two such times. The bench sets every
entry against torch DDP's final eval; a sweep's comparison against its first job's.

Pure arithmetic over a run's summary.json (as a dict): no files, no layout.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from flodl_run.config.schema import EvalDirection

NOT_REACHED = "not reached"
Point = Tuple[float, float]
"""(training seconds, eval) of one eval of a run."""


def train_axis(summary: Dict[str, Any]) -> List[float]:
    """Seconds of training at the end of each epoch: cumulative epoch time less the eval
    callbacks inside it (`eval_ms`, solo and distributed runs alike), so every run is timed
    alike. Start-up is never included."""
    return [ms / 1000.0 for ms in accumulate(e["epoch_ms"] - e.get("eval_ms", 0.0)
                                              for e in summary.get("epochs", []))]


def eval_points(summary: Dict[str, Any]) -> List[Point]:
    """(training s, eval) of every evaluated epoch, and the final eval at the end of training
    when the last epoch scored none (it was taken after the last epoch: no later point)."""
    epochs = summary.get("epochs", [])
    axis = train_axis(summary)
    points = [(t, e["eval"]) for t, e in zip(axis, epochs) if e.get("eval") is not None]
    final = summary.get("final_eval")
    if final is not None and axis and epochs[-1].get("eval") is None:
        points.append((axis[-1], final))
    return points


def time_to_bar(points: Sequence[Point], bar: Optional[float],
                direction: str = "max") -> Union[float, str, None]:
    """Training seconds of the first point whose eval reaches `bar` (>= for direction max, <=
    for min); NOT_REACHED when none does; None without a bar or without any point."""
    if bar is None or not points:
        return None
    reached = EvalDirection(direction).reached
    return next((t for t, score in points if reached(score, bar)), NOT_REACHED)


def speedup(reference_s: Union[float, str, None],
            time_s: Union[float, str, None]) -> Union[float, str, None]:
    """reference_s / time_s: how many times sooner than the reference a run reached the bar
    (1.0 = as soon; 2.0 = in half the time). NOT_REACHED when the run never reached it; None
    when either time is unknown, or the reference did not reach it."""
    if time_s == NOT_REACHED:
        return NOT_REACHED
    if not isinstance(reference_s, (int, float)) or not isinstance(time_s, (int, float)) \
            or time_s <= 0:
        return None
    return reference_s / time_s
