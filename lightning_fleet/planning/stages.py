"""What one pipeline stage holds: its layers (:func:`stage_layers`) and the per-sample sums over its blocks that the
cost terms need (:func:`stage_loads`).

The layers of a pipeline split evenly when pp divides them; otherwise the default split balances the stages by cost,
with the embedding and the head (the model's pre and post blocks) counted as load of the first and the last stage
(:func:`balanced_stage_layers`), as Llama 3 405B did: "To balance the pipeline, we reduce one Transformer layer each
from the first and the last stages" (Llama Team 2024, arXiv 2407.21783, Sec. 3.3.2), and BLOOM 176B with its
embedding as a stage slot at each end. A plan may also fix the split (``Plan.stage_layers``).

Pure; imported by the memory, time, estimate and search modules.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass

from lightning_fleet.planning.errors import PlanError
from lightning_fleet.planning.model import BlockSpec, ModelSpec, Role
from lightning_fleet.planning.plan import Plan


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
    attention_flops: float = 0.0
    """The part of ``flops`` fused attention kernels run, all blocks (:attr:`BlockSpec.attention_flops`)."""
    attention_kernel_flops: float = 0.0
    """Forward FLOPs per sample those kernels execute (half of them under a causal mask)."""
    layer_attention_flops: float = 0.0
    """The part of ``attention_flops`` that belongs to layer blocks (redone by full recomputation)."""
    layer_attention_kernel_flops: float = 0.0
    """The part of ``attention_kernel_flops`` that belongs to layer blocks."""
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
    op_recompute_flops: float = 0.0
    """Forward FLOPs per sample op-level recomputation redoes, layer blocks (:attr:`OpRecompute.flops`)."""
    op_recompute_elementwise: float = 0.0
    """Output elements per sample of the memory-bound operators it redoes, layer blocks."""
    layer_op_saved_replicated_bytes: float = 0.0
    """Bytes per sample op-level recomputation keeps beside each layer's input that tp does not split (sp does)."""
    layer_op_saved_sharded_bytes: float = 0.0
    """Bytes per sample it keeps that tp splits."""
    largest_op_rematerialised_replicated_bytes: float = 0.0
    """Replicated saved bytes per sample that op-level recomputation re-materialises in the backward of the layer where
    that is the most (its saved bytes less what it keeps)."""
    largest_op_rematerialised_split_bytes: float = 0.0
    """Sharded + attention bytes per sample it re-materialises in that layer."""
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
    sparse_params: int = 0
    """The part of ``trainable_params`` whose gradients are sparse (:attr:`BlockSpec.sparse_params`)."""
    sparse_tensors: int = 0
    """Parameter tensors with sparse gradients on the stage."""
    sparse_rows_per_sample: float = 0.0
    """Rows of those tensors one sample looks up (:attr:`BlockSpec.sparse_rows_per_sample`)."""
    sparse_elements_per_sample: float = 0.0
    """Gradient elements of those rows per sample."""


_SLACK = 1.0 + 1e-9
"""Stage costs within this factor count as equal: sums of equal layers at other positions differ only by rounding."""


def stage_layers(model: ModelSpec, pp: int, fixed: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers on each of ``pp`` stages, first to last: ``fixed`` when given (PlanError unless it fits the model),
    else an even split when pp divides the layers, else :func:`balanced_stage_layers`."""
    if fixed is not None:
        check_stage_layers(model, fixed)
        if len(fixed) != pp:
            raise PlanError(f"plan: stage_layers={_text(fixed)} names {len(fixed)} stages, but pp={pp}: give one count per stage")
        return tuple(fixed)
    total = model.num_layers
    if total % pp == 0:
        return (total // pp,) * pp
    return balanced_stage_layers(model, pp)


def check_stage_layers(model: ModelSpec, fixed: tuple[int, ...]) -> None:
    """PlanError unless ``fixed`` splits exactly the model's layers and leaves a stage empty only where the embedding
    (first stage) or the head (last stage) occupies it."""
    if sum(fixed) != model.num_layers:
        raise PlanError(
            f"plan: stage_layers={_text(fixed)} holds {sum(fixed)} layers, but model {model.name!r} has {model.num_layers}: "
            "the counts must add up to num_layers"
        )
    minimum = _least_layers(model, len(fixed))
    for index, (count, least) in enumerate(zip(fixed, minimum)):
        if count < least:
            raise PlanError(
                f"plan: stage_layers={_text(fixed)} leaves stage {index} without layers, and model {model.name!r} has no "
                f"{'pre' if index == 0 else 'post'} block to put there: give it at least one layer"
            )


@functools.lru_cache(maxsize=1024)
def balanced_stage_layers(model: ModelSpec, pp: int, capacity: tuple[tuple[float, float], ...] | None = None) -> tuple[int, ...]:
    """The default split when pp does not divide the layers: the contiguous split whose busiest stage carries the least
    load, a stage's load being the larger of its forward FLOPs and its parameters, each in units of the average layer's,
    with the embedding and the head (pre and post blocks) counted on the first and the last stage. So an embedding or
    head about as large as a layer takes a layer's slot: Llama 3.1 405B's 126 layers on 16 stages split 7/8x14/7 (Llama
    Team 2024, Sec. 3.3.2) and BLOOM's 70 on 12 split 5/6x10/5, "[embed | 5 transformer blocks]" on pp rank 0 and
    "[5 transformer blocks | embed]" on rank 11 (``--pp-partition-method 'type:transformer|embedding'``,
    bigscience-workshop/bigscience train/tr11-176B-ml/README.md, Architecture). Among the splits with that least load, stages fill from the last, so the
    first stages, which keep the most micro-batches in flight under 1F1B
    (:func:`lightning_fleet.planning.memory.in_flight_microbatches`), take what remains. Every stage keeps at least one
    layer, except an end stage that holds pre or post blocks. Needs pp <= num_layers.

    ``capacity`` (one pair per stage, first to last) is what each stage's devices hold relative to the others: its
    compute speed and its memory, each over the largest. A stage's load is then its FLOPs over its speed and its
    parameters over its memory, so a stage on faster devices carries more layers (stages on mixed devices); None: alike."""
    if not 1 <= pp <= model.num_layers:
        raise PlanError(f"plan: pp({pp}) must be between 1 and num_layers({model.num_layers}) to split the layers")
    if capacity is not None and (len(capacity) != pp or any(not (c > 0 and m > 0) for c, m in capacity)):
        raise PlanError(f"plan: capacity must give pp({pp}) positive (speed, memory) pairs, got {capacity!r}")
    costs = _LayerCosts(model, pp, capacity)
    split = costs.fill(costs.bounds(costs.least_load() * _SLACK))
    assert split is not None  # the load came from a split within it
    return split


def _least_layers(model: ModelSpec, pp: int) -> list[int]:
    """Per stage, the fewest layers it may hold: 0 for an end stage with pre (first) or post (last) blocks, else 1."""
    least = [1] * pp
    if pp > 1:
        least[0] = 0 if any(b.role is Role.PRE for b in model.blocks) else 1
        least[-1] = 0 if any(b.role is Role.POST for b in model.blocks) else 1
    return least


def _text(split: tuple[int, ...]) -> str:
    return "/".join(str(n) for n in split)


class _LayerCosts:
    """Prefix sums of the layers' forward FLOPs and parameters, and the end stages' extra blocks, for splitting (resource
    0: FLOPs, 1: parameters)."""

    def __init__(self, model: ModelSpec, pp: int, capacity: tuple[tuple[float, float], ...] | None = None) -> None:
        self.pp = pp
        self.scale = capacity or ((1.0, 1.0),) * pp
        """What each stage holds of a unit of load, per resource (its compute speed and memory, relative)."""
        self.prefix: tuple[list[float], list[float]] = ([0.0], [0.0])
        for block in model.blocks:
            if block.role is Role.LAYER:
                for _ in range(block.count):
                    self.prefix[0].append(self.prefix[0][-1] + block.flops)
                    self.prefix[1].append(self.prefix[1][-1] + block.params)
        pre = [b for b in model.blocks if b.role is Role.PRE]
        post = [b for b in model.blocks if b.role is Role.POST]
        self.extra = [(0.0, 0.0)] * pp
        self.extra[0] = (sum(b.flops * b.count for b in pre), sum(b.params * b.count for b in pre))
        last = (sum(b.flops * b.count for b in post), sum(b.params * b.count for b in post))
        self.extra[-1] = (self.extra[-1][0] + last[0], self.extra[-1][1] + last[1])
        layers = len(self.prefix[0]) - 1
        self.unit = (self.prefix[0][-1] / layers, self.prefix[1][-1] / layers)
        """The average layer's forward FLOPs and parameters: the units of a stage's load."""
        least = _least_layers(model, pp)
        self.least = least
        self.before = [sum(least[:i]) for i in range(pp)]  # layers the stages before each one need at least

    def cost(self, resource: int, lo: int, hi: int, stage: int) -> float:
        """FLOPs (resource 0) or parameters (1) of a stage holding layers lo..hi-1."""
        return self.prefix[resource][hi] - self.prefix[resource][lo] + self.extra[stage][resource]

    def _fits(self, lo: int, hi: int, stage: int, bounds: tuple[float, float]) -> bool:
        scale = self.scale[stage]
        return self.cost(0, lo, hi, stage) <= bounds[0] * scale[0] and self.cost(1, lo, hi, stage) <= bounds[1] * scale[1]

    def _most(self, resource: int, hi: int, stage: int, bound: float) -> int:
        """The most layers ending before ``hi`` that keep the stage within ``bound`` in ``resource`` (prefix sums never
        decrease, so a bisection finds it; the steps after it only settle what rounding left open)."""
        prefix, bound = self.prefix[resource], bound * self.scale[stage][resource]
        n = hi - bisect.bisect_left(prefix, prefix[hi] + self.extra[stage][resource] - bound, 0, hi)
        while n > 0 and self.cost(resource, hi - n, hi, stage) > bound:
            n -= 1
        while n < hi and self.cost(resource, hi - n - 1, hi, stage) <= bound:
            n += 1
        return n

    def fill(self, bounds: tuple[float, float]) -> tuple[int, ...] | None:
        """The split that fills each stage from the last with as many layers as ``bounds`` (FLOPs, params) allow, or
        None when no split keeps every stage within them (filling from the end leaves the least for the rest)."""
        counts = [0] * self.pp
        hi = len(self.prefix[0]) - 1
        for stage in range(self.pp - 1, 0, -1):
            n = min(hi - self.before[stage], self._most(0, hi, stage, bounds[0]), self._most(1, hi, stage, bounds[1]))
            if n < self.least[stage] or not self._fits(hi - n, hi, stage, bounds):  # its pre/post blocks alone may not
                return None
            counts[stage], hi = n, hi - n
        if hi < self.least[0] or not self._fits(0, hi, 0, bounds):
            return None
        counts[0] = hi
        return tuple(counts)

    def _worst(self, split: tuple[int, ...]) -> float:
        """The load of the busiest stage of ``split``, in average layers."""
        edges = [0]
        for n in split:
            edges.append(edges[-1] + n)
        return max(
            self.cost(resource, edges[i], edges[i + 1], i) / unit / self.scale[i][resource]
            for i in range(self.pp) for resource, unit in enumerate(self.unit) if unit > 0
        )

    def bounds(self, load: float) -> tuple[float, float]:
        """The FLOPs and parameters a stage may carry at ``load`` average layers (no bound on a resource layers lack)."""
        return tuple(load * unit if unit > 0 else float("inf") for unit in self.unit)  # type: ignore[return-value]

    def least_load(self) -> float:
        """The least load of the busiest stage over all splits, in average layers (bisection: each split found lowers the
        upper end to its own busiest stage, so the result is a split's)."""
        split = self.fill((float("inf"), float("inf")))
        assert split is not None, "pp <= num_layers admits a split"
        hi, lo = self._worst(split), 0.0
        while hi - lo > hi * 1e-12:
            mid = (lo + hi) / 2
            trial = self.fill(self.bounds(mid))
            if trial is None:
                lo = mid
            else:
                hi = self._worst(trial)
        return hi


def _layer_slice(model: ModelSpec, split: tuple[int, ...], index: int) -> list[tuple[BlockSpec, int]]:
    """Blocks on stage ``index`` with how many of each: the layers ``split`` gives it, pre blocks on the first stage and
    post blocks on the last."""
    lo = sum(split[:index])
    hi = lo + split[index]
    pp = len(split)
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


def _sum_op(pairs: list[tuple[BlockSpec, int]], attr: str) -> float:
    """The layer blocks' :class:`OpRecompute` ``attr``, summed (0 for a block that does not know it)."""
    return sum(getattr(b.op_recompute, attr) * n for b, n in pairs if b.role is Role.LAYER and b.op_recompute is not None)


def _op_rematerialised(block: BlockSpec) -> tuple[float, float]:
    """(replicated, split) saved bytes per sample that op-level recomputation re-materialises in ``block``'s backward:
    what it saves without recomputation less what the policy keeps (nothing when the block does not know it)."""
    op = block.op_recompute
    if op is None:
        return (0.0, 0.0)
    return (block.act_replicated_bytes - op.saved_replicated_bytes, block.act_split_bytes - op.saved_sharded_bytes)


def _stage(model: ModelSpec, split: tuple[int, ...], index: int) -> StageLoad:
    pp = len(split)
    pairs = _layer_slice(model, split, index)
    layers = [b for b, _ in pairs if b.role is Role.LAYER]
    biggest = max(layers, key=lambda b: b.act_bytes) if layers else _NO_LAYER
    rematerialised = max((_op_rematerialised(b) for b in layers), key=sum, default=(0.0, 0.0))
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
        attention_flops=_sum(pairs, "attention_flops"),
        attention_kernel_flops=_sum(pairs, "attention_kernel_flops"),
        layer_attention_flops=_sum(pairs, "attention_flops", Role.LAYER),
        layer_attention_kernel_flops=_sum(pairs, "attention_kernel_flops", Role.LAYER),
        act_replicated_bytes=_sum(pairs, "act_replicated_bytes"),
        act_sharded_bytes=_sum(pairs, "act_sharded_bytes"),
        act_attention_bytes=_sum(pairs, "act_attention_bytes"),
        layer_act_replicated_bytes=_sum(pairs, "act_replicated_bytes", Role.LAYER),
        layer_act_sharded_bytes=_sum(pairs, "act_sharded_bytes", Role.LAYER),
        layer_act_attention_bytes=_sum(pairs, "act_attention_bytes", Role.LAYER),
        checkpoint_bytes=_sum(pairs, "output_bytes", Role.LAYER),
        largest_layer_replicated_bytes=biggest.act_replicated_bytes,
        largest_layer_split_bytes=biggest.act_sharded_bytes + biggest.act_attention_bytes,
        op_recompute_flops=_sum_op(pairs, "flops"),
        op_recompute_elementwise=_sum_op(pairs, "elementwise"),
        layer_op_saved_replicated_bytes=_sum_op(pairs, "saved_replicated_bytes"),
        layer_op_saved_sharded_bytes=_sum_op(pairs, "saved_sharded_bytes"),
        largest_op_rematerialised_replicated_bytes=rematerialised[0],
        largest_op_rematerialised_split_bytes=rematerialised[1],
        tp_allreduces=int(sum((b.tp_allreduces_fwd + b.tp_allreduces_bwd) * n for b, n in pairs)),
        tp_allreduce_bytes=sum((b.tp_allreduces_fwd + b.tp_allreduces_bwd) * b.output_bytes * n for b, n in pairs),
        layer_tp_allreduces_fwd=int(_sum(pairs, "tp_allreduces_fwd", Role.LAYER)),
        layer_tp_allreduce_fwd_bytes=sum(b.tp_allreduces_fwd * b.output_bytes * n for b, n in pairs if b.role is Role.LAYER),
        boundary_bytes=pairs[-1][0].output_bytes,
        sparse_params=int(_sum(pairs, "sparse_params")),
        sparse_tensors=int(_sum(pairs, "sparse_tensors")),
        sparse_rows_per_sample=_sum(pairs, "sparse_rows_per_sample"),
        sparse_elements_per_sample=_sum(pairs, "sparse_elements_per_sample"),
    )


_NO_LAYER = BlockSpec(name="no layer", params=0, flops=0.0)
"""What a stage without layers (an end stage holding only the embedding or the head) re-materialises: nothing."""


@functools.lru_cache(maxsize=4096)
def stage_loads(model: ModelSpec, pp: int, fixed: tuple[int, ...] | None = None) -> tuple[StageLoad, ...]:
    """The stages that can be the worst device or the slowest stage, out of all ``pp``, their layers split as
    :func:`stage_layers` says (``fixed``: the plan's ``stage_layers``).

    A stage is left out when an earlier one has at least each of its costs: the earlier stage holds
    at least as many micro-batches in flight, so it needs at least as much memory and time. A model
    of identical layers split evenly keeps at most two: the first stage and the last.
    """
    split = stage_layers(model, pp, fixed)
    loads = [_stage(model, split, i) for i in range(pp)]
    return tuple(load for load in loads if not any(_dominates(other, load) for other in loads if other.index < load.index))


def _dominates(first: StageLoad, later: StageLoad) -> bool:
    """An earlier stage with at least every cost of a later one is at least as full and as slow."""
    return all(getattr(first, name) >= getattr(later, name) for name in _COST_FIELDS)


_COST_FIELDS = [f.name for f in dataclasses.fields(StageLoad) if f.name != "index"]


def with_stage_layers(model: ModelSpec, plan: Plan) -> Plan:
    """``plan`` with its layer split written out when it is uneven (PlanError when a fixed split does not fit the model):
    what a runtime executes then needs no model to know where the layers go."""
    if plan.pp == 1:
        return plan
    split = stage_layers(model, plan.pp, plan.stage_layers)
    return plan if plan.stage_layers == split or len(set(split)) == 1 else plan.replace(stage_layers=split)
