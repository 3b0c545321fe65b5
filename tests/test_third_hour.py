"""A newcomer's third hour (issue 46): a first screen in the project's own words, Ctrl-C through
a pipe that died, a sweep checked before its first job, a batch larger than the data, and the
small things a first week turns up.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import run_cli

REPO = Path(__file__).resolve().parents[1]
EXIT_CONFIG = 2
TINY = ("recipe=synthetic_mlp", "recipe.params.num_samples=512", "recipe.params.hidden=16",
        "recipe.params.depth=1", "batch_size=64")
"""A recipe that trains an epoch in well under a second."""
OURS = ("ddp: ", "note: ", "epoch ", "done: ", "wrote: ", "warning: ")
"""How the runner's own lines start (flodl_run.report.say and the progress lines)."""


# --- the first screen --------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_first_run_in_an_empty_directory_prints_only_the_projects_own_lines(tmp_path):
    """Pins the quick start's first screen: Hydra's `UserWarning: Callback
    SweepCallback.on_job_start raised MissingMandatoryValue: ... hydra.job.num` (and its four
    lines of Hydra internals) before every single run, and MLflow's INFO lines on the run that
    creates the store (`Creating initial MLflow database tables...`, `Updating database tables`,
    the system-metrics monitor's start and stop)."""
    proc = run_cli("num_epochs=1", *TINY, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "outputs" / "mlflow.db").is_file()  # this run created the store
    foreign = [line for line in (proc.stdout + proc.stderr).splitlines()
               if line and not line.startswith(OURS)]
    assert foreign == []


def _hidden_launchers_env(tmp_path: Path) -> dict:
    """An environment whose interpreter cannot import the optional launchers (a minimal GPU
    node): a sitecustomize puts a finder first on sys.meta_path that refuses them."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[:2] in (['hydra_plugins', 'hydra_joblib_launcher'],\n"
        "                                   ['hydra_plugins', 'hydra_submitit_launcher']):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, _Hide())\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


@pytest.mark.e2e
def test_without_the_optional_launchers_hydra_warns_of_nothing_and_a_sweep_says_what_to_install(
        tmp_path):
    """Pins a host without hydra-submitit-launcher and hydra-joblib-launcher: Hydra's plugin scan
    warned twice, nine lines each (`Error importing 'hydra_plugins.flodl_run_launchers.groups'
    ... Plugin is incompatible with this Hydra version or buggy`), before every command. Now
    nothing is printed, and a sweep that picks such a launcher exits 2 naming the package."""
    env = _hidden_launchers_env(tmp_path)
    shown = subprocess.run([sys.executable, "-m", "flodl_run", "--cfg", "job", "tracking=off"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == "" and shown.stdout.startswith("elche:\n")
    swept = subprocess.run([sys.executable, "-m", "flodl_run", "-m", "hydra/launcher=gpu_groups",
                            "seed=1,2", "tracking=off", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert swept.returncode == EXIT_CONFIG, swept.stdout + swept.stderr
    assert "hydra/launcher=gpu_groups: needs hydra-joblib-launcher, which is not installed" in swept.stderr
    assert "Traceback" not in swept.stderr and not (tmp_path / "sweep").exists()


def test_the_sweeps_own_process_shows_hydras_lines_and_no_other_librarys_info():
    """Pins the end of a first sweep: matplotlib's `[HYDRA] generated new fontManager` (an INFO
    line of another library, printed through Hydra's hydra_logging while the comparison was
    plotted). The shipped hydra_logging passes Hydra's own INFO lines and others' warnings."""
    import logging.config

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flodl_run.config.compose import conf_dir, register_schemas

    register_schemas()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        cfg = compose("config", return_hydra_config=True)
    setup = OmegaConf.to_container(cfg.hydra.hydra_logging, resolve=True)
    stream = io.StringIO()
    setup["handlers"]["console"]["stream"] = stream
    saved = logging.getLogger().handlers[:], logging.getLogger().level
    try:
        logging.config.dictConfig(setup)
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("hydra._internal.core_plugins.basic_launcher").info("Launching 2 jobs locally")
        logging.getLogger("matplotlib.font_manager").warning("a font is missing")
    finally:
        logging.getLogger().handlers[:], _ = saved
        logging.getLogger().setLevel(saved[1])
    lines = [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]
    assert lines == ["Launching 2 jobs locally", "a font is missing"]

