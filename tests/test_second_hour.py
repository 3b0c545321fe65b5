"""A newcomer's second hour, run the way they run it: the CLI as a user types it, its
exit code, its output and what it wrote. Most of these paths end before any rank starts, so each
costs a fork of the launch server and a compose, not a training run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_run.config.compose import register_schemas
from flodl_run.config.overrides import check
from tests.support import LOCKSTEP, PAIR, run_cli, start_cli

REPO = Path(__file__).resolve().parents[1]
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


@pytest.mark.e2e
def test_values_hydra_refuses_are_reported_in_our_words(tmp_path):
    """Pins: `num_epochs=ten`, a mistyped group option (its list showing the schema node
    `base_elche`), `recipe.params.x=...` without `+` and a run dir under a file coming straight
    from Hydra (its own text, a traceback for the file) instead of `key: rule, got value`."""
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = run_cli("num_epochs=ten", "elche=nccl_cadenc", "recipe=digits_cnn",
                   "recipe.params.hidden=32", f"hydra.run.dir={afile}/run", cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    err = proc.stderr
    assert "invalid config (4 problems)" in err
    assert "num_epochs: must be an integer, got 'ten'" in err
    assert "elche: must be one of cpu_async, cpu_cadence, cpu_sync, nccl_cadence, nccl_sync " \
           "(did you mean nccl_cadence?), got 'nccl_cadenc'" in err
    assert "recipe.params.hidden: is not a param of recipe digits_cnn" in err
    assert "+recipe.params.hidden=32 adds one" in err
    assert f"hydra.run.dir: must be a folder path ({afile} is a file)" in err
    assert "base_elche" not in err and "Traceback" not in err and "HYDRA_FULL_ERROR" not in err
    assert not (tmp_path / "outputs").exists()


def test_option_checks_leave_other_search_paths_and_known_params_alone():
    """Pins: the option check refusing a cluster YAML of the user's own search path
    (docs/multi-host.md's `hydra.searchpath=[...] cluster=my_hosts`), a recipe's own param set
    without `+`, an interpolated value, or a sweep's good values; and `+` on a param the recipe
    already sets coming from Hydra as `Could not append to config`."""
    register_schemas()
    conf = REPO / "conf"
    assert check(["hydra.searchpath=[file:///x.invalid]", "cluster=my_hosts"], conf, "config") == []
    assert check(["cluster=my_hosts"], conf, "config", extra_search_path=True) == []
    assert check(["recipe.params.hidden=8", "num_epochs=${oc.env:N}", "seed=1,2",
                  "elche=nccl_sync,cpu_sync"], conf, "config") == []
    [problem] = check(["seed=1,x"], conf, "config")
    assert str(problem) == "seed: must be an integer, got 'x'"
    [problem] = check(["+recipe.params.hidden=8", "++recipe.params.lr=0.1"], conf, "config")
    assert str(problem) == ("recipe.params.hidden: is already a param of recipe digits_mlp: set it "
                            "without `+` (recipe.params.hidden=8), got 8")


def test_python_configs_take_the_yamls_strings_for_every_enum_field():
    """Pins: `ClusterConfig(topology="cpu")` failing in validate with `'str' object has no
    attribute 'value'`, a string of a nested or dict enum field left a string,
    or a misspelt one passing without naming its dotted key."""
    from flodl_run.config.materialize import ConfigError, materialize
    from flodl_run.config.schema import (
        ClusterConfig,
        ElCheConfig,
        ExperimentConfig,
        GuardKind,
        Mode,
        OuterConfig,
        OuterKind,
        Reduction,
        Theme,
        Topology,
        TrackingConfig,
        TrackingKind,
    )

    config = ExperimentConfig(
        cluster=ClusterConfig(topology="cpu", num_ranks=2),
        elche=ElCheConfig(mode="cpu_async", convergence_guard="rate"), outer=OuterConfig(kind="slowmo"),
        tracking=TrackingConfig(kind="off"), scalar_reductions={"acc": "max"}, dashboard_theme="dark")
    typed = materialize(config, check_recipe=False).config
    assert (typed.cluster.topology, typed.elche.mode, typed.elche.convergence_guard) == (
        Topology.cpu, Mode.cpu_async, GuardKind.rate)
    assert (typed.outer.kind, typed.tracking.kind, typed.dashboard_theme) == (
        OuterKind.slowmo, TrackingKind.off, Theme.dark)
    assert typed.scalar_reductions["acc"] is Reduction.max
    with pytest.raises(ConfigError) as caught:
        materialize(ExperimentConfig(cluster=ClusterConfig(topology="cpuu")), check_recipe=False)
    assert "cluster.topology: must be one of auto, solo, cpu, local_gpus, hosts, slurm, got 'cpuu'" \
        in str(caught.value)


@pytest.mark.e2e
def test_a_recipe_error_in_process_reads_as_on_ranks(tmp_path):
    """Pins: a raising `train_step` in an in-process run (`cluster=solo`, the default on one
    device) printing Hydra's `Error executing job`, our own frames and the HYDRA_FULL_ERROR hint,
    with no `failed:` or `wrote:` line, where the distributed path prints the recipe's frames
    once and exits 1."""
    (tmp_path / "bad_step.py").write_text(
        "from recipes.digits_mlp import build_model, build_optimizer, train_dataset  # noqa: F401\n"
        "def train_step(model, batch):\n"
        "    raise ValueError('boom in my step')\n")
    proc = run_cli("recipe=custom", "recipe.module=bad_step", "cluster=solo", "num_epochs=1",
                   "tracking=off", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "failed: ValueError: boom in my step\nTraceback (most recent call last):\n" in out
    assert "bad_step.py\", line 3, in train_step" in out and out.count("boom in my step") == 3
    assert "flodl_run/" not in out.split("Traceback")[1].split("wrote:")[0]  # the recipe's frames only
    assert "Error executing job" not in out and "HYDRA_FULL_ERROR" not in out
    assert "wrote: " in proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.e2e
def test_a_bundle_of_another_model_or_no_epochs_left_and_an_unwritable_save_path_exit_2(
        tmp_path, lockstep_run):
    """Pins: resuming another recipe's bundle or other parameter shapes
    failing in every rank's load_state_dict after the ranks started; `num_epochs` at or below
    the bundle's epoch exiting 0 after training nothing; `save_path` under a regular file found
    only after training, with no bundle."""
    stem = Path(lockstep_run["run_dir"]) / "checkpoint"  # digits_mlp, 2 ranks, 1 epoch
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = run_cli(*LOCKSTEP, "tracking=off", f"resume_from={stem}", "recipe=digits_cnn",
                   "num_epochs=1", f"save_path={afile}/ckpt", f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    err = proc.stderr
    assert f"save_path: must lie in a folder ({afile} is a file)" in err
    assert "recipe.module: must be the bundle's recipe recipes.digits_mlp" in err
    assert "num_epochs: must be above the 1 epoch the bundle holds: num_epochs counts from the " \
           "start, so num_epochs=6 trains 5 more, got 1" in err
    proc = run_cli(*LOCKSTEP, "tracking=off", f"resume_from={stem}", "recipe.params.hidden=32",
                   "num_epochs=2", f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert "resume_from: must hold this run's model (0.weight is [128, 64] in the bundle, [32, 64] " \
           "here" in proc.stderr
    assert "recipe.params.hidden 128 -> 32" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.e2e
def test_an_unreachable_tracking_server_exits_2_at_once(tmp_path):
    """Pins: `tracking=mlflow_server` with no server spending minutes in MLflow's
    retries, then a long traceback, exit 1 and a run dir left behind."""
    with socket.socket() as s:  # a loopback port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("tracking=mlflow_server", f"tracking.uri=http://127.0.0.1:{port}", "num_epochs=1",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert f"tracking.uri: must reach an MLflow tracking server (127.0.0.1:{port}: " in proc.stderr
    assert f"mlflow server --host 127.0.0.1 --port {port}" in proc.stderr
    assert "tracking=off" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def test_a_second_stop_request_names_both_signals_and_stops_at_once():
    """Pins: SIGTERM then SIGINT reporting only SIGINT, and a second request reported as
    `no save within 8s of the ranks' last batch` when it cut the grace short itself."""
    from flodl_run.control.runstate import RunAborted, StopRequest

    stop = StopRequest()
    stop.request("interrupted by SIGTERM")
    stop.request("interrupted by SIGINT")
    with pytest.raises(RunAborted) as aborted:
        stop.check()
    assert aborted.value.reason == "interrupted by SIGTERM; then SIGINT (stopped at once: not saved)"


def test_a_ctrl_c_while_ranks_stop_hurries_to_the_next_signal(tmp_path):
    """Pins: a Ctrl-C during the launcher's wait for its ranks raising out of
    stop_ranks (the run then lost its summary.json and end event); here it moves on to the
    next, harder signal. The rank ignores SIGTERM, so only SIGKILL ends it: with a grace of
    ten minutes per signal, only hurrying gets there before the test's timeout."""
    from flodl_run.launch.rankproc import RankProcess
    from flodl_run.launch.supervisor import stop_ranks

    ignores_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "print('ready', flush=True); time.sleep(900)")
    child = subprocess.Popen([sys.executable, "-S", "-c", ignores_term], start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    rank = RankProcess(0, child, open(tmp_path / "rank0.log", "w"))
    stop_ranks([rank], grace_s=600, hurry=lambda: True)
    assert child.returncode == -signal.SIGKILL
    assert (tmp_path / "rank0.log").read_text() == f"# rank 0 exited with code {-signal.SIGKILL}\n"


@pytest.mark.e2e
def test_sigterm_then_ctrl_c_twice_still_writes_the_summary(tmp_path):
    """Pins: a Ctrl-C during the stop raising a KeyboardInterrupt out of the
    launcher (no summary.json, no `end` event, death by SIGINT), the screen saying nothing for
    the 8 s a stop may wait, and SIGTERM then SIGINT reported as SIGINT only. Each signal waits
    for the line the one before it printed; the last lands wherever the stop has got to."""
    run_dir = tmp_path / "run"
    proc = start_cli(*PAIR, "num_epochs=500", "tracking=off", f"hydra.run.dir={run_dir}")
    seen: list = []

    def until(prefix: str) -> None:
        for line in iter(proc.stdout.readline, ""):
            seen.append(line)
            if line.startswith(prefix):
                return
        raise AssertionError(f"no line {prefix!r}: {''.join(seen)}")

    until("epoch 1/")
    proc.send_signal(signal.SIGTERM)
    until("stopping (SIGTERM): the ranks finish the batch in hand, then the run saves what they "
          "trained (within 8 s of the last batch); Ctrl-C again")
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out = "".join(seen) + proc.communicate(timeout=60)[0]
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["message"].startswith("interrupted by SIGTERM")
    last = json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "end" and last["message"].startswith("interrupted: interrupted by SIGTERM")


def test_default_run_names_say_the_outer_optimizer():
    """Pins: slowmo and diloco runs both named `nccl_cadence-digits_mlp`; a name
    the user gave is kept as given."""
    from flodl_run.config.schema import OuterKind
    from flodl_run.config.validate import resolve
    from flodl_run.report.tracking import _run_name
    from tests.support import make

    diloco = resolve(make(outer__kind=OuterKind.diloco))
    assert diloco.run_name == "nccl_cadence+diloco-digits_mlp"
    assert _run_name(diloco, "solo", "none") == "solo-digits_mlp"  # what trained, in-process
    assert resolve(make(outer__kind=OuterKind.slowmo, run_name="mine")).run_name == "mine"


@pytest.mark.parametrize("choice", ["auto", "solo"])
def test_a_bench_on_one_gpu_runs_its_solo_loops_on_it(choice):
    """Pins: `python -m flodl_run.bench cluster=auto` (or `solo`) on a one-GPU
    host describing `1 CPU ranks` and placing its solo loops on the CPU, while the runner's own
    in-process run with the same cluster trains on the GPU."""
    from flodl_run.bench.run import BenchRunConfig, _solo_job, resolve_rig
    from flodl_run.config.schema import ClusterConfig, Topology
    from flodl_run.hardware.devices import GpuInfo

    gpu = GpuInfo(0, "GPU-0000.invalid", "NVIDIA H200", 141 * 2**30)
    cfg = BenchRunConfig(cluster=ClusterConfig(topology=Topology(choice)))
    rig = resolve_rig(cfg, choice, [], gpus=[gpu])
    assert rig.world_size == 1 and rig.gpu_uuids == (gpu.uuid,)
    assert "(1 GPU ranks" in rig.describe()
    job = _solo_job(rig, cfg.bench, cfg.bench.recipes[0], "digits_mlp", 1.0)
    assert "device=cuda:0" in job.overrides and dict(job.env)["CUDA_VISIBLE_DEVICES"] == gpu.uuid
    assert resolve_rig(cfg, choice, [], gpus=[]).gpu_uuids == ()  # no GPU: its CPU threads


def test_the_bench_terminal_table_keeps_names_whole_and_the_plot_tells_entries_apart(tmp_path):
    """Pins: a 17-column terminal table cutting `nccl_cadence` and
    `nccl_cadence+timeline` to `nccl_cade…`, and bench.png drawing solo@1.0 and torch_localsgd
    (the 1st and 11th entries of matplotlib's 10-colour cycle) in the same dashed blue."""
    import io

    from rich.console import Console

    from flodl_run.bench.report import TERMINAL_COLUMNS, RecipeBench, bench_document, entry_styles, tables
    from flodl_run.bench.run import RunOutcome
    from tests.support import _summary

    names = ["solo@1.0", "solo@2.5", "runner_solo@1.0", "torch_ddp", "nccl_sync", "nccl_cadence",
             "nccl_cadence+timeline", "cpu_sync", "cpu_cadence", "cpu_async", "torch_localsgd"]
    outcomes = [RunOutcome(n, "r", "flodl_run" if n.startswith(("nccl", "cpu")) else "peer",
                           "solo", "none", 2.0, _summary([0.5, 0.6]), str(tmp_path), "python ...")
                for n in names]
    doc = bench_document([RecipeBench("r", 0.55, [1.0, 2.5])], outcomes, {})
    shown = Console(file=io.StringIO(), width=100)
    for table in tables(doc):
        shown.print(table)
    text = shown.file.getvalue()
    assert all(f" {n} " in text for n in names) and "…" not in text, text
    assert len(TERMINAL_COLUMNS) <= 9
    styles = entry_styles(doc["entries"])
    looks = {(s["color"], s["marker"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(names)
    assert styles["solo@1.0"]["color"] != styles["torch_localsgd"]["color"]


def test_train_step_and_eval_step_get_the_params_they_declare(tmp_path, monkeypatch):
    """Pins: `train_step`/`eval_step` called without `recipe.params` while the README says every
    recipe function gets the params it declares (and a `**_` one must not get `model` twice)."""
    from flodl_run.contracts.recipe import import_recipe as load_recipe

    (tmp_path / "declares.py").write_text(
        "from recipes.digits_mlp import build_model, build_optimizer, train_dataset, eval_dataset  # noqa\n"
        "import torch\n"
        "def train_step(model, batch, scale=1.0):\n"
        "    return torch.tensor(scale)\n"
        "def eval_step(model, batch, **params):\n"
        "    return ('eval', sorted(params))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe("declares", {"scale": 3.0, "hidden": 8, "model": "not twice"})
    assert recipe.train_step("m", "b").item() == 3.0
    assert recipe.eval_step("m", "b") == ("eval", ["hidden", "scale"])


def test_every_options_help_line_is_a_whole_sentence():
    """Pins: `--help` showing byte_lm's and grad_accum's first comment line cut mid-sentence."""
    from flodl_run.config.helppage import choose_when

    for option in sorted(REPO.glob("conf/*/*.yaml")):
        if option.parent.name != "hydra":
            assert choose_when(option).endswith("."), option
    assert choose_when(REPO / "conf" / "recipe" / "grad_accum.yaml") == (
        "Choose to see gradient accumulation in a recipe's own loop (synthetic_mlp's model and data).")


def test_the_first_anchor_election_reads_as_one():
    """Pins: the dashboard's events list showing `anchor_rank None -> 1` for the first
    election."""
    from flodl_run.elche.balancer import _anchor_change

    assert _anchor_change(None, 1) == "rank 1 (first)"
    assert _anchor_change(1, 0) == "rank 1 -> rank 0"


def test_a_long_epoch_shows_progress_without_a_terminal():
    """Pins: byte_lm on a CPU showing nothing for ten minutes without a TTY (the epoch line is
    the first). Here the clock is the test's: a line once LINE_EVERY_S has passed, not before."""
    import io

    from rich.console import Console

    from flodl_run.report.progress import LINE_EVERY_S, TerminalProgress

    now = [0.0]
    out = io.StringIO()
    progress = TerminalProgress(Console(file=out, force_terminal=False, width=200), clock=lambda: now[0])
    progress.on_start(24, 400, 2)
    progress.on_batch(0, 10, 5.5)
    assert out.getvalue() == ""
    now[0] = LINE_EVERY_S
    progress.on_batch(0, 120, 3.25)
    progress.on_batch(0, 121, 3.25)  # one line per LINE_EVERY_S
    assert out.getvalue().splitlines() == [
        f"epoch 1/24  batch 120/400  loss 3.2500  {120 / LINE_EVERY_S:.2f} batches/s  "
        f"epoch ETA {280 / (120 / LINE_EVERY_S):,.0f}s"]


def test_a_gpu_sized_model_on_cpu_is_warned_about_by_whoever_builds_it():
    """Pins: byte_lm starting on CPU ranks without a word, then showing `0/24` for over ten
    minutes. Rank 0 (or the in-process run) warns once it has built the model, never the
    launcher (that would run the recipe's build_model there: one that starts processes left
    them behind); a small model gets no warning."""
    from flodl_run.hardware.devices import cpu_training_warning

    assert cpu_training_warning("wide", 16_004_000).startswith(
        "wide builds a 16.0 M-parameter model and trains it on CPU")
    assert cpu_training_warning("wide", 10_100) is None


@pytest.mark.e2e
def test_a_sim_sweep_writes_a_comparison(tmp_path):
    """Pins: `python -m flodl_run.sim -m elche=a,b` writing one sim.json per job and no
    comparison of them, where a training sweep writes one."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "flodl_run.sim", "-m", "elche=nccl_sync,nccl_cadence",
                           "sim.table=none", "sim.windows=10", f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(f"sweep: wrote {sweep}/: comparison.md, comparison.csv") == 1
    table = (sweep / "comparison.md").read_text().splitlines()
    assert table[0] == "| job | overrides | samples/s | x ideal | reduces to settle | mean idle |"
    assert table[2].startswith("| 0 | elche=nccl_sync ") and table[3].startswith("| 1 | elche=nccl_cadence ")
    assert "| - |" not in "\n".join(table[2:])  # every job's figures were read


def test_a_train_step_returning_a_float_is_named_with_its_line(tmp_path, monkeypatch):
    """Pins: `return loss.item()` failing as `'float' object has no attribute 'backward'` with
    only the runtime's frames, on every path (in-process and on each rank)."""
    from flodl_run.contracts.recipe import NotALoss, user_traceback
    from flodl_run.contracts.recipe import import_recipe as load_recipe

    (tmp_path / "floats.py").write_text(
        "from recipes.digits_mlp import build_model, build_optimizer, train_dataset  # noqa: F401\n"
        "def train_step(model, batch):\n"
        "    return 1.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(NotALoss) as caught:
        load_recipe("floats").train_step("m", "b")
    assert str(caught.value).startswith(f"train_step ({tmp_path / 'floats.py'}:2) must return the loss "
                                        "as a scalar tensor")
    assert "got float 1.5; return the tensor, not loss.item()" in str(caught.value)
    assert user_traceback(caught.value) == ""  # the message says where; the frames are all ours
