"""Named experiments and their snapshots.

Owns the `experiment` group (conf/experiment/ and the user's own directories that
`hydra.searchpath=[file://DIR]` adds: DIR/experiment/NAME.yaml) and the snapshot form of a
resolved config: one flat `dotted.key: value` line per field in schema order, secrets redacted,
values that depend on the machine left as their auto `null`. Comparing and printing snapshots
belong to `flodl_run.review`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml
from omegaconf import OmegaConf

from flodl_run.config.compose import dotted_items
from flodl_run.config.schema import ExperimentConfig

GROUP = "experiment"
REDACTED = "<redacted>"
# Auto values resolved from the machine that resolves them: the cwd's outputs/mlflow.db and the
# cores this process may use. A snapshot keeps them `null` (auto), so it reads the same anywhere.
MACHINE_AUTO = ("tracking.uri", "cluster.threads_per_rank")
# A dict entry whose name says it holds a credential (a worker's env, a recipe's params).
SECRET_NAME = re.compile(r"(^|_)(secret|token|password|passwd|api_?key|credentials?|private_key)($|_)",
                         re.IGNORECASE)
URL_PASSWORD = re.compile(r"(://[^/@:\s]+:)[^/@\s]+@")


class ExperimentError(Exception):
    """No experiment of that name, or a search path entry that is not a directory."""


def search_dirs(overrides: Sequence[str]) -> List[Path]:
    """The directories a `hydra.searchpath=[file://DIR, ...]` override adds, in its order.
    `pkg://` entries name installed packages: their experiments are found by Hydra when
    composing, not listed here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    dirs = []
    for override in parsed:
        if override.key_or_group != "hydra.searchpath" or override.is_delete():
            continue
        value = override.value()
        for entry in value if isinstance(value, list) else [value]:
            text = str(entry)
            if text.startswith("file://"):
                dirs.append(Path(text[len("file://"):]))
            elif "://" not in text:
                dirs.append(Path(text))
    return dirs


def experiment_files(config_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Path]:
    """{name: YAML} of every named experiment, sorted by name. conf/ comes first on Hydra's
    search path, so its experiment wins over a user's of the same name."""
    found: Dict[str, Path] = {}
    for root in [config_dir, *search_dirs(overrides)]:
        if not root.is_dir():
            raise ExperimentError(f"hydra.searchpath: {root} is not a directory")
        for path in sorted((root / GROUP).glob("*.yaml")):
            found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


def experiment_overrides(name: str, overrides: Sequence[str]) -> List[str]:
    """The command line of one experiment: `experiment=NAME` and the caller's other overrides."""
    return [f"{GROUP}={name}", *overrides]


def snapshot_items(config: ExperimentConfig, unresolved: Optional[ExperimentConfig] = None
                   ) -> Dict[str, Any]:
    """{dotted key: plain value} of a resolved config as a snapshot holds it: schema order,
    secrets redacted, machine-dependent auto values `null` where `unresolved` left them so."""
    items = {key: _plain(value) for key, value in dotted_items(config).items()}
    if unresolved is not None:
        before = dotted_items(unresolved)
        for key in MACHINE_AUTO:
            if before.get(key) is None:
                items[key] = None
    return {key: _redacted(key, value) for key, value in items.items()}


def snapshot_text(name: str, items: Dict[str, Any]) -> str:
    """The snapshot file of experiment `name`: a header, then one `key: value` line a field."""
    header = (f"# Resolved config of experiment {name}: python -m flodl_run experiment={name}\n"
              "# Written by python -m flodl_run.review --snapshot/--update; review a change here "
              "as a change to the run.\n")
    body = yaml.safe_dump(items, sort_keys=False, default_flow_style=None, width=10**6,
                          allow_unicode=True)
    return header + body


def read_snapshot(text: str) -> Dict[str, Any]:
    """{dotted key: value} of a snapshot file (what snapshot_text wrote)."""
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise ValueError("not a mapping of dotted keys to values")
    return {str(k): v for k, v in loaded.items()}


def normalized(items: Dict[str, Any]) -> Dict[str, Any]:
    """`items` as a snapshot file reads back (YAML's round trip), for comparing with one."""
    return read_snapshot(snapshot_text("-", items))


def config_of(items: Dict[str, Any]) -> Optional[ExperimentConfig]:
    """The typed config a snapshot describes; None when its keys no longer fit the schema (a
    snapshot of an older flodl_run): the field diff still says what changed."""
    nested: Dict[str, Any] = {}
    for key, value in items.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig),
                                 OmegaConf.create(_listed(nested)))
        return OmegaConf.to_object(merged)
    except Exception:  # an unknown key or a value of another type: OmegaConf raises several
        return None


def _listed(node: Any) -> Any:
    """Dicts keyed 0, 1, ... (a flattened list of dataclasses, cluster.workers.0.host) as lists."""
    if not isinstance(node, dict):
        return node
    if node and all(str(k).isdigit() for k in node):
        return [_listed(node[k]) for k in sorted(node, key=int)]
    return {k: _listed(v) for k, v in node.items()}


def _plain(value: Any) -> Any:
    """Enums as their values, dataclasses as dicts, dict keys sorted: YAML-safe and stable."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _redacted(key: str, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_NAME.search(k) and v is not None else _redacted(k, v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(key, v) for v in value]
    if isinstance(value, str):
        if SECRET_NAME.search(key.rsplit(".", 1)[-1]):
            return REDACTED
        return URL_PASSWORD.sub(rf"\1{REDACTED}@", value)
    return value
