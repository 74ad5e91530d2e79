"""Estimate one plan: per-device memory by term, step time by term, throughput."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_fleet.planning import memory as mem
from lightning_fleet.planning import time as tm
from lightning_fleet.planning.cluster import GIB, Calibration, ClusterSpec, LinkLevel, LinkSpec
from lightning_fleet.planning.comm import axis_level
from lightning_fleet.planning.errors import PlanError
from lightning_fleet.planning.model import ModelSpec, Role
from lightning_fleet.planning.plan import Axis, Offload, Plan, Recompute
from lightning_fleet.planning.stages import StageLoad, stage_loads


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

    @classmethod
    def of(cls, cluster: ClusterSpec, model: ModelSpec) -> "Hardware":
        """Derive from a cluster, planning heterogeneous clusters on their slowest device."""
        device = cluster.planning_device()
        host = cluster.host
        return cls(
            world_size=cluster.world_size,
            devices_per_node=cluster.devices_per_node,
            memory_bytes=device.memory_bytes,
            peak_flops_per_s=getattr(device.peak_tflops, model.precision.compute_dtype) * 1e12,
            intra_node=cluster.intra_node,
            inter_node=cluster.inter_node,
            host_bytes_per_device=host.memory_gib * GIB / cluster.devices_per_node if host else 0.0,
            pcie_GBps=host.pcie_GBps if host else 0.0,
            calibration=cluster.calibration,
        )

    def with_fastest_links(self) -> "Hardware":
        """The same hardware with both link levels as fast as the faster one (a lower bound over placements)."""
        a, b = self.intra_node, self.inter_node
        best = LinkSpec(bandwidth_GBps=max(a.bandwidth_GBps, b.bandwidth_GBps), latency_us=min(a.latency_us, b.latency_us))
        return dataclasses.replace(self, intra_node=best, inter_node=best)

    def link(self, plan: Plan, axis: Axis) -> LinkSpec:
        """The link an axis' collectives run on under the plan's placement."""
        return self.intra_node if axis_level(plan, axis, self.devices_per_node) is LinkLevel.INTRA else self.inter_node


def stage_state_bytes(
    model: ModelSpec, hw: Hardware, load: StageLoad, *, tp: int, dp: int, zero: int, offload: Offload
) -> tuple[float, float, float, float, float]:
    """Everything but activations on one device of a stage: (params, grads, optimizer, other, host) bytes."""
    n, p = load.params, model.precision
    other = (
        mem.comm_buffer_bytes(n, tp=tp, dp=dp, zero=zero, precision=p)
        + mem.zero3_gather_bytes(load.largest_block_params, tp=tp, zero=zero, precision=p)
        + mem.reserve_bytes(hw.memory_bytes, hw.calibration)
    )
    return (
        mem.params_bytes(n, tp=tp, dp=dp, zero=zero, offload=offload, precision=p),
        mem.grads_bytes(n, tp=tp, dp=dp, zero=zero, precision=p),
        mem.optimizer_bytes(n, tp=tp, dp=dp, zero=zero, offload=offload, precision=p),
        other,
        mem.host_bytes(n, tp=tp, dp=dp, offload=offload, precision=p),
    )


def stage_activation_bytes(load: StageLoad, plan: Plan, recompute: Recompute) -> float:
    """Activations on one device of a stage under ``plan`` with the given recomputation."""
    in_flight = mem.in_flight_microbatches(stage=load.index, pp=plan.pp, vpp=plan.vpp, gas=plan.gas)
    return mem.activations_bytes(load, tp=plan.tp, sp=plan.sp, recompute=recompute, mbs=plan.mbs, in_flight=in_flight)


def stage_memory(model: ModelSpec, hw: Hardware, plan: Plan, load: StageLoad) -> mem.MemoryEstimate:
    """Memory of one device of one pipeline stage."""
    params, grads, optimizer, other, host = stage_state_bytes(
        model, hw, load, tp=plan.tp, dp=plan.dp, zero=plan.zero, offload=plan.offload
    )
    return mem.MemoryEstimate(
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        activations_bytes=stage_activation_bytes(load, plan, plan.recompute),
        other_bytes=other,
        limit_bytes=hw.memory_bytes,
        host_bytes=host,
        host_limit_bytes=hw.host_bytes_per_device,
        stage=load.index,
    )


def memory_estimate(model: ModelSpec, hw: Hardware, plan: Plan) -> mem.MemoryEstimate:
    """Memory of the worst device: the stage with the largest shortfall (or least headroom)."""
    loads = stage_loads(model, plan.pp)
    return max((stage_memory(model, hw, plan, load) for load in loads), key=mem.MemoryEstimate.shortfall_bytes)


@dataclass(frozen=True, slots=True)
class _StageTime:
    compute_s: float
    tp_s: float
    pp_s: float
    dp_s: float

    @property
    def microbatch_s(self) -> float:
        return self.compute_s + self.tp_s + self.pp_s


def _stage_time(model: ModelSpec, hw: Hardware, plan: Plan, load: StageLoad, flops_per_s: float, links: dict[Axis, LinkSpec]) -> _StageTime:
    fwd = tm.forward_s(load, mbs=plan.mbs, tp=plan.tp, flops_per_s=flops_per_s)
    bwd = tm.backward_s(fwd) + tm.recompute_s(load, mbs=plan.mbs, tp=plan.tp, recompute=plan.recompute, flops_per_s=flops_per_s)
    dp = tm.dp_comm_s(
        load.params,
        tp=plan.tp,
        dp=plan.dp,
        zero=plan.zero,
        gas=plan.gas,
        precision=model.precision,
        link=links[Axis.DP],
        forward_time_s=fwd,
        backward_time_s=bwd,
        overlap=hw.calibration.overlap,
    )
    return _StageTime(
        compute_s=fwd + bwd,
        tp_s=tm.tp_comm_s(load, mbs=plan.mbs, tp=plan.tp, recompute=plan.recompute, link=links[Axis.TP]),
        pp_s=tm.pp_comm_s(load, mbs=plan.mbs, tp=plan.tp, sp=plan.sp, pp=plan.pp, vpp=plan.vpp, link=links[Axis.PP]),
        dp_s=dp,
    )


def achieved_rate(model: ModelSpec, hw: Hardware, plan: Plan) -> float:
    """Matmul FLOP/s one device reaches at the plan's per-device GEMM size."""
    dim = tm.gemm_dim(mbs=plan.mbs, seq_length=model.seq_length, hidden_size=model.hidden_size, tp=plan.tp)
    return tm.achieved_flops_per_s(hw.peak_flops_per_s, dim, hw.calibration)


def time_estimate(model: ModelSpec, hw: Hardware, plan: Plan) -> tm.TimeEstimate:
    """Step time: the slowest stage paces the pipeline; the slowest data-parallel group ends the step."""
    rate = achieved_rate(model, hw, plan)
    links = {axis: hw.link(plan, axis) for axis in Axis}
    loads = stage_loads(model, plan.pp)
    stages = [_stage_time(model, hw, plan, load, rate, links) for load in loads]
    slowest = max(stages, key=lambda s: s.microbatch_s)
    calib = hw.calibration
    overhead_s = tm.microbatch_overhead_s(model.forward_ops, calib)
    microbatch_s = slowest.microbatch_s + overhead_s
    largest = max(loads, key=lambda load: load.params)
    return tm.TimeEstimate(
        compute_s=plan.gas * slowest.compute_s,
        tp_comm_s=plan.gas * slowest.tp_s,
        pp_comm_s=plan.gas * slowest.pp_s,
        dp_comm_s=max(s.dp_s for s in stages),
        bubble_s=tm.bubble_s(microbatch_s, pp=plan.pp, vpp=plan.vpp),
        offload_s=tm.offload_s(
            largest.params,
            tp=plan.tp,
            dp=plan.dp,
            gas=plan.gas,
            offload=plan.offload,
            precision=model.precision,
            pcie_GBps=hw.pcie_GBps,
            cpu_adam_params_per_s=calib.cpu_adam_params_per_s,
            devices_per_node=hw.devices_per_node,
        ),
        overhead_s=plan.gas * overhead_s + calib.step_overhead_s,
    )


def compute_bound_s(model: ModelSpec, hw: Hardware, plan: Plan) -> float:
    """A lower bound on the step time of ``plan`` under any placement, recomputation and offload.

    Forward and backward of the slowest stage with every communication free, plus the bubble and
    the fixed overheads: each term of :func:`time_estimate` is at least this large.
    """
    rate = achieved_rate(model, hw, plan)
    fwd = max(tm.forward_s(load, mbs=plan.mbs, tp=plan.tp, flops_per_s=rate) for load in stage_loads(model, plan.pp))
    microbatch_s = fwd + tm.backward_s(fwd) + tm.microbatch_overhead_s(model.forward_ops, hw.calibration)
    return plan.gas * microbatch_s + tm.bubble_s(microbatch_s, pp=plan.pp, vpp=plan.vpp) + hw.calibration.step_overhead_s


def hardware_flops_per_sample(model: ModelSpec, recompute: Recompute) -> float:
    """Forward + backward (3x forward, Narayanan 2021) plus recomputed forward FLOPs, one sample."""
    extra = 0.0
    if recompute is Recompute.FULL:
        extra = sum(b.flops * b.count for b in model.blocks if b.role is Role.LAYER)
    elif recompute is Recompute.SELECTIVE:
        extra = sum(b.recompute_flops * b.count for b in model.blocks if b.role is Role.LAYER)
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
        global_batch_size=model.global_batch_size,
    )
    if plan.offload is not Offload.NONE and cluster.host is None:
        raise PlanError(f"plan {plan} offloads to the host, but cluster {cluster.name!r} has no host section (memory_gib, pcie_GBps)")


def estimate_with(model: ModelSpec, hw: Hardware, plan: Plan, memory: mem.MemoryEstimate | None = None) -> Estimate:
    """Estimate on pre-derived hardware (the search calls this in its inner loop, with the memory it already has)."""
    return Estimate(
        model=model,
        plan=plan,
        memory=memory if memory is not None else memory_estimate(model, hw, plan),
        time=time_estimate(model, hw, plan),
        world_size=hw.world_size,
    )


def estimate(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> Estimate:
    """Predict memory and step time of ``plan`` for ``model`` on ``cluster``; PlanError if the plan is invalid there."""
    check_plan(model, cluster, plan)
    return estimate_with(model, Hardware.of(cluster, model), plan)
