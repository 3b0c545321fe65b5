"""`python -m flodl_run.submit [--dry-run] [overrides]`: a Slurm batch job for a run.

Composes and checks the config exactly as the runner will (topology slurm), writes an sbatch
script whose allocation comes from `cluster.slurm` (nodes, GPUs per node, time, partition,
extra options) and whose body is `python -m flodl_run <the same overrides>`, submits it and
prints the job id and where its output goes. `--dry-run` prints the script and submits
nothing. Exit 0 submitted (or printed), 1 sbatch refused, 2 bad config.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from flodl_run.config.schema import ClusterConfig, ExperimentConfig, SlurmConfig, Topology

EXIT_REFUSED = 1
EXIT_CONFIG = 2


def sbatch_script(cluster: ClusterConfig, overrides: Sequence[str], output: Path,
                  project: Path, python: str) -> str:
    """The batch script: `#SBATCH` lines from cluster.slurm, then the run itself."""
    s = cluster.slurm
    lines = ["#!/bin/bash", f"#SBATCH --job-name={s.job_name}", f"#SBATCH --nodes={s.nodes}"]
    if s.gpus_per_node > 0:
        lines += [f"#SBATCH --ntasks-per-node={s.gpus_per_node}",
                  f"#SBATCH --gpus-per-node={s.gpus_per_node}"]
    else:
        lines.append(f"#SBATCH --ntasks={cluster.num_ranks}")
    if cluster.threads_per_rank:
        lines.append(f"#SBATCH --cpus-per-task={cluster.threads_per_rank}")
    lines.append(f"#SBATCH --time={s.time}")
    lines.append("#SBATCH --no-kill")  # a failed node ends its ranks, not the job (the launcher)
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    lines.append(f"#SBATCH --output={output}")
    lines += [f"#SBATCH {arg}" for arg in s.sbatch_args]
    run = " ".join(shlex.quote(w) for w in (python, "-m", "flodl_run", *overrides))
    lines += [
        "# Written by flodl_run.submit. The launcher runs on the batch host (the",
        "# coordinator binds its address) and starts the ranks as one srun step.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(project))}",
        f"exec {run}",
    ]
    return "\n".join(lines) + "\n"


def output_dir(slurm: SlurmConfig, project: Path) -> Path:
    """cluster.slurm.output_dir (relative to the project), else outputs/slurm."""
    where = Path(slurm.output_dir or "outputs/slurm").expanduser()
    return where if where.is_absolute() else project / where


def _config(overrides: Sequence[str]) -> ExperimentConfig:
    """The checked config; ConfigError or ComposeError for what the runner would refuse."""
    from flodl_run.config.compose import compose, to_experiment
    from flodl_run.config.materialize import ConfigError, materialize
    from flodl_run.config.validate import Problem

    typed, problems = to_experiment(compose(list(overrides)))
    if typed is None:
        raise ConfigError(problems)
    config = materialize(typed, check_recipe=False).config
    if config.cluster.topology is not Topology.slurm:
        raise ConfigError([Problem("cluster.topology", config.cluster.topology.value,
                                   "must be slurm to submit (add cluster=slurm)")])
    return config


def submit(script: Path) -> tuple[int, str]:
    """(0, job id) or (exit code, sbatch's complaint)."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              timeout=60)
    except FileNotFoundError:
        return EXIT_REFUSED, "sbatch not found: submit from a machine of the Slurm cluster"
    except subprocess.TimeoutExpired:
        return EXIT_REFUSED, "sbatch did not answer within 60 s"
    if done.returncode != 0:
        return EXIT_REFUSED, (done.stderr.strip() or f"sbatch exited {done.returncode}")
    return 0, done.stdout.strip().split(";")[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from flodl_run.config.compose import ComposeError
    from flodl_run.config.materialize import ConfigError

    parser = argparse.ArgumentParser(prog="python -m flodl_run.submit",
                                     description="write an sbatch script for a run and submit it")
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument("overrides", nargs="*", help="the run's overrides, as for python -m flodl_run")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    err = Console(stderr=True)
    try:
        config = _config(args.overrides)
    except (ComposeError, ConfigError) as exc:
        err.print(f"[bold red]flodl_run.submit:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    project = Path.cwd()
    where = output_dir(config.cluster.slurm, project)
    output = where / f"{config.cluster.slurm.job_name}-%j.out"
    text = sbatch_script(config.cluster, args.overrides, output, project, sys.executable)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    where.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    script = where / f"{config.cluster.slurm.job_name}-{stamp}-{os.getpid()}.sbatch"
    script.write_text(text)
    code, said = submit(script)
    if code != 0:
        err.print(f"[bold red]flodl_run.submit:[/] sbatch refused {escape(str(script))}: {escape(said)}",
                  highlight=False, soft_wrap=True)
        return code
    print(f"submitted job {said} | script {script} | output {str(output).replace('%j', said)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
