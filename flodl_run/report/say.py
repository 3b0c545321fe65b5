"""Terminal lines that carry text we did not write (peer errors, paths, rank output).

rich parses `[...]` as markup, so a Gloo error such as `[/__w/.../pair.cc:545] Read error`
inside a message raises MarkupError in the middle of a death report. Every line that mixes our
styling with foreign text goes through `labelled` (or is printed with markup off). `say` and
`say_labelled` also log the line, so the CLI's log file holds what the terminal showed.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.markup import escape

log = logging.getLogger("flodl_run")


def labelled(label: str, message: str, style: str) -> str:
    """Markup for `label: message` with only the label styled; the message is shown verbatim."""
    return f"[{style}]{escape(label)}:[/] {escape(message)}"


def say(console: Console, text: str) -> None:
    """Print a plain line (no markup) and log it to `flodl_run`: the CLI's log file (cli.log)
    gets what the terminal showed, without the live progress bar."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    log.info(text)


def say_labelled(console: Console, label: str, message: str, style: str) -> None:
    """`label: message` with the label styled, printed and logged like `say`."""
    console.print(labelled(label, message, style), highlight=False, soft_wrap=True)
    log.info("%s: %s", label, message)


def say_markup(console: Console, markup: str) -> None:
    """A line of our own markup (no foreign text in it), printed and logged as plain text."""
    from rich.text import Text

    console.print(markup, highlight=False, soft_wrap=True)
    log.info(Text.from_markup(markup).plain)


def say_table(console: Console, table: object) -> None:
    """A rich table, printed and logged as the text it renders to."""
    import io

    console.print(table)
    text = Console(file=io.StringIO(), width=max(console.width, 120), color_system=None)
    text.print(table)
    log.info("\n%s", text.file.getvalue().rstrip())
