"""The architecture's numbers for control/ and rank/, as tests/test_layers.py holds them:
mode checks outside the one module that picks each side's part (`modes.py`), classes over 25
methods, functions over 50 lines or 7 parameters, the bound methods and lambdas control/ hands
to calls, and the modules that write FLODL_RUN_* environment names.

    python tools/arch_metrics.py          # a table; exit 0
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent / "flodl_run"  # the tree this copy of the tool is in
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


def callbacks_passed(path: Path) -> List[str]:
    """Bound methods of the class a call is made in (`self._on_x`, not a property) handed to a
    call as arguments, closures (a function defined inside a method) and lambdas that call
    one: a part calling back into its caller. A lambda
    that only reads values (a sort key, a message filter) is not counted."""
    found = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)}

        def bound(node: ast.AST) -> bool:
            return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and node.attr in methods)

        closures = {inner.name for fn in ast.walk(cls) if isinstance(fn, ast.FunctionDef)
                    for inner in ast.walk(fn) if isinstance(inner, ast.FunctionDef) and inner is not fn}
        for call in ast.walk(cls):
            if not isinstance(call, ast.Call):
                continue
            for arg in list(call.args) + [k.value for k in call.keywords]:
                if bound(arg) or isinstance(arg, ast.Name) and arg.id in closures or \
                        isinstance(arg, ast.Lambda) and any(
                        isinstance(sub, ast.Call) and bound(sub.func) for sub in ast.walk(arg.body)):
                    found.append(f"{cls.name} line {arg.lineno}: {ast.unparse(arg)[:60]}")
    return found


def env_writers() -> List[str]:
    """Modules that write a FLODL_RUN_* name into an environment mapping: a subscript
    assignment, a dict literal key, or a `setdefault`/`putenv`, with the name spelled as a
    string or as a module constant that holds one (`COORD_ENV = "FLODL_RUN_COORD"`)."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}
    constants = {target.id for tree in trees.values() for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) and node.value.value.startswith("FLODL_RUN_")
                 for target in node.targets if isinstance(target, ast.Name)}

    def names_one(key: ast.AST) -> bool:
        if isinstance(key, ast.Constant):
            return isinstance(key.value, str) and key.value.startswith("FLODL_RUN_")
        return (isinstance(key, ast.Name) and key.id in constants
                or isinstance(key, ast.Attribute) and key.attr in constants)

    writers = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            keys: List[ast.AST] = []
            if isinstance(node, ast.Assign):
                keys = [t.slice for t in node.targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, ast.Dict):
                keys = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("setdefault", "putenv") and node.args:
                keys = [node.args[0]]
            if any(names_one(k) for k in keys):
                writers.append(str(path.relative_to(ROOT.parent)))
                break
    return writers


def measure() -> Dict[str, object]:
    checks: Dict[str, List[Tuple[str, int]]] = {}
    big: List[str] = []
    callbacks = [f"control/{path.name}: {what}" for path in sorted((ROOT / "control").glob("*.py"))
                 for what in callbacks_passed(path)]
    for side in SIDES:
        checks[side] = []
        for path in sorted((ROOT / side).glob("*.py")):
            if path.name != CHOOSER:
                checks[side] += [(path.name, line) for line in mode_checks(path)]
            big += [f"{side}/{path.name}: {what}" for what in oversized(path)]
    return {"checks": checks, "oversized": big, "callbacks": callbacks, "env_writers": env_writers()}


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
    print(f"callbacks passed as arguments in control/: {len(m['callbacks'])}")
    for line in m["callbacks"]:
        print(f"  {line}")
    print("modules writing FLODL_RUN_ names: " + ", ".join(m["env_writers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
