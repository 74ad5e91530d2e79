"""Plan -> DeepSpeed config dict. Pure: no torch, no deepspeed import; DeepSpeed reads the dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_fleet.planning.memory import BUCKET_ELEMENTS
from lightning_fleet.planning.plan import Offload, Plan
from lightning_fleet.planning.search import Constraints


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelSpec:
    """Which Linear weights AutoTP splits: regexes over parameter names (DeepSpeed ``partition_config``)."""

    column: tuple[str, ...]
    """Weights split along the output dimension (QKV, MLP up-projection)."""
    row: tuple[str, ...]
    """Weights split along the input dimension (attention output, MLP down-projection)."""


def deepspeed_config(
    plan: Plan,
    *,
    gradient_clipping: float = 0.0,
    overlap_comm: bool = False,
    tensor_parallel: TensorParallelSpec | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config that executes ``plan`` (precision keys are added by Lightning's precision plugin).

    Buckets are BUCKET_ELEMENTS, the size the memory model assumes; ``overlap_comm`` is worth it on
    GPUs (separate streams), not on CPU/gloo.
    """
    zero: dict[str, Any] = {
        "stage": plan.zero,
        "reduce_bucket_size": BUCKET_ELEMENTS,
        "allgather_bucket_size": BUCKET_ELEMENTS,
        "overlap_comm": overlap_comm,
        "contiguous_gradients": plan.zero >= 2,
    }
    if plan.zero == 3:
        zero["stage3_prefetch_bucket_size"] = BUCKET_ELEMENTS
        zero["stage3_param_persistence_threshold"] = 0
    if plan.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if plan.offload is Offload.OPTIMIZER_PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.mbs,
        "gradient_accumulation_steps": plan.gas,
        "gradient_clipping": gradient_clipping,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # the user's optimizer from configure_optimizers may run on offloaded states
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if plan.tp > 1:
        if tensor_parallel is None:
            raise ValueError(f"plan {plan} has tp={plan.tp} but no tensor-parallel layer patterns were given")
        config["tensor_parallel"] = {
            "autotp_size": plan.tp,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": list(tensor_parallel.column), "partition_type": "column"},
                    {"patterns": list(tensor_parallel.row), "partition_type": "row"},
                ],
            },
        }
    return config


def runtime_constraints(*, has_tensor_parallel: bool, has_pipeline: bool, has_layers: bool, allow_offload: bool = True, **narrower: Any) -> Constraints:
    """What the DeepSpeed runtime really executes, as planner constraints.

    No sequence parallelism and no interleaved pipeline (DeepSpeed has neither for AutoTP / its
    pipeline engine), ZeRO <= 1 with pp > 1 ("ZeRO-2 and ZeRO-3 are incompatible with pipeline
    parallelism"), neither AutoTP nor offload inside the pipeline engine, the default placement
    only, full recomputation only where the layers are known, tp and pp only where the module
    provides the hooks. ``narrower`` fields (e.g. zero_stages, max_tp) narrow further.
    """
    max_tp = narrower.pop("max_tp", None)
    max_pp = narrower.pop("max_pp", None)
    return Constraints(
        allow_sp=False,
        max_vpp=1,
        max_zero_with_pp=1,
        search_placement=False,
        tp_with_pp=False,
        offload_with_pp=False,
        allow_offload=allow_offload,
        recompute=("none", "full") if has_layers else ("none",),
        max_tp=(max_tp or None) if has_tensor_parallel else 1,
        max_pp=(max_pp or None) if has_pipeline else 1,
        **narrower,
    )
