"""A sweep's jobs, checked before the first one starts: `-m a,b x=1` expanded into each job's
overrides as Hydra's basic sweeper expands them, and every job's config composed and validated
as the runner will. A bad job is named (`job 1: elche.anchor: ...`), so a sweep never runs its
good jobs and then stops at a bad one, leaving a comparison of what ran.

Owns only the expansion and the check; the runner's CLI and `flodl_run.submit --dry-run -m`
act on the problems.
"""

from __future__ import annotations

from typing import List, Sequence

from flodl_run.config.validate import Problem


def sweep_jobs(overrides: Sequence[str]) -> List[List[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands `a,b` and the other sweep forms."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def job_problems(jobs: Sequence[Sequence[str]]) -> List[Problem]:
    """Every job's problems, each key prefixed with its job (`job 1: elche.anchor`): what Hydra
    would refuse when composing it, and the value rules the runner checks before it starts
    (the recipe itself is imported by the job)."""
    from flodl_run.config.compose import ComposeError, compose, to_experiment
    from flodl_run.config.materialize import ConfigError, materialize

    problems = []
    for num, job in enumerate(jobs):
        try:
            typed, found = to_experiment(compose(list(job)))
            if typed is not None and not found:
                materialize(typed, check_recipe=False)
        except ComposeError as exc:
            found = [Problem("overrides", " ".join(job), str(exc).splitlines()[0])]
        except ConfigError as exc:
            found = exc.problems
        problems += [Problem(f"job {num}: {p.key}", p.value, p.rule) for p in found]
    return problems
