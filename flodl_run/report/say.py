"""Terminal lines that carry text we did not write (peer errors, paths, rank output).

rich parses `[...]` as markup, so a Gloo error such as `[/__w/.../pair.cc:545] Read error`
inside a message raises MarkupError in the middle of a death report. Every line that mixes our
styling with foreign text goes through `labelled` (or is printed with markup off). `say` and
`say_labelled` also log the line, so the CLI's log file holds what the terminal showed.

A terminal can also go away under a run (`... 2>&1 | tee log` and a Ctrl-C that ends `tee`
too): `outlive_the_terminal` makes the process's writes to it harmless from then on.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Any, TextIO

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


GONE_ERRNOS = (errno.EPIPE, errno.EIO)
"""A pipe whose reader exited (EPIPE), a terminal that hung up (EIO)."""


class OutlivingStream:
    """A text stream (sys.stdout, sys.stderr) whose writes never fail because its reader went
    away. On the first such failure its file descriptor is pointed at /dev/null, so later
    writes and the interpreter's last flush land there; every other error still raises.

    Without it, rich answers a broken pipe by raising SystemExit(1) from inside `print`: the
    first line after `tee` died (a Ctrl-C's `stopping` line) ended the launcher with exit 1, no
    summary.json, no `end` event and the MLflow run left RUNNING."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError as exc:
                self._went_away(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as exc:
                self._went_away(exc)

    def _went_away(self, exc: OSError) -> None:
        if exc.errno not in GONE_ERRNOS:
            raise exc
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no descriptor of its own (a test's capture): writes stop here
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


def outlive_the_terminal() -> None:
    """From now on, sys.stdout and sys.stderr whose reader exits are written to /dev/null
    instead of failing (idempotent): a run that lost its terminal still writes its own files,
    its end event and its MLflow status, and exits with its own code."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, OutlivingStream):
            setattr(sys, name, OutlivingStream(stream))
