"""What each config key means, as the schema says it: its docstring and its declared bound.

Owns reading the attribute docstrings of `config.schema` (the string under each field) and
joining them with the field's bound (`config.bounds`), so that a key's documented range is the
one the validator checks. `python -m flodl_run.review --explain` prints them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Dict, Optional

from flodl_run.config.bounds import Bound, allows_none, bound_of
from flodl_run.config.schema import ExperimentConfig


@dataclass(frozen=True)
class KeyDoc:
    """One dotted key (`*` for any list index), its default, docstring and bound."""

    key: str
    default: Any
    doc: str
    bound: Optional[Bound] = None
    nullable: bool = False

    @property
    def text(self) -> str:
        """The docstring on one line, then the bound in the validator's words:
        `Initial anchor: batches the slowest rank runs per window. Must be >= 1.`"""
        if self.bound is None:
            return self.doc
        rule = self.bound.rule
        said = rule[0].upper() + rule[1:] + (" (or null)" if self.nullable else "")
        return f"{self.doc} {said}." if self.doc else f"{said}."


@functools.lru_cache(maxsize=None)
def docstrings(cls: type) -> Dict[str, str]:
    """The attribute docstrings of a dataclass and its bases, each on one line: the string
    literal right under a field (what Sphinx's autodoc reads)."""
    found: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                found[node.target.id] = " ".join(after.value.value.split())
    return found


def key_docs(cls: type = ExperimentConfig, prefix: str = "") -> Dict[str, KeyDoc]:
    """Every dotted key of a schema class in declaration order (nested configs walked;
    list-of-dataclass items as `<key>.*.<field>`), each with what it means."""
    docs: Dict[str, KeyDoc] = {}
    hints = typing.get_type_hints(cls)
    said = docstrings(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        item = (typing.get_args(kind) or [None])[0]
        if dataclasses.is_dataclass(kind):
            docs.update(key_docs(kind, key + "."))
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        docs[key] = KeyDoc(key, default, said.get(f.name, ""), bound_of(f), allows_none(f))
        if typing.get_origin(kind) is list and dataclasses.is_dataclass(item):
            docs.update(key_docs(item, key + ".*."))
    return docs
