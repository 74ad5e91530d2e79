"""lightning_fleet: adaptive large-model training for PyTorch Lightning.

``import lightning_fleet`` registers the strategy names ``fleet``, ``fleet_zero3`` and
``fleet_offload`` (as soon as Lightning is imported), so ``Trainer(strategy="fleet")`` works.
The planning core (:mod:`lightning_fleet.planning`) describes clusters and models, prices parallel
layouts and chooses one; it imports neither torch, lightning nor deepspeed, and neither does
``import lightning_fleet`` itself: :class:`FleetStrategy` loads on first use.
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

from lightning_fleet import registration as _registration

__version__ = "0.1.0"

_registration.install()


def __getattr__(name: str):
    """FleetStrategy and FleetCheckpoint are imported lazily (they need torch, Lightning and DeepSpeed)."""
    if name == "FleetStrategy":
        from lightning_fleet.strategy import FleetStrategy

        return FleetStrategy
    if name == "FleetCheckpoint":
        from lightning_fleet.elastic.callback import FleetCheckpoint

        return FleetCheckpoint
    raise AttributeError(f"module 'lightning_fleet' has no attribute {name!r}")


__all__ = [
    "ClusterSpec",
    "Constraints",
    "Estimate",
    "FleetCheckpoint",
    "FleetError",
    "FleetStrategy",
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
