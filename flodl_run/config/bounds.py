"""A config number's range, declared once on its schema field.

Owns `bounded(default, ge=..., gt=..., le=..., lt=...)`, the field metadata it writes and the
rule's wording. `config.validate` checks every bound against the value and `config.keydocs`
prints it beside the field's docstring, so neither states a range of its own. Rules between
keys, or that hold in one mode or topology only, stay explicit in `config.validate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

BOUND = "flodl_run.bound"
"""The field-metadata key a bound sits under."""

Number = float  # an int bound stays an int: the rule shows it as declared (`>= 1`, `[0.0, 0.9]`)


@dataclass(frozen=True)
class Bound:
    """The closed (ge, le) or open (gt, lt) ends of a number's range; None = unbounded there."""

    ge: Optional[Number] = None
    gt: Optional[Number] = None
    le: Optional[Number] = None
    lt: Optional[Number] = None

    def __post_init__(self) -> None:
        if (self.ge is not None and self.gt is not None) or (self.le is not None and self.lt is not None):
            raise TypeError("a bound has at most one lower end (ge or gt) and one upper (le or lt)")
        if self.low is None and self.high is None:
            raise TypeError("a bound needs an end")

    @property
    def low(self) -> Optional[Number]:
        return self.ge if self.ge is not None else self.gt

    @property
    def high(self) -> Optional[Number]:
        return self.le if self.le is not None else self.lt

    def admits(self, value: Any) -> bool:
        """`value` lies in the range. A lone `>=` end is checked as `not value < low`, so NaN
        passes it while every other shape refuses NaN, as the rules written out before did."""
        if self.high is None and self.ge is not None:
            return not value < self.ge
        low_ok = self.low is None or (self.ge <= value if self.ge is not None else self.gt < value)
        high_ok = self.high is None or (value <= self.le if self.le is not None else value < self.lt)
        return low_ok and high_ok

    @property
    def rule(self) -> str:
        """The validator's wording: `must be >= 1`, `must be > 0`, `must be in (0, 1]`."""
        if self.high is None:
            return f"must be {'>=' if self.ge is not None else '>'} {self.low}"
        if self.low is None:
            return f"must be {'<=' if self.le is not None else '<'} {self.high}"
        opening = "[" if self.ge is not None else "("
        closing = "]" if self.le is not None else ")"
        return f"must be in {opening}{self.low}, {self.high}{closing}"


def bounded(default: Any, *, ge: Optional[Number] = None, gt: Optional[Number] = None,
            le: Optional[Number] = None, lt: Optional[Number] = None) -> Any:
    """A dataclass field with `default` whose value must lie in the range given: `>= ge`,
    `> gt`, `<= le`, `< lt`. A field typed Optional may also be None (null)."""
    return dataclasses.field(default=default, metadata={BOUND: Bound(ge=ge, gt=gt, le=le, lt=lt)})


def bound_of(f: dataclasses.Field) -> Optional[Bound]:
    """The bound declared on a dataclass field; None when it has none."""
    return f.metadata.get(BOUND)


def allows_none(f: dataclasses.Field) -> bool:
    """The field's annotation admits None (`Optional[...]`; the schema's annotations are strings)."""
    kind = f.type if isinstance(f.type, str) else repr(f.type)
    return "Optional[" in kind or "None" in kind
