"""The digits MLP whose `epoch_fn` stops its own in-process run once, as a user's SIGTERM (or a
scheduler's notice, `stop_signal`) would: at epoch 1, when `stop_file` exists (it is removed
first, so a rerun or a requeue trains on). A test's stop at a known point, whatever the
machine's load."""

from __future__ import annotations

import os
import signal
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
             **_: object) -> None:
    if epoch == 1 and stop_file is not None and Path(stop_file).exists():
        Path(stop_file).unlink()
        os.kill(os.getpid(), signal.Signals[stop_signal])
