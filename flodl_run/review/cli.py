"""The command line of `python -m flodl_run.review`: parse it, run the review, the diff, the
snapshot commands or the keys' meanings (`--explain`), print, and choose the exit status.

Exit 0: valid (or, for --check, every experiment matches its snapshot). Plain review and the
diffs exit 1 on an invalid config (the runner's messages). --check exits 1 naming each
experiment that drifted; with the snapshot commands an invalid experiment or a bad snapshot
directory exits 2, so 1 always means "differs".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from rich.console import Console

from flodl_run.config.compose import ComposeError, compose
from flodl_run.config.experiments import ExperimentError
from flodl_run.config.keydocs import key_docs
from flodl_run.config.materialize import ConfigError
from flodl_run.report.say import labelled
from flodl_run.review import snapshots
from flodl_run.review.meaning import Rig, meaning_lines, render_meaning, rig_from
from flodl_run.review.table import (
    EXIT_INVALID,
    ReviewError,
    by_section,
    diff_of,
    mode_note,
    paired_rows,
    preset,
    render,
    resolved_from,
    show,
    shown_items,
)
from flodl_run.review.workflow import WORKFLOW

EXIT_DRIFT = 1
EXIT_BAD_INPUT = 2  # argparse's own status for a bad flag, and every config error of the runner


def review(args: argparse.Namespace, console: Console) -> None:
    """Build the review (or the diff) for parsed arguments and print it."""
    if args.against is not None or args.against_ref is not None:
        diff = diff_of(args.overrides, args.against, args.against_ref)
        rows = diff.rows() or [("(no differences)", "", "")]
        render([(diff.title, ("key", "this", "other"), rows, False)], diff.this.warnings,
               args.format, console)
        render_meaning(meaning_lines(diff.other, diff.this, rig_of(args)), args.format, console)
        return
    composed = compose(args.overrides)
    this = resolved_from(composed)
    shown = shown_items(this.config)
    sections = by_section(paired_rows(shown, preset(args.overrides, full=composed)))
    tables = [(name, ("key", "value", "preset"), rows, True) for name, rows in sections.items()]
    render(tables, this.warnings, args.format, console)
    note = mode_note(this.config)
    if note and args.format == "markdown":
        console.print(f"\n**Mode:** {note}\n", markup=False, highlight=False, soft_wrap=True)
    elif note:
        console.print(labelled("mode", note, "cyan"), highlight=False, soft_wrap=True)


def explain(args: argparse.Namespace, console: Console) -> None:
    """--explain [KEY ...]: each key's default and meaning (its schema docstring, then its
    bound as the validator words it); a group or nest name (`elche`, `cluster.slurm`) gives
    all of its keys, none gives every key."""
    docs = key_docs().values()
    asked = args.overrides or [""]
    unknown = [k for k in asked if not any(_under(d.key, k) for d in docs)]
    if unknown:
        raise ReviewError(f"--explain: no config key {', '.join(unknown)} (see "
                          "python -m flodl_run.review --explain for every key)")
    rows = [(d.key, show(d.default), d.text) for d in docs if any(_under(d.key, k) for k in asked)]
    render([("config keys", ("key", "default", "meaning"), rows, False)], [], args.format, console)


def _under(key: str, asked: str) -> bool:
    return not asked or key == asked or key.startswith(asked + ".")


def rig_of(args: argparse.Namespace) -> Rig:
    return rig_from(args.rig_ms, args.rig_sync_ms, args.rig_from)


def check(args: argparse.Namespace, console: Console) -> int:
    """--check DIR: print each drifted experiment; 1 when any did, else 0."""
    directory = Path(args.check)
    drifts = snapshots.check(directory, args.overrides, rig_of(args))
    print_drifts(drifts, args.format, console)
    names = ", ".join(d.name for d in drifts)
    if drifts:
        said = (f"experiments that differ from their snapshots in {directory} ({len(drifts)}): "
                f"{names}; `flodl_run.review --update {directory}` rewrites them")
    else:
        said = f"no experiment differs from its snapshot in {directory}"
    console.print(f"\n{said}" if args.format == "markdown" else said, markup=False,
                  highlight=False, soft_wrap=True)
    return EXIT_DRIFT if drifts else 0


def print_drifts(drifts: List[snapshots.Drift], fmt: str, console: Console) -> None:
    for drift in drifts:
        title = f"experiment {drift.name} {drift.problem}"
        if drift.rows:
            render([(title, ("key", "snapshot", "now"), drift.rows, False)], [], fmt, console)
        else:
            console.print(f"#### {title}" if fmt == "markdown" else title, markup=False,
                          highlight=False, soft_wrap=True)
        render_meaning(drift.lines, fmt, console)


def write(args: argparse.Namespace, console: Console) -> int:
    """--snapshot DIR (every experiment) or --update DIR (what differs, and what is gone)."""
    if args.snapshot is not None:
        names = snapshots.snapshot(Path(args.snapshot), args.overrides)
        console.print(f"wrote {len(names)} snapshots into {args.snapshot}: {', '.join(names)}",
                      markup=False, highlight=False, soft_wrap=True)
        return 0
    drifts = snapshots.update(Path(args.update), args.overrides, rig_of(args))
    print_drifts(drifts, args.format, console)
    changed = ", ".join(d.name for d in drifts) or "none"
    console.print(f"updated snapshots in {args.update}: {changed}", markup=False,
                  highlight=False, soft_wrap=True)
    return 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flodl_run.review",
        description="Print the materialized run config (marking values that differ from their "
                    "preset), a field-level diff of two configs, or check the named experiments "
                    "against their snapshots.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m flodl_run "
                                                     "(with --explain: config keys)")
    other = parser.add_mutually_exclusive_group()
    other.add_argument("--against", metavar="OVERRIDES",
                       help='diff against these overrides (one shell-quoted string)')
    other.add_argument("--against-ref", metavar="GITREF",
                       help="diff against the same overrides on the conf/ tree at a git ref")
    other.add_argument("--snapshot", metavar="DIR",
                       help="write every named experiment's resolved config into DIR/NAME.yaml")
    other.add_argument("--check", metavar="DIR",
                       help="exit 1 naming each experiment whose resolved config differs from "
                            "its snapshot in DIR, with the diff; 0 when none does")
    other.add_argument("--update", metavar="DIR",
                       help="rewrite the snapshots in DIR that differ, remove those of gone "
                            "experiments")
    other.add_argument("--explain", action="store_true",
                       help="print what each config key named (or under a group named) means: "
                            "its default, docstring and allowed range; none named: every key")
    other.add_argument("--print-workflow", action="store_true",
                       help="print the GitHub Actions workflow that runs the check on pull requests")
    parser.add_argument("--format", choices=("table", "markdown"), default="table")
    rig = parser.add_argument_group("the simulator's estimate in a diff (a rig of 2+ ranks)")
    rig.add_argument("--rig-ms", metavar="MS,MS,...",
                     help="ms per batch of each rank (default: cluster.emulate_slowdown x 10 ms)")
    rig.add_argument("--rig-sync-ms", metavar="MS", type=float, help="a reduce's wall in ms")
    rig.add_argument("--rig-from", metavar="RUN_DIR", type=Path,
                     help="the speeds a run measured (its summary.json and run.yaml)")
    args = parser.parse_intermixed_args(argv)
    if args.rig_ms is not None:
        try:
            rig_from(args.rig_ms, None, None)
        except ValueError:
            parser.error(f"--rig-ms: must be ms per batch separated by commas, got {args.rig_ms!r}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    console = Console()
    snapshotting = any(v is not None for v in (args.snapshot, args.check, args.update))
    try:
        if args.print_workflow:
            console.print(WORKFLOW, end="", markup=False, highlight=False, soft_wrap=True)
            return 0
        if args.explain:
            explain(args, console)
            return 0
        if args.check is not None:
            return check(args, console)
        if snapshotting:
            return write(args, console)
        review(args, console)
    except (ComposeError, ConfigError, ReviewError, ExperimentError) as exc:
        Console(stderr=True).print(labelled("flodl_run", str(exc), "bold red"), highlight=False,
                                   soft_wrap=True)
        return EXIT_BAD_INPUT if snapshotting else EXIT_INVALID
    return 0


if __name__ == "__main__":
    sys.exit(main())
