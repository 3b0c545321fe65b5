"""Typed configuration (schemas), its validation, and the Hydra composition edge."""

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
