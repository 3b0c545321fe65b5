"""The control plane's parts and who may call whom, read from the code: docs/architecture.md's
tables of the parts' keywords and of the protocols must match the constructors, what
`Coordinator._compose` hands in, and what each part asks of a collaborator typed with a
protocol (tests/test_layers.py checks the imports between subpackages in the same way)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTROL = REPO / "flodl_run" / "control"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_PARAMETERS = 6
# The composition root owns the socket and takes its settings; it is no part.
ROOT = "Coordinator"
KEYWORD = re.compile(r"`(\w+): ([^`=]+?) = ([\w.]+)`")


def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header row begins with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def documented_keywords(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """part -> keyword -> (its type, what the coordinator hands in), as the doc says."""
    return {row[0].strip("`"): {n: (t.strip(), src) for n, t, src in KEYWORD.findall(row[1])}
            for row in table(text, "| part | takes, by keyword")}


def documented_protocols(text: str) -> dict[str, tuple[str, set[str]]]:
    """protocol -> (the class that offers it, the names it may be asked)."""
    return {row[0].strip("`"): (row[1].strip("`"), set(re.findall(r"`(\w+)`", row[2])))
            for row in table(text, "| protocol | offered by |")}


def classes(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    """Every top-level class of the modules (name -> source text), by name."""
    return {node.name: node for text in sources.values() for node in ast.parse(text).body
            if isinstance(node, ast.ClassDef)}


def init_of(cls: ast.ClassDef) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)


def parts(found: dict[str, ast.ClassDef]) -> dict[str, ast.FunctionDef]:
    """The classes built from the run context: first parameter `ctx: RunContext`."""
    out = {}
    for name, cls in found.items():
        init = init_of(cls)
        args = init.args.args[1:] if init is not None else []
        if args and args[0].arg == "ctx" and args[0].annotation is not None \
                and ast.unparse(args[0].annotation) == "RunContext":
            out[name] = init
    return out


def keywords(init: ast.FunctionDef) -> dict[str, str]:
    return {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in init.args.kwonlyargs}


def protocol_members(found: dict[str, ast.ClassDef], name: str) -> set[str]:
    """What a protocol names: its methods and annotated attributes, with its protocol bases'."""
    cls = found[name]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in found:
            names |= protocol_members(found, base.id)
    return names


def protocols(found: dict[str, ast.ClassDef]) -> set[str]:
    return {name for name, cls in found.items()
            if any(ast.unparse(b) == "Protocol" for b in cls.bases)}


def offers(cls: ast.ClassDef, found: dict[str, ast.ClassDef] | None = None) -> set[str]:
    """What a class offers: its methods and properties, and the attributes its __init__ sets;
    with `found`, what its base classes among them offer too."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for base in cls.bases if found is not None else ():
        if isinstance(base, ast.Name) and base.id in found:
            names |= offers(found[base.id], found)
    init = init_of(cls)
    for node in ast.walk(init) if init is not None else ():
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and ast.unparse(leaf.value) == "self":
                    names.add(leaf.attr)
    return names


def asked(cls: ast.ClassDef, attribute: str) -> set[str]:
    """The names the class reads from `self.<attribute>` (the collaborator held there)."""
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
            and ast.unparse(node.value) == f"self.{attribute}"}


def outside_protocol(found: dict[str, ast.ClassDef]) -> list[str]:
    """Every use of a collaborator typed with a protocol beyond what the protocol names, as
    'Part.keyword.name'. A part holds its collaborator as `self.<keyword>` or `self._<keyword>`."""
    known = protocols(found)
    wrong = []
    for name, init in sorted(parts(found).items()):
        for keyword, kind in keywords(init).items():
            if kind not in known:
                continue
            allowed = protocol_members(found, kind)
            used = asked(found[name], keyword) | asked(found[name], f"_{keyword}")
            wrong += [f"{name}.{keyword}.{n}" for n in sorted(used - allowed)]
    return wrong


def handed_in(root: ast.ClassDef, names: set[str]) -> dict[str, dict[str, str]]:
    """part -> keyword -> what the coordinator passes: 'coordinator' for itself,
    'coordinator._x' for one of its own methods, the part's name for `self.<part>`."""
    calls = {}
    for node in ast.walk(root):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            passed = {}
            for kw in node.keywords:
                text = ast.unparse(kw.value)
                if text == "self":
                    text = "coordinator"
                elif text.startswith("self._"):
                    text = "coordinator." + text[len("self."):]
                elif text.startswith("self."):
                    text = text[len("self."):]
                passed[kw.arg] = text
            calls[node.func.id] = passed
    return calls


@pytest.fixture(scope="module")
def found() -> dict[str, ast.ClassDef]:
    return classes({p.name: p.read_text() for p in sorted(CONTROL.glob("*.py"))})


@pytest.fixture(scope="module")
def doc() -> str:
    return ARCHITECTURE.read_text()


def test_no_control_class_takes_more_than_six_parameters(found) -> None:
    """Pins the size of a constructor: more than six parameters says a shared context or a
    protocol is missing (the coordinator, which owns the socket and its settings, aside)."""
    counts = {name: len(init.args.args) - 1 + len(init.args.kwonlyargs)
              for name, cls in found.items() if name != ROOT and (init := init_of(cls)) is not None}
    assert counts and {n: c for n, c in counts.items() if c > MAX_PARAMETERS} == {}


def test_every_part_takes_the_context_then_keywords_as_documented(found, doc) -> None:
    """Pins the table of who may call whom: every part built from the run context is listed,
    takes nothing else positionally, and its keywords and their types are those documented."""
    built = parts(found)
    documented = documented_keywords(doc)
    assert set(built) == set(documented)
    for name, init in built.items():
        assert [a.arg for a in init.args.args] == ["self", "ctx"], name
        assert keywords(init) == {k: t for k, (t, _) in documented[name].items()}, name


def test_the_coordinator_hands_in_what_the_table_says(found, doc) -> None:
    """Pins what each keyword is filled with: the part named (or the coordinator itself,
    through a protocol), so the table says which part may call which."""
    documented = documented_keywords(doc)
    calls = handed_in(found[ROOT], set(documented))
    assert set(calls) == set(documented)
    for name, passed in calls.items():
        assert passed == {k: src for k, (_, src) in documented[name].items()}, name


def test_every_protocol_is_documented_and_offered(found, doc) -> None:
    """Pins the protocols table: each protocol of control/context is listed with exactly the
    names it declares, and the class said to offer it has each of them."""
    documented = documented_protocols(doc)
    assert set(documented) == protocols(found)
    for name, (offerer, names) in documented.items():
        assert names == protocol_members(found, name), name
        assert names <= offers(found[offerer], found), \
            f"{offerer} lacks {sorted(names - offers(found[offerer], found))}"


def test_a_part_asks_a_protocol_only_what_it_names(found) -> None:
    """Pins the narrow interfaces: a part uses a collaborator typed with a protocol only
    through the names that protocol declares."""
    assert outside_protocol(found) == []


def test_the_checks_catch_a_wide_call_and_a_long_constructor() -> None:
    """Pins that the checks see what they are for (a checker that finds nothing passes all):
    a part asking its members for something `Members` does not name is reported, and a
    constructor past six parameters is counted as such."""
    fake = classes({"fake.py": (
        "class Members(Protocol):\n    alive: set\n    def overdue(self): ...\n"
        "class Part:\n    def __init__(self, ctx: RunContext, *, members: Members, a, b, c, d, e):\n"
        "        self.members = members\n"
        "    def go(self):\n        return self.members.alive, self.members.declare_dead(1)\n")})
    assert outside_protocol(fake) == ["Part.members.declare_dead"]
    assert protocol_members(fake, "Members") == {"alive", "overdue"}
    init = init_of(fake["Part"])
    assert len(init.args.args) - 1 + len(init.args.kwonlyargs) == 7 > MAX_PARAMETERS
