"""Pipeline parallelism through DeepSpeed's PipelineModule and pipeline engine, from the module's ``fleet_pipeline()``.

The hook (:func:`lightning_fleet.hooks.pipeline_hook`) gives the forward pass as a sequence of layers (each takes the
previous one's output) and the loss; a training batch is ``(inputs, labels)``. The layers share the LightningModule's
weights; DeepSpeed keeps on each stage only its own: the layers of the layer stack's class as the plan splits them
(``Plan.stage_layers``, evenly without it: :func:`stage_parts`), what comes before them on the first stage and what
comes after on the last. The stages and replicas sit on the ranks where the plan's ``order`` puts them
(:func:`pipeline_topology`).

Imports torch and deepspeed (deepspeed lazily, at call time); imported by the DeepSpeed backend and the strategy.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_fleet.hooks import PIPELINE_SHAPE, pipeline_hook, stack_positions, stack_problem
from lightning_fleet.planning import Axis, FleetError, Plan, Recompute

_TOPOLOGY_AXES = {Axis.PP: "pipe", Axis.DP: "data"}
"""DeepSpeed's names for the plan's axes in a pipeline topology. tp has none: DeepSpeed's pipeline engine runs without
it (capabilities.py), and a "model" axis, even of size 1, would rename the layer checkpoint files
(``layer_00-model_00-model_states.pt``: PipelineModule.ckpt_layer_path appends topology.get_rank_repr, which omits only
"data" and "pipe"), which the weights reader and earlier checkpoints name ``layer_00-model_states.pt``."""


def pipeline_topology(plan: Plan) -> Any:
    """DeepSpeed's ProcessTopology of ``plan``: its pp and dp axes, outermost first as ``plan.order`` places them (the
    default tp-dp-pp gives DeepSpeed's own ``PipeDataParallelTopology(num_pp, num_dp)``: stages outside replicas)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    if plan.tp > 1:
        raise FleetError(f"plan {plan}: DeepSpeed's pipeline engine runs without tp; use tp=1 with pp > 1")
    axes = [axis for axis in reversed(plan.order) if axis in _TOPOLOGY_AXES]
    return ProcessTopology(axes=[_TOPOLOGY_AXES[axis] for axis in axes], dims=[getattr(plan, axis) for axis in axes])


def stage_parts(layers: list[Any], plan: Plan, layer_type: str) -> list[int]:
    """Where each stage's slice of ``layers`` starts, and the end (DeepSpeed's ``PipelineModule.parts``): the layers of
    class ``layer_type`` split as ``plan.stage_layers`` says (evenly without it), what comes before the first of them on
    the first stage and what comes after the last on the last (a layer holding a ``layer_type``, an adapter, counts as
    one of them: :func:`~lightning_fleet.hooks.stack_positions`). FleetError when the plan's split does not fit them."""
    problem = stack_problem(layers, layer_type)
    if problem:
        raise FleetError(f"fleet_pipeline(): {problem}; {PIPELINE_SHAPE}")
    stack = stack_positions(layers, layer_type)
    split = plan.stage_layers
    if split is None:
        if len(stack) % plan.pp:
            raise FleetError(
                f"plan {plan}: {len(stack)} layers of class {layer_type} do not split evenly over pp={plan.pp}: give the "
                "plan's stage_layers (the planner writes them for an uneven split)"
            )
        split = (len(stack) // plan.pp,) * plan.pp
    if sum(split) != len(stack):
        raise FleetError(f"plan {plan}: stage_layers adds up to {sum(split)} layers, but fleet_pipeline() has {len(stack)} of class {layer_type}")
    parts = [0]
    for count in split[:-1]:
        parts.append((stack[0] if len(parts) == 1 else parts[-1]) + count)
    return parts + [len(layers)]


def _pipeline_module_class() -> type:
    """DeepSpeed's PipelineModule with the partition given, not computed: DeepSpeed's partition methods balance by
    count, parameters or layer type only (deepspeed/runtime/pipe/module.py ``_partition_layers``), not by the planner's
    cost, so this subclass overrides that one method with the plan's boundaries (:func:`stage_parts`)."""
    from deepspeed.pipe import PipelineModule

    class FleetPipelineModule(PipelineModule):
        """A PipelineModule whose stages hold the layers ``parts`` gives them (``parts`` keyword, set before DeepSpeed
        partitions in ``__init__``)."""

        def __init__(self, *args: Any, parts: list[int], **kwargs: Any) -> None:
            self._fleet_parts = list(parts)
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._fleet_parts)
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    return FleetPipelineModule


def build_pipeline(module: nn.Module, plan: Plan, *, layer_type: str) -> nn.Module:
    """A DeepSpeed PipelineModule over the hook's layers, placed as ``plan`` says (:func:`pipeline_topology`) and split
    as it says (:func:`stage_parts`); with ``recompute=full`` each layer of the stack (of type ``layer_type``, or an adapter
    holding one) is recomputed in backward."""
    spec = pipeline_hook(module)
    assert spec is not None
    layers = list(spec["layers"])
    parts = stage_parts(layers, plan, layer_type)
    checkpointed = sorted({type(layers[i]).__name__ for i in stack_positions(layers, layer_type)})  # adapters: their class
    return _pipeline_module_class()(
        layers=layers,
        parts=parts,
        loss_fn=spec["loss_fn"],
        topology=pipeline_topology(plan),
        partition_method="uniform",  # unused: FleetPipelineModule partitions by the plan
        activation_checkpoint_interval=1 if plan.recompute is Recompute.FULL else 0,
        # full recomputation of the layers only (as the cost model prices it); non-reentrant, so a
        # first layer fed integer token ids still gets gradients for its weights
        checkpointable_layers=checkpointed,
        activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
    )


def local_optimizer(optimizer: torch.optim.Optimizer, keep: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over the parameters this stage holds (same class, groups and settings)."""
    local = {id(p) for p in keep.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in local]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups)  # every group carries its own settings


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, labels) of a pipeline micro-batch."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise FleetError(
            f"pipeline parallelism needs batches of (inputs, labels); the training DataLoader yields a {type(batch).__name__}: "
            "yield (inputs, labels) tuples (a collate_fn that returns them), or use pp=1"
        )
    return batch[0], batch[1]


def micro_batch_iterator(batches: list[Any], split: Callable[[Any], tuple[Any, Any]] = split_batch):
    """What PipelineEngine.train_batch/eval_batch read: one (inputs, labels) per micro-batch."""
    return iter([split(b) for b in batches])


def evaluate(engine: Any, batch: Any) -> torch.Tensor:
    """Mean loss of one (inputs, labels) batch through the pipeline, whatever its size.

    DeepSpeed sizes its stage-to-stage buffers on the first batch it sees; a batch of another size
    needs them reset first (and the next training step resets them back).
    """
    engine.reset_activation_shape()
    return engine.eval_batch(micro_batch_iterator([batch]), num_micro_batches=1)


def sync_stage_weights(engine: Any, module: nn.Module) -> None:
    """Give every rank's ``module`` the current weights of every pipeline stage (collective over the pipe group).

    A stage's engine trains only its own layers (the module's own parameters, shared with the PipelineModule); the
    other stages' parameters in this rank's module are left as they were built. Each stage broadcasts its layers'
    parameters and buffers to the other stages of its data-parallel position, so the whole LightningModule can then
    run the user's own ``validation_step`` (or be exported) unchanged. A received tensor keeps its owner's dtype.
    """
    import torch.distributed as dist

    spec = pipeline_hook(module)
    assert spec is not None
    parts, grid = engine.module.parts, engine.grid
    group = grid.get_pipe_parallel_group()
    for stage in range(len(parts) - 1):
        source = grid.stage_to_global(stage_id=stage)
        tensors = list({id(t): t for layer in spec["layers"][parts[stage] : parts[stage + 1]] for t in (*layer.parameters(), *layer.buffers())}.values())
        mine = grid.get_stage_id() == stage
        shapes = [[(tuple(t.shape), t.dtype) for t in tensors] if mine else None]
        dist.broadcast_object_list(shapes, src=source, group=group)  # the owner's shapes and dtypes, once per stage
        for tensor, (shape, dtype) in zip(tensors, shapes[0]):
            received = tensor.data.contiguous() if mine else torch.empty(shape, dtype=dtype, device=tensor.device)
            dist.broadcast(received, src=source, group=group)
            if not mine:
                tensor.data = received
