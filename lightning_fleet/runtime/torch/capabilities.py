"""What the torch runtime executes, as one :class:`~lightning_fleet.runtime.base.Capabilities` value: ``TORCH``.

Pure: imports only :mod:`lightning_fleet.runtime.base` and the planning core's :class:`Overlaps` (no torch); read by the
runtime table (:mod:`lightning_fleet.runtime`), the decision and ``fleet plan --runtime torch``. Each limit says where
it comes from (torch 2.13's sources under torch/, or what runtime/torch/backend.py builds).
"""

from __future__ import annotations

from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.runtime.base import Capabilities

TORCH_OVERLAPS = Overlaps(
    # DistributedDataParallel's reducer launches each bucket's all-reduce asynchronously from the autograd hooks as the
    # bucket's gradients become ready (torch/csrc/distributed/c10d/reducer.cpp mark_variable_ready ->
    # all_reduce_bucket), so the reduction runs behind the rest of backward; under no_sync() (the step's first gas-1
    # micro-batches) it reduces nothing, i.e. behind the last micro-batch's backward
    dp_grad_reduce=(0,),
    # nothing gathers weights at shard level 0
    dp_param_gather=(),
)
"""What torch's DistributedDataParallel runs beside compute (on CPU/gloo the calibrated ``overlap`` says how much hides)."""

TORCH = Capabilities(
    name="torch",
    label="torch",
    # shard level 0 is DistributedDataParallel (runtime/torch/backend.py)
    zero_stages=(0,),
    # DTensor's parallelize_module is not wired yet: tp plans run on DeepSpeed's AutoTP
    tensor_parallel=False,
    sequence_parallel=False,
    # torch.distributed.pipelining is the pipelines issue's work: pp plans run on DeepSpeed's pipeline engine
    pipeline=False,
    interleaved_pipeline=False,
    uneven_stages=False,
    # DDP averages the replicas' gradients (reducer.cpp divides by the world size), so each replica's loss weighted by
    # its share (strategy.py _weighted) gives the global batch's mean gradient, as for DeepSpeed
    uneven_dp=True,
    uneven_dp_with_pp=False,
    max_zero_with_pp=0,
    tp_with_pp=False,
    # FSDP2's CPUOffloadPolicy needs shard levels 2-3, which this runtime does not run yet
    offload=False,
    offload_with_pp=False,
    # one flat data-parallel group: nothing to place
    any_placement=False,
    selective_recompute=False,
    op_recompute=False,
    # full recomputation wraps each layer of the layer stack in torch.utils.checkpoint, as for DeepSpeed
    full_recompute_needs_layers=True,
    tp_needs_hook=True,
    pp_needs_hook=True,
    pp_needs_automatic_optimization=True,
    # a DDP checkpoint holds the whole model and optimizer state (torch.distributed.checkpoint): it loads at any
    # data-parallel size as it is
    reshard_zero_stages=(0,),
    reshard_data_parallel_only=True,
    overlaps=TORCH_OVERLAPS,
    # DDP's reducer all-reduces sparse gradients (nn.Embedding(sparse=True)) as sparse tensors (reducer.cpp: "sparse
    # gradients" buckets of their own; gloo runs sparse all-reduce)
    sparse_grad_zero_stages=(0,),
)
"""torch 2.13's own stack under strategy "fleet": DistributedDataParallel at shard level 0."""
