"""`python -m flodl_run`: compose with Hydra, materialize once, train, write the run dir.

The only place that turns errors into exit codes and prints: 0 done, 2 bad config (no
traceback; FLODL_RUN_TRACEBACK=1 shows one), 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

from rich.console import Console

from flodl_run.config.compose import conf_dir, experiment_to_yaml, register_schemas
from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.rundir import remove_startup_files
from flodl_run.say import labelled, say_labelled

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


def fail_config(message: str, console: Console, prog: str = "flodl_run") -> NoReturn:
    """Print a user error without a traceback and exit 2; long lines fold between words (a
    value or key is never cut in two, whatever the terminal width)."""
    console.print(labelled(prog, message, "bold red"), highlight=False, soft_wrap=True)
    sys.exit(EXIT_CONFIG)


def typed_or_exit(cfg: Any, prog: str) -> Any:
    """The composed config as its schema's dataclass (Hydra's own `hydra` node left out); a
    value the schema refuses exits 2 naming the dotted key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    keys = [k for k in cfg.keys() if k != "hydra"]
    plain = OmegaConf.masked_copy(cfg, keys) if "hydra" in cfg else cfg
    try:
        return OmegaConf.to_object(plain)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or "config"
        fail_config(f"{key}: {str(exc).splitlines()[0]}", Console(stderr=True), prog)


class JobFailed(Exception):
    """A sweep job ended failed: raised (not exited) so Hydra records it and runs the next job."""


def run_job(cfg: Any) -> None:
    """The body of one Hydra job (also one job of a multirun sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from flodl_run.launcher import launch

    err = Console(stderr=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    outputs = Path.cwd() / "outputs"
    try:
        materialized = materialize(cfg, run_dir=str(run_dir), outputs_dir=str(outputs))
        for warning in materialized.warnings:
            say_labelled(err, "warning", warning, "yellow")
        (run_dir / "run.yaml").write_text(experiment_to_yaml(materialized.config))
        status = launch(materialized.config, run_dir, Console())
    except ConfigError as exc:  # also what only the hardware or the hosts can tell: exit 2
        remove_startup_files(run_dir, outputs)  # a run that never started leaves no folder
        fail_config(str(exc), err)
    if status == "interrupted":
        sys.exit(EXIT_INTERRUPTED)
    if status not in ("completed",):
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise JobFailed(f"job ended {status}: {run_dir}")
        sys.exit(1)


def run_hydra_app(config_name: str, job: Callable[[Any], Optional[int]],
                  extra_schemas: Sequence[Any] = ()) -> int:
    """Run `job` as the Hydra app over conf/<config_name>.yaml; returns the last job's status.

    Hydra exits 1 for overrides it cannot compose (unknown key, wrong type, missing option)
    before any job starts: that is a config error, so it becomes exit 2 like ours. Shared by
    the runner, the sim and the bench."""
    import hydra

    if os.environ.get("FLODL_RUN_TRACEBACK"):
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    register_schemas(extra=list(extra_schemas))
    check_overrides(config_name)
    status: list = []

    @hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name=config_name)
    def _app(cfg: Any) -> None:
        status.append(0)
        status[-1] = job(cfg) or 0

    try:
        _app()
    except SystemExit as exc:
        if exc.code == 1 and not status:
            sys.exit(EXIT_CONFIG)
        raise
    return status[-1] if status else 0


def check_overrides(config_name: str) -> None:
    """Exit 2 before Hydra composes when an override names a key or group this command does not
    have, whatever its prefix (`+` and `++` included), suggesting the nearest real names. Call
    after the schemas are registered."""
    from hydra._internal.utils import get_args_parser

    from flodl_run.config import overrides

    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:  # a malformed flag: Hydra's own parser says so when the app runs
        return
    problems = overrides.check(args.overrides, conf_dir(), config_name)
    if problems:
        fail_config(str(ConfigError(problems)), Console(stderr=True))


def main() -> None:
    """Entry point; Hydra's flags (-m, --cfg, --info, --help) work as usual."""
    from flodl_run.sweep import end_active

    try:
        run_hydra_app("config", run_job)
    except ConfigError as exc:  # pragma: no cover - raised inside jobs is handled there
        fail_config(str(exc), Console(stderr=True))
    finally:
        # Hydra's on_multirun_end is skipped when a job failed or Ctrl-C stopped the sweep:
        # the jobs that ran still get their comparison and the parent run its status.
        end_active()

