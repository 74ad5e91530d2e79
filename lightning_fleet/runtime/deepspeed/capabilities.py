"""What DeepSpeed 0.19.8 executes, as one :class:`~lightning_fleet.runtime.base.Capabilities` value: ``DEEPSPEED``.

Pure: imports only :mod:`lightning_fleet.runtime.base` (no torch, no deepspeed); read by the strategy, the
decision, ``fleet plan --runtime deepspeed`` and the benchmarks. Each limit below says where it comes from
(measured on CPU/gloo: ../shared/ENVIRONMENT.md and docs/MEASURED.md; or read in DeepSpeed's source).
"""

from __future__ import annotations

from lightning_fleet.runtime.base import Capabilities

DEEPSPEED = Capabilities(
    name="deepspeed",
    label="DeepSpeed",
    # AutoTP splits Linear weights only; DeepSpeed has no Megatron-style sequence parallelism for it
    sequence_parallel=False,
    # PipelineEngine.train_batch runs schedule.TrainSchedule, 1F1B over one stage per rank (deepspeed/runtime/pipe/engine.py)
    interleaved_pipeline=False,
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
)
"""Stock DeepSpeed 0.19.8 under strategy "fleet": ZeRO 0-3, optimizer/parameter offload, AutoTP, its pipeline engine."""
