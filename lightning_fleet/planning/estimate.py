"""Estimate one plan: per-device memory by term, step time by term, throughput.

The terms come from :mod:`memory`, :mod:`time` and :mod:`comm`; this module adds them up per pipeline stage and
keeps the pieces many plans of one search share (:class:`TimeModel`, :class:`ActivationModel`). Intermediate results
travel as named records (:class:`StateBytes`, :class:`AxisLinks`, :class:`StageTime`).

Pure: imports neither torch nor deepspeed; imported by the search, the CLI, plotting, the strategy and benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_fleet.planning import memory as mem
from lightning_fleet.planning import time as tm
from lightning_fleet.planning.cluster import GIB, Calibration, ClusterSpec, DeviceSpec, LinkLevel, LinkSpec, slowest_device
from lightning_fleet.planning.comm import axis_level, shard_level
from lightning_fleet.planning.errors import PlanError
from lightning_fleet.planning.model import ModelSpec, Precision, Role, TouchedRows, touched_sparse
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.planning.plan import Axis, Offload, Plan, Recompute
from lightning_fleet.planning.stages import StageLoad, stage_loads, with_stage_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """The cluster facts one estimate needs, derived once per search from a ClusterSpec."""

    world_size: int
    """Devices in the cluster."""
    devices_per_node: int
    """Devices per node (placement)."""
    memory_bytes: float
    """Memory of the planning device."""
    peak_flops_per_s: float
    """Peak matmul FLOP/s of the planning device in the model's number format."""
    intra_node: LinkSpec
    """Link inside a node."""
    inter_node: LinkSpec
    """Link across nodes."""
    host_bytes_per_device: float
    """Host memory per device; 0 without a host spec."""
    pcie_GBps: float
    """Host link per device; 0 without a host spec."""
    calibration: Calibration
    """Cost-model constants."""
    elementwise_s: float = 0.0
    """Seconds per output element of a memory-bound operator: ``calibration.elementwise_s`` where stated, else
    :func:`time.memory_bound_element_s` at the planning device's memory bandwidth, else 0 (folded into the matmul rate)."""

    @classmethod
    def of(cls, cluster: ClusterSpec, model: ModelSpec) -> "Hardware":
        """Derive from a cluster, on its planning device (:meth:`ClusterSpec.planning_device`, the slowest) with the
        calibration as that device runs it (:meth:`Calibration.on`)."""
        device = cluster.planning_device()
        host, calibration = cluster.host, cluster.calibration.on(device)
        return cls(
            world_size=cluster.world_size,
            devices_per_node=cluster.devices_per_node,
            memory_bytes=device.memory_bytes,
            peak_flops_per_s=getattr(device.peak_tflops, model.precision.compute_dtype) * 1e12,
            intra_node=cluster.intra_node,
            inter_node=cluster.inter_node,
            host_bytes_per_device=host.memory_gib * GIB / cluster.devices_per_node if host else 0.0,
            pcie_GBps=host.pcie_GBps if host else 0.0,
            calibration=calibration,
            elementwise_s=_elementwise_s(calibration, device, model.precision),
        )

    def with_fastest_links(self) -> "Hardware":
        """The same hardware with both link levels as fast as the faster one (a lower bound over placements)."""
        best = self.intra_node.fastest_with(self.inter_node)
        return dataclasses.replace(self, intra_node=best, inter_node=best)

    def link(self, plan: Plan, axis: Axis) -> LinkSpec:
        """The link an axis' collectives run on under the plan's placement."""
        return self.intra_node if axis_level(plan, axis, self.devices_per_node) is LinkLevel.INTRA else self.inter_node

    def links(self, plan: Plan) -> "AxisLinks":
        """The links of all three axes under the plan's placement, and of its hybrid shard group."""
        dp = self.link(plan, Axis.DP)
        shard = dp if plan.dp_shard is None else (
            self.intra_node if shard_level(plan, self.devices_per_node) is LinkLevel.INTRA else self.inter_node)
        return AxisLinks(dp=dp, tp=self.link(plan, Axis.TP), pp=self.link(plan, Axis.PP), dp_shard=shard)


def _elementwise_s(calibration: Calibration, device: DeviceSpec, precision: Precision) -> float:
    """:attr:`Hardware.elementwise_s`: the calibration's (as the device runs it) where it states one, else the device
    memory's rate, else 0."""
    if calibration.elementwise_s is not None:
        return calibration.elementwise_s
    if device.memory_GBps is None:
        return 0.0
    return tm.memory_bound_element_s(device.memory_GBps, precision.element_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisLinks:
    """The link each axis' collectives run on under one placement: :attr:`Hardware.intra_node` or :attr:`Hardware.inter_node`."""

    dp: LinkSpec
    """Data parallel: gradient all-reduce, ZeRO reduce-scatter and all-gather."""
    tp: LinkSpec
    """Tensor parallel: the all-reduces (or all-gathers and reduce-scatters with sp) inside each layer."""
    pp: LinkSpec
    """Pipeline: activations and gradients sent between neighbouring stages."""
    dp_shard: LinkSpec
    """Hybrid sharding's shard group (:attr:`Plan.dp_shard`): its all-gathers and reduce-scatters (``dp`` then carries
    the all-reduce across the groups); the same link as ``dp`` without hybrid sharding."""

    def identity(self) -> tuple[int, int, int, int]:
        """Which of the hardware's link objects the dp, tp and pp axes (and the shard group) use: placements with the same
        identity price the same."""
        return (id(self.dp), id(self.tp), id(self.pp), id(self.dp_shard))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTime:
    """One micro-batch on one device of a pipeline stage, by term: the slowest stage paces the pipeline."""

    microbatch_s: float
    """compute_s + tp_comm_s + pp_comm_s, summed in that order."""
    compute_s: float
    """Forward and backward with recomputation, summed (:func:`time.forward_s`, :func:`time.backward_s`,
    :func:`time.recompute_s`)."""
    tp_comm_s: float
    """Tensor-parallel communication not hidden behind the compute (:func:`time.tp_comm_s`, :func:`time.tp_exposed_s`)."""
    pp_comm_s: float
    """Sends to and from the neighbouring stages not hidden (:func:`time.pp_comm_s`, :func:`time.pp_exposed_s`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Everything but activations on one device of a pipeline stage, by term (what :func:`stage_state_bytes` returns).

    It does not depend on the micro-batch size, gas, sp, vpp or recomputation, so the search keeps one per (layout,
    ZeRO stage, offload mode) and stage, and adds each micro-batch's activations with :meth:`with_activations`.
    """

    params_bytes: float
    """Working weights on the device (:func:`memory.params_bytes`)."""
    grads_bytes: float
    """Gradients of the trainable parameters on the device (:func:`memory.grads_bytes`)."""
    optimizer_bytes: float
    """Optimizer states of the trainable parameters on the device (:func:`memory.optimizer_bytes`)."""
    other_bytes: float
    """Communication buffers, the ZeRO-3 gather of the largest block and the framework reserve, summed in that order."""
    host_bytes: float
    """Host memory this device's offloaded states take (:func:`memory.host_bytes`); 0 without offload."""

    @property
    def device_bytes(self) -> float:
        """params + grads + optimizer + other on the device, summed in that order (the bytes next to the activations)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.other_bytes

    def with_activations(self, activations_bytes: float, hw: Hardware, stage: int) -> mem.MemoryEstimate:
        """The memory of the device of pipeline stage ``stage`` that holds these bytes and ``activations_bytes``."""
        return mem.MemoryEstimate(
            params_bytes=self.params_bytes,
            grads_bytes=self.grads_bytes,
            optimizer_bytes=self.optimizer_bytes,
            activations_bytes=activations_bytes,
            other_bytes=self.other_bytes,
            limit_bytes=hw.memory_bytes,
            host_bytes=self.host_bytes,
            host_limit_bytes=hw.host_bytes_per_device,
            stage=stage,
            fragmentation_bytes=mem.fragmentation_bytes(hw.memory_bytes, hw.calibration),
        )


def sparse_on_stage(load: StageLoad, zero: int) -> int:
    """The stage's parameters whose gradients are priced sparse at ``zero`` (:func:`memory.sparse_gradients_priced`);
    the rest of its trainable parameters are priced dense."""
    return load.sparse_params if mem.sparse_gradients_priced(zero) else 0


def stage_touched(model: ModelSpec, load: StageLoad, dp: int) -> TouchedRows:
    """The sparse rows one replica's step touches on a stage: its lookups for the replica's share of the global batch
    (:func:`~lightning_fleet.planning.model.touched_sparse`, an upper bound)."""
    return touched_sparse(load.sparse_params, load.sparse_rows_per_sample, load.sparse_elements_per_sample,
                          model.global_batch_size / dp)


def stage_state_bytes(
    model: ModelSpec, hw: Hardware, load: StageLoad, *, tp: int, dp: int, zero: int, offload: Offload, shard: int | None = None
) -> StateBytes:
    """Everything but activations on one device of a stage; gradients and optimizer states for its trainable parameters
    only, the gradients of sparse ones (at ZeRO-0) by the rows a step touches (:func:`memory.sparse_grads_bytes`). What
    ``zero`` shards is split over ``shard`` replicas (hybrid sharding's group, :attr:`Plan.dp_shard`; None: all dp)."""
    n, t, p = load.params, load.trainable_params, model.precision
    group = dp if shard is None else shard
    sparse = sparse_on_stage(load, zero)
    sparse_grads = mem.sparse_grads_bytes(stage_touched(model, load, dp), dp=dp, precision=p) if sparse else 0.0
    other = (
        mem.comm_buffer_bytes(n - sparse, tp=tp, dp=dp, zero=zero, precision=p)  # sparse gradients go unbucketed
        + mem.zero3_gather_bytes(load.largest_block_params, tp=tp, zero=zero, precision=p)
        + mem.reserve_bytes(hw.memory_bytes, hw.calibration)
    )
    return StateBytes(
        params_bytes=mem.params_bytes(n, tp=tp, dp=group, zero=zero, offload=offload, precision=p),
        grads_bytes=mem.grads_bytes(t - sparse, tp=tp, dp=group, zero=zero, precision=p, grad_accum=model.grad_accum_dtype)
        + sparse_grads,
        optimizer_bytes=mem.optimizer_bytes(t, tp=tp, dp=group, zero=zero, offload=offload, precision=p),
        other_bytes=other,
        host_bytes=mem.host_bytes(n, tp=tp, dp=group, offload=offload, precision=p, trainable=t),
    )


def stage_activation_bytes(load: StageLoad, plan: Plan, recompute: Recompute) -> float:
    """Activations on one device of a stage under ``plan`` with the given recomputation."""
    in_flight = mem.in_flight_microbatches(stage=load.index, pp=plan.pp, vpp=plan.vpp, gas=plan.gas)
    return mem.activations_bytes(load, tp=plan.tp, sp=plan.sp, recompute=recompute, mbs=plan.mbs, in_flight=in_flight)


class ActivationModel:
    """:func:`stage_activation_bytes` for many plans of one model, from the plan fields it depends on.

    :func:`memory.activations_bytes` is the per-sample bytes (which depend on the stage, tp, sp and
    recompute only) times mbs times the micro-batches in flight (which depend on the stage, pp, vpp
    and gas only), plus the recompute transient (which does not depend on vpp or gas). Those three
    are computed once and kept, and combined as there, so the result is the same bit for bit (tests
    hold the two against each other).

    Mutable (its memo tables grow); one per search.
    """

    __slots__ = ("_in_flight", "_per_sample", "_transient")

    def __init__(self) -> None:
        self._in_flight: dict[tuple[int, int, int], tuple[float, ...]] = {}
        self._per_sample: dict[tuple[int, int, bool, tuple[Recompute, ...]], list[tuple[Recompute, tuple[float, ...]]]] = {}
        self._transient: dict[tuple[int, int, bool, int, tuple[Recompute, ...]], list[tuple[float, ...]]] = {}

    def stage_bytes(
        self, loads: tuple[StageLoad, ...], recomputes: tuple[Recompute, ...], *, tp: int, sp: bool, pp: int, vpp: int, mbs: int, gas: int
    ) -> dict[Recompute, tuple[float, ...]]:
        """Per recompute mode, the activations on one device of each of ``loads`` (the stages of a ``pp``-stage pipeline), as :func:`stage_activation_bytes` gives them."""
        per_sample = self._per_sample.get((pp, tp, sp, recomputes))
        if per_sample is None:
            per_sample = self._per_sample[(pp, tp, sp, recomputes)] = [
                (r, tuple(mem.activation_bytes_per_sample(load, tp=tp, sp=sp, recompute=r) for load in loads)) for r in recomputes
            ]
        transient = self._transient.get((pp, tp, sp, mbs, recomputes))
        if transient is None:
            transient = self._transient[(pp, tp, sp, mbs, recomputes)] = [
                tuple(mem.recompute_transient_bytes(load, tp=tp, sp=sp, recompute=r, mbs=mbs) for load in loads) for r in recomputes
            ]
        in_flight = self._in_flight.get((pp, vpp, gas))
        if in_flight is None:
            in_flight = self._in_flight[(pp, vpp, gas)] = tuple(mem.in_flight_microbatches(stage=load.index, pp=pp, vpp=vpp, gas=gas) for load in loads)
        out = {}
        for (r, row), extras in zip(per_sample, transient):
            values = []
            for bytes_per_sample, held, extra in zip(row, in_flight, extras):
                values.append(bytes_per_sample * mbs * held + extra)
            out[r] = tuple(values)
        return out


def stage_memory(model: ModelSpec, hw: Hardware, plan: Plan, load: StageLoad) -> mem.MemoryEstimate:
    """Memory of one device of one pipeline stage."""
    state = stage_state_bytes(model, hw, load, tp=plan.tp, dp=plan.dp, zero=plan.zero, offload=plan.offload, shard=plan.dp_shard)
    return state.with_activations(stage_activation_bytes(load, plan, plan.recompute), hw, load.index)


def memory_estimate(model: ModelSpec, hw: Hardware, plan: Plan) -> mem.MemoryEstimate:
    """Memory of the worst device: the stage with the largest shortfall (or least headroom)."""
    loads = stage_loads(model, plan.pp, plan.stage_layers)
    return max((stage_memory(model, hw, plan, load) for load in loads), key=mem.MemoryEstimate.shortfall_bytes)


def achieved_rate(model: ModelSpec, hw: Hardware, plan: Plan) -> float:
    """Matmul FLOP/s one device reaches at the plan's per-device GEMM size."""
    return _matmul_rate(model, hw, mbs=plan.mbs, tp=plan.tp)


def _matmul_rate(model: ModelSpec, hw: Hardware, *, mbs: int, tp: int) -> float:
    dim = tm.gemm_dim(mbs=mbs, seq_length=model.seq_length, hidden_size=model.hidden_size, tp=tp)
    return tm.achieved_flops_per_s(hw.peak_flops_per_s, dim, hw.calibration)


class TimeModel:
    """:func:`time_estimate` and :func:`compute_bound_s` for many plans of one model on one hardware.

    Plans of one search share most of the pieces of their step time: the stage loads of a pipeline
    degree, the matmul rate of a micro-batch size, the links of a placement, and each stage's
    compute, tensor-, pipeline- and data-parallel terms, which depend on a few plan fields each.
    A TimeModel computes every piece once, keyed by exactly the fields it depends on, and adds
    them up in the order the single-plan functions do (they are this class, used once), so a
    plan's time is the same bit for bit however many plans were priced before it.

    Mutable (its memo tables grow); one per search and hardware, not shared between threads.
    """

    __slots__ = ("_compute", "_dp", "_fwd", "_least_step_overhead_s", "_links", "_loads", "_offload", "_optimizer", "_overhead_s", "_rates", "_slowest", "hw", "model", "overlaps", "stage_hw", "stage_layers")

    def __init__(
        self, model: ModelSpec, hw: Hardware, stage_layers: tuple[int, ...] | None = None, overlaps: Overlaps = Overlaps.DEFAULT,
        stage_hw: tuple[Hardware, ...] | None = None,
    ) -> None:
        self.model = model
        """The model priced."""
        self.hw = hw
        """The hardware it is priced on."""
        self.overlaps = overlaps
        """What the runtime hides behind compute: the same for every plan priced (a search's candidates compare fairly)."""
        self.stage_layers = stage_layers
        """The layer split of its plans with pp = len(stage_layers) (None, and for every other pp: the default split)."""
        self.stage_hw = stage_hw
        """The hardware of each pipeline stage where the stages' devices differ (their compute runs at its matmul rate
        and memory-bound rate; everything else at ``hw``'s); None: every stage on ``hw``."""
        self._overhead_s: dict[tuple[int, int, Recompute, Offload], float] = {}
        self._least_step_overhead_s = min(hw.calibration.step_overhead(zero) for zero in range(4))
        self._loads: dict[int, tuple[StageLoad, ...]] = {}
        self._rates: dict[tuple[int, int], float] = {}
        self._links: dict[tuple[int, int, int, tuple[Axis, ...], int | None], AxisLinks] = {}
        self._fwd: dict[tuple[int, int, int, int], float] = {}
        self._compute: dict[tuple[int, int, int, int, Recompute], tuple[float, float]] = {}
        self._slowest: dict[tuple[int, int, int, Recompute, bool, int, int, int], StageTime] = {}
        self._dp: dict[tuple[int, int, int, int, int, int, Recompute, int, int | None, int], float] = {}
        self._offload: dict[tuple[int, int, int, int, Offload], float] = {}  # (pp, tp, shard degree, gas, offload)
        self._optimizer: dict[tuple[int, int, int, int, Offload], float] = {}  # (pp, tp, shard degree, zero, offload)

    def loads(self, pp: int) -> tuple[StageLoad, ...]:
        """:func:`stage_loads` of the model for ``pp`` stages."""
        loads = self._loads.get(pp)
        if loads is None:
            fixed = self.stage_layers if self.stage_layers is not None and len(self.stage_layers) == pp else None
            loads = self._loads[pp] = stage_loads(self.model, pp, fixed)
        return loads

    def rate(self, mbs: int, tp: int, stage: int | None = None) -> float:
        """:func:`achieved_rate` of a plan with this micro-batch size and tensor-parallel degree (on pipeline stage
        ``stage``'s hardware where :attr:`stage_hw` gives one)."""
        hw = self.hw if stage is None or self.stage_hw is None else self.stage_hw[stage]
        key = (mbs, tp) if hw is self.hw else (mbs, tp, stage)
        rate = self._rates.get(key)  # type: ignore[arg-type]
        if rate is None:
            rate = self._rates[key] = _matmul_rate(self.model, hw, mbs=mbs, tp=tp)  # type: ignore[index]
        return rate

    def _elementwise_s(self, stage: int) -> float:
        """Seconds per memory-bound element on pipeline stage ``stage``."""
        return (self.hw if self.stage_hw is None else self.stage_hw[stage]).elementwise_s

    def links(self, plan: Plan, order: tuple[Axis, ...]) -> AxisLinks:
        """The links of ``plan``'s layout placed in ``order``."""
        key = (plan.dp, plan.tp, plan.pp, order, plan.dp_shard)
        links = self._links.get(key)
        if links is None:
            placed = plan if order == plan.order else Plan(dp=plan.dp, tp=plan.tp, pp=plan.pp, order=order, zero=plan.zero,
                                                          dp_shard=plan.dp_shard)
            links = self._links[key] = self.hw.links(placed)
        return links

    def forward_s(self, pp: int, load: StageLoad, mbs: int, tp: int) -> float:
        """Forward compute of one micro-batch on one device of a stage (:func:`time.forward_s`)."""
        key = (pp, load.index, mbs, tp)
        fwd = self._fwd.get(key)
        if fwd is None:
            fwd = self._fwd[key] = tm.forward_s(
                load, mbs=mbs, tp=tp, flops_per_s=self.rate(mbs, tp, load.index), elementwise_s=self._elementwise_s(load.index),
                attention_efficiency=self.hw.calibration.attention_efficiency,
            )
        return fwd

    def time(self, plan: Plan, order: tuple[Axis, ...] | None = None) -> tm.TimeEstimate:
        """Step time of ``plan`` (placed in ``order`` when given): the slowest stage paces the pipeline; the slowest data-parallel group ends the step."""
        links = self.links(plan, plan.order if order is None else order)
        tp_link, pp_link = links.tp, links.pp
        gas, overhead_s = plan.gas, self.microbatch_overhead_s(plan.zero, plan.pp, plan.recompute, plan.offload)
        key = (plan.pp, plan.mbs, plan.tp, plan.recompute, plan.sp, plan.vpp, id(tp_link), id(pp_link))
        slowest = self._slowest.get(key)
        if slowest is None:
            slowest = self._slowest[key] = self._slowest_stage(plan, tp_link, pp_link)
        key = (plan.pp, plan.mbs, plan.tp, plan.dp, plan.zero, gas, plan.recompute, id(links.dp), plan.dp_shard, id(links.dp_shard))
        dp_s = self._dp.get(key)
        if dp_s is None:
            dp_s = self._dp[key] = max(self._stage_dp_s(load, plan, links) for load in self.loads(plan.pp))
        microbatch_s = slowest.microbatch_s + overhead_s
        return tm.TimeEstimate(
            compute_s=gas * slowest.compute_s,
            tp_comm_s=gas * slowest.tp_comm_s,
            pp_comm_s=gas * slowest.pp_comm_s,
            dp_comm_s=dp_s,
            bubble_s=tm.bubble_s(microbatch_s, pp=plan.pp, vpp=plan.vpp),
            offload_s=self._offload_s(plan),
            optimizer_s=self._optimizer_s(plan),
            overhead_s=gas * overhead_s + self.hw.calibration.step_overhead(plan.zero),
        )

    def compute_bound(self, *, tp: int, pp: int, vpp: int, mbs: int, gas: int) -> float:
        """:func:`compute_bound_s` of a plan with these fields (the only ones it depends on)."""
        fwd, bwd = max((self._stage_compute(pp, load, mbs, tp, Recompute.NONE) for load in self.loads(pp)), key=sum)
        microbatch_s = fwd + bwd + min(self.microbatch_overhead_s(zero, pp, Recompute.NONE, Offload.NONE) for zero in range(4))
        return gas * microbatch_s + tm.bubble_s(microbatch_s, pp=pp, vpp=vpp) + self._least_step_overhead_s

    def microbatch_overhead_s(self, zero: int, pp: int, recompute: Recompute, offload: Offload) -> float:
        """:func:`time.microbatch_overhead_s` of one device of a ``pp``-stage pipeline (its share of the operators and
        parameter tensors); recomputation repeats the share of the forward FLOPs it recomputes. Op-level recomputation
        dispatches every operator of the layers' forward again, as full does: torch.utils.checkpoint's selective mode
        reruns the checkpointed forward and hands the kept operators their stored outputs at dispatch
        (``_CachedTorchDispatchMode``), and the layers' module hooks (ZeRO-3's gathers) fire again."""
        key = (zero, pp, recompute, offload)
        seconds = self._overhead_s.get(key)
        if seconds is None:
            model = self.model
            total = sum(b.flops * b.count for b in model.blocks)
            rerun = Recompute.FULL if recompute is Recompute.OP else recompute
            redone = hardware_flops_per_sample(model, rerun) - 3.0 * model.flops_per_sample
            seconds = self._overhead_s[key] = tm.microbatch_overhead_s(
                model.forward_ops / pp, self.hw.calibration, zero, param_tensors=model.param_tensors / pp,
                recomputed=redone / total if total else 0.0, offload=offload,
            )
        return seconds

    def _stage_compute(self, pp: int, load: StageLoad, mbs: int, tp: int, recompute: Recompute) -> tuple[float, float]:
        """(forward, backward with recomputation) seconds of one micro-batch on one device of a stage (a pair, not a
        record: the search asks for many)."""
        key = (pp, load.index, mbs, tp, recompute)
        pair = self._compute.get(key)
        if pair is None:
            fwd, rate, calibration = self.forward_s(pp, load, mbs, tp), self.rate(mbs, tp, load.index), self.hw.calibration
            attention_s = tm.fused_attention_s(
                load.attention_kernel_flops, mbs=mbs, tp=tp, flops_per_s=rate, efficiency=calibration.attention_efficiency
            )
            bwd = tm.backward_s(fwd, attention_s) + tm.recompute_s(load, mbs=mbs, tp=tp, recompute=recompute, flops_per_s=rate,
                                                                   elementwise_s=self._elementwise_s(load.index),
                                                                   attention_efficiency=calibration.attention_efficiency)
            pair = self._compute[key] = (fwd, bwd)
        return pair

    def _slowest_stage(self, plan: Plan, tp_link: LinkSpec, pp_link: LinkSpec) -> StageTime:
        """The stage with the longest micro-batch (the first of equally slow ones, as max() picks)."""
        pp, mbs, tp, overlaps, overlap = plan.pp, plan.mbs, plan.tp, self.overlaps, self.hw.calibration.overlap
        tp_hidden = tm.hidden_fraction(overlaps.hides_tp_comm(plan.sp), overlap)
        pp_hidden = tm.hidden_fraction(overlaps.hides_pp_p2p(plan.vpp), overlap)
        split = overlaps.splits_pp_p2p(tp, plan.sp)
        slowest = None  # (micro-batch, compute, tp, pp) seconds; named once the loop is done (records cost more to build)
        for load in self.loads(pp):
            fwd, bwd = self._stage_compute(pp, load, mbs, tp, plan.recompute)
            compute_s = fwd + bwd
            tp_all_s = tm.tp_comm_s(load, mbs=mbs, tp=tp, recompute=plan.recompute, link=tp_link, sp=plan.sp,
                                    sp_traffic=overlaps.sp_traffic)
            tp_s = tm.tp_exposed_s(tp_all_s, compute_s, tp_hidden)
            sends_s = tm.pp_comm_s(load, mbs=mbs, tp=tp, sp=plan.sp, pp=pp, vpp=plan.vpp, link=pp_link, split_over_tp=split)
            gathers_s = tm.pp_split_gather_s(load, mbs=mbs, tp=tp, pp=pp, vpp=plan.vpp, link=tp_link) if split else 0.0
            pp_s = tm.pp_exposed_s(sends_s, gathers_s, compute_s, pp_hidden)
            microbatch_s = compute_s + tp_s + pp_s
            if slowest is None or microbatch_s > slowest[0]:
                slowest = (microbatch_s, compute_s, tp_s, pp_s)
        assert slowest is not None  # a pipeline has at least one stage
        microbatch_s, compute_s, tp_s, pp_s = slowest
        return StageTime(microbatch_s=microbatch_s, compute_s=compute_s, tp_comm_s=tp_s, pp_comm_s=pp_s)

    def _stage_dp_s(self, load: StageLoad, plan: Plan, links: AxisLinks) -> float:
        """Exposed data-parallel communication of one stage (under hybrid sharding: in the shard group on its link,
        across the groups on the dp axis' link)."""
        fwd, bwd = self._stage_compute(plan.pp, load, plan.mbs, plan.tp, plan.recompute)
        sparse = sparse_on_stage(load, plan.zero)
        sparse_s = tm.sparse_grad_allgather_s(
            stage_touched(self.model, load, plan.dp), tensors=load.sparse_tensors, dp=plan.dp, precision=self.model.precision,
            link=links.dp,
        ) if sparse else 0.0
        return tm.dp_comm_s(
            load.params,
            tp=plan.tp,
            dp=plan.dp,
            zero=plan.zero,
            gas=plan.gas,
            precision=self.model.precision,
            link=links.dp_shard,
            forward_time_s=fwd,
            backward_time_s=bwd,
            overlap=self.hw.calibration.overlap,
            trainable=load.trainable_params - sparse,
            overlaps=self.overlaps,
            pp=plan.pp,
            sparse_s=sparse_s,
            shard=plan.dp_shard,
            replica_link=links.dp,
        )

    def _optimizer_s(self, plan: Plan) -> float:
        """The device optimizer step of the stage with the most work: its dense trainable parameters, and the rows its
        sparse gradients hold (:func:`time.sparse_optimizer_step_s`)."""
        key = (plan.pp, plan.tp, plan.shard_degree, plan.zero, plan.offload)
        seconds = self._optimizer.get(key)
        if seconds is None:
            seconds = self._optimizer[key] = max(self._stage_optimizer_s(load, plan) for load in self.loads(plan.pp))
        return seconds

    def _stage_optimizer_s(self, load: StageLoad, plan: Plan) -> float:
        rate, sparse = self.hw.calibration.adam_params_per_s, sparse_on_stage(load, plan.zero)
        dense = tm.optimizer_step_s(
            load.trainable_params - sparse, tp=plan.tp, dp=plan.shard_degree, zero=plan.zero, offload=plan.offload,
            adam_params_per_s=rate,
        )
        if not sparse:
            return dense
        return dense + tm.sparse_optimizer_step_s(stage_touched(self.model, load, plan.dp), dp=plan.dp, adam_params_per_s=rate)

    def _offload_s(self, plan: Plan) -> float:
        key = (plan.pp, plan.tp, plan.shard_degree, plan.gas, plan.offload)
        seconds = self._offload.get(key)
        if seconds is None:
            hw = self.hw
            seconds = self._offload[key] = max(
                tm.offload_s(
                    load.params,
                    tp=plan.tp,
                    dp=plan.shard_degree,
                    gas=plan.gas,
                    offload=plan.offload,
                    precision=self.model.precision,
                    pcie_GBps=hw.pcie_GBps,
                    cpu_adam_params_per_s=hw.calibration.cpu_adam_params_per_s,
                    devices_per_node=hw.devices_per_node,
                    trainable=load.trainable_params,
                )
                for load in self.loads(plan.pp)
            )
        return seconds


def time_estimate(model: ModelSpec, hw: Hardware, plan: Plan, overlaps: Overlaps = Overlaps.DEFAULT) -> tm.TimeEstimate:
    """Step time: the slowest stage paces the pipeline; the slowest data-parallel group ends the step; ``overlaps`` is
    what the runtime hides behind compute."""
    return TimeModel(model, hw, plan.stage_layers, overlaps).time(plan)


def compute_bound_s(model: ModelSpec, hw: Hardware, plan: Plan) -> float:
    """A lower bound on the step time of ``plan`` under any placement, recomputation and offload.

    Forward and backward of the slowest stage with every communication free, plus the bubble and
    the fixed overheads: each term of :func:`time_estimate` is at least this large.
    """
    return TimeModel(model, hw, plan.stage_layers).compute_bound(tp=plan.tp, pp=plan.pp, vpp=plan.vpp, mbs=plan.mbs, gas=plan.gas)


def hardware_flops_per_sample(model: ModelSpec, recompute: Recompute) -> float:
    """Forward + backward (3x forward, Narayanan 2021) plus recomputed forward FLOPs, one sample."""
    extra = 0.0
    if recompute is Recompute.FULL:
        extra = sum(b.flops * b.count for b in model.blocks if b.role is Role.LAYER)
    elif recompute is Recompute.SELECTIVE:
        extra = sum(b.recompute_flops * b.count for b in model.blocks if b.role is Role.LAYER)
    elif recompute is Recompute.OP:
        extra = sum(b.op_recompute.flops * b.count for b in model.blocks if b.role is Role.LAYER and b.op_recompute is not None)
    return 3.0 * model.flops_per_sample + extra


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """What the cost model predicts for one plan on one cluster."""

    model: ModelSpec
    """The model."""
    plan: Plan
    """The plan."""
    memory: mem.MemoryEstimate
    """Worst device's memory."""
    time: tm.TimeEstimate
    """Step time by term."""
    world_size: int
    """Devices used."""

    @property
    def fits(self) -> bool:
        """The worst device (and its host) holds the plan."""
        return self.memory.fits

    @property
    def samples_per_s(self) -> float:
        """Training samples per second, whole cluster."""
        return self.plan.global_batch_size / self.time.step_s

    @property
    def model_tflops_per_device(self) -> float:
        """Model FLOPs (3x forward, no recompute) per second per device, in TFLOP/s (MFU numerator)."""
        return 3.0 * self.model.flops_per_sample * self.samples_per_s / self.world_size / 1e12

    @property
    def hardware_tflops_per_device(self) -> float:
        """FLOPs actually executed (with recomputation) per second per device, in TFLOP/s."""
        return hardware_flops_per_sample(self.model, self.plan.recompute) * self.samples_per_s / self.world_size / 1e12

    def to_dict(self) -> dict[str, Any]:
        """The ``estimate`` JSON object of ``fleet estimate --json``."""
        return {
            "model": {"name": self.model.name, "params": self.model.params, "flops_per_sample": self.model.flops_per_sample},
            "plan": self.plan.to_dict(),
            "plan_string": str(self.plan),
            "fits": self.fits,
            "tight": self.memory.tight,
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict(),
            "throughput": {
                "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.samples_per_s * self.model.seq_length,
                "model_tflops_per_device": self.model_tflops_per_device,
                "hardware_tflops_per_device": self.hardware_tflops_per_device,
            },
        }


def check_plan(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> None:
    """Raise PlanError when the plan cannot run this model on this cluster at all."""
    plan.check(
        world_size=cluster.world_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        global_batch_size=model.global_batch_size,
    )
    if plan.offload is not Offload.NONE and cluster.host is None:
        raise PlanError(f"plan {plan} offloads to the host, but cluster {cluster.name!r} has no host section (memory_gib, pcie_GBps)")
    check_recompute(model, plan.recompute)


def check_recompute(model: ModelSpec, recompute: Recompute) -> None:
    """PlanError unless the model says what ``recompute`` does to it: op-level recomputation needs every layer block's
    :attr:`~lightning_fleet.planning.model.BlockSpec.op_recompute` (the transformer spec gives it; a profiled module's
    blocks do not)."""
    if recompute is Recompute.OP and not model.op_recompute_known:
        unknown = next(b.name for b in model.blocks if b.role is Role.LAYER and b.op_recompute is None)
        raise PlanError(
            f"recompute=op needs what op-level recomputation keeps and redoes in each layer block, and model {model.name!r} "
            f"does not say it for block {unknown!r} (profiled modules never do): use recompute=none, selective or full, "
            "or give the block an op_recompute"
        )


def estimate_with(
    model: ModelSpec, hw: Hardware, plan: Plan, memory: mem.MemoryEstimate | None = None, overlaps: Overlaps = Overlaps.DEFAULT
) -> Estimate:
    """Estimate on pre-derived hardware (the search calls this in its inner loop, with the memory it already has)."""
    return Estimate(
        model=model,
        plan=plan,
        memory=memory if memory is not None else memory_estimate(model, hw, plan),
        time=time_estimate(model, hw, plan, overlaps),
        world_size=hw.world_size,
    )


def estimate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, overlaps: Overlaps = Overlaps.DEFAULT) -> Estimate:
    """Predict memory and step time of ``plan`` for ``model`` on ``cluster`` under a runtime that hides ``overlaps``
    behind compute (a runtime's ``Capabilities.overlaps``; the default is the cost model's assumption, :attr:`Overlaps.DEFAULT`);
    PlanError if the plan is invalid there.
    The estimate's plan names its layer split when the split is uneven (:func:`stages.with_stage_layers`)."""
    check_plan(model, cluster, plan)
    if plan.dp_mbs is not None and not cluster.is_homogeneous:
        return _estimate_replicas(model, cluster, with_stage_layers(model, plan), overlaps)
    if plan.pp > 1 and len(set(stage_devices(cluster, plan))) > 1:
        return _estimate_stages(model, cluster, with_stage_layers(model, plan), overlaps)
    return estimate_with(model, Hardware.of(cluster, model), with_stage_layers(model, plan), overlaps=overlaps)


def stage_devices(cluster: ClusterSpec, plan: Plan) -> tuple[DeviceSpec, ...]:
    """The device each pipeline stage of ``plan`` runs on, first to last (:func:`axis_devices` along pp)."""
    return axis_devices(cluster, plan, Axis.PP)


def axis_devices(cluster: ClusterSpec, plan: Plan, axis: Axis) -> tuple[DeviceSpec, ...]:
    """For each index along ``axis`` (a replica, a stage), the slowest device of the ranks at that index
    (:func:`cluster.slowest_device`), the ranks placed by the plan's order (:meth:`Plan.coordinates`)."""
    by_index: list[list[DeviceSpec]] = [[] for _ in range(getattr(plan, axis.value))]
    for rank in range(plan.world_size):
        by_index[getattr(plan.coordinates(rank), axis.value)].append(cluster.rank_device(rank))
    return tuple(slowest_device(devices) for devices in by_index)


def _estimate_stages(model: ModelSpec, cluster: ClusterSpec, plan: Plan, overlaps: Overlaps) -> Estimate:
    """A pipeline whose stages run on devices that differ: each stage's compute at its own device's matmul and
    memory-bound rates (:attr:`TimeModel.stage_hw`), communication and the optimizer step on the slowest stage's device,
    the memory that of the stage with the least headroom on its own device."""
    devices = stage_devices(cluster, plan)
    stage_hw = tuple(Hardware.of(cluster.with_device(d), model) for d in devices)
    hw = Hardware.of(cluster.with_device(slowest_device(list(devices))), model)
    time = TimeModel(model, hw, plan.stage_layers, overlaps, stage_hw=stage_hw).time(plan)
    loads = stage_loads(model, plan.pp, plan.stage_layers)
    memory = max((stage_memory(model, stage_hw[load.index], plan, load) for load in loads), key=mem.MemoryEstimate.shortfall_bytes)
    return Estimate(model=model, plan=plan, memory=memory, time=time, world_size=cluster.world_size)


def replica_devices(cluster: ClusterSpec, plan: Plan) -> tuple[DeviceSpec, ...]:
    """The device each data-parallel replica of ``plan`` runs on, first to last (:func:`axis_devices` along dp)."""
    return axis_devices(cluster, plan, Axis.DP)


def replica_estimate(
    model: ModelSpec, cluster: ClusterSpec, plan: Plan, device: DeviceSpec, mbs: int, overlaps: Overlaps = Overlaps.DEFAULT
) -> Estimate:
    """One replica of ``plan`` running micro-batches of ``mbs`` on ``device``: the same layout with every replica alike,
    at the batch that makes (gas micro-batches of ``mbs`` on each of dp replicas), on the cluster with ``device`` in
    every node."""
    alike = dataclasses.replace(model, global_batch_size=plan.dp * mbs * plan.gas)
    return estimate_with(alike, Hardware.of(cluster.with_device(device), alike), plan.replace(mbs=mbs, dp_mbs=None), overlaps=overlaps)


def _estimate_replicas(model: ModelSpec, cluster: ClusterSpec, plan: Plan, overlaps: Overlaps) -> Estimate:
    """A plan whose replicas differ in micro-batch size on a cluster whose devices differ: each replica priced as the
    same plan with its own micro-batch on a cluster of its own device (at the batch of every replica running that
    size), the step paced by the slowest replica, the memory that of the replica with the least headroom; the
    data-parallel collectives are the same for every replica (they move the same parameters over the same links)."""
    per_replica = {}
    for device, mbs in zip(replica_devices(cluster, plan), (plan.replica_mbs(r) for r in range(plan.dp))):
        if (device, mbs) not in per_replica:
            per_replica[(device, mbs)] = replica_estimate(model, cluster, plan, device, mbs, overlaps)
    slowest = max(per_replica.values(), key=lambda e: e.time.step_s)
    tightest = max(per_replica.values(), key=lambda e: e.memory.shortfall_bytes())
    return Estimate(model=model, plan=plan, memory=tightest.memory, time=slowest.time, world_size=cluster.world_size)
