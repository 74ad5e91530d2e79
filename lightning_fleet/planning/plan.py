"""Plan: one parallel layout, as a value.

String form (also ``str(plan)``)::

    dp=32,tp=8,pp=4,zero=1,mbs=2,gas=28,recompute=full,sp=false,vpp=1,offload=none

Keys may be left out when parsing: zero=0, mbs=1, recompute=none, sp=false, vpp=1, offload=none,
gas derived from the global batch size. ``dp_shard=4`` (printed only when it is smaller than dp) shards the
data-parallel state (what ``zero`` shards) over groups of that many replicas and replicates it across the dp / dp_shard
groups (hybrid sharding: FSDP inside a node, replicas across nodes). ``order=tp-dp-pp`` (innermost axis first) is printed only
when it differs from the default placement, and ``stage_layers=7/8/8/7`` (transformer layers per
pipeline stage, first to last) only when the layers split unevenly; without it a pipeline splits
them evenly when pp divides them, else as :func:`lightning_fleet.planning.stages.balanced_stage_layers` says.
``dp_mbs=6/2`` gives each data-parallel replica its own micro-batch size (mbs is then the largest, and may be left
out); a replica's loss is weighted by its share (:meth:`Plan.loss_weight`) so the gradient stays the mean over the
global batch. It is printed only when the sizes differ.

A :class:`PartialPlan` (:func:`parse_partial_plan`) reads the same strings with the other meaning:
the keys given are fixed and the planner chooses the rest (``dp=2,zero=1``: ZeRO-1 on two replicas,
any micro-batch size, recomputation and offload that fit).

Where each rank sits is defined here once, by the plan's ``order``: :meth:`Plan.stride`,
:meth:`Plan.coordinates` and :meth:`Plan.rank_at`. The cost model (which link an axis runs on), the
sampler (which replica a rank feeds) and the runtime's process groups all derive from them.

Pure: imports neither torch nor deepspeed; imported by the rest of the planning core, the CLI, the
strategy and the runtimes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping

from lightning_fleet.planning.errors import PlanError
from lightning_fleet.planning.yamlspec import ascii_int, shown


class Axis(StrEnum):
    """Mesh axes: data, tensor and pipeline parallel."""

    DP = "dp"
    TP = "tp"
    PP = "pp"


class Recompute(StrEnum):
    """Activation recomputation, in order of the work it redoes (the search relies on this order: each mode redoes at
    least the work of the ones before it, so it is never faster)."""

    NONE = "none"
    """Every layer keeps what autograd saves."""
    SELECTIVE = "selective"
    """The attention core is recomputed, its s x s scores not kept (Korthikanti et al. 2022, Sec. 5)."""
    OP = "op"
    """Op-level selective checkpointing: each layer keeps its input, the outputs of its odd-numbered weight matmuls (1st,
    3rd, ... in forward order) and of a fused attention kernel, and recomputes the rest of its forward in backward
    (torchtitan's ``selective_ac_option = 'op'`` policy; :class:`~lightning_fleet.planning.model.OpRecompute`)."""
    FULL = "full"
    """Each layer keeps only its input and recomputes its whole forward in backward."""


class Offload(StrEnum):
    """What lives in host memory: nothing, the optimizer (ZeRO-Offload), or optimizer and parameters (ZeRO-Infinity)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


DEFAULT_ORDER: tuple[Axis, ...] = (Axis.TP, Axis.DP, Axis.PP)
"""Default placement, innermost first: tp on consecutive ranks of a node, then dp, then pp."""

@dataclass(frozen=True, slots=True, kw_only=True)
class Coordinates:
    """Where one rank sits in a plan's mesh: its index along each axis (:meth:`Plan.coordinates`)."""

    dp: int
    """Its data-parallel replica, 0 ... dp - 1 (which slice of each global batch it trains on)."""
    tp: int
    """Its place in its tensor-parallel group, 0 ... tp - 1 (which shard of each split layer it holds)."""
    pp: int
    """Its pipeline stage, 0 ... pp - 1 (which layers it runs)."""

    def __post_init__(self) -> None:
        for axis in Axis:
            index = getattr(self, axis.value)
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise PlanError(f"coordinates: {axis} must be a non-negative integer index, got {index!r}")


_KEYS = ("dp", "tp", "pp", "zero", "mbs", "gas", "recompute", "sp", "vpp", "offload", "order", "stage_layers", "dp_mbs",
         "dp_shard", "runtime")
_OPTIONAL = ("gas", "order", "stage_layers", "dp_mbs", "dp_shard", "runtime")
"""Keys a whole plan may leave out: gas follows from the global batch, order defaults to tp-dp-pp, stage_layers to the
default split, dp_mbs to mbs on every replica, dp_shard to sharding over all of dp, runtime to none chosen yet."""
_RUNTIME_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_INT_KEYS = ("dp", "tp", "pp", "mbs", "gas", "vpp")
_PARSED_INT_KEYS = (*_INT_KEYS, "dp_shard")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parallel layout and its batch split. Meshes and engines live in the strategy, never here."""

    dp: int
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    zero: int = 0
    """Shard level 0-3 of data-parallel state, in ZeRO's terms: 0 replicates everything, 1 shards the optimizer
    states, 2 also the gradients, 3 also the weights. Each runtime maps it to its own mechanism (DeepSpeed: ZeRO stage
    k; torch: DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2 without and with resharding after forward)."""
    mbs: int = 1
    """Micro-batch size per data-parallel replica."""
    gas: int = 1
    """Micro-batches per optimizer step (gradient accumulation / pipeline micro-batches)."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    sp: bool = False
    """Sequence parallelism (Megatron style, needs tp > 1)."""
    vpp: int = 1
    """Virtual pipeline stages per device (interleaved 1F1B, needs pp > 1)."""
    offload: Offload = Offload.NONE
    """Host offload."""
    order: tuple[Axis, ...] = DEFAULT_ORDER
    """Placement of the axes on ranks, innermost (consecutive ranks) first."""
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers on each pipeline stage, first to last (None: the default split, even when pp divides the
    layers); an even split is kept as None, so each split has one spelling."""
    dp_mbs: tuple[int, ...] | None = None
    """Micro-batch size of each data-parallel replica, first to last, when they differ (None: every replica runs
    ``mbs``; equal sizes are kept as None). ``mbs`` is then the largest: what the busiest device holds and computes."""
    dp_shard: int | None = None
    """Hybrid sharding: the data-parallel replicas ``zero`` shards over, as groups of this many consecutive dp ranks,
    each group holding one whole copy of the sharded state and the dp / dp_shard groups reducing their gradients across
    (torch's HSDP: FSDP2 over a (replicate, shard) mesh; torchtitan's ``data_parallel_shard_degree``). None: one group,
    all of dp (a group as large as dp is kept as None, so each layout has one spelling). Needs zero >= 1 and must
    divide dp."""
    runtime: str | None = None
    """The runtime that executes the plan, by its name in the runtime table (lightning_fleet/runtime; the planning core
    knows no runtime by name); None: not chosen (a plan of the cost model's whole space)."""

    def __post_init__(self) -> None:
        if self.runtime is not None:
            _check_runtime(self.runtime)
        for name in _INT_KEYS:  # the checks of _check_positive and _check_zero, inline: the search builds many plans
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _check_positive(name, value)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            _check_zero(self.zero)
        if self.dp_shard is not None:
            object.__setattr__(self, "dp_shard", _check_dp_shard(self.dp_shard, dp=self.dp, zero=self.zero))
        if type(self.recompute) is not Recompute:
            object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "recompute"))
        if type(self.offload) is not Offload:
            object.__setattr__(self, "offload", _enum(Offload, self.offload, "offload"))
        if self.order is not DEFAULT_ORDER:
            object.__setattr__(self, "order", _check_order(self.order))
        if self.sp and self.tp == 1 or self.vpp > 1 and self.pp == 1 or self.offload is not Offload.NONE:
            _check_pairs(tp=self.tp, pp=self.pp, zero=self.zero, sp=self.sp, vpp=self.vpp, offload=self.offload)
        if self.stage_layers is not None:
            split = _check_stage_layers(self.stage_layers)
            _check_split_pairs(split, pp=self.pp, vpp=self.vpp)
            object.__setattr__(self, "stage_layers", None if len(set(split)) == 1 else split)
        if self.dp_mbs is not None:
            sizes = _check_dp_mbs(self.dp_mbs, dp=self.dp, mbs=self.mbs)
            object.__setattr__(self, "dp_mbs", None if len(set(sizes)) == 1 else sizes)

    @property
    def world_size(self) -> int:
        """Devices the plan uses: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def shard_degree(self) -> int:
        """Ranks each copy of the sharded data-parallel state is split over: ``dp_shard``, else dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def shard_replicas(self) -> int:
        """Whole copies of the sharded data-parallel state: dp / :attr:`shard_degree` (1 without hybrid sharding)."""
        return self.dp // self.shard_degree

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: dp * mbs * gas, or gas * sum(dp_mbs) when the replicas' micro-batches differ."""
        if self.dp_mbs is not None:
            return self.gas * sum(self.dp_mbs)
        return self.dp * self.mbs * self.gas

    def replica_mbs(self, dp_rank: int) -> int:
        """Micro-batch size of data-parallel replica ``dp_rank``."""
        return self.mbs if self.dp_mbs is None else self.dp_mbs[dp_rank]

    def replica_samples(self) -> tuple[int, ...]:
        """Samples each data-parallel replica takes per optimizer step (gas micro-batches each), first to last: the
        contiguous shares of a step's global batch that replica 0, 1, ... read, in that order."""
        return tuple(self.gas * self.replica_mbs(r) for r in range(self.dp))

    def uneven_shares(self) -> tuple[int, ...] | None:
        """:meth:`replica_samples` where the replicas' micro-batches differ (``dp_mbs``), else None (every replica alike)."""
        return self.replica_samples() if self.dp_mbs is not None else None

    def loss_weight(self, dp_rank: int) -> float:
        """What replica ``dp_rank`` multiplies its micro-batch losses by (:func:`share_weight` of its
        :meth:`replica_samples`); 1 when the replicas' micro-batches are equal."""
        return 1.0 if self.dp_mbs is None else share_weight(self.replica_samples(), dp_rank)

    def __str__(self) -> str:
        text = (
            f"dp={self.dp},tp={self.tp},pp={self.pp},zero={self.zero},mbs={self.mbs},gas={self.gas},"
            f"recompute={self.recompute},sp={str(self.sp).lower()},vpp={self.vpp},offload={self.offload}"
        )
        if self.order != DEFAULT_ORDER:
            text += f",order={'-'.join(self.order)}"
        if self.stage_layers is not None:
            text += f",stage_layers={field_text(self.stage_layers)}"
        if self.dp_mbs is not None:
            text += f",dp_mbs={field_text(self.dp_mbs)}"
        if self.dp_shard is not None:
            text += f",dp_shard={self.dp_shard}"
        if self.runtime is not None:
            text += f",runtime={self.runtime}"
        return text

    def stride(self, axis: Axis) -> int:
        """Rank distance between neighbours on ``axis``: the product of the degrees of the axes :attr:`order` places
        inside it (order tp-dp-pp: tp 1, dp tp, pp tp * dp). The one definition of where ranks sit."""
        stride = 1
        for inner in self.order:
            if inner == axis:
                return stride
            stride *= getattr(self, inner.value)
        raise PlanError(f"plan: {axis!r} is not an axis (known: {', '.join(Axis)})")

    def coordinates(self, rank: int) -> Coordinates:
        """Where ``rank`` sits, the first axis of :attr:`order` varying fastest: with order tp-dp-pp, dp=2, tp=2 the ranks
        0, 1, 2, 3 are (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1). PlanError unless 0 <= rank < world_size."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(
                f"plan {self}: rank {rank!r} is not one of its ranks 0..{self.world_size - 1} "
                f"(dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size}): use a rank of the world it was made for"
            )
        return Coordinates(
            dp=rank // self.stride(Axis.DP) % self.dp,
            tp=rank // self.stride(Axis.TP) % self.tp,
            pp=rank // self.stride(Axis.PP) % self.pp,
        )

    def rank_at(self, coordinates: Coordinates) -> int:
        """The rank at ``coordinates`` (the inverse of :meth:`coordinates`); PlanError when an index is outside its axis."""
        for axis in Axis:
            index, size = getattr(coordinates, axis.value), getattr(self, axis.value)
            if index >= size:
                raise PlanError(
                    f"plan {self}: {axis} index {index} is outside 0..{size - 1} ({axis}={size}): use coordinates of its mesh"
                )
        return sum(getattr(coordinates, axis.value) * self.stride(axis) for axis in Axis)

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready values (order as 'tp-dp-pp'; stage_layers and dp_mbs as lists, and only when uneven)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["recompute"] = str(self.recompute)
        out["offload"] = str(self.offload)
        out["order"] = "-".join(self.order)
        for name in ("stage_layers", "dp_mbs", "dp_shard", "runtime"):
            if out[name] is None:
                del out[name]
            elif name in ("stage_layers", "dp_mbs"):
                out[name] = list(out[name])  # type: ignore[call-overload]
        return out

    def replace(self, **changes: object) -> "Plan":
        """A copy with some fields changed (validated again)."""
        return Plan(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

    def check(
        self, *, world_size: int, num_layers: int, num_heads: int, global_batch_size: int, num_kv_heads: int | None = None
    ) -> None:
        """Raise PlanError naming every factor when the plan does not fit this world, model and batch (tp must divide the
        key/value heads under grouped-query attention, and so the heads)."""
        problems = []
        if self.world_size != world_size:
            problems.append(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size} != world size {world_size}")
        if num_heads % self.tp:
            problems.append(f"tp({self.tp}) does not divide num_heads({num_heads})")
        elif num_kv_heads is not None and num_kv_heads % self.tp:
            problems.append(f"tp({self.tp}) does not divide num_kv_heads({num_kv_heads})")
        if self.stage_layers is not None:
            if sum(self.stage_layers) != num_layers:
                problems.append(f"stage_layers={field_text(self.stage_layers)} adds up to {sum(self.stage_layers)} != num_layers({num_layers})")
        elif self.vpp > 1 and num_layers % (self.pp * self.vpp):
            problems.append(f"pp({self.pp}) * vpp({self.vpp}) = {self.pp * self.vpp} does not divide num_layers({num_layers})")
        elif self.pp > num_layers:
            problems.append(f"pp({self.pp}) > num_layers({num_layers}): every stage needs a layer (or give stage_layers)")
        if self.global_batch_size != global_batch_size:
            split = f"gas({self.gas}) * sum(dp_mbs={field_text(self.dp_mbs)})" if self.dp_mbs else (
                f"dp({self.dp}) * mbs({self.mbs}) * gas({self.gas})")
            problems.append(f"{split} = {self.global_batch_size} != global batch size {global_batch_size}")
        if problems:
            raise PlanError("plan " + str(self) + " is invalid: " + "; ".join(problems))


_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def _enum(cls: type, value: object, name: str):
    try:
        return cls(value)
    except ValueError:
        raise PlanError(f"plan: {name} must be one of {', '.join(cls)}, got {shown(value)}") from None


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"plan: {name} must be a positive integer, got {shown(value)}")


def _check_zero(value: object) -> None:
    if value not in (0, 1, 2, 3) or isinstance(value, bool):
        raise PlanError(f"plan: zero must be 0, 1, 2 or 3, got {shown(value)}")


def _check_runtime(name: object) -> str:
    """A runtime's name as the plan holds it (its validity is the runtime table's to judge)."""
    if not isinstance(name, str) or not _RUNTIME_NAME.match(name):
        raise PlanError(f"plan: runtime must be a runtime's name such as torch or deepspeed, got {shown(name)}")
    return name


def _check_order(order: object) -> tuple[Axis, ...]:
    """The placement as Axis values; each of dp, tp and pp exactly once."""
    if isinstance(order, str) or not isinstance(order, (tuple, list)):
        raise PlanError(f"plan: order must name dp, tp and pp once each, got {shown(order)}")
    axes = tuple(_enum(Axis, a, "order") for a in order)
    if sorted(axes) != sorted(Axis):
        raise PlanError(f"plan: order must name dp, tp and pp once each, got {'-'.join(axes)}")
    return axes


def _check_dp_shard(value: object, *, dp: int | None, zero: int | None) -> int | None:
    """The shard group size as a plan keeps it (None when it is all of dp), checked against dp and zero where they are
    known: a positive integer of at least 2 that divides dp, with something to shard (zero >= 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"plan: dp_shard must be a positive integer (the replicas each shard group spans), got {shown(value)}")
    if dp is not None and dp % value:
        raise PlanError(f"plan: dp_shard={value} does not divide dp={dp}: give a shard group size that divides dp "
                        f"({', '.join(str(d) for d in range(2, dp + 1) if dp % d == 0) or 'none here'})")
    if dp is not None and value == dp:
        return None
    if value == 1:
        raise PlanError("plan: dp_shard=1 shards nothing (every replica holds everything): use zero=0, or a shard group of "
                        "at least 2 replicas")
    if zero == 0:
        raise PlanError(f"plan: dp_shard={value} needs zero >= 1 (it groups the replicas the data-parallel state is "
                        "sharded over; zero=0 shards nothing)")
    return value


def _check_stage_layers(value: object) -> tuple[int, ...]:
    """Layer counts per stage as a tuple: non-negative integers, at least one layer in all."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise PlanError(f"plan: stage_layers must be layer counts per stage such as 7/8/8/7, got {shown(value)}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in value) or not sum(value):
        raise PlanError(f"plan: stage_layers must be non-negative layer counts with at least one layer, got {shown(value)}")
    return tuple(value)


def share_weight(shares: tuple[int, ...], dp_rank: int) -> float:
    """What a replica multiplies its micro-batch losses by so that the runtime's gradient, the mean over replicas of each
    replica's mean over its micro-batches, is the mean over the global batch: dp * its share / the sum of the shares.
    Exact for a loss that is a mean over the micro-batch's samples."""
    return len(shares) * shares[dp_rank] / sum(shares)


def _check_dp_mbs(value: object, *, dp: int | None, mbs: int | None) -> tuple[int, ...]:
    """A tuple of positive micro-batch sizes, one per replica where dp is known, the largest equal to mbs where mbs is."""
    if not isinstance(value, tuple) or not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value):
        raise PlanError(
            f"plan: dp_mbs must be positive micro-batch sizes, one per data-parallel replica, such as 6/2, got {shown(value)}"
        )
    text = field_text(value)
    if dp is not None and len(value) != dp:
        raise PlanError(f"plan: dp_mbs={text} names {len(value)} replicas, but dp={dp}: give one micro-batch size per replica")
    if mbs is not None and mbs != max(value):
        raise PlanError(f"plan: dp_mbs={text} has largest micro-batch {max(value)}, but mbs={mbs}: mbs is the largest (or leave it out)")
    return value


def _check_split_pairs(split: tuple[int, ...], *, pp: int | None, vpp: int | None) -> None:
    """The rules between stage_layers and pp or vpp, where those are known: one count per stage, a layer on every stage
    between the first and the last (those hold the embedding and the head), and under interleaving a layer in every
    virtual stage, the end stages' embedding and head filling one of theirs (Llama 3 405B: 126 layers on 16 stages x 8
    virtual stages as 7/8x14/7, "the first model chunk on the first stage has only the embedding", arXiv 2407.21783
    Sec. 3.3.2)."""
    text = field_text(split)
    if pp is not None and len(split) != pp:
        raise PlanError(f"plan: stage_layers={text} names {len(split)} stages, but pp={pp}: give one count per stage")
    if len(split) < 2:
        raise PlanError(f"plan: stage_layers={text} needs pp > 1 (it splits the layers of a pipeline)")
    if 0 in split[1:-1]:
        raise PlanError(
            f"plan: stage_layers={text} leaves a middle stage without layers: only the first and the last stage "
            "(which hold the embedding and the head) may hold none"
        )
    if vpp is not None and vpp > 1 and (min(split[1:-1], default=vpp) < vpp or min(split[0], split[-1]) < vpp - 1):
        raise PlanError(
            f"plan: stage_layers={text} with vpp={vpp}: each of a stage's {vpp} virtual stages needs a layer (the first "
            "and the last stage's embedding or head may fill one of theirs): give every middle stage at least vpp layers "
            "and the end stages at least vpp - 1, or use vpp=1"
        )


def _check_pairs(
    *, tp: int | None, pp: int | None, zero: int | None, sp: bool | None, vpp: int | None, offload: Offload | None
) -> None:
    """The rules between two fields, checked where both are known (None: not fixed). They say what the cost model's sp,
    vpp and offload mean, not what a runtime executes (that is each runtime's Capabilities, lightning_fleet/runtime/)."""
    if sp and tp == 1:
        raise PlanError("plan: sp=true needs tp > 1 (sequence parallelism splits along the tensor-parallel group)")
    if vpp is not None and vpp > 1 and pp == 1:
        raise PlanError(f"plan: vpp={vpp} needs pp > 1 (virtual stages interleave a pipeline)")
    if offload is not None and offload is not Offload.NONE and zero == 0:
        raise PlanError(f"plan: offload={offload} needs zero >= 1 (DeepSpeed offloads ZeRO partitions)")
    if offload is Offload.OPTIMIZER_PARAMS and zero is not None and zero != 3:
        raise PlanError(f"plan: offload=optimizer+params needs zero=3, got zero={zero}")


def parse_plan(text: str, *, global_batch_size: int | None = None) -> Plan:
    """Parse ``dp=..,tp=..,...``; gas, when left out, is global_batch_size / (dp * mbs)."""
    fields = _split_plan(text)
    if "dp" not in fields:
        raise PlanError(f"plan {text!r} needs dp=N")
    sizes = fields.get("dp_mbs")
    if sizes is not None and "mbs" not in fields:
        fields["mbs"] = max(_check_dp_mbs(sizes, dp=None, mbs=None))
    if "gas" not in fields:
        if global_batch_size is None:
            raise PlanError(f"plan {text!r} has no gas= and no global batch size to derive it from")
        per_step, what = _per_micro_step(fields)
        if global_batch_size % per_step:
            raise PlanError(f"plan {text!r}: global batch size {global_batch_size} is not divisible by {what} = {per_step}")
        fields["gas"] = global_batch_size // per_step
    return Plan(**fields)


def _per_micro_step(fields: Mapping[str, object]) -> tuple[int, str]:
    """Samples one micro-batch of every replica takes together, and how the plan string says it: sum(dp_mbs) when given,
    else dp * mbs (mbs 1 when left out)."""
    sizes = fields.get("dp_mbs")
    if sizes is not None:
        return sum(sizes), f"sum(dp_mbs={field_text(sizes)})"  # type: ignore[call-overload, arg-type]
    mbs = fields.get("mbs", 1)
    return fields["dp"] * mbs, f"dp({fields['dp']}) * mbs({mbs})"  # type: ignore[operator]


def _split_plan(text: str) -> dict[str, object]:
    """The ``key=value`` items of a plan string, each value parsed and range-checked; an empty string has none, and an
    empty item (``dp=2,,tp=1``, a trailing comma) is refused, as every other item that is not key=value."""
    out: dict[str, object] = {}
    if not text.strip():
        return out
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise PlanError(f"plan {shown(text)}: an empty item between commas; write key=value items separated by single commas")
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise PlanError(f"plan {text!r}: {part!r} is not key=value")
        if key not in _KEYS:
            raise PlanError(f"plan {text!r}: unknown key {key!r} (known: {', '.join(_KEYS)})")
        if key in out:
            raise PlanError(f"plan {text!r}: {key} given twice")
        out[key] = _parse_value(key, value, text)
        if key in _PARSED_INT_KEYS:
            _check_positive(key, out[key])  # before gas = global batch size / (dp * mbs) divides by them
        elif key == "dp_mbs":
            _check_dp_mbs(out[key], dp=None, mbs=None)  # before gas = global batch size / sum(dp_mbs)
    return out


def _parse_value(key: str, value: str, text: str) -> object:
    if key == "sp":
        if value.lower() not in ("true", "false"):
            raise PlanError(f"plan {text!r}: sp must be true or false, got {value!r}")
        return value.lower() == "true"
    if key == "order":
        return tuple(value.split("-"))
    if key == "stage_layers":
        return _parse_stage_layers(value, text)
    if key == "dp_mbs":
        try:
            return tuple(ascii_int(n) for n in value.split("/"))
        except ValueError:
            raise PlanError(
                f"plan {text!r}: dp_mbs must be micro-batch sizes per replica such as 6/2, got {shown(value)}"
            ) from None
    if key in ("recompute", "offload"):
        return value
    if key == "runtime":
        return _check_runtime(value)
    try:
        return ascii_int(value)
    except ValueError as err:
        raise PlanError(f"plan {text!r}: {key} must be an integer, got {shown(value)} ({err})") from None


def _parse_stage_layers(value: str, text: str) -> tuple[int, ...]:
    """``7/8/8/7`` as (7, 8, 8, 7)."""
    try:
        return tuple(ascii_int(n) for n in value.split("/"))
    except ValueError:
        raise PlanError(
            f"plan {text!r}: stage_layers must be layer counts per stage such as 7/8/8/7, got {shown(value)}"
        ) from None


def plan_from_mapping(data: Mapping[str, object]) -> Plan:
    """A Plan from a dict such as :meth:`Plan.to_dict` produces (stage_layers as a list or as ``7/8/8/7``)."""
    data = dict(data)
    if isinstance(data.get("order"), str):
        data["order"] = tuple(str(data["order"]).split("-"))
    if isinstance(data.get("stage_layers"), str):
        data["stage_layers"] = _parse_stage_layers(str(data["stage_layers"]), str(data["stage_layers"]))
    for name in ("stage_layers", "dp_mbs"):
        if isinstance(data.get(name), list):
            data[name] = tuple(data[name])  # type: ignore[arg-type]
    return Plan(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartialPlan:
    """Some axes of a plan fixed, the others left to the planner; every field is optional (None: the planner chooses).

    ``PartialPlan(zero=1, mbs=4)``: ZeRO-1 with micro-batches of 4, any layout, recomputation and
    offload that fit. Values are validated as :class:`Plan` validates them, and the rules between
    two fields (sp needs tp > 1, vpp > 1 needs pp > 1, offload needs zero >= 1) where both are fixed.
    """

    dp: int | None = None
    """Data-parallel degree."""
    tp: int | None = None
    """Tensor-parallel degree."""
    pp: int | None = None
    """Pipeline-parallel degree."""
    zero: int | None = None
    """ZeRO stage 0-3."""
    mbs: int | None = None
    """Micro-batch size per data-parallel replica."""
    gas: int | None = None
    """Micro-batches per optimizer step."""
    recompute: Recompute | None = None
    """Activation recomputation."""
    sp: bool | None = None
    """Sequence parallelism."""
    vpp: int | None = None
    """Virtual pipeline stages per device."""
    offload: Offload | None = None
    """Host offload."""
    order: tuple[Axis, ...] | None = None
    """Placement of the axes on ranks, innermost first."""
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers per pipeline stage, first to last (None: the default split); fixes pp to its length."""
    dp_mbs: tuple[int, ...] | None = None
    """Micro-batch size of each data-parallel replica; fixes dp to its length and mbs to the largest. Uneven sizes are
    given with a whole plan (:attr:`complete`): the planner prices and runs them, it does not search around them;
    equal sizes are kept as dp and mbs (None here), as :class:`Plan` keeps them."""
    dp_shard: int | None = None
    """The shard group size of hybrid sharding (:attr:`Plan.dp_shard`); None: the planner chooses (one group of all dp,
    or groups where the runtime runs them)."""
    runtime: str | None = None
    """The runtime that must execute it (None: the planner or FleetStrategy(runtime=...) chooses)."""

    def __post_init__(self) -> None:
        if self.runtime is not None:
            _check_runtime(self.runtime)
        for name in _INT_KEYS:
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.zero is not None:
            _check_zero(self.zero)
        if self.dp_shard is not None:
            _check_dp_shard(self.dp_shard, dp=self.dp, zero=self.zero)
        if self.recompute is not None:
            object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "recompute"))
        if self.offload is not None:
            object.__setattr__(self, "offload", _enum(Offload, self.offload, "offload"))
        if self.sp is not None and not isinstance(self.sp, bool):
            raise PlanError(f"plan: sp must be true or false, got {shown(self.sp)}")
        if self.order is not None:
            object.__setattr__(self, "order", _check_order(self.order))
        _check_pairs(tp=self.tp, pp=self.pp, zero=self.zero, sp=self.sp, vpp=self.vpp, offload=self.offload)
        if self.stage_layers is not None:
            split = _check_stage_layers(self.stage_layers)
            _check_split_pairs(split, pp=self.pp, vpp=self.vpp)
            object.__setattr__(self, "stage_layers", split)
            if self.pp is None:
                object.__setattr__(self, "pp", len(split))
        if self.dp_mbs is not None:
            sizes = _check_dp_mbs(self.dp_mbs, dp=self.dp, mbs=self.mbs)
            object.__setattr__(self, "dp_mbs", None if len(set(sizes)) == 1 else sizes)  # as Plan keeps them
            if self.dp is None:
                object.__setattr__(self, "dp", len(sizes))
            if self.mbs is None:
                object.__setattr__(self, "mbs", max(sizes))

    @property
    def fixed(self) -> dict[str, object]:
        """The fixed fields by name, in the order of the plan string."""
        return {name: getattr(self, name) for name in _KEYS if getattr(self, name) is not None}

    @property
    def missing(self) -> tuple[str, ...]:
        """The axes still to choose before this is a whole plan (gas follows from the global batch, order defaults to
        tp-dp-pp, stage_layers to the default split)."""
        return tuple(name for name in _KEYS if name not in _OPTIONAL and getattr(self, name) is None)

    @property
    def complete(self) -> bool:
        """Every axis is fixed: :meth:`to_plan` gives the plan without a search."""
        return not self.missing

    def __str__(self) -> str:
        return ",".join(f"{name}={field_text(value)}" for name, value in self.fixed.items())

    def to_plan(self, global_batch_size: int | None = None) -> Plan:
        """The whole plan (PlanError naming the keys still free unless :attr:`complete`); gas, when not fixed, is
        global_batch_size / (dp * mbs), and a fixed gas must agree with global_batch_size when that is given."""
        if self.missing:
            raise PlanError(
                f"plan {str(self)!r} leaves {', '.join(self.missing)} to the planner; fix them all to use it without a search"
            )
        fields = {name: value for name, value in self.fixed.items()}
        per_step, what = _per_micro_step(fields)
        if global_batch_size is not None and global_batch_size % per_step:
            raise PlanError(f"plan {str(self)!r}: global batch size {global_batch_size} is not divisible by {what} = {per_step}")
        if self.gas is None:
            if global_batch_size is None:
                raise PlanError(f"plan {str(self)!r} has no gas= and no global batch size to derive it from")
            fields["gas"] = global_batch_size // per_step
        elif global_batch_size is not None and per_step * self.gas != global_batch_size:
            raise PlanError(
                f"plan {str(self)!r}: {what} * gas({self.gas}) = {per_step * self.gas} != global batch size {global_batch_size}"
            )
        return Plan(**fields)  # type: ignore[arg-type]

    def fix(self, **fields: object) -> "PartialPlan":
        """A copy with more fields fixed; PlanError when one of them is already fixed to another value."""
        for name, value in fields.items():
            if name not in _KEYS:
                raise PlanError(f"plan: unknown key {name!r} (known: {', '.join(_KEYS)})")
            current = getattr(self, name)
            if current is not None and current != value:
                raise PlanError(
                    f"plan {str(self)!r} already fixes {name}={field_text(current)}; it cannot also be {field_text(value)}"
                )
        return dataclasses.replace(self, **fields)  # type: ignore[arg-type]


def field_text(value: object) -> str:
    """A plan field's value as the plan string writes it (true, tp-dp-pp, optimizer+params, 4, 7/8/8/7)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "/".join(str(n) for n in value) if all(isinstance(n, int) for n in value) else "-".join(value)
    return str(value)


def parse_partial_plan(text: str) -> PartialPlan:
    """Parse ``key=value,...`` as fixed axes (the planner chooses the rest); the same keys, values and errors as
    :func:`parse_plan`, and no key is required. An empty string fixes nothing."""
    return PartialPlan(**_split_plan(text))  # type: ignore[arg-type]
