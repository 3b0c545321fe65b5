"""The materialized run config as a table or a diff to review.

Owns turning overrides into rows grouped by section (key, value, the preset's value), the
field-level diff against other overrides (`--against`) or the conf/ tree at a git ref
(`--against-ref`), and their rich or GitHub-markdown rendering. Composition and validation
belong to `flodl_run.config`; what a change means, to `review.meaning`.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from flodl_run.config.compose import (
    GROUPS,
    choices,
    compose,
    conf_dir,
    dotted_items,
)
from flodl_run.config.materialize import ConfigError, Materialized, materialize
from flodl_run.config.schema import Mode
from flodl_run.config.validate import Problem, planned_world_size
from flodl_run.contracts.recipe import RecipeError, locate
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


def resolved(overrides: Sequence[str], config_dir: Optional[Path] = None) -> Materialized:
    """The materialized run config with every warning the launcher would print; raises on
    invalid input."""
    return resolved_from(compose(overrides, config_dir=config_dir))


def validated(composed: DictConfig) -> Materialized:
    """A composed config materialized: every value and rule checked, the recipe module found
    but not imported. Importing a recipe (torch) costs seconds, more than composing and
    validating; its contract (train_step, datasets) is checked when the run starts."""
    result = materialize(composed, check_recipe=False)
    try:
        locate(result.config.recipe.module)
    except RecipeError as exc:
        raise ConfigError([Problem(exc.key, exc.value, exc.rule)], result.warnings) from None
    return result


def resolved_from(composed: DictConfig) -> Materialized:
    """A composed config validated, with the launcher's one-device notice among its warnings."""
    from flodl_run.launch.launcher import one_device_warning

    result = validated(composed)
    notice = one_device_warning(result.config)
    return dataclasses.replace(result, warnings=result.warnings + ([notice] if notice else []))


def materialized(overrides: Sequence[str], config_dir: Optional[Path] = None
                 ) -> Tuple[Dict[str, str], List[str]]:
    """{dotted key: shown value} of the run config, plus its warnings; raises on invalid input."""
    result = resolved(overrides, config_dir)
    return shown_items(result.config), result.warnings


def shown_items(config: Any) -> Dict[str, str]:
    """{dotted key: value as typed in YAML} of a typed config, in schema order."""
    return {k: show(v) for k, v in dotted_items(config).items()}


def mode_note(config: Any) -> Optional[str]:
    """What nccl_sync means for this materialized config (exact gradient averaging and its
    global batch, or floDl's parameter averaging); None for the other modes."""
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


def preset(overrides: Sequence[str], config_dir: Optional[Path] = None,
           full: Optional[DictConfig] = None) -> Dict[str, str]:
    """The config of only the group selections among `overrides`, without the recipe check.

    A mandatory key that the preset leaves open (recipe=custom's `recipe.module`) shows as
    `???`; it is borrowed from the full config only so that the rest can materialize.
    """
    if full is None:  # the config of all the overrides, when the caller has not composed it
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


@dataclasses.dataclass(frozen=True)
class Diff:
    """Two materialized configs side by side: `this` (the overrides on the working tree) and
    `other` (the other overrides, or conf/ at a git ref), under a title."""

    this: Materialized
    other: Materialized
    title: str

    def rows(self) -> List[Row]:
        """The fields whose values differ, this side's first."""
        pairs = paired_rows(shown_items(self.this.config), shown_items(self.other.config))
        return [r for r in pairs if r[1] != r[2]]


def diff_of(overrides: Sequence[str], against: Optional[str], against_ref: Optional[str]) -> Diff:
    """This config and the other one (`--against` overrides, or conf/ at `--against-ref`)."""
    this = resolved(overrides)
    if against is not None:
        return Diff(this, resolved(shlex.split(against)), f"diff: this vs {against!r}")
    with tempfile.TemporaryDirectory(prefix="flodl_review_") as tmp:
        other = resolved(overrides, config_dir=conf_at_ref(against_ref, Path(tmp)))
    return Diff(this, other, f"diff: working tree vs conf/ at {against_ref}")


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
