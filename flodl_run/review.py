"""`python -m flodl_run.review`: the materialized run config as a table or a diff to review.

Owns turning overrides into rows grouped by section (key, value, the preset's value), the
field-level diff against other overrides (`--against`) or the conf/ tree at a git ref
(`--against-ref`), and their rich or GitHub-markdown rendering. Composition and validation
belong to `flodl_run.config`. Exit 0 when valid, 1 when invalid (the runner's messages).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from flodl_run.config.compose import (
    GROUPS,
    ComposeError,
    choices,
    compose,
    conf_dir,
    dotted_items,
)
from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import Mode
from flodl_run.config.validate import planned_world_size
from flodl_run.report.say import labelled

EXIT_INVALID = 1
SECTIONS = (*GROUPS, "run")
ABSENT = "-"  # shown where one side of a diff (or the preset) has no such key

Row = Tuple[str, str, str]  # key, this value, the other value (preset or the diff's other side)


class ReviewError(Exception):
    """The review itself cannot proceed (e.g. `git archive` failed); exits 1 like a bad config."""


def show(value: Any) -> str:
    """One value as a user would type it in YAML: null, true, [1, 2], {a: 1}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "value") and hasattr(type(value), "__members__"):
        return show(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return str(value)


def section_of(key: str) -> str:
    """`elche.anchor` -> elche; top-level keys (and run-scope nests like max_failure) -> run."""
    head, dot, _ = key.partition(".")
    return head if dot and head in GROUPS else "run"


def materialized(overrides: Sequence[str], config_dir: Optional[Path] = None
                 ) -> Tuple[Dict[str, str], List[str]]:
    """{dotted key: shown value} of the run config, plus its warnings; raises on invalid input."""
    from flodl_run.launch.launcher import one_device_warning

    result = materialize(compose(overrides, config_dir=config_dir))
    notice = one_device_warning(result.config)
    warnings = result.warnings + ([notice] if notice else [])
    return {k: show(v) for k, v in dotted_items(result.config).items()}, warnings


def mode_note(overrides: Sequence[str]) -> Optional[str]:
    """What nccl_sync means for this config (exact gradient averaging and its global batch, or
    floDl's parameter averaging); None for the other modes."""
    config = materialize(compose(overrides)).config
    elche, batch = config.elche, config.batch_size
    if elche.mode is not Mode.nccl_sync:
        return None
    if not elche.averages_gradients:
        return ("nccl_sync averages parameters (elche.sync_average=params, floDl's variant): each "
                "rank takes its own optimizer step, then the replicas are averaged")
    world = planned_world_size(config)
    step = f"{world} x {batch} = {world * batch}" if world else f"world_size x {batch}"
    split = ("by elche.partition_ratios" if elche.partition_ratios
             else "so their steps end together (a fixed cost plus a cost per sample, fitted)")
    return (f"nccl_sync averages gradients (exact, torch DDP's trajectory): each global step has "
            f"{step} samples, split between the ranks {split}; each rank's gradient weighs its "
            f"share / the step's samples inside backward and every rank takes the same optimizer "
            f"step; a share above {elche.micro_batch_size or batch} samples is cut into micro-batches")


def preset(overrides: Sequence[str], config_dir: Optional[Path] = None) -> Dict[str, str]:
    """The config of only the group selections among `overrides`, without the recipe check.

    A mandatory key that the preset leaves open (recipe=custom's `recipe.module`) shows as
    `???`; it is borrowed from the full config only so that the rest can materialize.
    """
    full = compose(overrides, config_dir=config_dir)
    base = compose(choices(overrides), config_dir=config_dir)
    open_keys = sorted(OmegaConf.missing_keys(base))
    for key in open_keys:
        OmegaConf.update(base, key, OmegaConf.select(full, key), merge=False)
    try:
        items = dotted_items(materialize(base, check_recipe=False).config)
    except ConfigError:  # a preset that breaks a rule on its own has no values to compare
        return {}
    shown = {k: show(v) for k, v in items.items()}
    shown.update({key: "???" for key in open_keys})
    return shown


def paired_rows(this: Dict[str, str], other: Dict[str, str]) -> List[Row]:
    """Every key of either side in order (this side's first), the missing side shown as -."""
    keys = list(this) + [k for k in other if k not in this]
    return [(k, this.get(k, ABSENT), other.get(k, ABSENT)) for k in keys]


def by_section(rows: Iterable[Row]) -> Dict[str, List[Row]]:
    grouped: Dict[str, List[Row]] = {name: [] for name in SECTIONS}
    for row in rows:
        grouped[section_of(row[0])].append(row)
    return {name: rows for name, rows in grouped.items() if rows}


def conf_at_ref(ref: str, workdir: Path) -> Path:
    """Extract the conf/ tree of git ref `ref` into `workdir`; returns the extracted conf dir."""
    root = conf_dir().parent
    archive = subprocess.run(["git", "-C", str(root), "archive", ref, "conf"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        reason = archive.stderr.decode(errors="replace").strip()
        raise ReviewError(f"--against-ref: cannot read conf/ at {ref!r}: {reason}")
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive.stdout, check=True)
    return workdir / "conf"


def diff_rows(overrides: Sequence[str], against: Optional[str],
              against_ref: Optional[str]) -> Tuple[List[Row], List[str], str]:
    """Rows that differ between this config and the other one, this side's warnings, a title."""
    this, warnings = materialized(overrides)
    if against is not None:
        other, _ = materialized(shlex.split(against))
        title = f"diff: this vs {against!r}"
    else:
        with tempfile.TemporaryDirectory(prefix="flodl_review_") as tmp:
            other, _ = materialized(overrides, config_dir=conf_at_ref(against_ref, Path(tmp)))
        title = f"diff: working tree vs conf/ at {against_ref}"
    return [r for r in paired_rows(this, other) if r[1] != r[2]], warnings, title


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Row], mark: bool) -> Table:
    """A rich table; with `mark`, rows whose two values differ get a yellow `*`."""
    table = Table(title=title, title_justify="left")
    if mark:
        table.add_column(" ", width=1)
    table.add_column(headers[0], no_wrap=True)  # dotted keys stay whole: they are what users type
    for header in headers[1:]:
        table.add_column(header, overflow="fold")
    for key, a, b in rows:
        changed = mark and a != b
        marker = ["*" if changed else ""] if mark else []
        table.add_row(*marker, key, a, b, style="yellow" if changed else None)
    return table


def markdown_table(title: str, headers: Sequence[str], rows: Sequence[Row], mark: bool) -> str:
    """A GitHub markdown table; with `mark`, differing values are bold."""
    def cell(text: str) -> str:
        return "`" + text.replace("|", "\\|") + "`" if text else " "

    lines = [f"#### {title}", "", "| " + " | ".join(headers) + " |",
             "|" + "---|" * len(headers)]
    for key, a, b in rows:
        value = f"**{cell(a)}**" if mark and a != b else cell(a)
        lines.append(f"| {cell(key)} | {value} | {cell(b)} |")
    return "\n".join(lines) + "\n"


def render(tables: List[Tuple[str, Sequence[str], List[Row], bool]], warnings: List[str],
           fmt: str, console: Console) -> None:
    """Print the tables then the warnings, as rich output or GitHub markdown."""
    if fmt == "markdown":
        text = "\n".join(markdown_table(*spec) for spec in tables)
        if warnings:
            text += "\n**Warnings**\n\n" + "".join(f"- {w}\n" for w in warnings)
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return
    for spec in tables:
        console.print(rich_table(*spec))
    for warning in warnings:
        console.print(labelled("warning", warning, "yellow"), highlight=False, soft_wrap=True)


def review(args: argparse.Namespace, console: Console) -> None:
    """Build the review (or the diff) for parsed arguments and print it."""
    if args.against is not None or args.against_ref is not None:
        rows, warnings, title = diff_rows(args.overrides, args.against, args.against_ref)
        if not rows:
            rows = [("(no differences)", "", "")]
        render([(title, ("key", "this", "other"), rows, False)], warnings, args.format, console)
        return
    this, warnings = materialized(args.overrides)
    sections = by_section(paired_rows(this, preset(args.overrides)))
    tables = [(name, ("key", "value", "preset"), rows, True) for name, rows in sections.items()]
    render(tables, warnings, args.format, console)
    note = mode_note(args.overrides)
    if note and args.format == "markdown":
        console.print(f"\n**Mode:** {note}\n", markup=False, highlight=False, soft_wrap=True)
    elif note:
        console.print(labelled("mode", note, "cyan"), highlight=False, soft_wrap=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flodl_run.review",
        description="Print the materialized run config (marking values that differ from their "
                    "preset), or a field-level diff of two configs.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m flodl_run")
    other = parser.add_mutually_exclusive_group()
    other.add_argument("--against", metavar="OVERRIDES",
                       help='diff against these overrides (one shell-quoted string)')
    other.add_argument("--against-ref", metavar="GITREF",
                       help="diff against the same overrides on the conf/ tree at a git ref")
    parser.add_argument("--format", choices=("table", "markdown"), default="table")
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 valid, 1 invalid)."""
    args = parse_args(argv)
    try:
        review(args, Console())
    except (ComposeError, ConfigError, ReviewError) as exc:
        Console(stderr=True).print(labelled("flodl_run", str(exc), "bold red"), highlight=False,
                                     soft_wrap=True)
        return EXIT_INVALID
    return 0


if __name__ == "__main__":
    sys.exit(main())
