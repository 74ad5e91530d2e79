"""Measure the machine a job runs on and describe it as a ClusterSpec: below the strategy.

World size and node layout come from the launcher; device memory from CUDA (or, on CPU, the
host's available RAM split across its local ranks); matmul throughput and collective latency and
bandwidth from short microbenchmarks on the live process group, fitted here (saturating GEMM curve;
ring alpha-beta of the all-reduce, and of the all-gather and the reduce-scatter each on its own: :func:`fit_link`);
a fused attention kernel's rate against the GEMMs' from causal scaled_dot_product_attention calls
(:func:`fit_attention_efficiency`); each rank's speed in probe rounds (:func:`measure_ranks`, judged by
:mod:`~lightning_fleet.calibrate.ranks`). The result is cached per host, device kind and world shape, so a restart does
not measure again -- all but the per-rank devices, which each job probes again at its start.

Imports torch and the planning core, never Lightning, DeepSpeed or the strategy. Imported by the
strategy (to measure a cluster it was not given), by :mod:`lightning_fleet.calibrate.probe` and
:mod:`lightning_fleet.calibrate.command`, and by the benchmarks.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from lightning_fleet.calibrate.ranks import (  # noqa: F401  (the spreads: re-exported, the measure's vocabulary)
    RANK_MEMORY_SPREAD,
    RANK_PROBE_ROUNDS,
    RANK_SPEED_SPREAD,
    RankMeasures,
    device_identity,
)
from lightning_fleet.planning import (
    Calibration,
    ClusterSpec,
    DeviceGroup,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    PeakTflops,
    cluster_from_dict,
)
from lightning_fleet.planning.cluster import ATTENTION_EFFICIENCY_MAX, GIB, devices_by_speed
from lightning_fleet.planning.model import AttentionKernel, attention_kernel_flops
from lightning_fleet.planning.time import FUSED_ATTENTION_BACKWARD, achieved_flops_per_s, gemm_dim
from lightning_fleet.planning.yamlspec import read_yaml

MATMUL_SHAPES = ((32, 32), (128, 32), (64, 64), (256, 64), (128, 128), (512, 128), (256, 256), (1024, 256), (512, 512))
"""(tokens, width) of the layer GEMMs [tokens x width] @ [width x width] whose rates fit the saturating efficiency curve
against the edge of their volume's cube (the size the cost model prices a layer's GEMMs at)."""
MATMUL_LARGEST_WIDTH = 8192
"""Beyond MATMUL_SHAPES, square GEMMs of doubling width are measured while the rate still rises, up to this width."""
MATMUL_STILL_RISING = 1.05
"""A larger GEMM counts as still rising when it runs at least this factor faster than every smaller one."""
MATMUL_LONGEST_S = 1.0
"""No GEMM is measured whose one call would take longer than this at the rate of the last one (each is run >= 7 times)."""
COLLECTIVE_BYTES = (4096, 65536, 1024 * 1024, 8 * 1024 * 1024)
"""Message sizes (the whole tensor) of the all-reduces, all-gathers and reduce-scatters whose times fit each collective's
ring-model latency and bandwidth."""
RING_ROUNDS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
"""Each collective timed, and the passes over the ring its formula makes (Thakur et al. 2005: an all-reduce is a
reduce-scatter then an all-gather, 2(n-1) a + 2(n-1)/n B b; each of those alone is (n-1) a + (n-1)/n B b)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldShape:
    """How many processes there are and how they sit on nodes."""

    world_size: int
    """All processes."""
    num_nodes: int
    """Nodes."""
    local_world_size: int
    """Processes per node."""


def least_squares_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the ordinary least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def fit_saturation(points: list[tuple[float, float]], max_peak: float | None = None) -> tuple[float, float]:
    """Fit r(d) = peak * d / (d + half) to measured (d, rate) points; returns (peak, half).

    Least squares in relative error, sum(((r(d) - rate) / rate) ** 2), as the cost model's errors
    are relative: for a given ``half`` the best ``peak`` is closed-form (clipped to ``max_peak``: the
    objective is a parabola in ``peak``, so the clipped value is the best allowed one), and ``half``
    is searched on a log grid over 0 and 1 ... 1e5, then refined by golden section around the best
    grid point. A rate that does not grow with size fits best at half = 0 (flat).
    """

    def best_peak(half: float) -> tuple[float, float]:
        g = [d / (d + half) / r for d, r in points]  # model shape over the measured rate
        peak = sum(g) / sum(x * x for x in g)
        if max_peak is not None:
            peak = min(peak, max_peak)
        return sum((peak * x - 1) ** 2 for x in g), peak

    grid = [0.0] + [10 ** (k / 40) for k in range(201)]
    i = min(range(len(grid)), key=lambda k: best_peak(grid[k])[0])
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (5**0.5 - 1) / 2
    for _ in range(100):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if best_peak(a)[0] <= best_peak(b)[0]:
            hi = b
        else:
            lo = a
    half = (lo + hi) / 2
    if best_peak(0.0)[0] <= best_peak(half)[0]:
        half = 0.0
    return best_peak(half)[1], half


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulFit:
    """The saturating curve of one precision's GEMM rates, and how far it was allowed to go beyond the measurements."""

    precision: str
    """fp32 or bf16."""
    points: tuple[tuple[float, float], ...]
    """(cube edge d, FLOP/s) of each measured GEMM shape."""
    peak_flops: float
    """The curve's peak as written: never above the fastest GEMM measured (:func:`fit_matmul`)."""
    half_dim: float
    """The size at which the curve reaches half its peak."""
    unbounded_peak_flops: float
    """The peak of the fit without that bound (larger when the rates were still rising at the largest size)."""

    @property
    def best_flops(self) -> float:
        """The fastest GEMM measured."""
        return max(rate for _, rate in self.points)

    @property
    def bounded(self) -> bool:
        """The bound changed the fit: the unbounded curve claimed a peak no GEMM reached (beyond rounding)."""
        return self.unbounded_peak_flops > self.peak_flops * (1 + 1e-9)

    @property
    def still_rising(self) -> bool:
        """The largest GEMM measured was still clearly the fastest (MATMUL_STILL_RISING): larger layers may run faster."""
        *smaller, (_, last) = self.points
        return last >= MATMUL_STILL_RISING * max(rate for _, rate in smaller)


def fit_matmul(precision: str, points: list[tuple[float, float]]) -> MatmulFit:
    """Fit the saturating curve with its peak at most the fastest rate measured.

    Unbounded, a curve that is still rising at the largest size measured states a peak far beyond
    every measurement: bf16 on this 2-vCPU VM (AMX; 4 GFLOP/s at d = 32, 1.7 TFLOP/s at d = 406)
    fitted half = 1e5, the end of the grid, and a peak of 17-20 TFLOP/s, 11x the fastest GEMM run.
    Bounded, the cost model never prices a GEMM faster than one that was measured.
    """
    free_peak, _ = fit_saturation(points)
    best = max(rate for _, rate in points)
    peak, half = fit_saturation(points, max_peak=best)
    return MatmulFit(precision=precision, points=tuple(points), peak_flops=peak, half_dim=half, unbounded_peak_flops=free_peak)


def fit_alpha_beta(points: list[tuple[float, float]], n: int, rounds: int = 2) -> tuple[float, float]:
    """Fit the ring formula t = rounds (n-1) a + rounds (n-1)/n * B * b to (bytes, seconds) points (``rounds`` 2: the
    all-reduce; 1: the all-gather or the reduce-scatter, RING_ROUNDS); returns (alpha_s, beta_s_per_byte)."""
    intercept, slope = least_squares_line([float(b) for b, _ in points], [t for _, t in points])
    beta = max(slope / (rounds * (n - 1) / n), 1e-12)
    alpha = max(intercept / (rounds * (n - 1)), 0.0)
    return alpha, beta


def fit_link(points: dict[str, list[tuple[float, float]]], n: int) -> LinkSpec:
    """The link whose ring formulas give each collective's measured (bytes, seconds) ``points`` on ``n`` processes: the
    all-reduce's fit as the link's bandwidth and latency, the all-gather's and the reduce-scatter's as their own
    (:class:`~lightning_fleet.planning.cluster.LinkSpec`); GB/s to 4 decimals, microseconds to 2."""
    fits = {kind: fit_alpha_beta(points[kind], n, rounds) for kind, rounds in RING_ROUNDS.items()}
    (ar_alpha, ar_beta), (ag_alpha, ag_beta), (rs_alpha, rs_beta) = (fits[kind] for kind in RING_ROUNDS)
    return LinkSpec(
        bandwidth_GBps=_GBps(ar_beta), latency_us=_us(ar_alpha),
        allgather_GBps=_GBps(ag_beta), allgather_latency_us=_us(ag_alpha),
        reduce_scatter_GBps=_GBps(rs_beta), reduce_scatter_latency_us=_us(rs_alpha),
    )


def _GBps(beta_s_per_byte: float) -> float:
    """GB/s of a fitted beta, as written to the cluster file."""
    return round(1 / beta_s_per_byte / 1e9, 4)


def _us(alpha_s: float) -> float:
    """Microseconds of a fitted alpha, as written to the cluster file."""
    return round(alpha_s * 1e6, 2)


def _synchronizer(device: torch.device):  # type: ignore[no-untyped-def]
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on a GPU, nothing on the CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def matmul_rate(tokens: int, width: int, device: torch.device, dtype: torch.dtype, dispatch_s: float = 0.0) -> float:
    """FLOP/s of a [tokens x width] @ [width x width] matmul (a layer's GEMM) on ``device``, without ``dispatch_s`` of
    host time per call (the cost model prices operator dispatch separately: ``op_overhead_s``)."""
    a = torch.randn(tokens, width, device=device, dtype=dtype)
    b = torch.randn(width, width, device=device, dtype=dtype)
    sync = _synchronizer(device)

    def run() -> None:
        a @ b
        sync()

    start = time.perf_counter()
    run()
    once = time.perf_counter() - start
    seconds = _timed(run, max(5, min(5000, int(0.05 / max(once, 1e-7)))))  # ~50 ms a shape: a stable median
    return 2 * tokens * width * width / max(seconds - dispatch_s, seconds / 10)


RANK_PROBE_S = 1.0
"""How long the ranks' speed probe takes (:func:`measure_ranks`), in RANK_PROBE_ROUNDS rounds of :func:`sustained_speed`:
each round spans a few periods of a CPU quota (cgroup ``cpu.cfs_period_us`` is 100 ms by default) or of a shared
device's time slices."""
PROBE_SLICE_S = 0.01
"""How long each slice of the probe runs one kind of work (GEMMs or one-element operators) before the other."""
HOST_PROBE_SHARE = 0.25
"""The share of the probe's slices that time the host (one-element operators, which only dispatch) rather than GEMMs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpeed:
    """What one rank's probe measured: how fast its device computes and how fast its host dispatches."""

    flops_per_s: float
    """FLOP/s of back-to-back GEMMs."""
    ops_per_s: float
    """Operators per second its host dispatches (one-element adds: no compute to speak of)."""


def sustained_speed(device: torch.device, dtype: torch.dtype = torch.float32, width: int = 256,
                    seconds: float | None = None) -> RankSpeed:
    """Slices of PROBE_SLICE_S of [width x width] GEMMs and of one-element adds, alternating (one add slice in
    1 / HOST_PROBE_SHARE) for ``seconds`` (one probe round: RANK_PROBE_S / RANK_PROBE_ROUNDS), each kind's rate its work
    over the time its slices took: the mean over the whole span, not the median of short samples that
    :func:`matmul_rate` takes, so a rank slowed by a CPU quota or a shared device shows the speed it trains at. The
    slices are equally long, so each kind sees its share of the stalls by time: with rounds of 64 adds (0.1 ms against
    a GEMM round's 5 ms) one time slice of another process landing on an add round made a rank's host 2-12x slower
    on a busy machine."""
    seconds = RANK_PROBE_S / RANK_PROBE_ROUNDS if seconds is None else seconds
    a = torch.randn(width, width, device=device, dtype=dtype)
    b = torch.randn(width, width, device=device, dtype=dtype)
    t = torch.zeros(1, device=device)
    sync = _synchronizer(device)
    every = max(2, round(1 / HOST_PROBE_SHARE))
    gemms = adds = 0
    gemm_s = add_s = 0.0
    start = time.perf_counter()
    for slice_ in range(1 << 30):
        begun = now = time.perf_counter()
        while now - begun < PROBE_SLICE_S:
            if slice_ % every:
                a @ b
                gemms += 1
            else:
                for _ in range(16):
                    t.add_(1)
                adds += 16
            sync()
            now = time.perf_counter()
        if slice_ % every:
            gemm_s += now - begun
        else:
            add_s += now - begun
        if now - start >= seconds and gemms and adds:
            break
    return RankSpeed(flops_per_s=2 * width**3 * gemms / gemm_s, ops_per_s=adds / add_s)


def measure_ranks(device: torch.device, memory_gib: float, rounds: int = RANK_PROBE_ROUNDS) -> RankMeasures:
    """Every rank's :func:`sustained_speed` in ``rounds`` rounds, all ranks probing together and gathering each round's
    rates before the next, with each rank's ``memory_gib`` and device identity (collective). A job of one process has
    no rank to compare: one shortest round (two slices, about 20 ms) instead of RANK_PROBE_S."""
    alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    rounds, seconds = (1, 0.0) if alone else (rounds, None)
    per_round = [all_ranks_rows(dataclasses.astuple(sustained_speed(device, seconds=seconds)), device) for _ in range(rounds)]
    facts = all_ranks_rows((memory_gib, float(device_identity(device_identity_text(device)))), device)
    return RankMeasures(flops_rounds=tuple(tuple(r[0] for r in rows) for rows in per_round),
                        ops_rounds=tuple(tuple(r[1] for r in rows) for rows in per_round),
                        memory_gib=tuple(f[0] for f in facts), identity=tuple(int(f[1]) for f in facts),
                        host_is_device=device.type == "cpu")


def device_identity_text(device: torch.device) -> str:
    """This rank's device as text: the host, and its GPU's name and memory, or its CPU's model and the cores it may run
    on (its affinity)."""
    host = socket.gethostname()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{host}/{props.name}/{props.total_memory}"
    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{host}/{model}/{cores} cores"


def device_memory_gib(device: torch.device, local_world_size: int) -> float:
    """Memory one rank has: its GPU's, or on a CPU its share of the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return psutil.virtual_memory().available / GIB / local_world_size


def collective_seconds(kind: str, nbytes: int, device: torch.device) -> float:
    """Mean time of one collective (a RING_ROUNDS key) over a tensor of ``nbytes`` in all on the default process group,
    by the calls DeepSpeed makes: ``all_reduce`` (its ZeRO-0 gradients, and ZeRO-1/2's too: stage_1_and_2.py reduces
    each bucket with ``dist.all_reduce``), ``all_gather_into_tensor`` (ZeRO-1/2's updated weights,
    ``all_gather_into_tensor_dp_groups`` in runtime/utils.py; ZeRO-3's parameter gathers, ``allgather_fn`` in
    partition_parameters.py) and ``reduce_scatter_tensor`` (ZeRO-3's gradients, ``reduce_scatter_coalesced``;
    :func:`_reduce_scatter`, :func:`_all_gather`).

    The mean, not the median: a training step runs many collectives and pays each one's actual
    time, and on a shared machine those times are heavy-tailed (4 KiB on this VM's gloo: median
    0.9-2.6 ms, 75th percentile 3-4 ms, minimum 0.4 ms), so the expected time is what adds up.
    """
    world = dist.get_world_size()
    whole = torch.zeros(max(1, nbytes // 4 // world) * world, device=device)
    shard = torch.zeros(whole.numel() // world, device=device)
    call = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: _all_gather(whole, shard),
        "reduce_scatter": lambda: _reduce_scatter(shard, whole),
    }[kind]
    repeats = 40 if nbytes <= 65536 else 10
    call()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    _synchronizer(device)()
    return (time.perf_counter() - start) / repeats


def _reduce_scatter(output: torch.Tensor, whole: torch.Tensor) -> None:
    """``dist.reduce_scatter_tensor`` as DeepSpeed calls it, under the name torch 2.13 deprecated it for (there it only
    calls ``reduce_scatter_single``, torch/distributed/distributed_c10d.py), so that no deprecation warning is printed."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, whole)


def _all_gather(whole: torch.Tensor, shard: torch.Tensor) -> None:
    """``dist.all_gather_into_tensor`` as DeepSpeed calls it, under the name torch 2.13 deprecated it for
    (``all_gather_single``), likewise."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(whole, shard)


def all_ranks(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank of the live process group, rank 0 first (``[value]`` without one)."""
    return [row[0] for row in all_ranks_rows((value,), device)]


def all_ranks_rows(values: tuple[float, ...], device: torch.device) -> list[tuple[float, ...]]:
    """``values`` (the same count on every rank) of every rank of the live process group, rank 0 first, in one
    all-gather (``[values]`` without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [tuple(values)]
    t = torch.tensor(values, device=device, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [tuple(float(v) for v in x.tolist()) for x in out]


def across_ranks(value: float, device: torch.device, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MIN) -> float:
    """``value`` reduced over the live process group (MIN by default; itself without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def matmul_points(device: torch.device, dtype: torch.dtype, dispatch_s: float) -> list[tuple[float, float]]:
    """(cube edge, FLOP/s) of the MATMUL_SHAPES GEMMs, then of square GEMMs of doubling width while the rate still
    rises (MATMUL_STILL_RISING) and a call stays short (MATMUL_LONGEST_S), so that the fastest GEMM measured is close
    to what large layers reach. Rates are the minimum over ranks, so every rank takes the same decisions (and joins the
    same collectives)."""
    return matmul_points_by_rank(device, dtype, dispatch_s)[0]


def matmul_points_by_rank(
    device: torch.device, dtype: torch.dtype, dispatch_s: float
) -> tuple[list[tuple[float, float]], list[list[tuple[float, float]]]]:
    """:func:`matmul_points` (the minimum over ranks), and every rank's own points at the same shapes, rank 0 first."""
    by_rank: list[list[tuple[float, float]]] = []

    def point(tokens: int, width: int) -> tuple[float, float]:
        edge = (tokens * width * width) ** (1 / 3)
        rates = all_ranks(matmul_rate(tokens, width, device, dtype, dispatch_s), device)
        for r, rate in enumerate(rates):
            if r == len(by_rank):
                by_rank.append([])
            by_rank[r].append((edge, rate))
        return edge, min(rates)

    points = [point(t, w) for t, w in MATMUL_SHAPES]
    width = MATMUL_SHAPES[-1][1] * 2
    while width <= MATMUL_LARGEST_WIDTH and 2 * width**3 / points[-1][1] <= MATMUL_LONGEST_S:
        best = max(rate for _, rate in points)
        points.append(point(width, width))
        if points[-1][1] < MATMUL_STILL_RISING * best:
            break
        width *= 2
    return points, by_rank


def _device_spec(
    device: torch.device, shape: WorldShape, dispatch_s: float
) -> tuple[DeviceSpec, dict[str, MatmulFit], RankMeasures]:
    """The measured device (the slowest rank's, or the fastest's where the ranks differ: :meth:`RankMeasures.judged`),
    the GEMM fit of each precision (``dispatch_s``: the per-operator host time, taken off each GEMM's time), and what
    each rank measured. The cluster keeps one half size, fp32's."""
    precisions = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    measured = {key: matmul_points_by_rank(device, dtype, dispatch_s) for key, dtype in precisions}
    fits = {key: fit_matmul(key, points) for key, (points, _) in measured.items()}
    peak = {key: fit.peak_flops / 1e12 for key, fit in fits.items()}
    memory = device_memory_gib(device, shape.local_world_size)
    if device.type == "cuda":
        name, fp16 = torch.cuda.get_device_properties(device).name, peak["bf16"]
    else:
        name = f"cpu-{os.cpu_count()}-cores/{shape.local_world_size}-procs"
        fp16 = peak["fp32"]  # CPU fp16 matmuls are no faster than fp32
    ranks = measure_ranks(device, memory)
    spec = DeviceSpec(name=name, memory_gib=round(min(ranks.memory_gib), 2),
                      peak_tflops=PeakTflops(bf16=peak["bf16"], fp16=fp16, fp32=peak["fp32"]))
    if not ranks.differ():
        return spec, fits, ranks
    own = {key: fit_matmul(key, measured[key][1][ranks.fastest]).peak_flops / 1e12 for key in measured}
    peak = PeakTflops(bf16=own["bf16"], fp16=own["bf16"] if device.type == "cuda" else own["fp32"], fp32=own["fp32"])
    return dataclasses.replace(spec, peak_tflops=peak), fits, ranks


def rank_devices(fastest: DeviceSpec, ranks: RankMeasures) -> tuple[DeviceSpec, ...]:
    """One device per rank (:func:`~lightning_fleet.planning.cluster.devices_by_speed`) where the ranks differ
    (:meth:`RankMeasures.judged`), else none: ``fastest`` scaled by each rank's judged device and host speed (1 where a
    difference did not persist over the probe's rounds), with the memory of its identity (rounded as the cluster states
    it)."""
    judged = ranks.judged()
    if not judged.differ:
        return ()
    return devices_by_speed(fastest, list(judged.speeds), list(judged.host_speeds), [round(m, 2) for m in judged.memory_gib])


def with_rank_devices(cluster: ClusterSpec, ranks: RankMeasures) -> ClusterSpec:
    """``cluster`` (one device group, as measured) with each rank's device as this probe judged it (:func:`rank_devices`
    of its group's device): what a job planning from the cache uses, the ranks re-probed at its start."""
    return dataclasses.replace(cluster, rank_devices=rank_devices(cluster.groups[0].device, ranks))


def _link(device: torch.device, world_size: int) -> LinkSpec:
    """The link fitted to each collective at COLLECTIVE_BYTES (:func:`fit_link`); times are the slowest rank's, so every
    rank writes the same link."""
    if world_size == 1:
        return LinkSpec(bandwidth_GBps=100.0, latency_us=1.0)  # never used: no collective with one process

    def slowest(kind: str, nbytes: int) -> float:
        return across_ranks(collective_seconds(kind, nbytes, device), device, dist.ReduceOp.MAX)

    return fit_link({kind: [(b, slowest(kind, b)) for b in COLLECTIVE_BYTES] for kind in RING_ROUNDS}, world_size)


def op_overhead_s(device: torch.device) -> float:
    """Host time to dispatch one tiny operator (its compute is negligible)."""
    t = torch.zeros(1, device=device)
    sync = _synchronizer(device)

    def run() -> None:
        for _ in range(500):
            t.add_(1)
        sync()

    return _timed(run, 5) / 500


ELEMENTWISE_ELEMENTS = (1 << 14, 1 << 16, 1 << 18, 1 << 20)
"""Tensor sizes (elements) whose memory-bound operator times fit the per-element cost."""


def elementwise_s(device: torch.device, width: int = 128) -> float:
    """Seconds per output element of a transformer's operators that do no matmul -- LayerNorm, GELU, a residual add and
    a softmax, forward, over [n / width, width] tensors: the slope of their time against their output elements
    (least squares over ``ELEMENTWISE_ELEMENTS``; the intercept is dispatch, priced by ``op_overhead_s``)."""
    import torch.nn.functional as F

    sync = _synchronizer(device)
    points = []
    for n in ELEMENTWISE_ELEMENTS:
        x = torch.randn(n // width, width, device=device)
        y = torch.randn_like(x)

        def run() -> None:
            F.layer_norm(x, (width,))
            F.gelu(x)
            x + y
            torch.softmax(x, dim=-1)
            sync()

        points.append((4.0 * n, _timed(run, max(5, (1 << 24) // n))))
    return max(least_squares_line([e for e, _ in points], [t for _, t in points])[1], 0.0)


def adam_params_per_s(device: torch.device, params: int = 2_000_000, tensors: int = 40) -> float:
    """Parameters per second torch's AdamW (its default foreach path, as DeepSpeed runs a user's optimizer) updates on ``device``."""
    weights = [torch.nn.Parameter(torch.randn(params // tensors, device=device)) for _ in range(tensors)]
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer = torch.optim.AdamW(weights, lr=1e-3)
    sync = _synchronizer(device)

    def run() -> None:
        optimizer.step()
        sync()

    return params / _timed(run, 5)


def _host_copy_GBps(device: torch.device) -> float:
    src = torch.empty(64 * 1024 * 1024, dtype=torch.uint8)
    dst = torch.empty_like(src, device=device)

    sync = _synchronizer(device)

    def run() -> None:
        dst.copy_(src)
        sync()

    return src.numel() / _timed(run, 3) / 1e9


ATTENTION_CUDA_SHAPES = tuple((16384 // s, 2048 // d, s, d) for d in (64, 128) for s in (1024, 2048, 4096))
"""(batch, heads, sequence, head dim) of the causal attention calls timed on a GPU: the FlashAttention repository's
benchmark shapes (benchmarks/benchmark_flash_attention.py: 16k tokens, model width 2048, head dims 64 and 128), the
sequences 1k-4k of its sweep."""
ATTENTION_CPU_SHAPES = tuple((2048 // s, 256 // d, s, d) for d in (32, 64) for s in (128, 256, 512))
"""(batch, heads, sequence, head dim) of the causal attention calls timed on a CPU: 2048 tokens of width 256, head dims
32 and 64 and sequences 128-512 (the example GPT and benchmarks/vs_presets.py train heads of 32 and 64 at sequence 128);
about 1.5 s of one core for all six (measured)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionPoint:
    """One timed causal scaled_dot_product_attention shape, with what the cost model counts for it."""

    shape: tuple[int, int, int, int]
    """(batch, heads, sequence, head dim) of q, k and v."""
    forward_s: float
    """Seconds of one forward call."""
    total_s: float
    """Seconds of one forward and its backward (the gradients of q, k and v)."""
    gemm_flops_per_s: float
    """The rate the cost model prices this attention's layer GEMMs at (:func:`~lightning_fleet.planning.time.gemm_dim`
    of a model of width heads x head dim with this batch and sequence, on the fitted curve)."""

    @property
    def kernel_flops(self) -> float:
        """Forward FLOPs the kernel executes, as the cost model counts them (causal: half the scores,
        :func:`~lightning_fleet.planning.model.attention_kernel_flops`)."""
        b, a, s, d = self.shape
        return b * attention_kernel_flops(s, a * d, kernel=AttentionKernel.FLASH, causal=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionFit:
    """The attention efficiency fitted to the timed shapes, and what the device ran them with."""

    precision: str
    """fp32 or bf16: the precision of the calls and of the GEMM rate they are compared with."""
    backend: str
    """The fused kernel PyTorch chose (``torch._fused_sdp_choice``: FLASH_ATTENTION, EFFICIENT_ATTENTION, ...)."""
    points: tuple[AttentionPoint, ...]
    """The timed shapes."""
    efficiencies: tuple[float, ...]
    """Each shape's efficiency (:func:`attention_efficiency_of`)."""
    efficiency: float
    """Their median: what the cluster file states."""
    capped: int
    """How many shapes hit ATTENTION_EFFICIENCY_MAX."""

    @property
    def backward_ratio(self) -> float:
        """Median backward over forward time of the shapes (the cost model takes FUSED_ATTENTION_BACKWARD)."""
        return statistics.median((p.total_s - p.forward_s) / p.forward_s for p in self.points)


def attention_efficiency_of(point: AttentionPoint, dispatch_s: float = 0.0) -> float:
    """The ``attention_efficiency`` under which the cost model prices ``point``'s forward + backward at its measured time.

    The cost model prices a fused kernel's forward, softmax included, at its executed FLOPs over ``efficiency`` x the
    GEMM rate, and its backward at FUSED_ATTENTION_BACKWARD x that (planning/time.py ``forward_s``, ``backward_s``;
    no memory-bound elements: planning/model.py ``attention_elementwise``); so, with ``dispatch_s`` of host time per
    call taken off, efficiency = (1 + FUSED_ATTENTION_BACKWARD) x FLOPs / (rate x time), at most
    ATTENTION_EFFICIENCY_MAX (also when the dispatch alone reaches the measured time: nothing is left to fit)."""
    kernel_s = max(point.total_s - 2 * dispatch_s, 0.0)
    rate = (1.0 + FUSED_ATTENTION_BACKWARD) * point.kernel_flops / point.gemm_flops_per_s
    return min(rate / kernel_s, ATTENTION_EFFICIENCY_MAX) if kernel_s > 0 else ATTENTION_EFFICIENCY_MAX


def fit_attention_efficiency(
    points: list[AttentionPoint], dispatch_s: float = 0.0, *, precision: str, backend: str
) -> AttentionFit:
    """One attention efficiency for all shapes: the median of each one's (:func:`attention_efficiency_of`), robust to a
    shape the machine ran unusually slowly or fast."""
    each = tuple(attention_efficiency_of(p, dispatch_s) for p in points)
    return AttentionFit(precision=precision, backend=backend, points=tuple(points), efficiencies=each,
                        efficiency=statistics.median(each), capped=sum(e >= ATTENTION_EFFICIENCY_MAX for e in each))


def fused_attention_backend(shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype) -> str:
    """The kernel PyTorch runs for a causal scaled_dot_product_attention of this shape (``torch._fused_sdp_choice``,
    what profiling asks to decide whether a call is priced as a fused kernel): MATH when none is fused."""
    from torch.nn.attention import SDPBackend

    q = torch.empty(shape, device=device, dtype=dtype, requires_grad=True)  # as in training: the backward must be fused too
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name


def attention_seconds(shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(forward, forward + backward) median seconds of a causal ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
    on [batch, heads, sequence, head dim] tensors, backward being the gradients of q, k and v (~0.2 s of repeats each)."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    sync = _synchronizer(device)

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        sync()

    def both() -> None:
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
        sync()

    start = time.perf_counter()
    both()
    repeats = max(3, min(50, int(0.15 / max(time.perf_counter() - start, 1e-7))))
    return _timed(forward, repeats), _timed(both, repeats)


def measure_attention(
    device: torch.device, fit: MatmulFit, half_dim: float, dispatch_s: float = 0.0,
    shapes: tuple[tuple[int, int, int, int], ...] | None = None,
) -> AttentionFit | None:
    """Time causal attention at ``shapes`` (ATTENTION_CUDA_SHAPES / ATTENTION_CPU_SHAPES by device) in ``fit``'s precision
    and fit the efficiency against that precision's GEMM curve (``half_dim``: the one the cluster keeps), as the cost
    model will price it; None when PyTorch runs the math path for them (profiling then prices no fused kernel either).
    Times are the maximum over ranks, so every rank fits the same value."""
    dtype = torch.bfloat16 if fit.precision == "bf16" else torch.float32
    shapes = shapes if shapes is not None else ATTENTION_CUDA_SHAPES if device.type == "cuda" else ATTENTION_CPU_SHAPES
    backend = fused_attention_backend(shapes[0], device, dtype)
    if backend == "MATH":
        return None
    curve = Calibration(matmul_efficiency=1.0, matmul_half_dim=half_dim)
    points = []
    for b, a, s, d in shapes:
        forward, total = (across_ranks(t, device, dist.ReduceOp.MAX) for t in attention_seconds((b, a, s, d), device, dtype))
        rate = achieved_flops_per_s(fit.peak_flops, gemm_dim(mbs=b, seq_length=s, hidden_size=a * d, tp=1), curve)
        points.append(AttentionPoint(shape=(b, a, s, d), forward_s=forward, total_s=total, gemm_flops_per_s=rate))
    return fit_attention_efficiency(points, dispatch_s, precision=fit.precision, backend=backend)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """What :func:`measure` found: the cluster to plan with, and the GEMM fits behind its peaks."""

    cluster: ClusterSpec
    """The measured cluster."""
    matmul: tuple[MatmulFit, ...]
    """The GEMM fit of each precision (fp32, bf16)."""
    attention: AttentionFit | None = None
    """The fused attention kernel's fit (None: the device runs causal attention on the math path; the default stays)."""
    ranks: RankMeasures | None = None
    """What each rank's speed probe measured (:meth:`RankMeasures.judged` says whether and why they differ)."""


def measure_cluster(device: torch.device, shape: WorldShape, baseline_rss_bytes: float | None = None) -> ClusterSpec:
    """Microbenchmark the live job (every rank must call this together) and describe it (:func:`measure`'s cluster)."""
    return measure(device, shape, baseline_rss_bytes).cluster


def measure(device: torch.device, shape: WorldShape, baseline_rss_bytes: float | None = None) -> Measurement:
    """Microbenchmark the live job (every rank must call this together): the cluster, and the GEMM and attention fits behind it.

    On CPU the memory a training process holds before its model (interpreter, torch, Lightning,
    DeepSpeed) is the runtime reserve: ``baseline_rss_bytes`` when given, else this process' RSS now.
    """
    rss_gib = (psutil.Process().memory_info().rss if baseline_rss_bytes is None else baseline_rss_bytes) / GIB
    dispatch_s = float(f"{across_ranks(op_overhead_s(device), device):.3g}")  # the fastest host's: host_slowdown 1
    spec, fits, ranks = _device_spec(device, shape, dispatch_s)
    half_dim = fits["fp32"].half_dim
    link = _link(device, shape.world_size)
    # per element and per Adam parameter: the slowest rank's, or where ranks are described one by one the fastest's
    # (each rank's device then states its slowdown against it)
    per_element_s = float(f"{_slowest_or(ranks, elementwise_s(device), device, slowest=max):.3g}")
    # the precision the device trains in by default: bf16 on a GPU (its flash kernel takes 16-bit only), fp32 on a CPU
    attention = measure_attention(device, fits["bf16" if device.type == "cuda" else "fp32"], half_dim, dispatch_s)
    device_adam = _slowest_or(ranks, adam_params_per_s(device), device, slowest=min)
    host_adam = device_adam if device.type == "cpu" else across_ranks(adam_params_per_s(torch.device("cpu")), device)
    cluster = ClusterSpec(
        name=f"measured-{socket.gethostname()}",
        groups=(DeviceGroup(nodes=shape.num_nodes, devices_per_node=shape.local_world_size, device=spec),),
        intra_node=link,
        inter_node=link,
        host=HostSpec(memory_gib=round(psutil.virtual_memory().total / GIB, 2), pcie_GBps=round(_host_copy_GBps(device), 3)),
        calibration=Calibration(
            matmul_efficiency=1.0,  # the measured peak already is the achieved large-matmul rate
            matmul_half_dim=round(half_dim, 2),
            overlap=0.8 if device.type == "cuda" else 0.0,
            op_overhead_s=dispatch_s,
            elementwise_s=per_element_s,
            attention_efficiency=float(f"{attention.efficiency:.3g}") if attention else Calibration().attention_efficiency,
            adam_params_per_s=float(f"{device_adam:.3g}"),
            # an offloaded optimizer is the user's torch optimizer stepping on host tensors, every local rank at once
            cpu_adam_params_per_s=float(f"{min(host_adam, device_adam):.3g}") * shape.local_world_size,
            memory_reserve_fraction=0.05 if device.type == "cuda" else 0.0,
            memory_reserve_gib=round(1.0 if device.type == "cuda" else rss_gib, 3),
        ),
        rank_devices=rank_devices(spec, ranks),
    )
    return Measurement(cluster=cluster, matmul=tuple(fits.values()), attention=attention, ranks=ranks)


def _slowest_or(ranks: RankMeasures, value: float, device: torch.device, *, slowest: Any) -> float:
    """``value`` of the fastest rank where the ranks differ (:meth:`RankMeasures.differ`: they are described one by
    one), else the slowest rank's (``slowest``: max for a time, min for a rate); collective."""
    values = all_ranks(value, device)
    return values[ranks.fastest] if ranks.differ() else slowest(values)


def cache_path(device: torch.device, shape: WorldShape) -> Path:
    """Where the measurement of this host, device kind and world shape is kept."""
    root = Path(os.environ.get("FLEET_CACHE_DIR", Path.home() / ".cache" / "lightning_fleet"))
    kind = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    return root / f"cluster-{socket.gethostname()}-{kind}-{shape.num_nodes}x{shape.local_world_size}.yaml"


def load_cached(path: Path) -> ClusterSpec | None:
    """The cached cluster without per-rank devices (what a cache written before they were left out still holds: a
    rank's speed is no fact of the host, :func:`save_cache`), or None when there is none or it no longer parses."""
    if not path.is_file():
        return None
    try:
        cluster = cluster_from_dict(read_yaml(path, "cached cluster"))
    except ValueError:
        return None
    return dataclasses.replace(cluster, rank_devices=())


def save_cache(cluster: ClusterSpec, path: Path) -> None:
    """Keep what persists of a measurement for the next job on this host: the device kind, its memory, the GEMM, link
    and operator fits -- not the per-rank devices, which a busy machine makes differ for one measurement (every later
    job then split its batch 12/4): each job probes its ranks again at its start (:func:`with_rank_devices`)."""
    write_cluster(dataclasses.replace(cluster, rank_devices=()), path)


def write_cluster(cluster: ClusterSpec, path: Path) -> None:
    """Write the cluster YAML atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(cluster.to_yaml())
    os.replace(tmp, path)
