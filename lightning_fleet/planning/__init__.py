"""The planning core: describe a cluster and a model, estimate a plan, search for the best plans.

Pure Python: imports neither torch, lightning nor deepspeed, so it runs (and is tested) offline.

>>> from lightning_fleet.planning import load_cluster, load_model, plan
>>> result = plan(load_model("gpt3-175b"), load_cluster("dgx-a100-80gb-x128"), top=3)
>>> print(result.best.plan)  # doctest: +SKIP
"""

from lightning_fleet.planning.cluster import (
    Calibration,
    ClusterSpec,
    DeviceGroup,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    PeakTflops,
    RuntimeOverheads,
    cluster_from_dict,
    cluster_presets,
    load_cluster,
)
from lightning_fleet.planning.errors import FleetError, NoFeasiblePlanError, PlanError, SpecError
from lightning_fleet.planning.estimate import Estimate, estimate
from lightning_fleet.planning.model import (
    AttentionKernel,
    BlockSpec,
    FfnKind,
    GradAccumDtype,
    ModelSpec,
    NormKind,
    PositionEmbedding,
    Precision,
    Role,
    TransformerSpec,
    load_model,
    load_transformer,
    model_from_dict,
    model_presets,
    transformer_model,
)
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.planning.plan import Axis, Coordinates, Offload, PartialPlan, Plan, Recompute, parse_partial_plan, parse_plan
from lightning_fleet.planning.search import Constraints, PlanResult, Rejection, RejectionKind, narrow
from lightning_fleet.planning.search import plan  # bound last: the function, not the plan module

__all__ = [
    "AttentionKernel",
    "Axis",
    "BlockSpec",
    "Calibration",
    "ClusterSpec",
    "Constraints",
    "Coordinates",
    "DeviceGroup",
    "DeviceSpec",
    "Estimate",
    "FfnKind",
    "FleetError",
    "GradAccumDtype",
    "HostSpec",
    "LinkSpec",
    "ModelSpec",
    "NoFeasiblePlanError",
    "NormKind",
    "Offload",
    "Overlaps",
    "PartialPlan",
    "PeakTflops",
    "Plan",
    "PlanError",
    "PlanResult",
    "PositionEmbedding",
    "Precision",
    "Recompute",
    "Rejection",
    "RejectionKind",
    "Role",
    "RuntimeOverheads",
    "SpecError",
    "TransformerSpec",
    "cluster_from_dict",
    "cluster_presets",
    "estimate",
    "load_cluster",
    "load_model",
    "load_transformer",
    "model_from_dict",
    "model_presets",
    "narrow",
    "parse_partial_plan",
    "parse_plan",
    "plan",
    "transformer_model",
]
