"""What the torch runtime executes, as one :class:`~lightning_fleet.runtime.base.Capabilities` value: ``TORCH``.

Pure: imports only :mod:`lightning_fleet.runtime.base` and the planning core's :class:`Overlaps` (no torch); read by the
runtime table (:mod:`lightning_fleet.runtime`), the decision and ``fleet plan --runtime torch``. Each limit says where
it comes from (torch 2.13's sources under torch/, or what runtime/torch/backend.py builds).
"""

from __future__ import annotations

from lightning_fleet.planning import Offload
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.runtime.base import Capabilities

TORCH_OVERLAPS = Overlaps(
    # DistributedDataParallel's reducer launches each bucket's all-reduce asynchronously from the autograd hooks as the
    # bucket's gradients become ready (torch/csrc/distributed/c10d/reducer.cpp mark_variable_ready ->
    # all_reduce_bucket), so the reduction runs behind the rest of backward; under no_sync() (the step's first gas-1
    # micro-batches) it reduces nothing, i.e. behind the last micro-batch's backward. FSDP2 (shard levels 2-3)
    # reduce-scatters each layer's gradients from its post-backward hook on a stream of its own
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward -> foreach_reduce, reduce_scatter_stream)
    # shard level 1 is DDP's reduction too (runtime/torch/zero.py): a full all-reduce, not a reduce-scatter
    dp_grad_reduce=(0, 1, 2, 3),
    # FSDP2 all-gathers a layer's weights in its pre-forward (and at shard level 3 again in its pre-backward) on an
    # all-gather stream while the layer before computes, and prefetches the next layer's in backward
    # (_fsdp_param_group.py unshard(async_op), _fsdp_state.py _pre_forward / _fsdp_param_group.py _backward_prefetch);
    # at shard level 2 the updated shards are gathered by the next step's forward the same way, not inside step()
    dp_param_gather=(2, 3),
    # shard level 1: DDP all-reduces every gradient; each owner broadcasts its updated parameters after the step,
    # outside backward (runtime/torch/zero.py ShardedStep.broadcast), priced as the all-gather it equals
    dp_grad_allreduce=(1,),
    # sequence parallelism (engine.py _sequence_parallel), per layer in all-reduces of its hidden state: Megatron's
    # 2 forward + 2 backward (an all-gather before each region, a reduce-scatter after it, and their backward); here the
    # whole stream between layers adds an all-gather of the layer's output (forward) and of its input's gradient
    # (backward): +1, and a region's input gradient is all-reduced by ColwiseParallel's Replicate input, then sliced,
    # where Megatron reduce-scatters it: +1 (2 regions x half an all-reduce); 6 / 4
    sp_traffic=1.5,
)
"""What torch's DistributedDataParallel and FSDP2 run beside compute (on CPU/gloo the calibrated ``overlap`` says how
much hides)."""

TORCH = Capabilities(
    name="torch",
    label="torch",
    # shard level 0 is DistributedDataParallel, 1 DDP with each replica stepping the parameters it owns and
    # broadcasting them (ZeroRedundancyOptimizer's partition, on the user's optimizer object: runtime/torch/zero.py),
    # 2 and 3 FSDP2's fully_shard per layer and root with reshard_after_forward False/True (backend.py, engine.py)
    zero_stages=(0, 1, 2, 3),
    # DTensor's parallelize_module splits the layers fleet_tensor_parallel() names (runtime/torch/engine.py), on the tp
    # axis of a (dp, tp) mesh; FSDP2 shards over dp beside it, or at shard level 0 the engine all-reduces over dp
    tensor_parallel=True,
    # sequence parallelism (runtime/torch/engine.py _sequence_parallel): each layer of the stack runs on sequence shards
    # between its regions (attention, MLP), which gather their input whole; row-split layers reduce-scatter back to
    # shards; the norms fleet_tensor_parallel() names as 'sequence' run as DTensor's SequenceParallel (torchtitan's
    # layout inside each layer; the stream between layers is gathered whole, so the module's code outside its layers
    # need not be position-wise)
    sequence_parallel=True,
    # torch.distributed.pipelining is the pipelines issue's work: pp plans run on DeepSpeed's pipeline engine
    pipeline=False,
    interleaved_pipeline=False,
    uneven_stages=False,
    # DDP averages the replicas' gradients (reducer.cpp divides by the world size), so each replica's loss weighted by
    # its share (fit.py FitCore.loss_weight) gives the global batch's mean gradient, as for DeepSpeed
    uneven_dp=True,
    uneven_dp_with_pp=False,
    max_zero_with_pp=0,
    tp_with_pp=False,
    # FSDP2's CPUOffloadPolicy keeps a module's sharded parameters, their gradients and the optimizer states in host
    # memory and steps the optimizer there (torch/distributed/fsdp/_fully_shard/_fsdp_api.py): ZeRO-Infinity's
    # optimizer+params at shard level 3 (a plan rule); it has no optimizer-only mode (ZeRO-Offload), which stays
    # DeepSpeed's
    offloads=(Offload.OPTIMIZER_PARAMS,),
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
    # torch.distributed.checkpoint saves each tensor with its global shape (DDP: whole; FSDP2 and tensor parallelism:
    # DTensor shards) and loads it into whatever layout the loading engine has (get_state_dict / set_state_dict): any
    # world size, any of these shard levels, any tp
    reshard_zero_stages=(0, 1, 2, 3),
    reshard_data_parallel_only=False,
    overlaps=TORCH_OVERLAPS,
    # DDP's reducer all-reduces sparse gradients (nn.Embedding(sparse=True)) as sparse tensors (reducer.cpp: "sparse
    # gradients" buckets of their own; gloo runs sparse all-reduce)
    sparse_grad_zero_stages=(0,),
    # FSDP2's fully_shard over a 2-D (replicate, shard) mesh is HSDP (torch/distributed/fsdp/_fully_shard/_fully_shard.py:
    # "If 2D, then parameters are sharded across the 1st dim and replicated across the 0th dim (HSDP)"), at shard levels 2
    # and 3 (runtime/torch/engine.py)
    hybrid_shard_zero_stages=(2, 3),
    # a DeepSpeed checkpoint's full state (its universal form: fp32 weights and Adam moments by parameter name) is
    # written as a DCP checkpoint beside it (runtime/torch/backend.py import_state)
    imports=("deepspeed",),
)
"""torch 2.13's own stack under strategy "fleet": DistributedDataParallel at shard level 0, FSDP2 at 2 and 3, DTensor
tensor parallelism beside either."""
