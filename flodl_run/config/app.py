"""The Hydra app edge every command shares (the runner, the sim, the bench): run a command's
Hydra app over its `conf/` tree, check its overrides before Hydra composes, turn the composed
config into its schema's dataclass, and exit 2 on a config error without a traceback.

Owns only that edge; what a command does with its typed config is the command's.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, List, NoReturn, Optional, Sequence

from rich.console import Console
from rich.markup import escape

from flodl_run.config.compose import conf_dir, register_schemas
from flodl_run.config.materialize import ConfigError

EXIT_CONFIG = 2
JOB_MODULE = "flodl_run.cli"
"""Hydra's job name comes from this module's last part: `cli`, hence `cli.log`."""


def fail_config(message: str, console: Console, prog: str = "flodl_run") -> NoReturn:
    """Print a user error without a traceback and exit 2; long lines fold between words (a
    value or key is never cut in two, whatever the terminal width)."""
    # Only the label is markup: a message may hold `[...]` (paths, peer errors) shown verbatim.
    console.print(f"[bold red]{escape(prog)}:[/] {escape(message)}", highlight=False, soft_wrap=True)
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


def run_hydra_app(config_name: str, job: Callable[[Any], Optional[int]],
                  extra_schemas: Sequence[Any] = (),
                  check_jobs: Optional[Callable[[List[List[str]]], List[Any]]] = None) -> int:
    """Run `job` as the Hydra app over conf/<config_name>.yaml; returns the last job's status.

    Hydra exits 1 for overrides it cannot compose (unknown key, wrong type, missing option)
    before any job starts: that is a config error, so it becomes exit 2 like ours. A sweep
    (`-m`) with `check_jobs` has each of its jobs' overrides checked before Hydra starts the
    first (problems: exit 2, nothing run or written). Shared by the runner, the sim and the
    bench."""
    import hydra

    if os.environ.get("FLODL_RUN_TRACEBACK"):
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    register_schemas(extra=list(extra_schemas))
    check_overrides(config_name)
    if check_jobs is not None:
        check_sweep(check_jobs)
    status: list = []

    def _app(cfg: Any) -> None:
        status.append(0)
        status[-1] = job(cfg) or 0

    # Hydra names the job, and so its log file in the run dir, after the module of the function
    # it runs: every command's log is cli.log, as it was when this edge lived in flodl_run.cli.
    _app.__module__ = JOB_MODULE
    app = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name=config_name)(_app)
    try:
        with _mode_read_without_composing():
            app()
    except SystemExit as exc:
        if exc.code == 1 and not status:
            sys.exit(EXIT_CONFIG)
        raise
    return status[-1] if status else 0


@contextlib.contextmanager
def _mode_read_without_composing() -> Iterator[None]:
    """Hydra composes the whole config once more before it runs, only to read `hydra.mode`
    (`Hydra.get_mode`, 0.14 CPU-s of a launcher's 0.52 once its imports are done), and it is
    None unless a config or an override sets it: then `-m` decides. While nothing can set it
    (`_mode_may_be_set`), Hydra is told None without that compose."""
    from hydra._internal.hydra import Hydra

    if _mode_may_be_set(conf_dir(), sys.argv[1:]):
        yield
        return
    composing = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = composing  # type: ignore[method-assign]


_MODE_KEY = re.compile(r"\bmode\s*:")
"""A `mode` key, in block or flow style (comments too: erring on yes)."""


def _mode_may_be_set(conf: Path, argv: Sequence[str]) -> bool:
    """Whether `hydra.mode` may be set by what this command composes, erring on yes: an
    override of `hydra.mode` or `hydra.searchpath`, another config tree (`--config-dir`,
    `--config-path`, `--config-name`), or a YAML file of `conf/` with a `mode` key that is
    either Hydra's own node's or may be (under `conf/hydra/`, under a `@package` header, or
    the `hydra:` key of the file). `mode:` of an ElChe preset is its own."""
    import yaml
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # Hydra's own parser says what is wrong
            args = get_args_parser().parse_args(list(argv))
    except SystemExit:
        return True
    if args.config_dir or args.config_path or args.config_name:
        return True
    keys = [o.split("=", 1)[0].lstrip("+~") for o in args.overrides]
    if any(k in ("hydra", "hydra.mode", "hydra.searchpath") for k in keys):
        return True
    for path in conf.rglob("*.yaml"):
        text = path.read_text()
        if not _MODE_KEY.search(text):
            continue
        if path.relative_to(conf).parts[0] == "hydra" or "@package" in text:
            return True
        if "hydra" not in text:
            continue
        try:
            node = yaml.safe_load(text)
        except yaml.YAMLError:  # Hydra's own compose says what is wrong with it
            return True
        if isinstance(node, dict) and isinstance(node.get("hydra"), dict) and "mode" in node["hydra"]:
            return True
    return False


def check_sweep(check_jobs: Callable[[List[List[str]]], List[Any]]) -> None:
    """A sweep's jobs, each checked before any starts; exit 2 naming the jobs with problems.
    Not a sweep, or flags Hydra's parser refuses: nothing to do here."""
    from hydra._internal.utils import get_args_parser

    from flodl_run.config.sweep import sweep_jobs

    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:  # a malformed flag: Hydra's own parser says so when the app runs
        return
    if not args.multirun or args.config_dir or args.config_name:
        return  # another config tree than conf/: its jobs are checked as each starts
    try:
        jobs = sweep_jobs(args.overrides)
    except Exception:  # a sweep syntax Hydra's parser refuses: its message names it when it runs
        return
    problems = check_jobs(jobs)
    if problems:
        fail_config(str(ConfigError(problems)), Console(stderr=True))


def check_overrides(config_name: str) -> None:
    """Exit 2 before Hydra composes when an override names a key or group this command does not
    have, whatever its prefix (`+` and `++` included), suggesting the nearest real names, or
    gives a value Hydra would refuse (see `config.overrides`). Call after the schemas are
    registered."""
    from hydra._internal.utils import get_args_parser

    from flodl_run.config import overrides

    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:  # a malformed flag: Hydra's own parser says so when the app runs
        return
    problems = overrides.check(args.overrides, conf_dir(), config_name,
                               extra_search_path=bool(args.config_dir))
    if problems:
        fail_config(str(ConfigError(problems)), Console(stderr=True))
