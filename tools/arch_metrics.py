"""The architecture's numbers for control/ and rank/, as tests/test_layers.py holds them:
mode checks outside the one module that picks each side's part (`modes.py`), classes over 25
methods, functions over 50 lines or 7 parameters, and the modules that write FLODL_RUN_*
environment names.

    python tools/arch_metrics.py          # a table; exit 0
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent / "flodl_run"
SIDES = ("control", "rank")
CHOOSER = "modes.py"  # the one place on each side that picks the mode's part
MODE_ATTRS = {"mode", "is_sync", "is_collective", "is_progressive", "is_async", "is_central",
              "exact", "collective", "micro", "_exact_path"}
MODE_NAMES = {"mode", "exact", "collective"}
MAX_METHODS, MAX_LINES, MAX_PARAMS = 25, 50, 7


def _mentions_mode(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and (sub.attr in MODE_ATTRS or
                                               isinstance(sub.value, ast.Name) and sub.value.id == "Mode"):
            return True
        if isinstance(sub, ast.Name) and sub.id in MODE_NAMES:
            return True
    return False


def mode_checks(path: Path) -> List[int]:
    """Lines of the decisions that look at the mode (`Mode.x`, `.mode`, `.is_collective` and
    kin, `.exact`, `collective`): the test of an if, elif, while, conditional expression,
    assert or comprehension filter, and any other comparison or and/or on the mode (`fold =
    self.mode.is_collective and ...`). A decision is counted once, however many it names."""
    found, counted = [], set()

    def count(test: ast.AST) -> None:
        if _mentions_mode(test) and id(test) not in counted:
            found.append(test.lineno)
            counted.update(id(sub) for sub in ast.walk(test))

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            count(node.test)
        elif isinstance(node, ast.comprehension):
            for test in node.ifs:
                count(test)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Compare, ast.BoolOp)):
            count(node)
    return found


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return count - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def oversized(path: Path) -> List[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > MAX_METHODS:
                found.append(f"class {node.name}: {len(methods)} methods")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES or _params(node) > MAX_PARAMS:
                found.append(f"{node.name} (line {node.lineno}): {lines} lines, {_params(node)} parameters")
    return found


def env_writers() -> List[str]:
    """Modules that write a FLODL_RUN_* name into an environment mapping: a subscript
    assignment, a dict literal key, or a keyword/`update`/`setdefault` with the name as a
    string constant."""
    writers = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            keys: List[ast.AST] = []
            if isinstance(node, ast.Assign):
                keys = [t.slice for t in node.targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, ast.Dict):
                keys = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("setdefault", "putenv") and node.args:
                keys = [node.args[0]]
            if any(isinstance(k, ast.Constant) and isinstance(k.value, str) and
                   k.value.startswith("FLODL_RUN_") for k in keys):
                writers.append(str(path.relative_to(ROOT.parent)))
                break
    return writers


def measure() -> Dict[str, object]:
    checks: Dict[str, List[Tuple[str, int]]] = {}
    big: List[str] = []
    for side in SIDES:
        checks[side] = []
        for path in sorted((ROOT / side).glob("*.py")):
            if path.name != CHOOSER:
                checks[side] += [(path.name, line) for line in mode_checks(path)]
            big += [f"{side}/{path.name}: {what}" for what in oversized(path)]
    return {"checks": checks, "oversized": big, "env_writers": env_writers()}


def main() -> int:
    m = measure()
    for side, found in m["checks"].items():
        per_file: Dict[str, int] = {}
        for name, _ in found:
            per_file[name] = per_file.get(name, 0) + 1
        print(f"mode checks in {side}/ (outside {CHOOSER}): {len(found)}  "
              + ", ".join(f"{k} {v}" for k, v in sorted(per_file.items(), key=lambda kv: -kv[1])))
    print(f"over {MAX_METHODS} methods, {MAX_LINES} lines or {MAX_PARAMS} parameters:")
    for line in m["oversized"]:
        print(f"  {line}")
    print("modules writing FLODL_RUN_ names: " + ", ".join(m["env_writers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
