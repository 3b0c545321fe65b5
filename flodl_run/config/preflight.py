"""What the disk says about a valid config before anything trains: whether the bundle it resumes
can be continued by this run (world size, seed and files, as the checkpoint contract says; the
same recipe and parameter shapes; epochs left to train), and whether its `save_path` can be
written on this host.

Owns only these checks, each a Problem naming the dotted key; reading bundles belongs to
`contracts.checkpoint`, the value rules to `config.validate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from flodl_run.config.schema import ExperimentConfig, Topology
from flodl_run.config.validate import Problem, planned_world_size

LOCAL = (Topology.auto, Topology.solo, Topology.cpu, Topology.local_gpus)
"""Topologies whose bundle is written on this host (elsewhere `save_path` is a remote path)."""


def resume_problems(cfg: ExperimentConfig, world_size: Optional[int],
                    check_model: bool = True) -> List[Problem]:
    """A bundle this run cannot continue is a config error, never a silent fresh start, nor a
    failure in `load_state_dict` after the ranks started. `check_model`: build the recipe's
    model on the meta device to compare its parameter shapes with the bundle's."""
    from flodl_run.contracts.checkpoint import BundleError, check_resume, read_meta

    try:
        meta = read_meta(cfg.resume_from)
    except BundleError as exc:
        return [Problem("resume_from", cfg.resume_from, f"must name a readable bundle ({exc})")]
    size = world_size if world_size is not None else planned_world_size(cfg)
    problems = [Problem("resume_from", cfg.resume_from, f"cannot be resumed here: {why}")
                for why in check_resume(meta, size, cfg.seed, cfg.resume_from)]
    saved = meta.config.get("recipe.module")  # the meta's config is flat: dotted key -> value
    if saved and saved != cfg.recipe.module:
        problems.append(Problem("recipe.module", cfg.recipe.module,
                                f"must be the bundle's recipe {saved} to resume {cfg.resume_from}"))
    elif check_model and not problems:
        problems += _shape_problems(cfg, meta)
    if cfg.num_epochs <= meta.epoch:
        problems.append(Problem("num_epochs", cfg.num_epochs, _more_epochs(meta.epoch)))
    return problems


def _more_epochs(done: int) -> str:
    return (f"must be above the {done} epoch{'s' if done != 1 else ''} the bundle holds: "
            f"num_epochs counts from the start, so num_epochs={done + 5} trains 5 more")


def _shape_problems(cfg: ExperimentConfig, meta: Any) -> List[Problem]:
    """The recipe's parameters against the bundle's model file: another model (other params,
    such as a hidden size) fails here, not in every rank's load_state_dict."""
    import torch

    from flodl_run.contracts.checkpoint import bundle_files
    from flodl_run.contracts.recipe import eager_module, load_recipe

    try:
        saved = torch.load(bundle_files(cfg.resume_from, meta)["model"], map_location="meta",
                           weights_only=True)
        recipe = load_recipe(cfg)
        with torch.device("meta"):
            model = recipe.call("build_model", torch.device("meta"))
        here = {k: tuple(v.shape) for k, v in eager_module(model).state_dict().items()}
    except Exception:  # a recipe that cannot build on the meta device: the ranks' load will say
        return []
    differ = _differences({k: tuple(v.shape) for k, v in saved.items()}, here)
    if not differ:
        return []
    params = _param_changes(meta.config, cfg)
    return [Problem("resume_from", cfg.resume_from,
                    f"must hold this run's model ({'; '.join(differ[:3])}"
                    f"{'; ...' if len(differ) > 3 else ''}){params}")]


def _differences(saved: Dict[str, tuple], here: Dict[str, tuple]) -> List[str]:
    out = [f"{k} is {list(saved[k])} in the bundle, {list(v)} here"
           for k, v in here.items() if k in saved and saved[k] != v]
    out += [f"{k} is not in the bundle" for k in here if k not in saved]
    out += [f"the bundle's {k} is not in this model" for k in saved if k not in here]
    return out


def _param_changes(saved_config: Dict[str, Any], cfg: ExperimentConfig) -> str:
    saved = saved_config.get("recipe.params") or {}
    changed = [f"recipe.params.{k} {saved.get(k)!r} -> {v!r}" for k, v in cfg.recipe.params.items()
               if saved.get(k) != v]
    return f"; the bundle was trained with other params ({', '.join(changed)})" if changed else ""


def save_path_problems(cfg: ExperimentConfig) -> List[Problem]:
    """A `save_path` this host cannot write would be found after training, with no bundle:
    some part of it is a file, or the nearest folder that exists is not writable."""
    if cfg.save_path is None or cfg.cluster.topology not in LOCAL or not cfg.cluster.launch_ranks:
        return []
    folder = Path(cfg.save_path).parent
    for path in [folder, *folder.parents]:
        if not path.exists():
            continue
        if not path.is_dir():
            return [Problem("save_path", cfg.save_path, f"must lie in a folder ({path} is a file)")]
        if not os.access(path, os.W_OK | os.X_OK):
            return [Problem("save_path", cfg.save_path, f"must be writable ({path} is not)")]
        return []
    return []
