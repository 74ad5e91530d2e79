"""ClusterSpec: what the devices are, how they are grouped into nodes, and how fast their links are.

YAML form (homogeneous)::

    name: dgx-a100-80gb
    nodes: 4
    devices_per_node: 8
    device: {name: A100-SXM4-80GB, memory_gib: 80, peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5},
             memory_GBps: 2039}                         # memory_GBps optional: HBM bandwidth, data sheet
    intra_node: {bandwidth_GBps: 300, latency_us: 5}   # per device, one direction
    inter_node: {bandwidth_GBps: 25, latency_us: 10}   # per device, one direction
                                                        # (+ optional per-collective fits, see LinkSpec)
    host: {memory_gib: 1024, pcie_GBps: 25}            # optional; needed for offload
    calibration: {...}                                  # optional; fitted constants, see Calibration

A heterogeneous cluster replaces ``nodes/devices_per_node/device`` with
``groups: [{nodes: 2, devices_per_node: 8, device: {...}}, ...]`` (ranks fill the groups in order); a job whose ranks
measured differently states each rank's device in ``rank_devices: [...]``. The planner prices each data-parallel replica
and each pipeline stage on its own ranks' devices (:meth:`ClusterSpec.rank_device`) and splits the batch and the layers
by them; the view every plan starts from is the slowest, smallest device (:meth:`ClusterSpec.planning_device`).

Pure (stdlib + yaml); imported across the planning core and by its users (decide, calibrate, the CLI, the strategy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from lightning_fleet.planning.errors import SpecError
from lightning_fleet.planning.yamlspec import (
    check_keys,
    check_source,
    dump_yaml,
    from_mapping,
    read_yaml,
    require_name,
    require_non_negative,
    require_positive,
    shown,
    to_mapping,
)

GIB = 1024**3
MAX_WORLD_SIZE = 2**20
"""Most devices a cluster may have (1,048,576; the largest training runs published use tens of thousands): the planner
loops over the divisors of the device count, and planning 2**20 devices alike takes under a second here."""
MAX_MIXED_WORLD_SIZE = 2**13
"""Most devices a cluster file of different devices may describe (8,192): the planner prices each rank of such a
cluster, 3-9 s at this size here (2 CPU cores) and about ten times that at 2**16. A cluster the strategy measured rank
by rank is not held to it."""
ATTENTION_EFFICIENCY_MAX = 10.0
"""Largest ``calibration.attention_efficiency`` a cluster file may state (and `fleet calibrate` fits): a fused attention
kernel ten times faster than the GEMMs of its layer is a measurement or unit error, not a kernel."""


class LinkLevel(StrEnum):
    """Where a collective runs: inside one node, or across nodes."""

    INTRA = "intra_node"
    INTER = "inter_node"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeakTflops:
    """Peak dense matmul throughput of one device per number format, in TFLOP/s."""

    bf16: float
    """Peak with bfloat16 inputs."""
    fp16: float
    """Peak with float16 inputs."""
    fp32: float
    """Peak with float32 inputs (no TF32)."""

    def __post_init__(self) -> None:
        require_positive("device.peak_tflops.", bf16=self.bf16, fp16=self.fp16, fp32=self.fp32)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU worker process)."""

    name: str
    """Marketing name, for reports only."""
    memory_gib: float
    """Memory one device has, in GiB."""
    peak_tflops: PeakTflops
    """Peak matmul throughput per number format."""
    memory_GBps: float | None = None
    """Bandwidth of the device's own memory (HBM), in GB/s, as its data sheet states it: the rate at which the
    memory-bound operators (norms, activations, softmax, adds) run when the calibration does not state
    ``elementwise_s`` (:func:`lightning_fleet.planning.time.memory_bound_element_s`). None: not known; their time is
    then folded into ``calibration.matmul_efficiency``."""
    slowdown: float = 1.0
    """How many times the calibration's device this device takes for the work the calibration prices per element and
    per parameter (``elementwise_s``, ``adam_params_per_s``): 1 for a device from a data sheet (its own peak and
    bandwidth say how fast it is); a rank of a job measured at half the speed of its fastest rank: 2
    (:func:`devices_by_speed`)."""
    host_slowdown: float = 1.0
    """How many times the calibration's host this device's host takes to dispatch operators and run the framework's
    work per micro-batch and per step (``op_overhead_s`` and the other ``*_overhead_s``, ``cpu_adam_params_per_s``): 1
    unless measured otherwise; a CPU worker whose core is throttled to half: 2 (:func:`devices_by_speed`)."""

    def __post_init__(self) -> None:
        require_positive("device.", memory_gib=self.memory_gib)
        if self.memory_GBps is not None:
            require_positive("device.", memory_GBps=self.memory_GBps)
        for name in ("slowdown", "host_slowdown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
                raise SpecError(
                    f"device.{name} must be a number >= 1 (how many times the calibrated device's time it takes), got {value!r}"
                )

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        return self.memory_gib * GIB


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One link level in the alpha-beta model: latency alpha and bandwidth 1/beta, per device, one direction.

    ``bandwidth_GBps`` / ``latency_us`` price every collective by the ring model (planning/comm.py). A collective whose
    implementation runs slower or faster than its ring share (gloo's reduce-scatter takes ~1.7x an all-reduce of the same
    tensor, not 0.5x) states its own fit: the bandwidth and latency that make *its* ring formula match its measured time;
    left out (None), it is priced from the link's, exactly as the ring model says.
    """

    bandwidth_GBps: float
    """Bandwidth one device gets in one direction, in GB/s (1e9 bytes per second); what all-reduces are priced at."""
    latency_us: float
    """Start-up latency of one message, in microseconds; what all-reduces are priced at."""
    allgather_GBps: float | None = None
    """The bandwidth under which the ring all-gather formula gives the all-gather's measured time, in GB/s; None: the
    link's ``bandwidth_GBps``."""
    allgather_latency_us: float | None = None
    """The latency the all-gather fit goes with, in microseconds; None: the link's ``latency_us``."""
    reduce_scatter_GBps: float | None = None
    """The bandwidth under which the ring reduce-scatter formula gives the reduce-scatter's measured time, in GB/s; None:
    the link's ``bandwidth_GBps``."""
    reduce_scatter_latency_us: float | None = None
    """The latency the reduce-scatter fit goes with, in microseconds; None: the link's ``latency_us``."""

    def __post_init__(self) -> None:
        require_positive("link.", bandwidth_GBps=self.bandwidth_GBps)
        require_non_negative("link.", latency_us=self.latency_us)
        for name in ("allgather_GBps", "reduce_scatter_GBps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise SpecError(f"link.{name} must be > 0 GB/s or left out (the ring model from bandwidth_GBps), got {value!r}")
        for name in ("allgather_latency_us", "reduce_scatter_latency_us"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SpecError(f"link.{name} must be >= 0 us or left out (the link's latency_us), got {value!r}")

    @property
    def alpha_s(self) -> float:
        """Latency of one message, in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.bandwidth_GBps * 1e9)

    @property
    def allgather_alpha_s(self) -> float:
        """Latency of one all-gather step, in seconds (the link's when no all-gather fit is stated)."""
        return _or(self.allgather_latency_us, self.latency_us) * 1e-6

    @property
    def allgather_beta_s_per_byte(self) -> float:
        """Seconds per byte of an all-gather (the link's when no all-gather fit is stated)."""
        return 1.0 / (_or(self.allgather_GBps, self.bandwidth_GBps) * 1e9)

    @property
    def reduce_scatter_alpha_s(self) -> float:
        """Latency of one reduce-scatter step, in seconds (the link's when no reduce-scatter fit is stated)."""
        return _or(self.reduce_scatter_latency_us, self.latency_us) * 1e-6

    @property
    def reduce_scatter_beta_s_per_byte(self) -> float:
        """Seconds per byte of a reduce-scatter (the link's when no reduce-scatter fit is stated)."""
        return 1.0 / (_or(self.reduce_scatter_GBps, self.bandwidth_GBps) * 1e9)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the YAML layout; fits left out (None) are not written."""
        return {key: value for key, value in to_mapping(self).items() if value is not None}

    def fastest_with(self, other: "LinkSpec") -> "LinkSpec":
        """A link at least as fast as both for every collective: the larger bandwidth and smaller latency of each
        (a per-collective fit stays stated where either link states one)."""

        def fit(name: str, base: str, pick: Any) -> float | None:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                return None
            return pick(_or(mine, getattr(self, base)), _or(theirs, getattr(other, base)))

        return LinkSpec(
            bandwidth_GBps=max(self.bandwidth_GBps, other.bandwidth_GBps),
            latency_us=min(self.latency_us, other.latency_us),
            allgather_GBps=fit("allgather_GBps", "bandwidth_GBps", max),
            allgather_latency_us=fit("allgather_latency_us", "latency_us", min),
            reduce_scatter_GBps=fit("reduce_scatter_GBps", "bandwidth_GBps", max),
            reduce_scatter_latency_us=fit("reduce_scatter_latency_us", "latency_us", min),
        )


def slowest_device(devices: list[DeviceSpec]) -> DeviceSpec:
    """One device no better than any of ``devices``: the least memory, the lowest peak per number format and memory
    bandwidth (none where one states none); the device itself when they are all alike."""
    if len(set(devices)) == 1:
        return devices[0]
    peak = PeakTflops(
        bf16=min(d.peak_tflops.bf16 for d in devices),
        fp16=min(d.peak_tflops.fp16 for d in devices),
        fp32=min(d.peak_tflops.fp32 for d in devices),
    )
    names = "/".join(dict.fromkeys(d.name for d in devices))
    bandwidths = [d.memory_GBps for d in devices]
    return DeviceSpec(
        name=f"slowest of {names}", memory_gib=min(d.memory_gib for d in devices), peak_tflops=peak,
        memory_GBps=None if None in bandwidths else min(b for b in bandwidths if b is not None),
        slowdown=max(d.slowdown for d in devices), host_slowdown=max(d.host_slowdown for d in devices),
    )


def devices_by_speed(
    fastest: DeviceSpec, speeds: list[float], host_speeds: list[float] | None = None, memory_gib: list[float] | None = None
) -> tuple[DeviceSpec, ...]:
    """One device per rank from what each rank measured, named by rank: ``fastest`` (the fastest rank's device, at the
    calibration's speed) with its peaks and memory bandwidth scaled by the rank's compute speed over the fastest's
    (``slowdown`` their inverse), its ``host_slowdown`` the fastest host's speed over the rank's (``host_speeds``; None:
    every host alike), and the rank's own memory where ``memory_gib`` gives one."""
    top, name = max(speeds), fastest.name.split(" rank ")[0]
    hosts = host_speeds or [1.0] * len(speeds)
    top_host = max(hosts)
    if len(hosts) != len(speeds) or (memory_gib is not None and len(memory_gib) != len(speeds)) or min(speeds + hosts) <= 0:
        raise SpecError(f"each rank needs one positive speed, host speed and memory; got {speeds}, {host_speeds}, {memory_gib}")

    def scaled(value: float, speed: float) -> float:
        return value * speed / top

    return tuple(
        dataclasses.replace(
            fastest, name=f"{name} rank {r}",
            peak_tflops=PeakTflops(bf16=scaled(fastest.peak_tflops.bf16, speed), fp16=scaled(fastest.peak_tflops.fp16, speed),
                                   fp32=scaled(fastest.peak_tflops.fp32, speed)),
            memory_GBps=None if fastest.memory_GBps is None else scaled(fastest.memory_GBps, speed),
            memory_gib=fastest.memory_gib if memory_gib is None else memory_gib[r],
            slowdown=fastest.slowdown * top / speed, host_slowdown=fastest.host_slowdown * top_host / host,
        )
        for r, (speed, host) in enumerate(zip(speeds, hosts))
    )


def _without_defaults(group: dict[str, Any]) -> dict[str, Any]:
    """A group's mapping without the device keys that hold their default (``memory_GBps`` not known, no slowdown):
    what it reads back as, and what a cluster file states."""
    device = group["device"]
    for key, default in (("memory_GBps", None), ("slowdown", 1.0), ("host_slowdown", 1.0)):
        if device.get(key, default) == default:
            device.pop(key, None)
    return group


def _or(value: float | None, default: float) -> float:
    """``value``, or ``default`` when it is None."""
    return default if value is None else value


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSpec:
    """The CPU side of one node; needed to plan optimizer or parameter offload."""

    memory_gib: float
    """Host memory of one node, in GiB."""
    pcie_GBps: float
    """Host<->device bandwidth one device gets, one direction, in GB/s."""

    def __post_init__(self) -> None:
        require_positive("host.", memory_gib=self.memory_gib, pcie_GBps=self.pcie_GBps)


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeOverheads:
    """One runtime's own framework time per shard level, as `fleet calibrate` measured it by training its probe through
    that runtime: an input to the cost model like the runtime's overlaps (:meth:`Calibration.for_runtime`)."""

    runtime: str
    """The runtime's name in the runtime table (``torch``, ``deepspeed``)."""
    zero_stages: tuple[int, ...]
    """The shard levels measured (those the runtime runs)."""
    step_overhead_s: tuple[float, ...]
    """Extra seconds per optimizer step at each of ``zero_stages`` (beyond ``Calibration.step_overhead_s``)."""
    tensor_overhead_s: tuple[float, ...]
    """Extra seconds per micro-batch and parameter tensor at each of ``zero_stages``."""

    def __post_init__(self) -> None:
        count = len(self.zero_stages)
        if not count or len(set(self.zero_stages)) != count or any(z not in range(4) for z in self.zero_stages):
            raise SpecError(f"calibration.runtimes: {self.runtime}'s zero_stages must be distinct shard levels 0-3, got {list(self.zero_stages)}")
        for name in ("step_overhead_s", "tensor_overhead_s"):
            values = getattr(self, name)
            if len(values) != count or any(not v >= 0 for v in values):
                raise SpecError(f"calibration.runtimes: {self.runtime}'s {name} must be {count} non-negative seconds "
                                f"(one per zero_stages entry), got {list(values)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """The cost model's free constants. Defaults are stated assumptions; `fleet calibrate` fits them.

    Achieved matmul throughput is ``peak * matmul_efficiency * d / (d + matmul_half_dim)`` where
    ``d`` is the edge of the cube with the volume of one device's layer GEMM, ``(tokens * h * h/tp) ** (1/3)``:
    small per-device matrices run far from peak, large ones approach ``matmul_efficiency``.
    """

    matmul_efficiency: float = 0.6
    """Fraction of peak that large matmuls reach (Megatron-LM reaches 0.44-0.52 end to end on A100)."""
    matmul_half_dim: float = 96.0
    """Per-device GEMM dimension at which half of ``matmul_efficiency`` is reached."""
    overlap: float = 0.8
    """Fraction of data-parallel / ZeRO communication hidden behind compute when there is compute to hide behind."""
    step_overhead_s: float = 0.0
    """Fixed framework time per optimizer step (optimizer launch, logging), in seconds."""
    microbatch_overhead_s: float = 0.0
    """Fixed framework time per micro-batch (engine bookkeeping), in seconds."""
    op_overhead_s: float = 0.0
    """Host time to dispatch one operator (Python + dispatcher + launch), in seconds; paid per operator of a micro-batch."""
    elementwise_s: float | None = None
    """Device time per output element of an operator that does no matmul (norms, activations, softmax, adds: memory-bound),
    in seconds; backward costs twice the forward. None (the default): one read and one write of the element at the
    device's ``memory_GBps`` (:func:`lightning_fleet.planning.time.memory_bound_element_s`), or folded into
    ``matmul_efficiency`` (0) where the device states no bandwidth. `fleet calibrate` measures it."""
    attention_efficiency: float = 0.83
    """A fused attention kernel's rate (FlashAttention / SDPA, forward and backward) as a fraction of the large GEMMs'
    achieved rate, at most ATTENTION_EFFICIENCY_MAX. 0.83: FlashAttention-2 on an A100, causal, head dimension 128,
    sequence 2k, forward + backward, runs 155 TFLOP/s (flash-attention README, assets/flash2_a100_fwd_bwd_benchmark.png,
    panel d), 0.50 of the 312 peak, against the default ``matmul_efficiency`` 0.6 (0.50 / 0.6 = 0.83). `fleet calibrate`
    measures it: causal scaled_dot_product_attention timed against the layer GEMMs' fitted rate, net of the kernel's
    softmax elements the cost model prices at ``elementwise_s`` (so above 1 where those are priced high)."""
    zero_step_overhead_s: tuple[float, ...] = ()
    """Extra framework time per optimizer step at ZeRO stage 0, 1, 2, 3 (four values, or empty for none), in seconds."""
    zero_tensor_overhead_s: tuple[float, ...] = ()
    """Extra framework time per micro-batch and per parameter tensor at ZeRO stage 0, 1, 2, 3 (DeepSpeed's
    per-parameter hooks: gradient reduction, ZeRO-3's gather and release), four values or empty, in seconds."""
    offload_tensor_overhead_s: tuple[float, ...] = ()
    """Extra framework time per micro-batch and per parameter tensor of optimizer offload and of optimizer +
    parameter offload (DeepSpeed's per-parameter host copies and bookkeeping), two values or empty, in seconds."""
    adam_params_per_s: float = 5.0e10
    """Parameters per second the device's own Adam step updates (memory-bound: ~32 bytes moved per parameter;
    5e10/s is an A100's ~1.6 TB/s). The step of an offloaded optimizer runs on the host instead."""
    cpu_adam_params_per_s: float = 2.0e9
    """Parameters per second one host updates with DeepSpeed's CPU Adam (offload), shared by its devices."""
    memory_reserve_fraction: float = 0.05
    """Fraction of device memory kept free for allocator fragmentation."""
    memory_reserve_gib: float = 1.0
    """Fixed device memory taken by the runtime (CUDA context, communicator buffers), in GiB."""
    runtimes: tuple[RuntimeOverheads, ...] = ()
    """Each measured runtime's own per-shard-level framework time, which replaces ``zero_step_overhead_s`` and
    ``zero_tensor_overhead_s`` at those levels when that runtime's plans are priced (:meth:`for_runtime`)."""

    def for_runtime(self, name: str) -> "Calibration":
        """The constants as the runtime called ``name`` runs them: its measured per-shard-level overheads in place of the
        default ones (itself when it has none)."""
        entry = next((r for r in self.runtimes if r.runtime == name), None)
        if entry is None:
            return self
        step, tensor = list(self.zero_step_overhead_s or (0.0,) * 4), list(self.zero_tensor_overhead_s or (0.0,) * 4)
        for zero, step_s, tensor_s in zip(entry.zero_stages, entry.step_overhead_s, entry.tensor_overhead_s):
            step[zero], tensor[zero] = step_s, tensor_s
        return dataclasses.replace(self, zero_step_overhead_s=tuple(step), zero_tensor_overhead_s=tuple(tensor))

    def step_overhead(self, zero: int) -> float:
        """Framework seconds per optimizer step at this ZeRO stage."""
        return self.step_overhead_s + (self.zero_step_overhead_s[zero] if self.zero_step_overhead_s else 0.0)

    def microbatch_overhead(self, zero: int, param_tensors: float, offload_level: int = 0) -> float:
        """Framework seconds per micro-batch at this ZeRO stage and offload level (0 none, 1 optimizer, 2 optimizer +
        parameters) for a device holding ``param_tensors`` parameter tensors, beyond its operators' dispatch."""
        per_tensor = self.zero_tensor_overhead_s[zero] if self.zero_tensor_overhead_s else 0.0
        if offload_level and self.offload_tensor_overhead_s:
            per_tensor += self.offload_tensor_overhead_s[offload_level - 1]
        return self.microbatch_overhead_s + per_tensor * param_tensors

    def on(self, device: DeviceSpec) -> "Calibration":
        """The constants as ``device`` runs them: its per-element and Adam work ``device.slowdown`` times the
        calibrated time, its host's framework work and CPU Adam ``device.host_slowdown`` times (itself when both are 1)."""
        work, host = device.slowdown, device.host_slowdown
        if work == 1 and host == 1:
            return self
        return dataclasses.replace(
            self,
            step_overhead_s=self.step_overhead_s * host,
            microbatch_overhead_s=self.microbatch_overhead_s * host,
            op_overhead_s=self.op_overhead_s * host,
            zero_step_overhead_s=tuple(v * host for v in self.zero_step_overhead_s),
            zero_tensor_overhead_s=tuple(v * host for v in self.zero_tensor_overhead_s),
            offload_tensor_overhead_s=tuple(v * host for v in self.offload_tensor_overhead_s),
            runtimes=tuple(dataclasses.replace(r, step_overhead_s=tuple(v * host for v in r.step_overhead_s),
                                               tensor_overhead_s=tuple(v * host for v in r.tensor_overhead_s)) for r in self.runtimes),
            cpu_adam_params_per_s=self.cpu_adam_params_per_s / host,
            elementwise_s=None if self.elementwise_s is None else self.elementwise_s * work,
            adam_params_per_s=self.adam_params_per_s / work,
        )

    def __post_init__(self) -> None:
        require_positive(
            "calibration.",
            matmul_efficiency=self.matmul_efficiency,
            attention_efficiency=self.attention_efficiency,
            cpu_adam_params_per_s=self.cpu_adam_params_per_s,
            adam_params_per_s=self.adam_params_per_s,
        )
        for name, count, what in (("zero_step_overhead_s", 4, "ZeRO stages 0-3"), ("zero_tensor_overhead_s", 4, "ZeRO stages 0-3"),
                                  ("offload_tensor_overhead_s", 2, "optimizer, optimizer+params")):
            values = getattr(self, name)
            if len(values) not in (0, count) or any(v < 0 for v in values):
                raise SpecError(f"calibration.{name} must be {count} non-negative seconds ({what}) or left out, got {list(values)}")
        require_non_negative(
            "calibration.",
            matmul_half_dim=self.matmul_half_dim,
            overlap=self.overlap,
            step_overhead_s=self.step_overhead_s,
            microbatch_overhead_s=self.microbatch_overhead_s,
            op_overhead_s=self.op_overhead_s,
            elementwise_s=0.0 if self.elementwise_s is None else self.elementwise_s,
            memory_reserve_fraction=self.memory_reserve_fraction,
            memory_reserve_gib=self.memory_reserve_gib,
        )
        for name in ("matmul_efficiency", "overlap", "memory_reserve_fraction"):
            if getattr(self, name) > 1:
                raise SpecError(f"calibration.{name} is a fraction and must be <= 1, got {getattr(self, name)}")
        names = [r.runtime for r in self.runtimes]
        if len(set(names)) != len(names):
            raise SpecError(f"calibration.runtimes names a runtime twice: {names}; keep one entry per runtime")
        if self.attention_efficiency > ATTENTION_EFFICIENCY_MAX:
            raise SpecError(
                f"calibration.attention_efficiency is a fused attention kernel's rate over the GEMMs' and must be <= "
                f"{ATTENTION_EFFICIENCY_MAX:g}, got {self.attention_efficiency}: measure it with fleet calibrate or leave it out"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGroup:
    """Nodes that share one device type and node size."""

    nodes: int
    """Number of nodes in the group."""
    devices_per_node: int
    """Devices (worker processes) on each node."""
    device: DeviceSpec
    """The device every node of the group has."""

    def __post_init__(self) -> None:
        for value in (self.nodes, self.devices_per_node):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(
                    f"a device group needs at least one node and one device per node, got nodes={self.nodes!r}, "
                    f"devices_per_node={self.devices_per_node!r}: give both, or leave the group out"
                )


_HOMOGENEOUS_KEYS = ("nodes", "devices_per_node", "device")
_COMMON_KEYS = ("name", "intra_node", "inter_node", "host", "calibration", "rank_devices")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """A cluster: groups of identical nodes, two link levels, optional host side and calibration."""

    name: str
    """Name of the cluster, for reports."""
    groups: tuple[DeviceGroup, ...]
    """Device groups; one group for a homogeneous cluster."""
    intra_node: LinkSpec
    """Links between devices of one node."""
    inter_node: LinkSpec
    """Links between nodes, per device."""
    host: HostSpec | None = None
    """Host memory and PCIe bandwidth; None forbids offload."""
    calibration: Calibration = Calibration()
    """Fitted constants of the cost model."""
    rank_devices: tuple[DeviceSpec, ...] = ()
    """The device each rank measured, rank 0 first, where the ranks differ (the strategy's own measurement of a job
    whose ranks run at different speeds); empty: every rank has its group's device."""

    def __post_init__(self) -> None:
        require_name("cluster.", self.name)
        if not self.groups:
            raise SpecError("cluster needs at least one device group")
        if self.rank_devices and len(self.rank_devices) != self.world_size:
            raise SpecError(
                f"cluster rank_devices lists {len(self.rank_devices)} devices for {self.world_size} ranks: give one per rank"
            )
        self._check_world_size()
        c = self.calibration
        if c.cpu_adam_params_per_s > self.devices_per_node * c.adam_params_per_s:
            # the planner prunes on "offload never makes a step faster"; a host that out-steps its devices breaks that
            raise SpecError(
                f"calibration.cpu_adam_params_per_s ({c.cpu_adam_params_per_s:g}) is more than devices_per_node "
                f"({self.devices_per_node}) x adam_params_per_s ({c.adam_params_per_s:g}): offloading would make the "
                "optimizer step faster than on the devices; raise adam_params_per_s or lower cpu_adam_params_per_s"
            )

    def _check_world_size(self, mixed_bound: int = MAX_WORLD_SIZE) -> None:
        """SpecError when the cluster has more devices than the planner prices in bounded time (``mixed_bound``: the
        bound when its devices differ)."""
        bound, kind = (MAX_WORLD_SIZE, "") if self.is_homogeneous else (mixed_bound, " of different devices")
        if self.world_size > bound:
            raise SpecError(
                f"cluster {shown(self.name)} has {self.world_size:,} devices; a cluster{kind} may have at most {bound:,} "
                "(the planner's bound): give fewer nodes"
            )

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return sum(g.nodes * g.devices_per_node for g in self.groups)

    @property
    def num_nodes(self) -> int:
        """Total number of nodes."""
        return sum(g.nodes for g in self.groups)

    @property
    def devices_per_node(self) -> int:
        """Devices per node used for placement (the smallest node, when nodes differ)."""
        return min(g.devices_per_node for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        """True when every device and node is alike."""
        return len({(g.devices_per_node, g.device) for g in self.groups}) == 1 and len(set(self.rank_devices)) <= 1

    def planning_device(self) -> DeviceSpec:
        """The device plans are made for: the least memory, the lowest peak and memory bandwidth of any group (no
        bandwidth where a group states none)."""
        return slowest_device(list(self.rank_devices) or [g.device for g in self.groups])

    def rank_device(self, rank: int) -> DeviceSpec:
        """The device of global rank ``rank``: ranks fill the groups in order, node by node (as a launcher numbers them)."""
        if not 0 <= rank < self.world_size:
            raise SpecError(f"cluster {self.name}: rank {rank} is not one of its ranks 0..{self.world_size - 1}")
        if self.rank_devices:
            return self.rank_devices[rank]
        for group in self.groups:
            size = group.nodes * group.devices_per_node
            if rank < size:
                return group.device
            rank -= size
        raise AssertionError("unreachable: rank checked against world_size")

    def with_device(self, device: DeviceSpec) -> "ClusterSpec":
        """The same nodes and links with ``device`` in every node (the view a plan takes of one replica's devices)."""
        return dataclasses.replace(self, groups=tuple(dataclasses.replace(g, device=device) for g in self.groups), rank_devices=())

    def without_devices(self, devices: set[DeviceSpec]) -> "ClusterSpec":
        """The cluster without the ranks whose device (:meth:`rank_device`) is one of ``devices``: each node keeps its
        other ranks, in order; nodes left alike form one group. SpecError when no rank is left."""
        nodes: list[list[DeviceSpec]] = []
        rank = 0
        for group in self.groups:
            for _ in range(group.nodes):
                nodes.append([self.rank_device(rank + i) for i in range(group.devices_per_node)])
                rank += group.devices_per_node
        kept = [[d for d in node if d not in devices] for node in nodes]
        kept = [node for node in kept if node]
        if not kept:
            raise SpecError(f"cluster {self.name}: leaving out {', '.join(sorted(d.name for d in devices))} leaves no rank")
        groups: list[DeviceGroup] = []
        for node in kept:
            group = DeviceGroup(nodes=1, devices_per_node=len(node), device=slowest_device(node))
            last = groups[-1] if groups else None
            if last is not None and (last.devices_per_node, last.device) == (group.devices_per_node, group.device):
                groups[-1] = dataclasses.replace(last, nodes=last.nodes + 1)
            else:
                groups.append(group)
        ranks = tuple(d for node in kept for d in node)
        alike_in_nodes = all(len(set(node)) == 1 for node in kept)
        # a host's CPU Adam is shared by its devices: with fewer of them it is no faster than they are (the pruning's rule)
        c, fewest = self.calibration, min(g.devices_per_node for g in groups)
        return dataclasses.replace(
            self, name=f"{self.name} without {'/'.join(sorted(d.name for d in devices))}", groups=tuple(groups),
            rank_devices=() if (alike_in_nodes and not self.rank_devices) or len(set(ranks)) == 1 else ranks,
            calibration=dataclasses.replace(c, cpu_adam_params_per_s=min(c.cpu_adam_params_per_s, fewest * c.adam_params_per_s)),
        )

    def link(self, level: LinkLevel) -> LinkSpec:
        """The link spec of one level."""
        return self.intra_node if level is LinkLevel.INTRA else self.inter_node

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the YAML layout (homogeneous form when there is one group)."""
        out: dict[str, Any] = {"name": self.name}
        groups = [_without_defaults(to_mapping(g)) for g in self.groups]
        if len(groups) == 1:
            out.update(groups[0])
        else:
            out["groups"] = groups
        out["intra_node"] = self.intra_node.to_dict()
        out["inter_node"] = self.inter_node.to_dict()
        if self.host is not None:
            out["host"] = to_mapping(self.host)
        if self.calibration != Calibration():
            out["calibration"] = {k: v for k, v in to_mapping(self.calibration).items() if v is not None}
        if self.rank_devices:
            out["rank_devices"] = [_without_defaults({"device": to_mapping(d)})["device"] for d in self.rank_devices]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`load_cluster` reads back to an equal spec."""
        return dump_yaml(self.to_dict())

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        """The same homogeneous cluster with another node count."""
        if len(self.groups) != 1 or self.rank_devices:
            what = f"{len(self.groups)} device groups" if len(self.groups) != 1 else "a device measured per rank"
            raise SpecError(f"cluster {self.name!r} has {what}; only a homogeneous cluster can be resized by node count")
        return dataclasses.replace(self, groups=(dataclasses.replace(self.groups[0], nodes=nodes),))

    def for_runtime(self, name: str) -> "ClusterSpec":
        """The cluster as the runtime called ``name`` runs on it (:meth:`Calibration.for_runtime`)."""
        calibration = self.calibration.for_runtime(name)
        return self if calibration is self.calibration else self.with_calibration(calibration)

    def with_calibration(self, calibration: Calibration) -> "ClusterSpec":
        """A copy with other cost-model constants."""
        return dataclasses.replace(self, calibration=calibration)


def cluster_from_dict(data: Mapping[str, Any], where: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from the YAML mapping; errors name the key."""
    if "groups" in data:
        check_keys(data, ("groups",) + _COMMON_KEYS, ("name", "groups", "intra_node", "inter_node"), where)
        if not isinstance(data["groups"], list) or not data["groups"]:
            raise SpecError(f"{where}.groups must be a non-empty list of device groups")
        groups = tuple(_group(g, f"{where}.groups[{i}]") for i, g in enumerate(data["groups"]))
        rest = {k: v for k, v in data.items() if k != "groups"}
    else:
        check_keys(data, _HOMOGENEOUS_KEYS + _COMMON_KEYS, ("name",) + _HOMOGENEOUS_KEYS + ("intra_node", "inter_node"), where)
        groups = (from_mapping(DeviceGroup, {k: data[k] for k in _HOMOGENEOUS_KEYS}, where),)
        rest = {k: v for k, v in data.items() if k not in _HOMOGENEOUS_KEYS}
    spec = from_mapping(_ClusterRest, rest, where)
    cluster = ClusterSpec(groups=groups, **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    cluster._check_world_size(MAX_MIXED_WORLD_SIZE)
    return cluster


def _group(data: Any, where: str) -> DeviceGroup:
    """One entry of ``groups:``; a SpecError names the entry."""
    try:
        return from_mapping(DeviceGroup, data, where)
    except SpecError as err:
        raise SpecError(str(err) if where in str(err) else f"{where}: {err}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class _ClusterRest:
    """The keys a cluster file has besides its device groups (parsing helper)."""

    name: str
    intra_node: LinkSpec
    inter_node: LinkSpec
    host: HostSpec | None = None
    calibration: Calibration = Calibration()
    rank_devices: tuple[DeviceSpec, ...] = ()


def cluster_presets() -> list[str]:
    """Names of the shipped cluster presets."""
    return sorted(p.name.removesuffix(".yaml") for p in _preset_dir("clusters").iterdir() if p.name.endswith(".yaml"))


def load_cluster(source: str | Path) -> ClusterSpec:
    """Load a cluster from a YAML file path or a preset name (see :func:`cluster_presets`)."""
    path = _resolve(source, "clusters", cluster_presets)
    return cluster_from_dict(read_yaml(path, "cluster"), where=f"cluster file {Path(path).name!r}")


def _preset_dir(kind: str) -> Any:
    return resources.files("lightning_fleet.planning") / "presets" / kind


def _resolve(source: str | Path, kind: str, names: Any) -> Any:
    """A path as given, or the preset of that name; error lists the presets."""
    text = str(source)
    singular = kind.removesuffix("s")
    check_source(text, f"{singular} file or preset")
    if Path(text).is_file():
        return Path(text)
    preset = _preset_dir(kind) / f"{text}.yaml"
    if preset.is_file():
        return preset
    if Path(text).exists():  # a directory, a FIFO, a device: never opened (a FIFO would block, /dev/zero fill memory)
        raise SpecError(f"{shown(text, 200)} is not a regular file and no {singular} preset has that name: give a YAML file")
    raise SpecError(f"no {singular} file or preset named {shown(text, 200)}; presets: {', '.join(names())}")
