"""What one pipeline stage holds: the per-sample sums over its blocks that the cost terms need.

Pure; imported by the memory, time, estimate and search modules.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from lightning_fleet.planning.model import BlockSpec, ModelSpec, Role


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLoad:
    """Sums over the blocks of one pipeline stage, per sample, before tensor parallelism (0 where not given)."""

    index: int
    """Stage number, 0 = first."""
    layers: int = 0
    """Layer blocks on the stage."""
    params: int = 0
    """Parameters stored on the stage (tied parameters once when both ends sit here)."""
    trainable_params: int = 0
    """The part of ``params`` that trains: gradients, optimizer states and their communication."""
    largest_block_params: int = 0
    """Parameters of the largest single block (ZeRO-3 gathers one block at a time)."""
    flops: float = 0.0
    """Forward FLOPs per sample of all blocks."""
    layer_flops: float = 0.0
    """Forward FLOPs per sample of the layer blocks (redone by full recomputation)."""
    elementwise: float = 0.0
    """Forward output elements per sample of the operators that do no matmul, all blocks."""
    layer_elementwise: float = 0.0
    """The part of ``elementwise`` that belongs to layer blocks (redone by full recomputation)."""
    recompute_flops: float = 0.0
    """Forward FLOPs per sample redone by selective recomputation."""
    act_replicated_bytes: float = 0.0
    """Saved bytes per sample that tp keeps whole (sp splits them)."""
    act_sharded_bytes: float = 0.0
    """Saved bytes per sample split by tp."""
    act_attention_bytes: float = 0.0
    """Saved attention-score bytes per sample (split by tp, dropped by selective recompute)."""
    layer_act_replicated_bytes: float = 0.0
    """The part of act_replicated_bytes that belongs to layer blocks (full recompute drops it)."""
    layer_act_sharded_bytes: float = 0.0
    """The part of act_sharded_bytes that belongs to layer blocks."""
    layer_act_attention_bytes: float = 0.0
    """The part of act_attention_bytes that belongs to layer blocks."""
    checkpoint_bytes: float = 0.0
    """Bytes per sample full recomputation keeps: each layer's output."""
    largest_layer_replicated_bytes: float = 0.0
    """Replicated saved bytes per sample of the largest layer (re-materialised under full recompute)."""
    largest_layer_split_bytes: float = 0.0
    """Sharded + attention saved bytes per sample of that layer."""
    tp_allreduces: int = 0
    """Tensor-parallel all-reduces per micro-batch, forward and backward."""
    tp_allreduce_bytes: float = 0.0
    """Bytes per sample moved by those all-reduces (sum of message sizes)."""
    layer_tp_allreduces_fwd: int = 0
    """Forward all-reduces of the layer blocks (repeated by full recompute)."""
    layer_tp_allreduce_fwd_bytes: float = 0.0
    """Bytes per sample of those forward all-reduces."""
    boundary_bytes: float = 0.0
    """Bytes per sample the stage sends to the next one (its last block's output)."""


def _layer_slice(model: ModelSpec, pp: int, index: int) -> list[tuple[BlockSpec, int]]:
    """Blocks on stage ``index`` with how many of each: layers split evenly by position."""
    total = model.num_layers
    lo, hi = index * total // pp, (index + 1) * total // pp
    out: list[tuple[BlockSpec, int]] = []
    seen = 0
    for block in model.blocks:
        if block.role is Role.PRE and index == 0 or block.role is Role.POST and index == pp - 1:
            out.append((block, block.count))
        elif block.role is Role.LAYER:
            take = max(0, min(hi, seen + block.count) - max(lo, seen))
            if take:
                out.append((block, take))
            seen += block.count
    return out


def _sum(pairs: list[tuple[BlockSpec, int]], attr: str, role: Role | None = None) -> float:
    return sum(getattr(b, attr) * n for b, n in pairs if role is None or b.role is role)


def _stage(model: ModelSpec, pp: int, index: int) -> StageLoad:
    pairs = _layer_slice(model, pp, index)
    layers = [b for b, _ in pairs if b.role is Role.LAYER]
    biggest = max(layers, key=lambda b: b.act_bytes)
    tied = model.tied_params if pp == 1 else 0
    return StageLoad(
        index=index,
        layers=sum(n for b, n in pairs if b.role is Role.LAYER),
        params=int(_sum(pairs, "params")) - tied,
        trainable_params=int(_sum(pairs, "trainable")) - (model.tied_trainable if pp == 1 else 0),
        largest_block_params=max(b.params for b, _ in pairs),
        flops=_sum(pairs, "flops"),
        layer_flops=_sum(pairs, "flops", Role.LAYER),
        elementwise=_sum(pairs, "elementwise"),
        layer_elementwise=_sum(pairs, "elementwise", Role.LAYER),
        recompute_flops=_sum(pairs, "recompute_flops", Role.LAYER),
        act_replicated_bytes=_sum(pairs, "act_replicated_bytes"),
        act_sharded_bytes=_sum(pairs, "act_sharded_bytes"),
        act_attention_bytes=_sum(pairs, "act_attention_bytes"),
        layer_act_replicated_bytes=_sum(pairs, "act_replicated_bytes", Role.LAYER),
        layer_act_sharded_bytes=_sum(pairs, "act_sharded_bytes", Role.LAYER),
        layer_act_attention_bytes=_sum(pairs, "act_attention_bytes", Role.LAYER),
        checkpoint_bytes=_sum(pairs, "output_bytes", Role.LAYER),
        largest_layer_replicated_bytes=biggest.act_replicated_bytes,
        largest_layer_split_bytes=biggest.act_sharded_bytes + biggest.act_attention_bytes,
        tp_allreduces=int(sum((b.tp_allreduces_fwd + b.tp_allreduces_bwd) * n for b, n in pairs)),
        tp_allreduce_bytes=sum((b.tp_allreduces_fwd + b.tp_allreduces_bwd) * b.output_bytes * n for b, n in pairs),
        layer_tp_allreduces_fwd=int(_sum(pairs, "tp_allreduces_fwd", Role.LAYER)),
        layer_tp_allreduce_fwd_bytes=sum(b.tp_allreduces_fwd * b.output_bytes * n for b, n in pairs if b.role is Role.LAYER),
        boundary_bytes=pairs[-1][0].output_bytes,
    )


@functools.lru_cache(maxsize=4096)
def stage_loads(model: ModelSpec, pp: int) -> tuple[StageLoad, ...]:
    """The stages that can be the worst device or the slowest stage, out of all ``pp``.

    A stage is left out when an earlier one has at least each of its costs: the earlier stage holds
    at least as many micro-batches in flight, so it needs at least as much memory and time. A model
    of identical layers keeps at most two: the first stage and the last.
    """
    loads = [_stage(model, pp, i) for i in range(pp)]
    return tuple(load for load in loads if not any(_dominates(other, load) for other in loads if other.index < load.index))


def _dominates(first: StageLoad, later: StageLoad) -> bool:
    """An earlier stage with at least every cost of a later one is at least as full and as slow."""
    return all(getattr(first, name) >= getattr(later, name) for name in _COST_FIELDS)


_COST_FIELDS = [f.name for f in dataclasses.fields(StageLoad) if f.name != "index"]
