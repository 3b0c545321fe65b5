"""Terminal lines that carry text we did not write (peer errors, paths, rank output).

rich parses `[...]` as markup, so a Gloo error such as `[/__w/.../pair.cc:545] Read error`
inside a message raises MarkupError in the middle of a death report. Every line that mixes our
styling with foreign text goes through `labelled` (or is printed with markup off).
"""

from __future__ import annotations

from rich.markup import escape


def labelled(label: str, message: str, style: str) -> str:
    """Markup for `label: message` with only the label styled; the message is shown verbatim."""
    return f"[{style}]{escape(label)}:[/] {escape(message)}"
