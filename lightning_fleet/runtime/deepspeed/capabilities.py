"""What DeepSpeed 0.19.8 executes, as one :class:`~lightning_fleet.runtime.base.Capabilities` value: ``DEEPSPEED``.

Pure: imports only :mod:`lightning_fleet.runtime.base` and the planning core's :class:`Overlaps` (no torch, no
deepspeed); read by the strategy, the decision, ``fleet plan --runtime deepspeed`` and the benchmarks. Each limit below
says where it comes from (measured on CPU/gloo: ../shared/ENVIRONMENT.md and docs/MEASURED.md; or read in DeepSpeed's
source, paths under deepspeed/ of 0.19.8).
"""

from __future__ import annotations

from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.runtime.base import Capabilities

DEEPSPEED_OVERLAPS = Overlaps(
    # ZeRO-0: the engine all-reduces every gradient after loss.backward() returns (runtime/engine.py _backward_epilogue ->
    # allreduce_gradients -> buffered_allreduce_fallback): nothing to hide behind. ZeRO-1/2: with overlap_comm (our
    # config sets it on CUDA, runtime/deepspeed/backend.py) backward hooks reduce full buckets on a separate stream
    # (runtime/zero/stage_1_and_2.py reduce_ready_partitions_and_remove_grads, reduction_stream), ZeRO-1 in the last
    # micro-batch's backward; ZeRO-3 likewise (runtime/zero/stage3.py reduce_and_partition_stream).
    dp_grad_reduce=(1, 2, 3),
    # ZeRO-1/2 gather the updated weights inside step(), before it returns (stage_1_and_2.py step ->
    # all_gather_dp_groups): exposed. ZeRO-3 prefetches the next layers' weights on its own stream
    # (runtime/zero/partitioned_param_coordinator.py fetch_sub_module, __allgather_stream from parameter_offload.py).
    dp_param_gather=(3,),
    # "Pipeline parallelism does not support overlapped communication, will be disabled." (runtime/engine.py
    # _configure_zero_optimizer); the pipeline schedule reduces after its last backward (runtime/pipe/schedule.py
    # TrainSchedule: ReduceGrads before OptimizerStep)
    dp_exposed_in_pipeline=True,
    # AutoTP's row-parallel all-reduce runs inline in forward (module_inject/layers.py RowParallel.forward); its
    # tp_overlap_comm (runtime/tensor_parallel/config.py, default False) is not set by our config, and no sp anyway
    tp_comm=False,
    # p2p.send/recv assert async_op == False (runtime/pipe/p2p.py), and no interleaved schedule
    pp_p2p=False,
    # no tensor parallelism inside DeepSpeed's pipeline here (tp_with_pp below), so nothing to split
    pp_p2p_split_over_tp=False,
    # ZeRO-1/2 reduce the gradients with a full all-reduce, each rank keeping its partition: with
    # use_multi_rank_bucket_allreduce at its default True (our config does not set it) the slices are bucketed under
    # ("allreduce", process_group) and reduced by allreduce_and_scatter (runtime/zero/stage_1_and_2.py); ZeRO-3
    # reduce-scatters (reduce_scatter_tensor, counted on gloo).
    dp_grad_allreduce=(1, 2),
)
"""What DeepSpeed 0.19.8 runs beside compute under strategy "fleet" (on CUDA; on CPU/gloo nothing overlaps and the
calibrated ``overlap`` is 0, calibrate/measure.py)."""

DEEPSPEED = Capabilities(
    name="deepspeed",
    label="DeepSpeed",
    # AutoTP splits Linear weights only; DeepSpeed has no Megatron-style sequence parallelism for it
    sequence_parallel=False,
    # PipelineEngine.train_batch runs schedule.TrainSchedule, 1F1B over one stage per rank (deepspeed/runtime/pipe/engine.py)
    interleaved_pipeline=False,
    # PipelineModule's partition_method only balances by count, parameters or layer type; runtime/deepspeed/pipeline.py
    # gives it the plan's split instead (FleetPipelineModule overrides _partition_layers, deepspeed/runtime/pipe/module.py)
    uneven_stages=True,
    # the engine never checks the size of the batches it is fed (only the config's train_batch_size = micro * gas *
    # dp, runtime/config.py), reduces the replicas' gradients by their mean (runtime/engine.py allreduce_gradients,
    # ZeRO's average_tensor), and scales each micro-batch's loss by 1/gas: each replica's loss weighted by dp * its
    # micro-batch / their sum (fit.py FitCore.loss_weight) gives the global batch's mean gradient at every ZeRO stage
    uneven_dp=True,
    # PipelineEngine.train_batch computes the loss inside its schedule (runtime/pipe/engine.py _exec_forward_pass):
    # strategy "fleet" has no hook there to weight it
    uneven_dp_with_pp=False,
    # "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" (deepspeed/runtime/pipe/engine.py, measured)
    max_zero_with_pp=1,
    # the pipeline module is built with a pipe x data topology only (runtime/deepspeed/pipeline.py): no AutoTP in it
    tp_with_pp=False,
    # offloading ZeRO partitions needs ZeRO >= 1 and is not run inside the pipeline engine (not verified: refused)
    offload_with_pp=False,
    # DeepSpeed builds its own process groups (AutoTP: consecutive ranks; the pipeline grid: pipe outside data), and
    # the data sampler follows the same placement: the default tp-dp-pp only
    any_placement=False,
    # selective recomputation needs the attention core's internals, which a user's module does not expose
    selective_recompute=False,
    # op-level selective checkpointing needs a save policy per operator inside each layer's checkpoint (torch.utils.checkpoint
    # context_fn=create_selective_checkpoint_contexts(policy)); strategy "fleet" wraps each layer in plain checkpointing
    # (runtime/deepspeed/backend.py _checkpointed) and its pipeline uses DeepSpeed's activation_checkpoint_interval
    # (runtime/deepspeed/pipeline.py): neither runs such a policy
    op_recompute=False,
    # full recomputation wraps each layer of the layer stack in torch.utils.checkpoint (the pipeline: its own
    # activation checkpointing over the same layers)
    full_recompute_needs_layers=True,
    # the automatic AutoTP policy fails on a custom module ("Not able to determine model policy automatically"):
    # the hook's explicit row/column patterns are needed
    tp_needs_hook=True,
    # PipelineModule needs the forward pass as a sequence of layers and a loss (fleet_pipeline()), balanced over
    # the layer stack
    pp_needs_hook=True,
    # PipelineEngine.train_batch runs forward, backward and the optimizer step itself
    pp_needs_automatic_optimization=True,
    # a ZeRO-2/3 checkpoint cannot be loaded at another data-parallel size directly; its universal form
    # (runtime/deepspeed/universal.py) loads into ZeRO 1-3 at any data-parallel size, not into ZeRO-0
    reshard_zero_stages=(1, 2, 3),
    # tensor- and pipeline-parallel per-rank layouts have no verified conversion: data-parallel plans only
    reshard_data_parallel_only=True,
    overlaps=DEEPSPEED_OVERLAPS,
    # a sparse gradient (nn.Embedding/EmbeddingBag(sparse=True)) is reduced by the engine's own all-gather at ZeRO-0
    # (runtime/engine.py buffered_allreduce_fallback -> sparse_allreduce; no config flag: 'sparse_gradients' is a removed
    # key that raises, runtime/config.py). ZeRO 1-3 flatten gradients into dense buffers and fail at the first step
    # (measured: zero=1 "unsupported memory format option Contiguous", zero=2 "Could not run 'aten::view' with arguments
    # from the 'SparseCPU' backend", zero=3 "copy_() between dense and sparse Tensors is not implemented")
    sparse_grad_zero_stages=(0,),
    # a torch checkpoint's full state (DCP's whole tensors and Adam moments by parameter name) is written as the
    # universal form (runtime/deepspeed/universal.py universal_from_state), which ZeRO 1-3 load at any data-parallel size
    imports=("torch",),
)
"""Stock DeepSpeed 0.19.8 under strategy "fleet": ZeRO 0-3, optimizer/parameter offload, AutoTP, its pipeline engine."""
