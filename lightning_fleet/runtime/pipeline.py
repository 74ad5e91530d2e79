"""Pipeline parallelism through DeepSpeed's PipelineModule, from the module's ``fleet_pipeline()`` hook.

The hook returns ``{"layers": [nn.Module, ...], "loss_fn": fn(last_output, labels)}``: the forward
pass as a sequence (each layer takes the previous one's output) and the loss; a training batch is
``(inputs, labels)``. The layers share the LightningModule's weights; DeepSpeed keeps on each
stage only its own, balancing the layers of the ``fleet_layers()`` class across stages and putting
what comes before them on the first stage and what comes after on the last.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_fleet.planning import FleetError


def pipeline_hook(module: nn.Module) -> dict[str, Any] | None:
    """``fleet_pipeline()`` validated, or None when the module has no such hook."""
    hook = getattr(module, "fleet_pipeline", None)
    if not callable(hook):
        return None
    spec = hook()
    layers, loss_fn = (spec.get("layers"), spec.get("loss_fn")) if isinstance(spec, dict) else (None, None)
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers) or not callable(loss_fn):
        raise FleetError(f"{type(module).__name__}.fleet_pipeline() must return {{'layers': [nn.Module, ...], 'loss_fn': callable}}")
    return {"layers": list(layers), "loss_fn": loss_fn}


def build_pipeline(module: nn.Module, *, pp: int, dp: int, layer_type: str, checkpoint_layers: bool) -> nn.Module:
    """A DeepSpeed PipelineModule over the hook's layers, ``pp`` stages outside ``dp`` replicas (our default placement)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    spec = pipeline_hook(module)
    assert spec is not None
    return PipelineModule(
        layers=spec["layers"],
        loss_fn=spec["loss_fn"],
        topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
        partition_method=f"type:^{layer_type}$",
        activation_checkpoint_interval=1 if checkpoint_layers else 0,
        # full recomputation of the layers only (as the cost model prices it); non-reentrant, so a
        # first layer fed integer token ids still gets gradients for its weights
        checkpointable_layers=[layer_type],
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
        raise FleetError("pipeline parallelism needs batches of (inputs, labels); the training DataLoader yields another shape")
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
