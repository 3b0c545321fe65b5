"""The digits MLP whose `epoch_fn` stops its own in-process run once, as a user's SIGTERM (or a
scheduler's notice, `stop_signal`) would: at epoch 1, when `stop_file` exists (it is removed
first, so a rerun or a requeue trains on). A test's stop at a known point, whatever the
machine's load. `pause_s` makes each epoch last that much longer in wall time and no longer in
CPU: a run that must go on for some seconds (for heartbeats to carry samples) without training
more."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from recipes.digits_mlp import (  # noqa: F401  (the recipe's functions)
    build_model,
    build_optimizer,
    eval_dataset,
    eval_step,
    train_dataset,
    train_step,
)


def epoch_fn(epoch: int, model: object, stop_file: Optional[str] = None, stop_signal: str = "SIGTERM",
             pause_s: float = 0.0, **_: object) -> None:
    time.sleep(pause_s)
    if epoch == 1 and stop_file is not None and Path(stop_file).exists():
        Path(stop_file).unlink()
        os.kill(os.getpid(), signal.Signals[stop_signal])
