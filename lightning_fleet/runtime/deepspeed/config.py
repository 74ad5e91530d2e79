"""Plan -> DeepSpeed config dict.

Pure: imports neither torch nor deepspeed (DeepSpeed reads the dict); imported by the DeepSpeed backend and the
strategy. What DeepSpeed can execute at all is stated in ``capabilities.py`` beside it.
"""

from __future__ import annotations

from typing import Any

from lightning_fleet.planning.memory import BUCKET_ELEMENTS
from lightning_fleet.planning.plan import Offload, Plan
from lightning_fleet.runtime.base import TensorParallelSpec


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
