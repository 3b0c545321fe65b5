"""A stand-in for a launcher whose base plugin is not installed (a minimal environment on a
GPU node: neither hydra-submitit-launcher nor hydra-joblib-launcher). Our launcher modules
still import, so Hydra's plugin scan, which imports every module of `hydra_plugins` before any
run, has nothing to warn about; a sweep that picks the launcher exits 2 naming what to install.

Private (`_absent`): Hydra's scan skips modules whose name starts with one underscore.
"""

from typing import Any

from hydra.plugins.launcher import Launcher


def absent_launcher(distribution: str, option: str, error: ImportError) -> type:
    """A launcher class whose construction (a sweep picked `option`) exits 2 saying that
    `distribution` is not installed (`error`: why its import failed)."""

    class Absent(Launcher):
        def __init__(self, **_: Any) -> None:
            from rich.console import Console

            from flodl_run.config.app import fail_config

            fail_config(f"hydra/launcher={option}: needs {distribution}, which is not installed "
                        f"here ({error}): pip install {distribution}", Console(stderr=True))

        def setup(self, **_: Any) -> None:  # pragma: no cover - never constructed
            raise NotImplementedError

        def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:  # pragma: no cover
            raise NotImplementedError

    Absent.__name__ = Absent.__qualname__ = f"Absent_{distribution.replace('-', '_')}"
    return Absent
