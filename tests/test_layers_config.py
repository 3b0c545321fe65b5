"""Functions receive what they use, and the package's modules import each other without cycles.

The whole `ExperimentConfig` goes only to whole-run consumers (the launcher's run, config/, the
run records, the coordinator and the rank process); everything else takes the sub-config or the
values it reads, so that what a function depends on is in its signature.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import import_cycles, import_graph, module_name

PACKAGE = Path(__file__).resolve().parents[1] / "flodl_run"

WHOLE_CONFIG = {
    "flodl_run.train": "the library entry point: one whole run",
    "flodl_run.launch.launcher.launch": "the CLI's run: plans, trains and records one whole run",
    "flodl_run.launch.launcher.run": "plans, trains and records one whole run",
    "flodl_run.launch.launcher._run": "run's body, shared with launch: one whole run",
    "flodl_run.launch.notices.say_what_differs": "what the whole run leaves unsaid: resume, timeline, size",
    "flodl_run.launch.launcher.plan_topology":
        "a hosts or slurm plan checks the config's world-size rules once the world size is known",
    "flodl_run.launch.launcher.one_device_warning": "plans the run as launcher.run would (review)",
    "flodl_run.launch.launcher._world_problems": "validate's world-size rules read the whole config",
    "flodl_run.launch.launcher._check_run": "resume compatibility reads resume_from, seed and the topology",
    "flodl_run.launch.launcher._trajectory_problems":
        "a resumed bundle against the run's epochs, epoch splits and ElChe knobs",
    "flodl_run.launch.launcher._dashboard": "turns the run's config into the dashboard's parts",
    "flodl_run.launch.launcher._record_log": "turns the run's config into the record log's parts",
    "flodl_run.launch.launcher._uploads": "which of the run's files the tracker uploads",
    "flodl_run.launch.launcher._train": "hands the run to the coordinator or the in-process trainer",
    "flodl_run.launch.launcher._train_in_process": "the solo trainer trains the whole run",
    "flodl_run.launch.supervisor.launch_ranks": "builds the Coordinator, which runs the whole run",
    "flodl_run.control.coordinator.Coordinator.__init__": "the coordinator runs the whole run",
    "flodl_run.rank.runner.RankRunner.__init__": "the rank process trains its replica of the whole run",
    "flodl_run.rank.solo.SoloTrainer.__init__": "the in-process trainer trains the whole run",
    "flodl_run.rank.solo.train_solo": "the in-process trainer trains the whole run",
    "flodl_run.data.dataplane.DataPlane.__init__":
        "built by rank and solo (narrowed with them); reads data, batch_size and seed",
    "flodl_run.report.tracking.NullTracker.start": "the tracked run records every config key as a param",
    "flodl_run.report.tracking.MlflowTracker.start": "the tracked run records every config key as a param",
    "flodl_run.report.tracking.MlflowTracker._start_tags": "part of start: the run's tags",
    "flodl_run.report.tracking._params": "every config key, flattened, as the run's params",
    "flodl_run.report.tracking._run_name": "a default name follows the run's mode, outer and recipe",
    "flodl_run.bench.peers.PeerRank.__init__": "the bench's peer rank trains one replica of the run",
    "flodl_run.bench.peers.run_solo": "the bench's peer rank trains one replica of the run",
    "flodl_run.bench.peers.run_rank": "the bench's peer rank trains one replica of the run",
    "flodl_run.bench.peers.spawn": "plans the rig as launcher.run would, then starts its ranks",
    "flodl_run.review.meaning.shape_of": "what a config change means reads the world size, batch, "
                                         "LR scaling, recipe LR, elche, outer and emulated rig",
}
"""Functions and methods (module.qualname) that may take the whole ExperimentConfig, each with
why it needs the whole run rather than part of it. config/ (materialize, validate, compose)
is a whole-run consumer by definition and is not listed."""

TOLERATED_CYCLES: dict = {}
"""Import cycles known and not yet removed, each with the reason it still stands."""


def whole_config_parameters(package: Path) -> dict[str, list[str]]:
    """module.qualname -> its parameters annotated with ExperimentConfig (also inside Optional[...]
    or a string annotation), for every function and method outside config/."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package.parent)
        if module.startswith(f"{package.name}.config"):
            continue
        _collect(ast.parse(path.read_text(), str(path)), module, found)
    return found


def _collect(node: ast.AST, prefix: str, found: dict[str, list[str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{child.name}"
            args = child.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            typed = [a.arg for a in every if a is not None and a.annotation is not None
                     and re.search(r"\bExperimentConfig\b", ast.unparse(a.annotation))]
            if typed:
                found[name] = typed
            _collect(child, name, found)
        elif isinstance(child, ast.ClassDef):
            _collect(child, f"{prefix}.{child.name}", found)


def test_whole_config_only_reaches_whole_run_consumers() -> None:
    """Pins that functions take the sub-config or values they read (ClusterConfig, a host list,
    TrackingConfig, a port): a new `config: ExperimentConfig` parameter outside the allowlist
    fails here, naming the function; pass it what it uses, or list it with a reason."""
    found = whole_config_parameters(PACKAGE)
    unlisted = {name: params for name, params in found.items() if name not in WHOLE_CONFIG}
    assert not unlisted, f"take the sub-config instead of the whole ExperimentConfig: {unlisted}"


def test_whole_config_allowlist_is_current() -> None:
    """Pins that the allowlist shrinks as functions are narrowed: an entry whose function no
    longer takes the whole config (or no longer exists) must be removed."""
    found = whole_config_parameters(PACKAGE)
    stale = sorted(name for name in WHOLE_CONFIG if name not in found)
    assert not stale, f"remove from WHOLE_CONFIG (they no longer take it): {stale}"


def test_whole_config_check_sees_every_kind_of_parameter(tmp_path: Path) -> None:
    """Pins the checker itself: a method's parameter, an Optional, a string annotation and a
    keyword-only one are all seen, and a plain sub-config is not (a checker that parses
    nothing would pass every module)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "def a(config: ExperimentConfig): ...\n"
        "def b(cluster: ClusterConfig, *, whole: Optional[ExperimentConfig] = None): ...\n"
        "class C:\n    def __init__(self, config: 'ExperimentConfig'): ...\n"
        "def d(config: ExperimentConfigs): ...\n")
    assert whole_config_parameters(package) == {
        "pkg.mod.a": ["config"], "pkg.mod.b": ["whole"], "pkg.mod.C.__init__": ["config"]}


def test_no_import_cycles() -> None:
    """Pins that no module of flodl_run imports itself through others (imports inside
    functions count: a lazy import only hides a cycle). A new cycle fails with its chain."""
    cycles = [c for c in import_cycles(import_graph(PACKAGE))
              if frozenset(c) not in TOLERATED_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_check_finds_a_lazy_cycle(tmp_path: Path) -> None:
    """Pins the graph builder and the cycle finder: a cycle closed by an import inside a
    function, through a relative import, is reported as its chain; a one-way import is not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    graph = import_graph(package)
    assert graph["pkg.d"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


ENTRY_POINTS = ("flodl_run.cli", "flodl_run.bench", "flodl_run.sim", "flodl_run.review")
"""Commands a user runs (`.venv/bin/python -m ...`): what they share lives below them
(config/app holds the Hydra edge), so none imports another."""


def test_no_module_imports_an_entry_point() -> None:
    """Pins that the commands stay at the top: a module importing cli, bench, sim or review
    (as bench and sim once took the Hydra helpers from cli) fails here, naming both. Only
    `flodl_run/__main__.py` may start the runner's cli."""
    graph = import_graph(PACKAGE)
    found = sorted((module, entry) for module, imported in graph.items() for entry in ENTRY_POINTS
                   if entry in imported and module != "flodl_run.__main__")
    assert not found, f"modules importing an entry point: {found}"
