"""The package's layers, read from its imports: nothing imports upward, Hydra stays at the
edge, and the ElChe core imports nothing of the imperative shell (tests/test_layers_config.py
checks that there are no import cycles).

Layers go from pure to effectful (docs/architecture.md): each subpackage's docstring says what
it owns and what it may import, and this test holds the code to it. Imports inside functions
count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import FORBIDDEN_ROOTS, _imports, external_imports, import_graph

PACKAGE = Path(__file__).resolve().parents[1] / "flodl_run"

LAYER = {
    "contracts": 0, "hardware": 0, "config": 0,
    "elche": 1, "averaging": 1, "data": 1, "observe": 1,
    "control": 2, "rank": 2,
    "report": 3,
    "launch": 4,
    "bench": 5, "sim": 5, "cli": 5, "review": 5, "submit": 5, "__main__": 5, "": 5,
}
# Imports between two subpackages of one layer: only these (the importer first).
SIDEWAYS = {("hardware", "contracts"), ("config", "contracts")}
# Entry points: nothing outside their own subpackage imports them.
ENTRY = {name for name, layer in LAYER.items() if layer == 5}
# Library modules of an entry point another entry point may import (the importer first): the
# review's estimate is the sim's own pure rig on a run's measured speeds, not the sim's CLI.
ENTRY_LIBRARY = {("review", "flodl_run.sim.rig"), ("review", "flodl_run.sim.measured")}
# The pure ElChe core, and the simulated rig (and its model of nccl_sync) built on it.
CORE = {"elche"}
CORE_MODULES = {"flodl_run.sim.rig", "flodl_run.sim.exact"}
CORE_MAY_IMPORT = {"flodl_run.config.schema"}


def part(module: str) -> str:
    """The subpackage (or top-level module) a module of the package belongs to: '' for the root."""
    return module.split(".")[1] if module.count(".") else ""


def source(module: str) -> Path:
    """The file of a module of the package (a subpackage's __init__.py for a subpackage)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    return path if path.exists() else PACKAGE.parent / module.replace(".", "/") / "__init__.py"


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of the graph that breaks the layering, as 'importer -> imported: rule'."""
    found = []
    for importer, targets in sorted(graph.items()):
        mine = part(importer)
        for target in sorted(targets):
            theirs = part(target)
            if theirs == mine or mine == "__main__":  # `python -m flodl_run` runs the CLI
                continue
            if theirs not in LAYER or mine not in LAYER:
                found.append(f"{importer} -> {target}: {theirs or mine!r} has no layer")
            elif LAYER[theirs] > LAYER[mine]:
                found.append(f"{importer} -> {target}: layer {LAYER[mine]} imports layer {LAYER[theirs]}")
            elif (mine, target) in ENTRY_LIBRARY:
                continue
            elif theirs in ENTRY and theirs != "":
                found.append(f"{importer} -> {target}: entry points are imported by nobody")
            elif LAYER[theirs] == LAYER[mine] and (mine, theirs) not in SIDEWAYS and theirs != "":
                found.append(f"{importer} -> {target}: {mine} and {theirs} share layer {LAYER[mine]}")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_every_subpackage_has_a_layer_and_says_what_it_may_import(graph) -> None:
    """Pins that a new subpackage gets a place in the layers, and a docstring naming its layer."""
    parts = {part(m) for m in graph}
    assert parts <= set(LAYER), f"subpackages without a layer: {sorted(parts - set(LAYER))}"
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        doc = (folder / "__init__.py").read_text()
        assert '"""' in doc and "Layer" in doc, f"flodl_run/{folder.name}/__init__.py: no layer stated"


def test_nothing_imports_upward_or_into_an_entry_point(graph) -> None:
    """Pins the layering: a lower layer never imports a higher one, the coordinator and the
    ranks never import each other, and nothing imports the CLI, bench, sim or review."""
    assert violations(graph) == []


@pytest.mark.parametrize("module", ["elche", "sim.rig", "sim.exact"])
def test_the_core_imports_no_shell(graph, module: str) -> None:
    """Pins the functional core: a clock, socket, file, logger, tracker, tensor or Hydra import
    in the ElChe core or the simulated rig fails here, as does any import of the package's
    shell (only the core itself and the config schemas)."""
    modules = [m for m in graph if m == f"flodl_run.{module}" or m.startswith(f"flodl_run.{module}.")]
    assert modules
    for name in modules:
        shell = [n for n in external_imports(source(name)) if n.split(".")[0] in FORBIDDEN_ROOTS]
        inner = [t for t in graph[name]
                 if part(t) not in CORE and t not in CORE_MAY_IMPORT | CORE_MODULES]
        assert not shell, f"{name} imports shell modules {shell}"
        assert not inner, f"{name} imports non-core package modules {inner}"


def test_the_checks_catch_an_upward_import_and_a_sideways_one() -> None:
    """Pins that the checks see what they are for (a checker that finds nothing passes all)."""
    fake = {
        "flodl_run.elche.guard": {"flodl_run.launch.launcher"},
        "flodl_run.control.reduces": {"flodl_run.rank.replica"},
        "flodl_run.launch.hosts": {"flodl_run.launch.supervisor", "flodl_run.cli"},
        "flodl_run.launch.supervisor": {"flodl_run.launch.hosts"},
        "flodl_run.hardware.hostinfo": {"flodl_run.contracts.wire"},
    }
    assert violations(fake) == [
        "flodl_run.control.reduces -> flodl_run.rank.replica: control and rank share layer 2",
        "flodl_run.elche.guard -> flodl_run.launch.launcher: layer 1 imports layer 4",
        "flodl_run.launch.hosts -> flodl_run.cli: layer 4 imports layer 5",
    ]


def test_the_graph_resolves_every_form_of_import(tmp_path: Path) -> None:
    """Pins the parser: `import a.b`, `from a import b` where b is a module, `from a.b import c`
    where c is a name, relative imports and imports inside functions all land on modules."""
    pkg = tmp_path / "flodl_run"
    (pkg / "elche").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "elche" / "__init__.py").write_text("")
    (pkg / "elche" / "phase.py").write_text("import time\n")
    (pkg / "elche" / "guard.py").write_text(
        "from flodl_run.elche import phase\nfrom . import phase as p\n"
        "def f():\n    from flodl_run.elche.phase import Phase\n    import flodl_run.x\n")
    (pkg / "x.py").write_text("from .elche.guard import f\n")
    got = import_graph(pkg)
    assert got["flodl_run.elche.guard"] == {"flodl_run.elche.phase", "flodl_run.x"}
    assert got["flodl_run.x"] == {"flodl_run.elche.guard"}
    assert external_imports(pkg / "elche" / "phase.py") == ["time"]


def test_hydra_stays_at_the_edge(graph) -> None:
    """Pins 'Hydra at the edge': only `config` and the entry points import hydra or omegaconf;
    everything between takes the typed dataclasses."""
    for name in graph:
        if part(name) == "config" or LAYER.get(part(name)) == 5:
            continue
        hydra = [n for n in external_imports(source(name)) if n.split(".")[0] in {"hydra", "omegaconf"}]
        assert not hydra, f"{name} imports {hydra}"


def _loads_at_import(module: str) -> tuple[set[str], set[str]]:
    """(the package's modules, the outside roots) that loading `module` imports at once: its
    module-level imports and their packages' __init__s, not those inside functions or under
    `if TYPE_CHECKING:`."""
    ours: set[str] = set()
    outside: set[str] = set()
    body = list(ast.parse(source(module).read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body += node.orelse
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            body += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            ours |= {n for n in names if n.startswith("flodl_run")}
            outside |= {n.split(".")[0] for n in names if not n.startswith("flodl_run")}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if not node.module.startswith("flodl_run"):
                outside.add(node.module.split(".")[0])
                continue
            subs = {f"{node.module}.{a.name}" for a in node.names}
            ours |= {sub for sub in subs if source(sub).exists()}  # `from pkg import module`
            ours.add(node.module)
    parents = {".".join(m.split(".")[:k]) for m in ours for k in range(1, m.count(".") + 1)}
    return ours | parents, outside


def test_a_rank_process_loads_no_hydra() -> None:
    """Pins that `python -m flodl_run.rank` (a fresh interpreter for every srun, torchrun and SSH
    rank) loads no Hydra: it reads run.yaml with OmegaConf alone, and Hydra's import cost each
    such rank ~0.12 CPU-s (config.compose imported it at module level for the CLI's use)."""
    seen, todo = set(), ["flodl_run.rank.__main__"]
    chains = {"flodl_run.rank.__main__": "flodl_run.rank.__main__"}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        ours, outside = _loads_at_import(name)
        assert "hydra" not in outside, f"{chains[name]} imports hydra at load"
        for child in ours - seen:
            chains.setdefault(child, f"{chains[name]} -> {child}")
            todo.append(child)
    assert "flodl_run.rank.process" in seen and "flodl_run.config.compose" in seen


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/support.py and shared fixtures in conftest.py: a test module
    that imports another runs that module's fixtures and couples two files nobody reads together."""
    tests = PACKAGE.parent / "tests"
    offenders = {path.name: [name for name in _imports(path) if name.startswith("tests.test_")]
                 for path in sorted(tests.glob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}


def _arch_metrics():
    """tools/arch_metrics.py, the numbers a developer prints (loaded from its file: tools/ is
    no package)."""
    import importlib.util

    path = PACKAGE.parent / "tools" / "arch_metrics.py"
    spec = importlib.util.spec_from_file_location("arch_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_side_decides_the_mode_in_one_place_and_no_part_is_oversized() -> None:
    """Pins the shape of control/ and rank/: the mode is looked at in each side's modes.py and
    at most 8 times elsewhere (it was 26 and 26); no class over 25 methods, no function over 50
    lines or 7 parameters; control/ hands no bound method or closure of its own to a call (the
    reduce returned to windows through `plan_next` and `ahead=`); one module writes the rank's
    FLODL_RUN_ environment (three launchers wrote it)."""
    metrics = _arch_metrics().measure()
    for side, found in metrics["checks"].items():
        assert len(found) <= 8, (side, found)
    assert metrics["oversized"] == []
    assert metrics["callbacks"] == []
    assert len(metrics["env_writers"]) == 1, metrics["env_writers"]


def test_the_architecture_numbers_see_what_they_count(tmp_path: Path) -> None:
    """The counters are not blind: a mode test, an and/or on the mode, a long function, a
    bound method handed to a call and a FLODL_RUN_ key written are each found."""
    arch = _arch_metrics()
    source = tmp_path / "part.py"
    body = "\n".join(f"        x{i} = {i}" for i in range(52))
    source.write_text(
        "class Part:\n"
        "    def run(self, mode):\n"
        "        if self.mode is Mode.cpu_async:\n"
        "            pass\n"
        "        fold = self.mode.is_collective and mode\n"
        "        schedule(self.on_done)\n"
        "    def on_done(self):\n"
        f"{body}\n"
        "env = {'FLODL_RUN_X': '1'}\n")
    assert arch.mode_checks(source) == [3, 5]
    assert arch.callbacks_passed(source) == ["Part line 6: self.on_done"]
    assert arch.oversized(source) == ["on_done (line 7): 53 lines, 0 parameters"]
