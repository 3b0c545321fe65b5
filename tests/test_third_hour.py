"""A newcomer's third hour: a first screen in the project's own words, Ctrl-C through
a pipe that died, a sweep checked before its first job, a batch larger than the data, and the
small things a first week turns up.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import PAIR, run_cli, start_cli, text_of, wait_for

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
    # the events count epochs as the terminal does (`epoch 1/1`): the bundle resumes at epoch 2
    events = (tmp_path / "outputs" / "latest" / "events.jsonl").read_text().splitlines()
    saved = [json.loads(e)["message"] for e in events if json.loads(e)["kind"] == "checkpoint"]
    assert saved and saved[-1].endswith("(resume at epoch 2)"), saved


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



# --- Ctrl-C through a pipe that died -----------------------------------------------------------


def _sigint_with_the_pipe_gone(events: Path, *args: str):
    """`python -m flodl_run ... 2>&1 | tee log`, then Ctrl-C, which ends `tee` too: start the
    run with stdout and stderr on one pipe, wait for its ranks to train (the `start` event in
    `events`), close the pipe's only reader, SIGINT the launcher; its exit code."""
    proc = start_cli(*args)
    wait_for("the run's start event", lambda: '"start"' in text_of(events) or proc.poll() is not None,
             timeout_s=120)
    assert proc.poll() is None, proc.stdout.read()
    proc.stdout.close()  # tee is gone: every later write to stdout or stderr fails (EPIPE)
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=120)


def _mlflow_status(db: Path, run_id: str) -> str:
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{db}").get_run(run_id).info.status


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["ranks", "in_process"])
def test_ctrl_c_after_the_terminals_reader_died_still_ends_the_run_as_interrupted(tmp_path, mlflow_db,
                                                                                 path):
    """Pins Ctrl-C through `| tee log`: the first line printed after tee died (the `stopping`
    line) ended the launcher with exit 1 (rich's answer to a broken pipe is SystemExit(1)): no
    summary.json, no `end` event, the MLflow run RUNNING for ever. Now the run writes its
    records as without tee and exits 130, on ranks and in-process alike."""
    run_dir = tmp_path / "run"
    cluster = (*PAIR, "cluster.emulate_slowdown=[20,20]") if path == "ranks" else ("cluster=solo",)
    code = _sigint_with_the_pipe_gone(run_dir / "events.jsonl", f"hydra.run.dir={run_dir}", *cluster,
                                      *TINY, "num_epochs=500", f"tracking.uri=sqlite:///{mlflow_db}")
    assert code == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["message"].startswith("interrupted by SIGINT")
    assert json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])["kind"] == "end"
    assert _mlflow_status(mlflow_db, summary["mlflow_run_id"]) == "KILLED"


@pytest.mark.e2e
def test_ctrl_c_of_a_sweep_after_the_terminals_reader_died_still_writes_the_comparison(tmp_path,
                                                                                     mlflow_db):
    """Pins the sweep path of Ctrl-C through `| tee log`: the stopped job's records, the sweep's
    comparison and its MLflow parent's status are written, and the sweep exits 130."""
    import mlflow

    sweep_dir = tmp_path / "sweep"
    code = _sigint_with_the_pipe_gone(sweep_dir / "0" / "events.jsonl", "-m",
                                      "seed=0,1", "cluster=solo", *TINY, "num_epochs=500",
                                      f"tracking.uri=sqlite:///{mlflow_db}",
                                      f"hydra.sweep.dir={sweep_dir}")
    assert code == 130
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    table = (sweep_dir / "comparison.md").read_text()
    assert table.startswith("# Sweep comparison (1 jobs)") and "| 0 |  | interrupted |" in table
    assert not (sweep_dir / "1").exists()
    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    runs = client.search_runs([client.get_experiment_by_name("flodl_run").experiment_id])
    assert sorted(r.info.status for r in runs) == ["KILLED", "KILLED"]  # the job and its parent


def test_a_stream_whose_reader_left_takes_every_later_write_and_other_errors_still_raise():
    """Pins the stream under the terminal: a write into a pipe whose reader exited raised
    BrokenPipeError (rich turns it into SystemExit(1)); now it and every later write succeed,
    the descriptor points at /dev/null (the interpreter's last flush cannot fail), while an
    error that is not about the reader (a closed file) still raises."""
    from flodl_run.report.say import OutlivingStream

    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    pipe = open(write_fd, "w", buffering=1)
    stream = OutlivingStream(pipe)
    assert stream.write("stopping (SIGINT)\n") == len("stopping (SIGINT)\n")
    assert stream.gone and stream.write("wrote: ...\n") == len("wrote: ...\n")
    assert os.readlink(f"/proc/self/fd/{write_fd}") == os.devnull
    pipe.write("the interpreter's last flush\n")
    pipe.flush()
    pipe.close()
    closed = OutlivingStream(open(os.devnull, "w"))
    closed.stream.close()
    with pytest.raises(ValueError):
        closed.write("x")


# --- a sweep checked before its first job ------------------------------------------------------


@pytest.mark.e2e
def test_a_sweep_with_a_bad_job_exits_2_naming_it_before_any_job_runs(tmp_path):
    """Pins `-m elche=nccl_sync,cpu_async elche.anchor=0`: the sweep ran its good jobs, then
    exited 2 at the bad one, leaving a comparison.md of what ran. Every job is now checked
    before the first starts: the bad one is named and nothing is run or written."""
    sweep_dir = tmp_path / "sweep"
    proc = run_cli("-m", "elche.min_anchor=5,50", "elche.max_anchor=20", "cluster=solo", *TINY,
                   "num_epochs=1", "tracking=off", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[1:] == [
        "  job 1: elche.min_anchor: must be <= elche.max_anchor (20), got 50"]
    assert "Launching" not in proc.stdout and not sweep_dir.exists()


# --- the small ones ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_value_error_is_reported_before_torch_or_the_recipe_is_imported(tmp_path):
    """Pins `num_epochs=0` taking 5-12 s where a mistyped key takes 1 s: the runner imported
    the launcher (torch) and the recipe before it reported a value rule. Now the value rules
    come first: exit 2 with torch never imported."""
    code = ("import sys\n"
            "sys.argv = ['flodl_run', 'num_epochs=0', 'tracking=off']\n"
            "from flodl_run.cli import main\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as exc:\n"
            "    print('exit', exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.splitlines()[-1] == "exit 2 False", proc.stdout + proc.stderr
    assert "num_epochs: must be >= 1, got 0" in proc.stderr


def test_a_mistyped_enum_value_gets_a_did_you_mean_and_a_bool_only_takes_true_or_false():
    """Pins `elche.mode=nccl_async` listing the modes with no suggestion (while the group
    `elche=nccl_synk` got one), and `elche.relax_up=yes` (or 1) silently taken as true while
    its typo `ye` was refused: a bool takes only true or false."""
    from flodl_run.config.compose import conf_dir, register_schemas
    from flodl_run.config.overrides import check

    register_schemas()
    found = {p.key: p.rule for p in check(["elche.mode=nccl_async", "elche.relax_up=yes",
                                           "cluster.launch_ranks=1"], conf_dir(), "config")}
    assert found["elche.mode"].endswith("(did you mean nccl_sync or cpu_async?)")
    assert found["elche.relax_up"] == found["cluster.launch_ranks"] == "must be true or false"
    assert check(["elche.relax_up=true", "elche.relax_up=false"], conf_dir(), "config") == []


# --- a batch larger than the data --------------------------------------------------------------


def test_a_batch_larger_than_the_data_says_what_it_does():
    """Pins `batch_size=5000` on 1,437 samples training one short step an epoch without a word,
    and on two ranks leaving rank 1 with nothing to train (`share [1.00 0.00]`)."""
    from flodl_run.config.validate import batch_size_warning
    from tests.support import make

    assert batch_size_warning(1437, make(batch_size=5000), 1) == (
        "batch_size=5000 is more than an epoch's 1,437 samples: each epoch is one step of 1,437")
    assert batch_size_warning(1437, make(batch_size=5000), 2) == (
        "batch_size=5000 makes 1 batch of an epoch's 1,437 samples for 2 ranks: rank 1 trains "
        "nothing (batch_size <= 718 gives every rank a batch)")
    assert "ranks 2-3 train nothing" in batch_size_warning(1437, make(batch_size=800), 4)
    assert batch_size_warning(1437, make(batch_size=718), 2) is None
    assert batch_size_warning(1437, make(batch_size=300, data__epoch_splits=3), 2) is None
    assert "2 batches of an epoch's 479 samples for 3 ranks" in batch_size_warning(
        1437, make(batch_size=300, data__epoch_splits=3), 3)


@pytest.mark.e2e
def test_a_rank_left_without_a_batch_is_named_on_the_terminal(tmp_path):
    """Pins the two-rank run whose one batch an epoch left rank 1 idle with no warning: rank 0
    says so, naming the batch_size that gives every rank a batch."""
    proc = run_cli("tracking=off", f"hydra.run.dir={tmp_path / 'run'}", *PAIR, *TINY,
                   "batch_size=600", "num_epochs=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("[rank 0] warning: batch_size=600 makes 1 batch of an epoch's 409 samples for 2 ranks: "
            "rank 1 trains nothing (batch_size <= 204 gives every rank a batch)") in proc.stdout


def test_a_comparison_where_no_job_finished_an_epoch_names_no_epoch(tmp_path):
    """Pins comparison.md's `loss @ epoch 0` column of a sweep whose jobs finished no epoch (the
    terminal counts epochs from 1: there is no epoch 0); and an epoch's timeline label counts
    from 1 too."""
    from flodl_run.contracts.summary import EpochRecord
    from flodl_run.observe.timeline import TimelineFile
    from flodl_run.report.compare import JobOutcome, to_markdown

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "failed", "epochs": []}))
    table = to_markdown([JobOutcome.read(0, ["elche=cpu_async"], tmp_path / "0")])
    assert "epoch 0" not in table and "| loss @ epoch - |" in table
    assert "`loss @ epoch -`: no job finished an epoch." in table
    labels = []
    timeline = TimelineFile.__new__(TimelineFile)
    timeline.recorder = type("Recorder", (), {"instant": lambda self, kind, text: labels.append(text)})()
    timeline.on_epoch(EpochRecord(epoch=0, avg_loss=1.5, eval=None, epoch_ms=10.0,
                                  per_rank_throughput=[], per_rank_batch_share=[]))
    assert labels == ["epoch 1: loss 1.5"]
