"""The planner: enumerate layouts, prune by memory, rank by predicted step time, explain the rest.

Search is separate from execution: it takes specs and returns ranked estimates; it never launches
anything. These rules keep it fast and exact (tests compare it with brute force):

* memory never shrinks as the micro-batch grows, so the first micro-batch size that does not fit
  ends that branch;
* recomputation (none < selective < op < full, the order of :class:`Recompute`: each mode redoes at
  least the work of the ones before it, which :class:`~lightning_fleet.planning.model.OpRecompute`
  checks for every block) and offload (none < optimizer < optimizer+params) only add time, so a
  fitting variant is priced only when no variant with less of both fits;
* branch and bound on compute: a micro-batch size is not priced when its step time with all
  communication free (:func:`~lightning_fleet.planning.estimate.compute_bound_s`, a lower bound over
  placements, recomputation and offload) is no better than the top-th time priced so far;
* branch and bound on links: a variant is not priced when its step time with every collective on
  the fastest link (a lower bound over placements: every term grows with latency and per-byte time)
  exceeds the (top + max_rejected)-th time priced so far by more than rounding (factor 1 + 1e-9). At
  least that many plans are then strictly faster under every placement, so the plans and rejections
  returned are the same as without the rule; only ``all_feasible`` holds fewer estimates;
* placements other than the default are priced only when the default puts a collective across
  nodes, only for plans whose fastest-link time could enter the top, and only those that put some
  axis on another link than the default and the placements tried before (time depends on a
  placement only through the links of the axes).

Candidates and feasible counts do not depend on the bounds: every micro-batch size is still tested
for memory. That test compares activation bytes with *rooms*, the largest value that still fits
next to a stage's other bytes as floats round the sum (:func:`room`), so it decides exactly as the
sum does; which variants fit then depends only on where the activation bytes rank among a layout's
rooms, and is kept per ranking. Step times come from memoised pieces
(:class:`~lightning_fleet.planning.estimate.TimeModel`) equal bit for bit to :func:`estimate`'s, every candidate's
with the one :class:`~lightning_fleet.planning.overlap.Overlaps` of the constraints (what the runtime hides behind
compute), so no layout wins by an overlap the others are denied.

Every plan not chosen comes back as a :class:`Rejection` with a :class:`RejectionKind` to branch on.

Pure: imports neither torch nor deepspeed; imported by the CLI, the decision, the strategy and benchmarks.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import struct
import time as _clock
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from lightning_fleet.planning.cluster import GIB, ClusterSpec, DeviceSpec, LinkLevel, devices_by_speed
from lightning_fleet.planning.comm import axis_level
from lightning_fleet.planning.errors import NoFeasiblePlanError, PlanError
from lightning_fleet.planning.estimate import (
    ActivationModel,
    Estimate,
    Hardware,
    StateBytes,
    TimeModel,
    check_recompute,
    stage_state_bytes,
)
from lightning_fleet.planning.estimate import estimate as estimate_plan
from lightning_fleet.planning.estimate import replica_devices, replica_estimate, stage_devices
from lightning_fleet.planning.memory import MemoryEstimate
from lightning_fleet.planning.model import MAX_GLOBAL_BATCH_SIZE, ModelSpec
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.planning.plan import DEFAULT_ORDER, Axis, Offload, PartialPlan, Plan, Recompute, field_text
from lightning_fleet.planning.stages import StageLoad, balanced_stage_layers, check_stage_layers, stage_layers, with_stage_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraints:
    """What the search may choose. Runtimes narrow it to what they really execute; a :class:`PartialPlan` fixes axes
    (:func:`narrow`). Only plans that satisfy every field are candidates."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages to consider."""
    max_tp: int | None = None
    """Largest tensor-parallel degree (None: no limit beyond the heads)."""
    tp_divides: int | None = None
    """A number every tensor-parallel degree must divide: what the module's split layers allow (the gcd of their heads
    and features; 1 when one of them cannot be split), a fact the runtime reads off the module (None: only the heads)."""
    max_pp: int | None = None
    """Largest pipeline degree (None: no limit beyond the layers)."""
    max_zero_with_pp: int = 3
    """Highest ZeRO stage allowed together with pp > 1 (DeepSpeed's pipeline engine: 1)."""
    allow_offload: bool = True
    """Consider optimizer / parameter offload (needs a host section in the cluster)."""
    require_offload: bool = False
    """Consider only plans that offload (implies allow_offload)."""
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    """Recomputation modes to consider (:func:`plan` leaves op out for a model that does not say what it does to it)."""
    allow_sp: bool = True
    """Consider sequence parallelism."""
    max_vpp: int | None = None
    """Largest number of virtual pipeline stages (1 disables interleaving)."""
    mbs: tuple[int, ...] | None = None
    """Micro-batch sizes to consider (None: every divisor of the per-replica batch)."""
    search_placement: bool = True
    """Price placements other than tp-dp-pp when the default crosses nodes."""
    tp_with_pp: bool = True
    """Allow tp > 1 and pp > 1 together."""
    offload_with_pp: bool = True
    """Allow offload when pp > 1."""
    dp: int | None = None
    """Exact data-parallel degree (None: any)."""
    tp: int | None = None
    """Exact tensor-parallel degree (None: any within max_tp)."""
    pp: int | None = None
    """Exact pipeline degree (None: any within max_pp)."""
    gas: int | None = None
    """Exact micro-batches per optimizer step (None: any)."""
    offloads: tuple[Offload, ...] | None = None
    """Offload modes to consider (None: those allow_offload and require_offload give)."""
    sp: bool | None = None
    """Sequence parallelism on (True) or off (False) in every plan (None: either, as allow_sp says)."""
    vpp: int | None = None
    """Exact number of virtual pipeline stages (None: any within max_vpp)."""
    order: tuple[Axis, ...] | None = None
    """Exact placement of every plan (None: tp-dp-pp, and others when search_placement)."""
    overlaps: Overlaps = Overlaps.DEFAULT
    """What the runtime hides behind compute; every candidate is priced with it (a runtime's ``Capabilities.overlaps``)."""
    uneven_stages: bool = True
    """Allow a pipeline degree that does not divide the layers (its stages split by the default rule,
    :func:`~lightning_fleet.planning.stages.balanced_stage_layers`); False: pp must divide num_layers."""
    stage_layers: tuple[int, ...] | None = None
    """Exact layers per pipeline stage of every plan, first to last (None: the default split); pp must be its length."""
    uneven_dp: bool = True
    """Allow data-parallel replicas with different micro-batch sizes (``dp_mbs``, given by the user, never searched)."""
    uneven_dp_with_pp: bool = True
    """Allow them inside a pipeline (False: a plan with dp_mbs has pp=1)."""
    search_dp_mbs: bool = True
    """On a cluster whose devices differ, let the planner give the replicas different micro-batch sizes, each replica's
    share of the batch by its speed and within its memory (:func:`balance_micro_batches`). Off for a loss that may depend
    on the micro-batch (the decision turns it off unless the module is known not to)."""
    consider_leaving_out: bool = True
    """On a cluster whose devices differ, also plan on the cluster without its slowest kind(s) of device, and report it
    (:attr:`PlanResult.leave_out`) when that runs the same global batch at least LEAVE_OUT_GAIN faster."""
    dp_mbs: tuple[int, ...] | None = None
    """Exact micro-batch size of each data-parallel replica of every plan (dp is its length, mbs its largest): the
    search plans the rest as for every replica running the largest (what the busiest device holds and computes), and
    the plans it returns are priced with the real sizes."""
    hybrid_zero_stages: tuple[int, ...] = (1, 2, 3)
    """ZeRO stages at which to consider hybrid sharding (``Plan.dp_shard``): the shard group of one node's
    data-parallel ranks, replicated across the groups (:func:`_shard_groups`); empty: never."""
    dp_shard: int | None = None
    """Exact shard group size of every plan at zero >= 1 (None: all of dp, or the groups ``hybrid_zero_stages`` allows)."""
    sparse_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the runtime runs parameters with sparse gradients at (a runtime's
    ``Capabilities.sparse_grad_zero_stages``): a model with some (:attr:`ModelSpec.sparse_params`) is planned on these
    only, the others rejected (:attr:`RejectionKind.SPARSE`)."""

    def __post_init__(self) -> None:
        order = list(Recompute)  # none < selective < op < full, each never faster: the search relies on this order
        object.__setattr__(self, "recompute", tuple(sorted({Recompute(r) for r in self.recompute}, key=order.index)))
        for name in ("zero_stages", "sparse_zero_stages", "hybrid_zero_stages"):
            for stage in getattr(self, name):
                if stage not in (0, 1, 2, 3):
                    raise PlanError(f"constraint {name}: {stage!r} is not a ZeRO stage (0-3)")
        for name in ("max_tp", "tp_divides", "max_pp", "max_vpp", "dp", "tp", "pp", "gas", "vpp", "dp_shard"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PlanError(f"constraint {name} must be an integer >= 1, got {value!r}")
        if self.mbs is not None:
            if not self.mbs or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.mbs):
                raise PlanError(f"constraint mbs must be positive integers, got {self.mbs!r}")
            object.__setattr__(self, "mbs", tuple(sorted(set(self.mbs))))
        if self.offloads is not None:
            modes = list(Offload)  # none < optimizer < optimizer+params: the search relies on this order
            object.__setattr__(self, "offloads", tuple(sorted({_offload(o) for o in self.offloads}, key=modes.index)))
        if self.order is not None:
            object.__setattr__(self, "order", _placement(self.order))
        if self.sp is not None and not isinstance(self.sp, bool):
            raise PlanError(f"constraint sp must be True, False or None, got {self.sp!r}")
        if not isinstance(self.overlaps, Overlaps):
            raise PlanError(f"constraint overlaps must be an Overlaps value (Overlaps.of([...names])), got {self.overlaps!r}")
        if self.stage_layers is not None:
            split = PartialPlan(stage_layers=self.stage_layers).stage_layers
            if self.pp not in (None, len(split)):  # type: ignore[arg-type]
                raise PlanError(f"constraint stage_layers={field_text(split)} names {len(split)} stages, but pp={self.pp}")  # type: ignore[arg-type]
            object.__setattr__(self, "stage_layers", split)
            object.__setattr__(self, "pp", len(split))  # type: ignore[arg-type]
        if not self.zero_stages or not self.recompute or not _allowed_offloads(self):
            raise PlanError("constraints leave no ZeRO stage, recompute mode or offload mode to choose from")


def _offload(value: object) -> Offload:
    try:
        return Offload(value)
    except ValueError:
        raise PlanError(f"constraint offloads: {value!r} is not one of {', '.join(Offload)}") from None


def _placement(order: object) -> tuple[Axis, ...]:
    """A placement as the tuple Plan keeps (DEFAULT_ORDER itself for the default)."""
    axes = Plan(dp=1, order=tuple(order.split("-")) if isinstance(order, str) else order).order  # type: ignore[arg-type]
    return DEFAULT_ORDER if axes == DEFAULT_ORDER else axes


def _allowed_offloads(cons: Constraints) -> tuple[Offload, ...]:
    """Offload modes the constraints allow (whatever the cluster has)."""
    modes = cons.offloads if cons.offloads is not None else tuple(Offload)
    if cons.require_offload:
        return tuple(m for m in modes if m is not Offload.NONE)
    return modes if cons.allow_offload else tuple(m for m in modes if m is Offload.NONE)


def _names(values: tuple[object, ...]) -> str:
    return ", ".join(str(v) for v in values)


def narrow(base: Constraints, partial: PartialPlan) -> Constraints:
    """``base`` narrowed to the axes ``partial`` fixes; PlanError (one line: the key, the value, what ``base`` allows)
    when a fixed value is outside ``base``. The search then honours every fixed axis exactly."""
    text = str(partial)

    def refuse(key: str, value: object, allowed: str) -> PlanError:
        shown = field_text(value)
        return PlanError(
            f"plan {text!r}: {key}={shown} is not allowed here (allowed: {allowed}); change {key} or leave it to the planner"
        )

    changes: dict[str, object] = {}
    if partial.tp is not None and _splits_apart(base, partial.tp):
        raise refuse("tp", partial.tp, f"a tp that divides {base.tp_divides}, what the module's split layers allow")
    for name, limit in (("tp", base.max_tp), ("pp", base.max_pp), ("vpp", base.max_vpp)):
        value = getattr(partial, name)
        if value is None:
            continue
        if limit is not None and value > limit:
            raise refuse(name, value, f"{name} <= {limit}")
        if getattr(base, name) not in (None, value):
            raise refuse(name, value, f"{name}={getattr(base, name)}")
        changes[name] = value
    for name in ("dp", "gas", "sp", "order"):
        value = getattr(partial, name)
        if value is not None and getattr(base, name) not in (None, value):
            raise refuse(name, value, f"{name}={field_text(getattr(base, name))}")
    if partial.dp is not None:
        changes["dp"] = partial.dp
    if partial.gas is not None:
        changes["gas"] = partial.gas
    if partial.sp is not None:
        if partial.sp and not base.allow_sp:
            raise refuse("sp", True, "sp=false")
        if partial.sp and base.max_tp == 1:
            raise refuse("sp", True, "sp=false, as tp <= 1 here and sequence parallelism needs tp > 1")
        changes["sp"] = partial.sp
    if partial.vpp is not None and partial.vpp > 1 and base.max_pp == 1:
        raise refuse("vpp", partial.vpp, "vpp=1, as pp <= 1 here and virtual stages need pp > 1")
    if partial.order is not None:
        if partial.order != DEFAULT_ORDER and not base.search_placement:
            raise refuse("order", partial.order, "the default placement tp-dp-pp only")
        changes["order"] = partial.order
    if partial.stage_layers is not None:
        if base.stage_layers not in (None, partial.stage_layers):
            raise refuse("stage_layers", partial.stage_layers, f"stage_layers={field_text(base.stage_layers)}")
        if not base.uneven_stages and len(set(partial.stage_layers)) > 1:
            raise refuse("stage_layers", partial.stage_layers, "an even split only, as this runtime runs no uneven stages")
        changes["stage_layers"] = partial.stage_layers
    if partial.dp_mbs is not None:
        if not base.uneven_dp:
            raise refuse("dp_mbs", partial.dp_mbs, "one micro-batch size on every replica, as this runtime runs no other")
        if not base.uneven_dp_with_pp:
            if (partial.pp or 1) > 1:
                raise refuse("pp", partial.pp, "pp=1 with dp_mbs, as this runtime's pipeline computes the loss itself")
            changes["pp"] = 1
        changes["dp_mbs"] = partial.dp_mbs
    if partial.tp is not None and partial.pp is not None and partial.tp > 1 and partial.pp > 1 and not base.tp_with_pp:
        raise refuse("tp", partial.tp, "tp=1 when pp > 1")
    if partial.zero is not None:
        pipelined = (partial.pp or 1) > 1
        stages = tuple(z for z in base.zero_stages if not pipelined or z <= base.max_zero_with_pp)
        if partial.zero not in stages:
            raise refuse("zero", partial.zero, f"zero {_names(stages)}" + (" with pp > 1" if pipelined else ""))
        changes["zero_stages"] = (partial.zero,)
    if partial.mbs is not None:
        if base.mbs is not None and partial.mbs not in base.mbs:
            raise refuse("mbs", partial.mbs, f"mbs {_names(base.mbs)}")
        changes["mbs"] = (partial.mbs,)
    if partial.recompute is not None:
        if partial.recompute not in base.recompute:
            raise refuse("recompute", partial.recompute, f"recompute {_names(base.recompute)}")
        changes["recompute"] = (partial.recompute,)
    if partial.offload is not None:
        allowed = _allowed_offloads(base)
        if (partial.pp or 1) > 1 and not base.offload_with_pp:
            allowed = tuple(m for m in allowed if m is Offload.NONE)
        if partial.offload not in allowed:
            raise refuse("offload", partial.offload, f"offload {_names(allowed)}" if allowed else "no offload mode")
        stages = changes.get("zero_stages", base.zero_stages)
        lowest = 3 if partial.offload is Offload.OPTIMIZER_PARAMS else 1
        if partial.offload is not Offload.NONE and not any(z >= lowest for z in stages):
            raise refuse("offload", partial.offload, f"offload none, as zero is {_names(stages)} here")
        changes["offloads"] = (partial.offload,)
    if partial.dp_shard is not None:
        if base.dp_shard not in (None, partial.dp_shard):
            raise refuse("dp_shard", partial.dp_shard, f"dp_shard={base.dp_shard}")
        if not base.hybrid_zero_stages and partial.dp_shard != partial.dp:
            raise refuse("dp_shard", partial.dp_shard, "sharding over all of dp, as this runtime runs no hybrid sharding")
        runs = (1, 2, 3) if partial.dp_shard == partial.dp else base.hybrid_zero_stages
        stages = tuple(z for z in changes.get("zero_stages", base.zero_stages) if z in runs)  # type: ignore[attr-defined]
        if not stages:
            raise refuse("dp_shard", partial.dp_shard, f"none, as zero is {_names(changes.get('zero_stages', base.zero_stages))} "  # type: ignore[arg-type]
                         f"here and hybrid sharding runs at zero {_names(base.hybrid_zero_stages)}")
        changes["zero_stages"], changes["dp_shard"] = stages, partial.dp_shard
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


class RejectionKind(StrEnum):
    """Why a candidate was not chosen, as a value to branch on (the reason text is for people)."""

    LAYOUT = "layout"
    """Its layout cannot split this model's batch (dp does not divide the global batch size); no variant is a candidate."""
    MEMORY = "memory"
    """It does not fit: device or host memory is short, for its variant closest to fitting and every larger mbs."""
    SLOWER = "slower"
    """It fits, but is predicted slower than the plans returned (a runner-up)."""
    SPARSE = "sparse"
    """Its ZeRO stage cannot run the model's sparse gradients on this runtime (``Constraints.sparse_zero_stages``); no
    plan at that stage is a candidate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A candidate (or a family of them) that was not chosen, and why."""

    plan: str
    """The plan string (for a family, its smallest member)."""
    kind: RejectionKind
    """Why, as a value: a layout that cannot split the batch, a plan that does not fit, or one that is slower."""
    reason: str
    """Which term did not fit and by how much, or why it lost."""

    def to_dict(self) -> dict[str, str]:
        """JSON form: ``{"plan", "kind", "reason"}``."""
        return {"plan": self.plan, "kind": str(self.kind), "reason": self.reason}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The planner's answer: the best plans first, why others lost, and how big the search was."""

    plans: tuple[Estimate, ...]
    """Top plans, fastest first."""
    rejected: tuple[Rejection, ...]
    """Plans that lost, with a kind and a reason each: the runners-up beyond the top (slower), then those that did not fit
    (memory, closest first), then layouts that cannot split the batch (layout), then ZeRO stages that cannot run the
    model's sparse gradients (sparse)."""
    candidates: int
    """Candidates considered (pruned families counted in full)."""
    feasible: int
    """Candidates that fit (each is priced, dominated by a faster one that fits, or skipped by a bound as slower than the plans reported)."""
    seconds: float
    """Wall time of the search."""
    all_feasible: tuple[Estimate, ...] = field(default=(), repr=False)
    """Every estimate priced, fastest first: every undominated feasible plan when searched exhaustively,
    otherwise the top plans and the runners-up among those the bounds did not skip."""
    misfit_plans: tuple[Plan, ...] = field(default=(), repr=False)
    """The variant closest to fitting of every family that did not fit (for plots)."""
    even_best: Estimate | None = None
    """On a cluster whose devices differ, when the best plan splits the work by the devices (the replicas' micro-batches,
    ``dp_mbs``, or the stages' layers, ``stage_layers``; chosen only when predicted REBALANCE_GAIN faster): the best plan
    as planned on the slowest device (one micro-batch size on every replica, layers split by their load)."""

    leave_out: "LeaveOut | None" = None
    """On a cluster whose devices differ: the best plan on the cluster without its slowest device kind(s), where it is
    at least LEAVE_OUT_GAIN faster than :attr:`best` (those devices would slow the job down); None otherwise."""

    @property
    def best(self) -> Estimate:
        """The chosen plan."""
        return self.plans[0]

    @property
    def speedup_over_even(self) -> float | None:
        """Step time of :attr:`even_best` over the best plan's (None when there is no uneven best)."""
        return None if self.even_best is None else self.even_best.time.step_s / self.best.time.step_s

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``fleet plan --json`` (with ``even_best`` and ``speedup_over_even`` when the best plan
        splits the batch unevenly over devices that differ)."""
        out: dict[str, object] = {
            "plans": [e.to_dict() for e in self.plans],
            "rejected": [r.to_dict() for r in self.rejected],
            "search": {"candidates": self.candidates, "feasible": self.feasible, "seconds": self.seconds},
        }
        if self.even_best is not None:
            out["even_best"] = self.even_best.to_dict()
            out["speedup_over_even"] = self.speedup_over_even
        if self.leave_out is not None:
            out["leave_out"] = self.leave_out.to_dict(self.best)
        return out


LEAVE_OUT_GAIN = 1.05
"""Leaving devices out is proposed only when the rest run the global batch at least this much faster (fewer devices are
otherwise worth keeping: they add memory and fault tolerance)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveOut:
    """Devices that slow a job down, and the plan without them."""

    devices: tuple[str, ...]
    """The kinds of device left out (their names), slowest first."""
    ranks: tuple[int, ...]
    """The global ranks left out (as a launcher numbers them: the groups in order, node by node)."""
    cluster: ClusterSpec
    """The cluster without them."""
    best: Estimate
    """The best plan on :attr:`cluster`."""

    def speedup(self, best: Estimate) -> float:
        """Step time of ``best`` (the plan with every device) over this plan's."""
        return best.time.step_s / self.best.time.step_s

    def line(self, best: Estimate) -> str:
        """One line: what to leave out, the plan without it, and how much faster that is."""
        many, rest = len(self.ranks) > 1, self.cluster.world_size
        return (
            f"leave out: the {len(self.ranks)} {'/'.join(self.devices)} device{'s' if many else ''} (rank"
            f"{'s' if many else ''} {_ranks_text(self.ranks)}) slow{'' if many else 's'} this job down: the other "
            f"{rest} run{'' if rest > 1 else 's'} {self.best.plan} at {self.best.time.step_s:.4g} s a step, "
            f"{self.speedup(best):.2f}x the throughput with {'them' if many else 'it'} ({best.time.step_s:.4g} s); "
            f"launch on {'those' if rest > 1 else 'that one'} only"
        )

    def to_dict(self, best: Estimate) -> dict[str, object]:
        """JSON form: the devices and ranks left out, the world without them, its best plan and the speed-up."""
        return {"devices": list(self.devices), "ranks": list(self.ranks), "world_size": self.cluster.world_size,
                "best": self.best.to_dict(), "speedup": self.speedup(best)}


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """``0-7, 12`` for ranks 0..7 and 12."""
    parts, start = [], ranks[0]
    for i, rank in enumerate(ranks):
        following = ranks[i + 1] if i + 1 < len(ranks) else None
        if following != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = following
    return ", ".join(parts)


def _leave_out(model: ModelSpec, cluster: ClusterSpec, cons: Constraints, best: Estimate) -> LeaveOut | None:
    """The fastest of the plans on ``cluster`` without its k slowest kinds of device (k = 1 .. kinds - 1; a kind's speed
    its peak in the model's format, then its memory), where it beats ``best`` by LEAVE_OUT_GAIN; else None."""
    dtype = model.precision.compute_dtype
    devices = [cluster.rank_device(r) for r in range(cluster.world_size)]
    kinds = sorted(set(devices), key=lambda d: (getattr(d.peak_tflops, dtype), d.memory_gib))
    quiet = dataclasses.replace(cons, consider_leaving_out=False)
    found: LeaveOut | None = None
    for k in range(1, len(kinds)):
        dropped = set(kinds[:k])
        rest = cluster.without_devices(dropped)
        try:
            e = plan(model, rest, top=1, max_rejected=0, constraints=quiet).best
        except (PlanError, NoFeasiblePlanError):  # the rest cannot hold the model, or a fixed axis does not fit their count
            continue
        if e.time.step_s * LEAVE_OUT_GAIN <= (best if found is None else found.best).time.step_s:
            found = LeaveOut(devices=tuple(d.name for d in kinds[:k]),
                             ranks=tuple(r for r, d in enumerate(devices) if d in dropped), cluster=rest, best=e)
    return found


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _offloads(zero: int, cons: Constraints, has_host: bool) -> list[Offload]:
    """Offload modes to try for a ZeRO stage, lightest first: those the constraints allow that the stage and the cluster
    can run (offload needs zero >= 1 and a host section; parameters, zero = 3). Empty when there is none."""
    allowed = _allowed_offloads(cons)
    possible = [Offload.NONE] + ([Offload.OPTIMIZER] if has_host and zero else [])
    possible += [Offload.OPTIMIZER_PARAMS] if has_host and zero == 3 else []
    return [mode for mode in possible if mode in allowed]


@dataclass(frozen=True, slots=True)
class _Layout:
    """A split of the world into dp x tp x pp devices, and of the layers into the pp stages (None: even)."""

    dp: int
    tp: int
    pp: int
    split: tuple[int, ...] | None = None


def _split(model: ModelSpec, cons: Constraints, pp: int) -> tuple[int, ...] | None:
    """The layers per stage of a layout's plans: the fixed split, else the default; None when it is even."""
    split = stage_layers(model, pp, cons.stage_layers if cons.stage_layers is not None and len(cons.stage_layers) == pp else None)
    return None if len(set(split)) == 1 else split


def _pp_excluded(model: ModelSpec, cons: Constraints, pp: int) -> bool:
    """The layers cannot go on ``pp`` stages here: more stages than layers, or an uneven split the constraints forbid."""
    return pp > model.num_layers or (not cons.uneven_stages and model.num_layers % pp != 0)


def _vpps(model: ModelSpec, cons: Constraints, layout: _Layout) -> list[int]:
    """Virtual stages a layout may interleave: divisors of its layers per stage, with an even split only."""
    if layout.pp == 1 or layout.split is not None:
        return [1]
    return [v for v in divisors(model.num_layers // layout.pp) if cons.max_vpp is None or v <= cons.max_vpp]


def _layouts(model: ModelSpec, world: int, cons: Constraints, rejected: list[Rejection]) -> list[_Layout]:
    """The layouts dp x tp x pp = world the constraints allow; those that cannot split the global batch go to ``rejected``."""
    out = []
    for tp in divisors(world):
        if model.kv_heads % tp or _splits_apart(cons, tp) or (cons.max_tp and tp > cons.max_tp) or cons.tp not in (None, tp):
            continue
        for pp in divisors(world // tp):
            if _pp_excluded(model, cons, pp) or (cons.max_pp and pp > cons.max_pp) or cons.pp not in (None, pp):
                continue
            dp = world // (tp * pp)
            if tp > 1 and pp > 1 and not cons.tp_with_pp or cons.dp not in (None, dp):
                continue
            if model.global_batch_size % dp:
                reason = f"dp({dp}) does not divide the global batch size {model.global_batch_size}"
                rejected.append(Rejection(plan=f"dp={dp},tp={tp},pp={pp}", kind=RejectionKind.LAYOUT, reason=reason))
                continue
            out.append(_Layout(dp, tp, pp, _split(model, cons, pp) if pp > 1 else None))
    return sorted(out, key=lambda layout: layout.split is not None)  # uneven splits last: the even ones' times bound them


def _variants(layout: _Layout, model: ModelSpec, cons: Constraints, devices_per_node: int) -> list[tuple[int, bool, int, int | None]]:
    """The (vpp, sp, zero, dp_shard) combinations of a layout, vpp outermost and the shard group innermost (tuples: the
    search makes many)."""
    vpps = [v for v in _vpps(model, cons, layout) if cons.vpp in (None, v)]
    sps = [False, True] if layout.tp > 1 and cons.allow_sp else [False]
    sps = [sp for sp in sps if cons.sp in (None, sp)]
    top_zero = cons.max_zero_with_pp if layout.pp > 1 else 3
    shards = [(z, g) for z in cons.zero_stages if z <= top_zero for g in _shard_groups(layout, z, cons, devices_per_node)]
    return [(vpp, sp, z, g) for vpp, sp in itertools.product(vpps, sps) for z, g in shards]


def _shard_groups(layout: _Layout, zero: int, cons: Constraints, devices_per_node: int) -> list[int | None]:
    """The hybrid shard groups (``Plan.dp_shard``) of a layout at shard level ``zero``: None (all of dp) first, then,
    where the constraints allow hybrid sharding and zero >= 1, the largest group of dp ranks inside one node (tp ranks
    apart under the default placement): its gathers and reduce-scatters run on the node's link. A smaller group inside a
    node holds more and talks on the same link, so it is never faster; a group spanning nodes moves, in ring terms, the
    bytes sharding over all of dp moves on the same slower link ((g-1)/g + (r-1)/(r g) = (dp-1)/dp of them for g ranks
    in r groups) and only saves ring latency while holding more: neither is searched (a fixed ``dp_shard`` is the only
    group)."""
    if cons.dp_shard is not None:
        if zero == 0 or layout.dp % cons.dp_shard or cons.dp_shard < layout.dp and zero not in cons.hybrid_zero_stages:
            return []
        return [None if cons.dp_shard == layout.dp else cons.dp_shard]
    if zero not in cons.hybrid_zero_stages:
        return [None]
    inside = [g for g in divisors(layout.dp) if 2 <= g < layout.dp and layout.tp * g <= devices_per_node]
    return [None, *inside[-1:]]


def _micro_batch_sizes(batch: int, cons: Constraints) -> list[int]:
    """Micro-batch sizes of a replica's ``batch`` samples that the constraints allow (mbs, and gas = batch / mbs), ascending."""
    return [m for m in divisors(batch) if (cons.mbs is None or m in cons.mbs) and cons.gas in (None, batch // m)]


def _alternative_orders(plan: Plan, hw: Hardware) -> list[tuple[Axis, ...]]:
    """Other placements worth pricing: only when the default crosses nodes, and only distinct ones."""
    sized = [a for a in Axis if getattr(plan, a.value) > 1]
    if len(sized) < 2 or all(axis_level(plan, a, hw.devices_per_node) is LinkLevel.INTRA for a in sized):
        return []
    seen = {tuple(a for a in DEFAULT_ORDER if a in sized)}
    out = []
    for order in itertools.permutations(Axis):
        key = tuple(a for a in order if a in sized)
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


_SLACK = 1.0 + 1e-9
"""A bound prunes only when it exceeds the threshold by this factor: far more than the rounding of a few dozen operations."""


def _rank_key(e: Estimate) -> tuple[float, float]:
    """Fastest first; equal times prefer less memory."""
    return (e.time.step_s, e.memory.total_bytes)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def explain_misfit(memory: MemoryEstimate) -> str:
    """One line: what the plan needs, what there is, and the largest term; the device, the host, or both (a
    :attr:`MemoryEstimate.tight` plan is explained as that, :func:`explain_tight`)."""
    if memory.tight:
        return "tight: " + explain_tight(memory)
    host = (
        f"host memory: needs {_gib(memory.host_bytes)} per device > {_gib(memory.host_limit_bytes)} "
        f"(short {_gib(memory.host_bytes - memory.host_limit_bytes)})"
    )
    if memory.total_bytes <= memory.limit_bytes:
        return host
    term, nbytes = memory.largest_term()
    device = (
        f"needs {_gib(memory.total_bytes)} > {_gib(memory.limit_bytes)} on stage {memory.stage} "
        f"(short {_gib(memory.total_bytes - memory.limit_bytes)}; largest term {term} {_gib(nbytes)})"
    )
    return device + ("; " + host if memory.host_bytes > memory.host_limit_bytes else "")


def explain_tight(memory: MemoryEstimate) -> str:
    """One line for a :attr:`MemoryEstimate.tight` plan: what it needs against the device, and what that leaves out."""
    need = memory.total_bytes - memory.fragmentation_bytes
    return (
        f"needs {_gib(need)} of {_gib(memory.limit_bytes)} on stage {memory.stage}, inside the "
        f"{_gib(memory.fragmentation_bytes)} kept for allocator fragmentation (calibration.memory_reserve_fraction): "
        f"it may run with a tuned allocator (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), the planner never chooses it"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Misfit:
    """A family of candidates that did not fit, by its variant closest to fitting (explained only if reported)."""

    plan: Plan
    """That variant."""
    memory: MemoryEstimate
    """Its worst stage's memory (what :func:`memory_estimate` returns)."""
    shortfall_bytes: float
    """``memory.shortfall_bytes()``: how far it is from fitting; the report lists the closest first."""


def _misfit_rejection(misfit: _Misfit) -> Rejection:
    """A family that did not fit, explained by its variant closest to fitting."""
    reason = explain_misfit(misfit.memory) + " (and every larger mbs)"
    return Rejection(plan=str(misfit.plan), kind=RejectionKind.MEMORY, reason=reason)


def _slower_rejection(candidate: Estimate, best: Estimate) -> Rejection:
    """A runner-up that fits but lost to ``best``, explained."""
    return Rejection(plan=str(candidate.plan), kind=RejectionKind.SLOWER, reason=_explain_slower(candidate, best))


def _explain_slower(candidate: Estimate, best: Estimate) -> str:
    ratio = candidate.time.step_s / best.time.step_s
    term, seconds = candidate.time.largest_term()
    return (
        f"slower: {candidate.time.step_s:.4g} s/step vs {best.time.step_s:.4g} s ({ratio:.2f}x); "
        f"largest term {term} {seconds:.4g} s"
    )


def _undominated(
    fitting: list[tuple[Recompute, Offload]], recomputes: tuple[Recompute, ...], offloads: tuple[Offload, ...]
) -> list[tuple[Recompute, Offload]]:
    """Fitting variants with no lighter-weight fitting variant: less recomputation and less offload are never slower."""
    rank = {v: (recomputes.index(v[0]), offloads.index(v[1])) for v in fitting}
    return [
        v
        for v in fitting
        if not any(w != v and rank[w][0] <= rank[v][0] and rank[w][1] <= rank[v][1] for w in fitting)
    ]


_ORDINAL_INF = 0x7FF0000000000000  # the ordinal of +inf (and minus that of -inf)


def _ordinal(x: float) -> int:
    """The position of a float among all floats, as an integer (-0.0 and 0.0 both 0); increasing with x."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -bits - (1 << 63)


def _from_ordinal(n: int) -> float:
    """The float at position ``n`` (the inverse of :func:`_ordinal`)."""
    return struct.unpack("<d", struct.pack("<q", n if n >= 0 else -n - (1 << 63)))[0]


def room(other: float, limit: float) -> float:
    """The largest float ``a`` for which ``a + other <= limit`` holds as floats round the sum.

    Rounded addition never decreases when an operand grows, so the test holds exactly for the
    floats ``a <= room(other, limit)``: one comparison with the room decides it bit for bit. Found
    by galloping from ``limit - other``, then bisecting, over the floats in order.
    """

    def fits(n: int) -> bool:
        return _from_ordinal(n) + other <= limit

    n = min(max(_ordinal(limit - other), -_ORDINAL_INF), _ORDINAL_INF)
    step = 1
    if fits(n):  # gallop up to a float that does not fit (+inf never does)
        lo = n
        while lo + step < _ORDINAL_INF and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, _ORDINAL_INF)
    else:  # gallop down to a float that fits (-inf always does)
        hi = n
        while hi - step > -_ORDINAL_INF and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, -_ORDINAL_INF)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return _from_ordinal(lo)


@dataclass(frozen=True, slots=True)
class _State:
    """What a stage holds besides activations, for one (layout, zero, offload)."""

    terms: tuple[StateBytes, ...]
    """Per stage: what :func:`stage_state_bytes` returns."""
    rooms: tuple[float, ...]
    """Per stage: :func:`room` for :attr:`StateBytes.device_bytes`: the activation bytes that still fit."""
    host_fits: bool
    """Every stage's host bytes fit the host share of one device."""


@dataclass(frozen=True, slots=True)
class _States:
    """The offload modes of one (layout, zero) and where their rooms rank among the layout's."""

    zero: int
    """ZeRO stage."""
    shard: int | None
    """Its hybrid shard group (``Plan.dp_shard``; None: all of dp)."""
    offloads: tuple[Offload, ...]
    """Offload modes, lightest first."""
    states: tuple[_State, ...]
    """Their states, in the same order."""
    positions: tuple[tuple[Offload, tuple[int, ...]], ...]
    """Per mode that fits the host, in order: per stage, the rank of its room among the layout's rooms."""


class _FitTable:
    """Which (recompute, offload) variants of one layout fit, decided on ranks and remembered.

    Activations ``a`` fit next to other bytes with room ``r`` exactly when ``a <= r``; among the
    layout's sorted rooms ``R`` that is ``bisect_left(R, a) <= bisect_left(R, r)``. So whether each
    variant fits depends only on the ranks of the activation bytes (one signature per micro-batch
    size, vpp and sp, shared by the ZeRO stages), and the answer for a signature is kept.
    """

    __slots__ = ("_fitting", "recomputes", "rooms")

    def __init__(self, recomputes: tuple[Recompute, ...], states: list[_State]) -> None:
        self.recomputes = recomputes
        """Recompute modes, in search order."""
        self.rooms: tuple[list[float], ...] = tuple(sorted(set(r)) for r in zip(*(s.rooms for s in states))) if states else ()
        """Per stage: the sorted rooms of the layout's states."""
        self._fitting: dict[tuple[int, int | None, tuple[int, ...]], list[tuple[Recompute, Offload]]] = {}

    def states(self, key: tuple[int, int | None], offloads: list[Offload], states: list[_State]) -> _States:
        """Rank the rooms of the offload modes of one (ZeRO stage, shard group)."""
        positions = tuple(
            (offload, tuple(bisect.bisect_left(rooms, r) for rooms, r in zip(self.rooms, state.rooms)))
            for offload, state in zip(offloads, states)
            if state.host_fits
        )
        return _States(zero=key[0], shard=key[1], offloads=tuple(offloads), states=tuple(states), positions=positions)

    def signature(self, by_mode: dict[Recompute, tuple[float, ...]]) -> tuple[int, ...]:
        """The ranks of every mode's activation bytes (recompute outer, stage inner) among the rooms."""
        ranks = []
        for row in by_mode.values():
            for rooms, a in zip(self.rooms, row):
                ranks.append(bisect.bisect_left(rooms, a))
        return tuple(ranks)

    def fitting(self, states: _States, signature: tuple[int, ...]) -> list[tuple[Recompute, Offload]]:
        """The variants that fit on the device and on the host, in search order (not to be changed)."""
        out = self._fitting.get((states.zero, states.shard, signature))
        if out is None:
            out = self._fitting[(states.zero, states.shard, signature)] = []
            n = len(self.rooms)
            for i, recompute in enumerate(self.recomputes):
                ranks = signature[i * n : i * n + n]
                for offload, positions in states.positions:
                    for rank, position in zip(ranks, positions):
                        if rank > position:
                            break
                    else:
                        out.append((recompute, offload))
        return out


class _Activations:
    """Activation bytes of every stage per recompute mode, for one (layout, vpp, sp, mbs), and what they decide.

    Shared by the ZeRO stages of the layout: which variants of each stage fit, and the compute
    bound, are kept here once known.
    """

    __slots__ = ("bound", "by_mode", "fits", "gas", "signature")

    def __init__(self, gas: int, by_mode: dict[Recompute, tuple[float, ...]], signature: tuple[int, ...]) -> None:
        self.gas = gas
        """Micro-batches per step at this micro-batch size."""
        self.by_mode = by_mode
        """Per recompute mode (in search order), per stage: what :func:`stage_activation_bytes` returns."""
        self.signature = signature
        """Their ranks among the layout's rooms (:meth:`_FitTable.signature`)."""
        self.fits: dict[tuple[int, int | None], list[tuple[Recompute, Offload]]] = {}
        """(ZeRO stage, shard group) -> the variants that fit (:meth:`_FitTable.fitting`)."""
        self.bound: float | None = None
        """:func:`compute_bound_s` of the plans, once needed."""


class _Search:
    """One run of the planner (mutable bookkeeping kept out of the pure functions)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cons: Constraints, *, top: int, reported: int, exhaustive: bool) -> None:
        self.model, self.cons, self.top, self.reported, self.exhaustive = model, cons, top, reported, exhaustive
        self._top_times: list[float] = []  # negated step times of the best `top` priced so far (a max-heap)
        self._reported_times: list[float] = []  # negated step times of the best `reported` priced so far (a max-heap)
        self.hw = Hardware.of(cluster, model)
        self.times = TimeModel(model, self.hw, cons.stage_layers, cons.overlaps)
        self.fastest = TimeModel(model, self.hw.with_fastest_links(), cons.stage_layers, cons.overlaps)
        self._fastest_s: dict[int, float] = {}  # id(estimate) -> its step time with every collective on the fastest link
        self.activations = ActivationModel()
        self.has_host = cluster.host is not None
        self.order = DEFAULT_ORDER if cons.order is None else cons.order
        """The placement plans are built with (a fixed one, or the default that refine_placements may change)."""
        self.candidates = 0
        self.feasible_count = 0
        self.feasible: list[Estimate] = []
        self.unsplittable: list[Rejection] = []
        """Layouts that cannot split the global batch, in search order."""
        self.misfits: list[_Misfit] = []
        """Every family that did not fit, in search order (explained only when reported)."""
        self.closest: _Misfit | None = None
        """The misfit with the least shortfall (the first of equally close ones)."""
        self._states: dict[tuple[int, int, int, int, Offload, int | None], _State] = {}
        self._bounds: dict[tuple[int, int, int, int, int], float] = {}
        self._orders: dict[tuple[int, int, int, int | None], list[tuple[Axis, ...]]] = {}
        self._undominated: dict[tuple[tuple[Recompute, Offload], ...], list[tuple[Recompute, Offload]]] = {}

    def _worst(self, acts: tuple[float, ...], state: _State, loads: tuple[StageLoad, ...]) -> MemoryEstimate:
        """The worst stage's MemoryEstimate (what :func:`memory_estimate` returns: the first stage with the largest
        shortfall, as max() picks it), built from the sums the search already has for that stage only."""
        shortfalls = self._shortfalls(acts, state)
        worst = shortfalls.index(max(shortfalls))
        return state.terms[worst].with_activations(acts[worst], self.hw, loads[worst].index)

    def _shortfall(self, acts: tuple[float, ...], state: _State) -> float:
        """:meth:`MemoryEstimate.shortfall_bytes` of the worst stage (what :meth:`_worst` would build)."""
        return max(self._shortfalls(acts, state))

    def _shortfalls(self, acts: tuple[float, ...], state: _State) -> list[float]:
        """Per stage, :meth:`MemoryEstimate.shortfall_bytes` of its device, summed as that sums."""
        limit, host_limit = self.hw.memory_bytes, self.hw.host_bytes_per_device
        return [
            max(t.params_bytes + t.grads_bytes + t.optimizer_bytes + a + t.other_bytes - limit, t.host_bytes - host_limit)
            for a, t in zip(acts, state.terms)
        ]

    def _bound(self, tp: int, pp: int, vpp: int, mbs: int, gas: int) -> float:
        """:func:`compute_bound_s`, kept: it depends on neither ZeRO, sp, recomputation, offload nor placement."""
        key = (tp, pp, vpp, mbs, gas)
        bound = self._bounds.get(key)
        if bound is None:
            bound = self._bounds[key] = self.times.compute_bound(tp=tp, pp=pp, vpp=vpp, mbs=mbs, gas=gas)
        return bound

    def _alternatives(self, plan: Plan) -> list[tuple[Axis, ...]]:
        """:func:`_alternative_orders` of a default-placed plan that put some axis on another link, kept per layout.

        A step time depends on the placement only through the links of the three axes, so a
        placement with the links of the default, or of an earlier alternative, is never strictly faster.
        """
        key = (plan.dp, plan.tp, plan.pp, plan.dp_shard)
        orders = self._orders.get(key)
        if orders is None:
            seen = {self.times.links(plan, plan.order).identity()}
            orders = self._orders[key] = []
            for order in _alternative_orders(plan, self.hw):
                links = self.times.links(plan, order).identity()
                if links not in seen:
                    seen.add(links)
                    orders.append(order)
        return orders

    def _state(self, layout: _Layout, zero: int, offload: Offload, shard: int | None) -> _State:
        """Per-stage non-activation bytes; they do not depend on mbs, gas, sp or vpp, so they are kept."""
        key = (layout.dp, layout.tp, layout.pp, zero, offload, shard)
        state = self._states.get(key)
        if state is None:
            terms = tuple(
                stage_state_bytes(self.model, self.hw, load, tp=layout.tp, dp=layout.dp, zero=zero, offload=offload, shard=shard)
                for load in self.times.loads(layout.pp)
            )
            state = self._states[key] = _State(
                terms=terms,
                rooms=tuple(room(t.device_bytes, self.hw.memory_bytes) for t in terms),
                host_fits=all(t.host_bytes <= self.hw.host_bytes_per_device for t in terms),
            )
        return state

    def run(self) -> None:
        """Walk every layout, variant and micro-batch size; price what fits and can still enter the top."""
        for layout in _layouts(self.model, self.hw.world_size, self.cons, self.unsplittable):
            batch = self.model.global_batch_size // layout.dp
            mbs_values = _micro_batch_sizes(batch, self.cons)
            variants = _variants(layout, self.model, self.cons, self.hw.devices_per_node)
            # (zero, shard group) -> its offload modes and their states
            modes: dict[tuple[int, int | None], tuple[list[Offload], list[_State]]] = {}
            for zero, shard in dict.fromkeys((zero, shard) for _, _, zero, shard in variants):
                offloads = _offloads(zero, self.cons, self.has_host)
                if layout.pp > 1 and not self.cons.offload_with_pp:
                    offloads = [o for o in offloads if o is Offload.NONE]
                if offloads:
                    modes[(zero, shard)] = (offloads, [self._state(layout, zero, offload, shard) for offload in offloads])
            table = _FitTable(self.cons.recompute, [state for _, states in modes.values() for state in states])
            by_zero = {key: table.states(key, offloads, states) for key, (offloads, states) in modes.items()}
            sweeps: dict[tuple[int, bool], list[_Activations]] = {}  # shared by the ZeRO stages of a layout
            for vpp, sp, zero, shard in variants:
                if (zero, shard) in by_zero:
                    self._micro_batches(layout, vpp, sp, by_zero[(zero, shard)], batch, mbs_values, table,
                                        sweeps.setdefault((vpp, sp), []))

    def _micro_batches(
        self,
        layout: _Layout,
        vpp: int,
        sp: bool,
        states: _States,
        batch: int,
        mbs_values: list[int],
        table: _FitTable,
        sweep: list[_Activations],
    ) -> None:
        """Micro-batch sizes smallest first: price the variants that fit, stop at the first size where none does.

        ``sweep`` holds the activations of this (vpp, sp) by micro-batch size, as far as some ZeRO stage went.
        """
        top_times, top, bounded = self._top_times, self.top, not self.exhaustive
        tp, pp, zero, order = layout.tp, layout.pp, states.zero, self.order
        family = len(self.cons.recompute) * len(states.offloads)
        candidates = feasible = 0
        for i, mbs in enumerate(mbs_values):
            if i < len(sweep):
                acts = sweep[i]
            else:
                acts = self._activations(layout, vpp, sp, mbs, batch // mbs, table)
                sweep.append(acts)
            fitting = acts.fits.get((zero, states.shard))
            if fitting is None:
                fitting = acts.fits[(zero, states.shard)] = table.fitting(states, acts.signature)
            fields = {"dp": layout.dp, "tp": tp, "pp": pp, "zero": zero, "mbs": mbs, "gas": acts.gas, "sp": sp, "vpp": vpp,
                      "order": order, "stage_layers": layout.split, "dp_shard": states.shard}
            if not fitting:
                self._misfit(fields, acts, states)
                candidates += family * (len(mbs_values) - i)
                break
            candidates += family
            feasible += len(fitting)
            if bounded and len(top_times) >= top:
                # branch and bound: skip pricing when even free communication would not beat the top-th time so far
                if acts.bound is None:
                    acts.bound = self._bound(tp, pp, vpp, mbs, acts.gas)
                if acts.bound >= -top_times[0]:
                    continue
            self._price(fields, fitting, acts, states)
        self.candidates += candidates
        self.feasible_count += feasible

    def _activations(self, layout: _Layout, vpp: int, sp: bool, mbs: int, gas: int, table: _FitTable) -> _Activations:
        """Per recompute mode, the activation bytes of every stage (what :func:`stage_activation_bytes` returns)."""
        loads = self.times.loads(layout.pp)
        by_mode = self.activations.stage_bytes(loads, self.cons.recompute, tp=layout.tp, sp=sp, pp=layout.pp, vpp=vpp, mbs=mbs, gas=gas)
        return _Activations(gas, by_mode, table.signature(by_mode))

    def _price(
        self, fields: dict[str, object], fitting: list[tuple[Recompute, Offload]], acts: _Activations, states: _States
    ) -> None:
        """Estimate the fitting variants (of the plan with these fields) that no lighter fitting variant dominates, and keep the top times."""
        loads = self.times.loads(int(fields["pp"]))
        key = tuple(fitting)
        undominated = self._undominated.get(key)
        if undominated is None:
            undominated = self._undominated[key] = _undominated(fitting, self.cons.recompute, states.offloads)
        reported = self._reported_times
        for recompute, offload in undominated:
            plan = Plan(**fields, recompute=recompute, offload=offload)  # type: ignore[arg-type]
            fastest_s = None
            if not self.exhaustive and len(reported) >= self.reported:
                # the plan's time with every collective on the fastest link bounds it under any placement
                fastest_s = self.fastest.time(plan).step_s
                if fastest_s > -reported[0] * _SLACK:
                    continue
            memory = self._worst(acts.by_mode[recompute], states.states[states.offloads.index(offload)], loads)
            priced = Estimate(model=self.model, plan=plan, memory=memory, time=self.times.time(plan), world_size=self.hw.world_size)
            self.feasible.append(priced)
            if fastest_s is not None:
                self._fastest_s[id(priced)] = fastest_s
            step_s = priced.time.step_s
            for heap, size in ((self._top_times, self.top), (reported, self.reported)):
                heapq.heappush(heap, -step_s)
                if len(heap) > size:
                    heapq.heappop(heap)

    def _misfit(self, fields: dict[str, object], acts: _Activations, states: _States) -> None:
        """Record the variant of a family (the plan with these fields) closest to fitting: its shortfall and largest term.

        Every variant misses. The last recompute mode (full; op when full is not allowed) needs the least device memory
        for every offload mode and host memory does not depend on recomputation, so the closest is that mode with the
        offload mode that misses by the least (device or host bytes, whichever is worse:
        :meth:`MemoryEstimate.shortfall_bytes`, summed as it sums).
        When every offload mode fits the host, that is the heaviest one (offload only removes device bytes).
        """
        recompute = self.cons.recompute[-1]
        acts_by_stage = acts.by_mode[recompute]
        k = len(states.states) - 1  # where every mode fits the host, the heaviest offload leaves the least on the device
        if not all(state.host_fits for state in states.states):
            _, k = min((self._shortfall(acts_by_stage, state), k) for k, state in enumerate(states.states))
        plan = Plan(**fields, recompute=recompute, offload=states.offloads[k])  # type: ignore[arg-type]
        memory = self._worst(acts_by_stage, states.states[k], self.times.loads(plan.pp))  # == memory_estimate(model, hw, plan)
        misfit = _Misfit(plan=plan, memory=memory, shortfall_bytes=memory.shortfall_bytes())
        if self.closest is None or misfit.shortfall_bytes < self.closest.shortfall_bytes:
            self.closest = misfit
        self.misfits.append(misfit)

    def refine_placements(self, ranked: list[Estimate]) -> list[Estimate]:
        """Price other placements for the plans that could still enter the top ``top``.

        A plan's time with every collective on the faster link is a lower bound over all placements;
        plans whose bound is no better than the current top-th time keep the default placement.
        """
        threshold = ranked[min(self.top, len(ranked)) - 1].time.step_s
        out = []
        for candidate in ranked:
            p = candidate.plan
            if self._bound(p.tp, p.pp, p.vpp, p.mbs, p.gas) < threshold and (orders := self._alternatives(p)):
                fastest_s = self._fastest_s.get(id(candidate))
                if fastest_s is None:
                    fastest_s = self.fastest.time(p).step_s
                if fastest_s < threshold:
                    candidate = self._best_placement(candidate, orders)
            out.append(candidate)
        return sorted(out, key=_rank_key)

    def _best_placement(self, default: Estimate, orders: list[tuple[Axis, ...]]) -> Estimate:
        """The fastest of the default and the other placements (the first of equally fast ones); placement moves no bytes."""
        best_s, best = default.time.step_s, None
        for order in orders:
            other = self.times.time(default.plan, order)
            if other.step_s < best_s:
                best_s, best = other.step_s, (order, other)
        if best is None:
            return default
        order, time = best
        return Estimate(model=self.model, plan=default.plan.replace(order=order), memory=default.memory, time=time, world_size=self.hw.world_size)


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    top: int = 5,
    max_rejected: int = 20,
    exhaustive: bool = False,
    constraints: Constraints | None = None,
    **constraint_fields: object,
) -> PlanResult:
    """Rank every plan for ``model`` on ``cluster``; the keyword arguments are :class:`Constraints` fields.

    The top ``top`` plans are exact. Plans that provably cannot enter them (their step time with all
    communication free is already slower) are counted but not priced; neither are plans whose time
    with every collective on the fastest link is slower than the ``top + max_rejected`` fastest
    priced so far, which changes neither the top nor the runners-up reported. ``exhaustive`` prices
    every candidate (for plots and benchmarks that want every estimate in ``all_feasible``).

    Raises NoFeasiblePlanError (naming the closest plan, its shortfall and what would help) when no
    candidate fits.
    """
    if top < 1:
        raise PlanError(f"top must be >= 1, got {top}")
    if model.global_batch_size > MAX_GLOBAL_BATCH_SIZE:  # the search walks its divisors for every dp (time ~ its root)
        raise PlanError(f"global batch size {model.global_batch_size:,} is more than the planner searches "
                        f"({MAX_GLOBAL_BATCH_SIZE:,} samples): give a smaller one")
    cons = constraints if constraints is not None else Constraints(**constraint_fields)  # type: ignore[arg-type]
    if cons.dp_mbs is not None:
        return _plan_uneven_dp(model, cluster, cons, top=top, max_rejected=max_rejected, exhaustive=exhaustive)
    cons = _recomputable(model, cons)
    cons, unrunnable = _sparse_runnable(model, cons)
    if cons.stage_layers is not None:
        check_stage_layers(model, cons.stage_layers)
    started = _clock.perf_counter()
    search = _Search(model, cluster, cons, top=top, reported=top + max(max_rejected, 0), exhaustive=exhaustive)
    search.run()
    if not search.feasible:
        raise _nothing_fits(model, cluster, search)
    ranked = sorted(search.feasible, key=_rank_key)
    if cons.search_placement and cons.order is None:
        ranked = search.refine_placements(ranked)
    even_best = None
    if not cluster.is_homogeneous:
        uneven = []
        for e in ranked[: top + max(max_rejected, 0)]:
            if cons.uneven_dp and cons.search_dp_mbs and cons.mbs is None:
                uneven.append(_rebalanced(model, cluster, cons, e))
            if cons.uneven_stages and cons.stage_layers is None:
                uneven.append(_restaged(model, cluster, cons, e))
        uneven = [e for e in uneven if e is not None]
        if uneven and min(e.time.step_s for e in uneven) * REBALANCE_GAIN <= ranked[0].time.step_s:
            even_best, ranked = ranked[0], sorted([*uneven, *ranked], key=_rank_key)
    best = ranked[0]
    leave_out = _leave_out(model, cluster, cons, best) if not cluster.is_homogeneous and cons.consider_leaving_out else None
    slower = [_slower_rejection(e, best) for e in ranked[top : top + max_rejected]]
    closest = sorted(search.misfits, key=lambda m: m.shortfall_bytes)[:max_rejected]
    misfits = ([_misfit_rejection(m) for m in closest] + search.unsplittable + unrunnable)[:max_rejected]  # layouts are furthest
    return PlanResult(
        plans=tuple(ranked[:top]),
        rejected=tuple(slower + misfits),
        candidates=search.candidates,
        feasible=search.feasible_count,
        seconds=_clock.perf_counter() - started,
        all_feasible=tuple(ranked),
        misfit_plans=tuple(m.plan for m in search.misfits),
        even_best=even_best,
        leave_out=leave_out,
    )


def uneven_split_line(result: PlanResult, cluster: ClusterSpec) -> str:
    """One line for a best plan that splits the work by devices that differ: the micro-batch each device type's replicas
    take and the layers each device type's stages hold, and the speed-up over :attr:`PlanResult.even_best` (planning on
    the slowest device)."""
    best, even = result.best, result.even_best
    assert even is not None
    parts = []
    if best.plan.dp_mbs is not None:
        by_device: dict[str, list[int]] = {}
        for device, r in zip(replica_devices(cluster, best.plan), range(best.plan.dp)):
            by_device.setdefault(device.name, []).append(best.plan.replica_mbs(r))
        parts += [f"{len(sizes)} replica{'s' if len(sizes) > 1 else ''} on {name} at mbs "
                  f"{field_text(tuple(sorted(set(sizes), reverse=True)))}" for name, sizes in by_device.items()]
    if best.plan.stage_layers is not None and best.plan.pp > 1:
        by_stage: dict[str, list[int]] = {}
        for device, layers in zip(stage_devices(cluster, best.plan), best.plan.stage_layers):
            by_stage.setdefault(device.name, []).append(layers)
        parts += [f"{len(layers)} stage{'s' if len(layers) > 1 else ''} on {name} holding {field_text(tuple(layers))} layers"
                  for name, layers in by_stage.items()]
    return (
        f"split by device: {'; '.join(parts)}: {result.speedup_over_even:.2f}x the throughput of the best plan for the "
        f"slowest device ({even.plan}: {even.time.step_s:.4g} s)"
    )


def balance_micro_batches(step_s: Callable[[int, int], float | None], replicas: int, total: int) -> tuple[int, ...] | None:
    """Micro-batch sizes for ``replicas`` replicas adding up to ``total`` that minimise the slowest replica's step:
    ``step_s(replica, mbs)`` is that replica's step time with micro-batches of ``mbs`` (None: it does not fit), never
    shorter for a larger ``mbs``. Every replica starts at one sample; each further sample goes to the replica whose step
    grows least with it (optimal for a min-max of non-decreasing costs). None when they cannot hold ``total``."""
    if total < replicas:
        return None
    sizes = [1] * replicas
    if any(step_s(r, 1) is None for r in range(replicas)):
        return None
    heap = []
    for r in range(replicas):
        grown = step_s(r, 2)
        if grown is not None:
            heap.append((grown, r))
    heapq.heapify(heap)
    for _ in range(total - replicas):
        if not heap:
            return None
        _, r = heapq.heappop(heap)
        sizes[r] += 1
        grown = step_s(r, sizes[r] + 1)
        if grown is not None:
            heapq.heappush(heap, (grown, r))
    return tuple(sizes)


def _rebalanced(model: ModelSpec, cluster: ClusterSpec, cons: Constraints, even: Estimate) -> Estimate | None:
    """``even``'s layout with each replica's micro-batch sized to its devices (:func:`split_by_speed`), priced per
    replica; None when that split is the even one, or no split fits."""
    if even.plan.dp == 1 or even.plan.pp > 1 and not cons.uneven_dp_with_pp:
        return None
    split = split_by_speed(model, cluster, even.plan, overlaps=cons.overlaps)
    if split is None or split.dp_mbs is None:
        return None
    uneven = estimate_plan(model, cluster, split, overlaps=cons.overlaps)
    return uneven if uneven.fits else None


def _restaged(model: ModelSpec, cluster: ClusterSpec, cons: Constraints, planned: Estimate) -> Estimate | None:
    """``planned``'s pipeline with its layers split by its stages' devices (:func:`stages.balanced_stage_layers` with
    each stage's speed and memory), priced stage by stage; None without a pipeline over devices that differ, or when
    that split is the one it has or does not fit."""
    plan = planned.plan
    if plan.pp == 1:
        return None
    devices = stage_devices(cluster, plan)
    if len(set(devices)) == 1:
        return None
    dtype = model.precision.compute_dtype
    fastest = max(getattr(d.peak_tflops, dtype) for d in devices)
    largest = max(d.memory_gib for d in devices)
    capacity = tuple((getattr(d.peak_tflops, dtype) / fastest, d.memory_gib / largest) for d in devices)
    try:
        restaged = plan.replace(stage_layers=balanced_stage_layers(model, plan.pp, capacity))
    except PlanError:  # e.g. an interleaved schedule that this split leaves a virtual stage without a layer
        return None
    if restaged.stage_layers == with_stage_layers(model, plan).stage_layers:
        return None
    e = estimate_plan(model, cluster, restaged, overlaps=cons.overlaps)
    return e if e.fits else None


def split_by_speed(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, overlaps: Overlaps = Overlaps.DEFAULT) -> Plan | None:
    """``plan``'s layout and gas with the samples of each micro-step (gas * that many make the global batch) split over
    its replicas by :func:`balance_micro_batches`, each replica priced on its own devices (:func:`replica_devices`);
    ``dp_mbs`` None when the best split is the even one; None when no split fits."""
    devices = replica_devices(cluster, plan)
    cache: dict[tuple[DeviceSpec, int], float | None] = {}

    def step_s(replica: int, mbs: int) -> float | None:
        key = (devices[replica], mbs)
        if key not in cache:
            e = replica_estimate(model, cluster, plan, devices[replica], mbs, overlaps)
            cache[key] = e.time.step_s if e.fits else None
        return cache[key]

    sizes = balance_micro_batches(step_s, plan.dp, plan.global_batch_size // plan.gas)
    if sizes is None:
        return None
    return plan.replace(mbs=max(sizes), dp_mbs=sizes)


REBALANCE_GAIN = 1.05
"""A split of the work by the devices is chosen over the even one, and a new split of the batch over the replicas is
taken while training, only when it is predicted at least this much faster (speeds measured on a shared machine wander
by several percent; the split should not flap, nor be made for noise)."""


def rebalance(
    model: ModelSpec, cluster: ClusterSpec, plan: Plan, speeds: list[float], *, host_speeds: list[float] | None = None,
    overlaps: Overlaps = Overlaps.DEFAULT,
) -> tuple[Estimate, Estimate] | None:
    """After the ranks measured ``speeds`` and ``host_speeds`` (rank 0 first; None: hosts alike): the estimate of
    ``plan`` and of its replicas' micro-batches split by them (:func:`split_by_speed` on ``cluster`` with each rank's
    device its fastest device scaled by its speeds, :func:`~lightning_fleet.planning.cluster.devices_by_speed`, each
    keeping its memory), when the new split is another, fits and is predicted at least REBALANCE_GAIN faster; else None."""
    devices = [cluster.rank_device(r) for r in range(cluster.world_size)]
    # the fastest device, at the calibration's speed: the fastest rank measured now is taken to run at it
    fastest = dataclasses.replace(min(devices, key=lambda d: (d.slowdown, -d.peak_tflops.fp32)), slowdown=1.0, host_slowdown=1.0)
    memory = [d.memory_gib for d in devices]
    measured = dataclasses.replace(cluster, rank_devices=devices_by_speed(fastest, speeds, host_speeds, memory))
    split = split_by_speed(model, measured, plan, overlaps=overlaps)
    if split is None or split.dp_mbs == plan.dp_mbs:
        return None
    now = estimate_plan(model, measured, plan, overlaps=overlaps)
    new = estimate_plan(model, measured, split, overlaps=overlaps)
    return (now, new) if new.fits and new.time.step_s * REBALANCE_GAIN <= now.time.step_s else None


def _plan_uneven_dp(
    model: ModelSpec, cluster: ClusterSpec, cons: Constraints, *, top: int, max_rejected: int, exhaustive: bool
) -> PlanResult:
    """:func:`plan` for replicas with the micro-batch sizes ``cons.dp_mbs``: the search of the same model at the batch
    of every replica running the largest (gas micro-steps of sum(dp_mbs) samples), so each candidate's memory and pace
    are its busiest replica's; the plans it returns are then priced at the model's own batch with those sizes. PlanError
    (one line) when the sizes do not split the global batch into whole micro-steps."""
    sizes = cons.dp_mbs
    assert sizes is not None
    gbs, per_micro_step = model.global_batch_size, sum(sizes)
    if gbs % per_micro_step or cons.gas not in (None, gbs // per_micro_step):
        raise PlanError(
            f"dp_mbs={field_text(sizes)} takes {per_micro_step} samples a micro-step, which does not make the global batch "
            f"{gbs} in {'gas=' + str(cons.gas) if cons.gas else 'whole'} micro-steps: give sizes adding up to a divisor of {gbs}"
        )
    gas, largest = gbs // per_micro_step, max(sizes)
    even = dataclasses.replace(cons, dp_mbs=None, dp=len(sizes), gas=gas, mbs=(largest,))
    as_even = dataclasses.replace(model, global_batch_size=len(sizes) * largest * gas)
    result = plan(as_even, cluster, top=top, max_rejected=max_rejected, exhaustive=exhaustive, constraints=even)

    def priced(e: Estimate) -> Estimate:
        return estimate_plan(model, cluster, e.plan.replace(dp_mbs=sizes), overlaps=cons.overlaps)

    return dataclasses.replace(
        result, plans=tuple(priced(e) for e in result.plans), all_feasible=tuple(priced(e) for e in result.all_feasible)
    )


def _sparse_runnable(model: ModelSpec, cons: Constraints) -> tuple[Constraints, list[Rejection]]:
    """``cons`` with only the ZeRO stages that run the model's sparse gradients, and a SPARSE rejection for each stage
    left out; PlanError (one line) when none is left."""
    if not model.sparse_params:
        return cons, []
    kept = tuple(z for z in cons.zero_stages if z in cons.sparse_zero_stages)
    what = f"model {model.name!r} has {model.sparse_params:,} parameters with sparse gradients (embedding lookups with sparse=True)"
    runs = f"the runtime runs them at zero {_names(cons.sparse_zero_stages)} only" if cons.sparse_zero_stages else "the runtime runs none"
    if not kept:
        raise PlanError(f"{what}, and {runs}, but zero {_names(cons.zero_stages)} was asked for: allow zero "
                        f"{_names(cons.sparse_zero_stages) or '0'}, or build the embeddings with sparse=False")
    rejected = [Rejection(plan=f"zero={z}", kind=RejectionKind.SPARSE, reason=f"{what}; {runs}")
                for z in cons.zero_stages if z not in kept]
    return dataclasses.replace(cons, zero_stages=kept), rejected


def _recomputable(model: ModelSpec, cons: Constraints) -> Constraints:
    """``cons`` without recompute=op when the model does not say what op-level recomputation does to its layers (a
    profiled module: :attr:`ModelSpec.op_recompute_known`); PlanError (one line) when op is the only mode it allows."""
    if Recompute.OP not in cons.recompute or model.op_recompute_known:
        return cons
    left = tuple(r for r in cons.recompute if r is not Recompute.OP)
    if not left:
        check_recompute(model, Recompute.OP)
    return dataclasses.replace(cons, recompute=left)


def _nothing_fits(model: ModelSpec, cluster: ClusterSpec, search: _Search) -> NoFeasiblePlanError:
    """No candidate fits: name the plan closest to fitting (the least bytes missing, on the device or the host), what it
    needs against what there is, and what would help; or, without any candidate, what excluded them all."""
    if search.closest is None:
        return NoFeasiblePlanError(_no_candidates(model, cluster, search.cons))
    memory, closest = search.closest.memory, search.closest.plan
    device_short = memory.total_bytes > memory.limit_bytes
    host_short = memory.host_bytes > memory.host_limit_bytes
    term, nbytes = memory.largest_term()
    needs, have = [], []
    if device_short:
        needs.append(f"{_gib(memory.total_bytes)} memory per device")
        have.append(f"devices have {_gib(memory.limit_bytes)} (largest term: {term} {_gib(nbytes)})")
    if host_short:
        needs.append(f"{_gib(memory.host_bytes)} host memory per device")
        have.append(f"hosts have {_gib(memory.host_limit_bytes)} per device")
    return NoFeasiblePlanError(
        f"model {model.name!r} needs {' and '.join(needs)} with the closest plan ({closest}); {', '.join(have)}: "
        + ", ".join(_remedies(cluster, search.cons, device_short=device_short, host_short=host_short))
    )


def _remedies(cluster: ClusterSpec, cons: Constraints, *, device_short: bool, host_short: bool) -> list[str]:
    """What would let a plan fit, most general first; only what applies to this cluster and these constraints."""
    helps = []
    if device_short:
        helps.append("add devices or use devices with more memory")
    if host_short:
        helps.append("add nodes or host memory")
    if device_short:
        offloads = _allowed_offloads(cons)
        if cluster.host is None:
            helps.append("give the cluster a host: section (memory_gib, pcie_GBps) to allow offload")
        elif cons.offloads is not None and Offload.OPTIMIZER_PARAMS not in cons.offloads:
            helps.append(f"leave offload to the planner (fixed: {_names(cons.offloads)})")
        elif Offload.OPTIMIZER_PARAMS not in offloads:
            helps.append("allow offload")
        if 3 not in cons.zero_stages:
            helps.append("allow zero=3")
        if Recompute.FULL not in cons.recompute:
            helps.append("allow recompute=full")
        if cons.mbs is not None and 1 not in cons.mbs:
            helps.append(f"allow a smaller micro-batch size (mbs {_names(cons.mbs)})")
        limits = [f"{name}={getattr(cons, name)}" for name in ("max_tp", "max_pp") if getattr(cons, name) is not None]
        if limits:
            helps.append(f"allow larger tp / pp ({', '.join(limits)})")
        fixed = [f"{name}={field_text(getattr(cons, name))}" for name in ("dp", "tp", "pp", "gas", "sp", "vpp", "stage_layers")
                 if getattr(cons, name) is not None]
        if fixed:
            helps.append(f"leave {', '.join(fixed)} to the planner")
    return helps


def _no_candidates(model: ModelSpec, cluster: ClusterSpec, cons: Constraints) -> str:
    """Why no plan is a candidate at all: offload without a host, fixed axes the world cannot hold, or every layout
    or every variant excluded (each reason once, as the search applies them)."""
    world = cluster.world_size
    head = f"no plan for {model.name!r} on {world} devices"
    allowed = _allowed_offloads(cons)
    if Offload.NONE not in allowed:
        what = "require_offload" if cons.require_offload else f"offload={_names(allowed)}"
        undo = "drop require_offload" if cons.require_offload else "leave offload to the planner"
        if cluster.host is None:
            return (
                f"{head}: {what} needs host memory, but cluster {cluster.name!r} has no host: section: add one "
                f"(memory_gib, pcie_GBps) to the cluster spec or {undo}"
            )
        if max(cons.zero_stages) == 0:
            return (
                f"{head}: {what} needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads ZeRO partitions), but zero_stages is 0: "
                f"allow one or {undo}"
            )
    fixed = {name: getattr(cons, name) for name in ("dp", "tp", "pp") if getattr(cons, name) is not None}
    product = 1
    for value in fixed.values():
        product *= value
    if world % product or (len(fixed) == 3 and product != world):
        relation = "!=" if len(fixed) == 3 else "does not divide"
        factors = " * ".join(f"{name}({value})" for name, value in fixed.items()) + (f" = {product}" if len(fixed) > 1 else "")
        return f"{head}: {factors} {relation} world size {world}: change the fixed values or the device count"
    reasons: dict[str, _Exclusion] = {}  # each reason once, the first time it excludes something
    layouts = []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            exclusion = _layout_exclusion(model, cons, dp, tp, pp)
            if exclusion is None:
                layouts.append(_Layout(dp, tp, pp, _split(model, cons, pp) if pp > 1 else None))
            else:
                reasons.setdefault(exclusion.reason, exclusion)
    if not layouts:
        return f"{head}: no layout dp x tp x pp = {world} is left: {'; '.join(reasons)}: {_lift(reasons.values())}"
    reasons = {}
    for layout in layouts:
        for exclusion in _variant_exclusions(model, cons, layout, cluster.host is not None):
            reasons.setdefault(exclusion.reason, exclusion)
    return f"{head}: every layout is excluded: {'; '.join(reasons)}: {_lift(reasons.values())}"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Exclusion:
    """Why the search skips a layout or every variant of one, and what could lift that."""

    reason: str
    """The rule broken, as the error message says it."""
    by_constraint: bool
    """Changing a constraint it names (a fixed value or a limit) could lift it."""
    by_size: bool
    """Another device count or global batch size could lift it."""


def _by_constraint(reason: str) -> _Exclusion:
    """An exclusion only a constraint it names can lift."""
    return _Exclusion(reason=reason, by_constraint=True, by_size=False)


def _by_size(reason: str) -> _Exclusion:
    """An exclusion only another device count or global batch size can lift."""
    return _Exclusion(reason=reason, by_constraint=False, by_size=True)


def _lift(exclusions: Iterable[_Exclusion]) -> str:
    """What lifts these exclusions: the constraints they name, the device count or global batch size, or both."""
    exclusions = list(exclusions)
    constraint, size = any(e.by_constraint for e in exclusions), any(e.by_size for e in exclusions)
    if not constraint:
        return "change the device count or the global batch size"
    return "change those fixed values or limits" + (", the device count or the global batch size" if size else "")


def _splits_apart(cons: Constraints, tp: int) -> bool:
    """The module's split layers cannot be divided among ``tp`` ranks (``Constraints.tp_divides``)."""
    return cons.tp_divides is not None and cons.tp_divides % tp != 0


def _heads_rule(model: ModelSpec) -> str:
    """The rule tp must keep with the model's attention heads, in words."""
    if model.num_kv_heads is None:
        return f"tp must divide num_heads ({model.num_heads})"
    return f"tp must divide num_kv_heads ({model.num_kv_heads}) and so num_heads ({model.num_heads})"


def _layout_exclusion(model: ModelSpec, cons: Constraints, dp: int, tp: int, pp: int) -> _Exclusion | None:
    """Why the search skips a layout (the first rule it breaks, as :func:`_layouts` tests them), or None."""
    rules = (
        (model.kv_heads % tp, _by_size, _heads_rule(model)),
        (_splits_apart(cons, tp), _by_constraint, f"tp must divide {cons.tp_divides}, what the module's split layers allow"),
        (cons.max_tp and tp > cons.max_tp, _by_constraint, f"tp is limited to max_tp={cons.max_tp}"),
        (cons.tp not in (None, tp), _by_constraint, f"tp is fixed to {cons.tp}"),
        (pp > model.num_layers, _by_size, f"pp must be at most num_layers ({model.num_layers})"),
        (not cons.uneven_stages and model.num_layers % pp, _by_size, f"pp must divide num_layers ({model.num_layers}) here"),
        (cons.max_pp and pp > cons.max_pp, _by_constraint, f"pp is limited to max_pp={cons.max_pp}"),
        (cons.pp not in (None, pp), _by_constraint, f"pp is fixed to {cons.pp}"),
        (tp > 1 and pp > 1 and not cons.tp_with_pp, _by_constraint, "tp > 1 and pp > 1 cannot be combined here"),
        (cons.dp not in (None, dp), _by_constraint, f"dp is fixed to {cons.dp}"),
        (model.global_batch_size % dp, _by_size, f"dp must divide the global batch size ({model.global_batch_size})"),
    )
    return next((exclusion(reason) for broken, exclusion, reason in rules if broken), None)


def _variant_exclusions(model: ModelSpec, cons: Constraints, layout: _Layout, has_host: bool) -> list[_Exclusion]:
    """Why a layout that passes :func:`_layouts` still has no candidate, as :func:`_variants`, :func:`_offloads` and
    :func:`_micro_batch_sizes` decide (each reason with what could lift it)."""
    out: list[_Exclusion] = []
    vpps = _vpps(model, cons, layout)
    if cons.vpp not in (None, *vpps):
        out.append(_by_constraint(f"vpp={cons.vpp} needs pp > 1 with pp * vpp dividing num_layers ({model.num_layers})" + (
            f" and vpp <= max_vpp={cons.max_vpp}" if cons.max_vpp is not None else "")))
    if cons.sp and not (layout.tp > 1 and cons.allow_sp):
        out.append(_by_constraint("sp=true needs tp > 1" + ("" if cons.allow_sp else " and allow_sp")))
    zeros = [z for z in cons.zero_stages if layout.pp == 1 or z <= cons.max_zero_with_pp]
    if not zeros:
        reason = f"zero {_names(cons.zero_stages)} cannot run with pp > 1 here (at most zero={cons.max_zero_with_pp})"
        out.append(_by_constraint(reason))
    else:
        allowed = _allowed_offloads(cons)
        runs = [o for z in zeros for o in _offloads(z, cons, has_host)
                if layout.pp == 1 or cons.offload_with_pp or o is Offload.NONE]
        if not runs and layout.pp > 1 and not cons.offload_with_pp:
            out.append(_by_constraint(f"offload {_names(allowed)} cannot run with pp > 1 here"))
        elif not runs:
            needed = "3" if allowed == (Offload.OPTIMIZER_PARAMS,) else "1, 2 or 3"
            out.append(_by_constraint(f"offload {_names(allowed)} needs zero {needed}, but zero is {_names(zeros)} here"))
    if not _micro_batch_sizes(model.global_batch_size // layout.dp, cons):
        fixed = "; ".join(f"{name} {_names(v) if isinstance(v, tuple) else v}"
                          for name, v in (("mbs", cons.mbs), ("gas", cons.gas)) if v is not None)
        reason = f"{fixed} does not split the global batch size ({model.global_batch_size}) / dp into mbs * gas"
        out.append(_Exclusion(reason=reason, by_constraint=True, by_size=True))
    return out
