"""`python -m flodl_run.submit [--dry-run] [overrides]`: a Slurm batch job for a run.

Composes and checks the config exactly as the runner will (topology slurm), writes an sbatch
script whose allocation comes from `cluster.slurm` (nodes, GPUs per node, time, partition,
extra options) and whose body is `python -m flodl_run <the same overrides>`, submits it and
prints the job id and where its output goes. `--dry-run` prints the script and submits
nothing. Exit 0 submitted (or printed), 1 sbatch refused, 2 bad config.

`--dry-run -m hydra/launcher=slurm <sweep overrides>` prints what a sweep would submit: every
job's overrides (each checked as the runner will), and the job array's script as submitit
writes it. A sweep itself is submitted by `python -m flodl_run -m ...`, whose process waits for
its jobs and then writes their comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

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


def _config(overrides: Sequence[str], need_slurm: bool = True) -> ExperimentConfig:
    """The checked config; ConfigError or ComposeError for what the runner would refuse."""
    from flodl_run.config.compose import compose, to_experiment
    from flodl_run.config.materialize import ConfigError, materialize
    from flodl_run.config.validate import Problem

    typed, problems = to_experiment(compose(list(overrides)))
    if typed is None:
        raise ConfigError(problems)
    config = materialize(typed, check_recipe=False).config
    if need_slurm and config.cluster.topology is not Topology.slurm:
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


def _launcher_node(overrides: Sequence[str]) -> Dict[str, Any]:
    """The sweep's `hydra.launcher` node, resolved (folder and job name as a sweep has them)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from flodl_run.config.app import JOB_MODULE
    from flodl_run.config.compose import conf_dir, register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    name = f"hydra.job.name={JOB_MODULE.rsplit('.', 1)[-1]}"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        cfg = compose("config", overrides=[*overrides, name], return_hydra_config=True)
    GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def array_script(launcher: Dict[str, Any], num_jobs: int) -> str:
    """The job array's sbatch script as hydra-submitit-launcher has submitit write it. Needs no
    Slurm on this machine: a dry run only writes text (submitit's executor refuses to exist
    without `srun` on the PATH, so the script is made by one that does not ask)."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm.slurm import _make_sbatch_string

    params = {k: v for k, v in launcher.items() if k != "_target_" and v is not None}  # None: unset
    folder = params.pop("submitit_folder")
    params.pop("max_num_timeout", None)
    base = {f.name for f in dataclasses.fields(BaseQueueConf)}
    slurm = _script_only_executor()(folder)
    # what submitit's AutoExecutor does: shared names (timeout_min, mem_gb, ...) renamed to
    # Slurm's, the launcher's other keys (partition, signal_delay_s, ...) taken as they are
    generic = slurm._convert_parameters({k: v for k, v in params.items() if k in base})
    slurm.update_parameters(**generic, **{k: v for k, v in params.items() if k not in base})
    return _make_sbatch_string(command=" ".join(slurm._submitit_command_str.split()), folder=folder,
                               map_count=num_jobs, **slurm.parameters)


def _script_only_executor() -> type:
    """submitit's Slurm executor for writing scripts only: available whether or not this
    machine has `srun` (it never submits)."""
    from submitit.slurm.slurm import SlurmExecutor

    class ScriptOnly(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1

    return ScriptOnly


def sweep_dry_run(overrides: Sequence[str]) -> str:
    """What `python -m flodl_run -m <overrides>` would submit; ConfigError naming the job."""
    from flodl_run.config.materialize import ConfigError
    from flodl_run.config.sweep import job_problems, sweep_jobs

    jobs = sweep_jobs(overrides)
    problems = job_problems(jobs)
    if problems:
        raise ConfigError(problems)
    launcher = _launcher_node(jobs[0])
    target = str(launcher.get("_target_", ""))
    lines = []
    if target.endswith("SlurmSweepLauncher") or target.endswith("submitit_launcher.SlurmLauncher"):
        lines.append(array_script(launcher, len(jobs)).rstrip("\n"))
    else:
        lines.append("# not a Slurm launcher: nothing goes to a queue (pick hydra/launcher=slurm)")
    lines.append(f"# sweep: {len(jobs)} job{'s' if len(jobs) != 1 else ''} through {target}, "
                 "array task k runs job k:")
    lines += [f"# job {num}: {' '.join(o for o in job if not o.startswith(('hydra/', 'hydra.')))}"
              for num, job in enumerate(jobs)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from flodl_run.config.compose import ComposeError
    from flodl_run.config.materialize import ConfigError

    parser = argparse.ArgumentParser(prog="python -m flodl_run.submit",
                                     description="write an sbatch script for a run and submit it")
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="a sweep (with --dry-run): print each job and the job array's script")
    parser.add_argument("overrides", nargs="*", help="the run's overrides, as for python -m flodl_run")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    err = Console(stderr=True)
    if args.multirun:
        return _sweep_main(args, err)
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


def _sweep_main(args: argparse.Namespace, err: Any) -> int:
    """`-m`: print what the sweep would submit (only with --dry-run)."""
    from rich.markup import escape

    from flodl_run.config.compose import ComposeError
    from flodl_run.config.materialize import ConfigError

    if not args.dry_run:
        err.print("[bold red]flodl_run.submit:[/] -m: a sweep is submitted by `python -m flodl_run -m "
                  "hydra/launcher=slurm ...`; add --dry-run to see what it would submit",
                  highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    try:
        sys.stdout.write(sweep_dry_run(args.overrides))
    except (ComposeError, ConfigError) as exc:
        err.print(f"[bold red]flodl_run.submit:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
