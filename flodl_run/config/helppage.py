"""The `--help` page of the runner, the sim and the bench, built from `conf/` itself.

Hydra's help template (`conf/hydra/help/flodl_run.yaml`) calls the `flodl_run_help` resolver;
the page lists the groups this command composes, each option with the first line of its
YAML comment (its "choose when"), then the top-level keys with their values. Options come from
the group folders, so the schema nodes Hydra stores (`base_*`) never show.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List

from omegaconf import DictConfig, OmegaConf

from flodl_run.config.overrides import app_groups

WIDTH = 100
INTRO = {
    "config": ("flodl_run: train one model on several devices; ElChe sizes each rank's work to its "
               "speed.", "python -m flodl_run"),
    "sim": ("flodl_run.sim: what ElChe would do on a rig you describe, without training.",
            "python -m flodl_run.sim"),
    "bench": ("flodl_run.bench: every mode against solo runs and plain torch DDP on one rig.",
              "python -m flodl_run.bench"),
}


def choose_when(path: Path) -> str:
    """The first sentence of an option's leading comment, without the `#`s and Hydra's
    `@package` header, over as many lines as it takes (empty when it has none); a leading
    `Default.` stays in front of it."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.lstrip("#").strip().startswith("@"):  # Hydra's `# @package _global_` header
            lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    prefix = "Default. " if text.startswith("Default. ") else ""
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text[len(prefix):])  # not at `e.g.`
    return prefix + (text[len(prefix):][:end.start() + 1] if end else text[len(prefix):])


def group_lines(config_dir: Path, group: str, chosen: str) -> List[str]:
    """`group  option  choose-when` lines; the option in use is starred."""
    lines = []
    for path in sorted((config_dir / group).glob("*.yaml")):
        mark = "*" if path.stem == chosen else " "
        text = choose_when(path).removeprefix("Default. ")
        head = f"  {group if not lines else '':<10} {mark}{path.stem:<14} "
        body = textwrap.wrap(text, WIDTH - len(head), break_on_hyphens=False) or [""]
        lines.append(head + body[0])
        lines += [" " * len(head) + more for more in body[1:]]
    return lines


def top_level_keys(root: DictConfig, groups: List[str]) -> List[str]:
    """`key=value` of every root key that is not a group (a plain node shows its own keys)."""
    items: List[str] = []
    for key in root.keys():
        if key == "hydra" or key in groups:
            continue
        node = root._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none():
            items += [f"{key}.{sub}={_show(node._get_node(sub))}" for sub in node.keys()]
        else:
            items.append(f"{key}={_show(node)}")
    return textwrap.wrap("  ".join(items), WIDTH - 2, break_on_hyphens=False) or ["(none)"]


def _show(node: Any) -> str:
    if OmegaConf.is_missing(node._get_parent(), node._key()) if node._get_parent() else False:
        return "???"
    value = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node._value()
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, dict):  # YAML flow style, as it would be typed: {rank:0,factor:1.0}
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    text = str(getattr(value, "value", value))
    return text.replace(" ", "")


def page(config_name: str, config_dir: Path, root: DictConfig, choices: Dict[str, str]) -> str:
    """The whole help page of the command whose root YAML is `config_name`."""
    intro, command = INTRO.get(config_name, (config_name, f"python -m flodl_run ({config_name})"))
    groups = app_groups(config_dir, config_name)
    lines = [intro, "",
             f"usage: .venv/bin/python -m {command.split()[-1]} [group=option ...] [key=value ...]",
             "  -m ... a,b       one run per combination (a sweep)",
             "  --cfg job        print the composed config (--resolve: with values filled in)",
             "", "groups (group=option; * = in use), each option with when to choose it:"]
    for group in groups:
        lines += group_lines(config_dir, group, choices.get(group, ""))
    lines += ["", "top-level keys (key=value); a group's own keys go by their dotted path "
              f"({groups[0] + '.<key>' if groups else 'group.key'}):"]
    lines += [f"  {line}" for line in top_level_keys(root, groups)]
    lines += ["", "An unknown key or group exits 2 and names the nearest real one."]
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the template with string.Template


def resolve_help(conf: Path, root: DictConfig) -> str:
    """The `flodl_run_help` resolver's page: the one of the command Hydra is running."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    choices = {k: v for k, v in hydra.runtime.choices.items() if not k.startswith("hydra")}
    return page(hydra.job.config_name, conf, root, choices)


def register(conf_dir: Callable[[], Path]) -> None:
    """Make `${flodl_run_help:}` available to Hydra's help template (idempotent). `conf_dir`
    finds the `conf/` tree when the page is drawn (compose owns where it is)."""
    def flodl_run_help(*, _root_: DictConfig) -> str:
        return resolve_help(conf_dir(), _root_)

    OmegaConf.register_new_resolver("flodl_run_help", flodl_run_help, replace=True)
