"""Typed configuration (schemas), its validation, and the Hydra composition edge.

Layer 0: may import `contracts`. The only subpackage (with the CLI) that imports Hydra or
OmegaConf; everything below the CLI takes the typed dataclasses.
"""

from flodl_run.config.schema import (  # noqa: F401
    ClusterConfig,
    DataConfig,
    DdpRunConfig,
    ElCheConfig,
    ExperimentConfig,
    GuardKind,
    MaxFailureConfig,
    Mode,
    OuterConfig,
    OuterKind,
    RecipeConfig,
    Reduction,
    Topology,
    TrackingConfig,
    TrackingKind,
)
from flodl_run.config.validate import Problem, Report, resolve, validate  # noqa: F401
