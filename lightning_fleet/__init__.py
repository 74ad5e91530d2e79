"""lightning_fleet: adaptive large-model training for PyTorch Lightning.

The planning core (:mod:`lightning_fleet.planning`) describes clusters and models, prices parallel
layouts and chooses one; it imports neither torch, lightning nor deepspeed.
"""

from lightning_fleet.planning import (
    ClusterSpec,
    Constraints,
    Estimate,
    FleetError,
    ModelSpec,
    Plan,
    PlanResult,
    estimate,
    load_cluster,
    load_model,
    parse_plan,
    plan,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec",
    "Constraints",
    "Estimate",
    "FleetError",
    "ModelSpec",
    "Plan",
    "PlanResult",
    "__version__",
    "estimate",
    "load_cluster",
    "load_model",
    "parse_plan",
    "plan",
]
