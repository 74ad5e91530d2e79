"""Measure the machine a job runs on and describe it as a ClusterSpec.

World size and node layout come from the launcher; device memory from CUDA (or, on CPU, the
host's available RAM split across its local ranks); matmul throughput and collective latency and
bandwidth from short microbenchmarks on the live process group. The result is cached per host,
device kind and world shape, so a restart does not measure again.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

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
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.yamlspec import read_yaml

MATMUL_SIZES = (64, 512)
"""Square matmul sizes whose rates fit the saturating efficiency curve (small, large)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldShape:
    """How many processes there are and how they sit on nodes."""

    world_size: int
    """All processes."""
    num_nodes: int
    """Nodes."""
    local_world_size: int
    """Processes per node."""


def fit_saturation(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """Solve r(d) = peak * d / (d + half) through two measured (d, rate) points; returns (peak, half)."""
    (n1, r1), (n2, r2) = small, large
    k = r2 / r1
    if k * n1 - n2 >= 0 or k <= 1:  # no saturation visible: the rate is flat
        return max(r1, r2), 0.0
    half = n1 * n2 * (1 - k) / (k * n1 - n2)
    return r2 * (n2 + half) / n2, half


def fit_alpha_beta(small: tuple[float, float], large: tuple[float, float], n: int) -> tuple[float, float]:
    """Ring all-reduce t = 2(n-1) a + 2(n-1)/n * B * b through two (bytes, seconds) points; returns (alpha_s, beta_s_per_byte)."""
    (b1, t1), (b2, t2) = small, large
    beta = max((t2 - t1) / ((b2 - b1) * 2 * (n - 1) / n), 1e-12)
    alpha = max((t1 - 2 * (n - 1) / n * b1 * beta) / (2 * (n - 1)), 0.0)
    return alpha, beta


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


def matmul_rate(n: int, device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of an n x n x n matmul on ``device``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    repeats = max(3, int(2e8 // (2 * n**3)))

    def run() -> None:
        a @ b
        sync()

    return 2 * n**3 / _timed(run, repeats)


def allreduce_seconds(nbytes: int, device: torch.device) -> float:
    """Median time of an all-reduce of ``nbytes`` on the default process group."""
    t = torch.zeros(max(1, nbytes // 4), device=device)

    def run() -> None:
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return _timed(run, 5)


def _min_across_ranks(value: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _device_spec(device: torch.device, shape: WorldShape) -> tuple[DeviceSpec, float]:
    """The measured device, and the matmul size at which it reaches half its large-matmul rate."""
    fits = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        small, large = (_min_across_ranks(matmul_rate(n, device, dtype), device) for n in MATMUL_SIZES)
        fits[key] = fit_saturation((MATMUL_SIZES[0], small), (MATMUL_SIZES[1], large))
    peak = {key: rate / 1e12 for key, (rate, _) in fits.items()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory, fp16 = props.name, props.total_memory / GIB, peak["bf16"]
    else:
        name = f"cpu-{os.cpu_count()}-cores/{shape.local_world_size}-procs"
        memory = psutil.virtual_memory().available / GIB / shape.local_world_size
        fp16 = peak["fp32"]  # CPU fp16 matmuls are no faster than fp32
    spec = DeviceSpec(name=name, memory_gib=round(memory, 2), peak_tflops=PeakTflops(bf16=peak["bf16"], fp16=fp16, fp32=peak["fp32"]))
    return spec, fits["fp32"][1]


def _link(device: torch.device, world_size: int) -> LinkSpec:
    if world_size == 1:
        return LinkSpec(bandwidth_GBps=100.0, latency_us=1.0)  # never used: no collective with one process
    small, large = 4096, 8 * 1024 * 1024
    alpha, beta = fit_alpha_beta((small, allreduce_seconds(small, device)), (large, allreduce_seconds(large, device)), world_size)
    return LinkSpec(bandwidth_GBps=round(1 / beta / 1e9, 4), latency_us=round(alpha * 1e6, 2))


def op_overhead_s(device: torch.device) -> float:
    """Host time to dispatch one tiny operator (its compute is negligible)."""
    t = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> None:
        for _ in range(500):
            t.add_(1)
        sync()

    return _timed(run, 5) / 500


def _host_copy_GBps(device: torch.device) -> float:
    src = torch.empty(64 * 1024 * 1024, dtype=torch.uint8)
    dst = torch.empty_like(src, device=device)

    def run() -> None:
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return src.numel() / _timed(run, 3) / 1e9


def measure_cluster(device: torch.device, shape: WorldShape) -> ClusterSpec:
    """Microbenchmark the live job (every rank must call this together) and describe it."""
    spec, half_dim = _device_spec(device, shape)
    link = _link(device, shape.world_size)
    rss_gib = psutil.Process().memory_info().rss / GIB
    return ClusterSpec(
        name=f"measured-{socket.gethostname()}",
        groups=(DeviceGroup(nodes=shape.num_nodes, devices_per_node=shape.local_world_size, device=spec),),
        intra_node=link,
        inter_node=link,
        host=HostSpec(memory_gib=round(psutil.virtual_memory().total / GIB, 2), pcie_GBps=round(_host_copy_GBps(device), 3)),
        calibration=Calibration(
            matmul_efficiency=1.0,  # the measured peak already is the achieved large-matmul rate
            matmul_half_dim=round(half_dim, 2),
            overlap=0.8 if device.type == "cuda" else 0.0,
            op_overhead_s=float(f"{_min_across_ranks(op_overhead_s(device), device):.3g}"),
            memory_reserve_fraction=0.05 if device.type == "cuda" else 0.0,
            memory_reserve_gib=round(1.0 if device.type == "cuda" else rss_gib, 3),
        ),
    )


def cache_path(device: torch.device, shape: WorldShape) -> Path:
    """Where the measurement of this host, device kind and world shape is kept."""
    root = Path(os.environ.get("FLEET_CACHE_DIR", Path.home() / ".cache" / "lightning_fleet"))
    kind = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    return root / f"cluster-{socket.gethostname()}-{kind}-{shape.num_nodes}x{shape.local_world_size}.yaml"


def load_cached(path: Path) -> ClusterSpec | None:
    """The cached cluster, or None when there is none or it no longer parses."""
    if not path.is_file():
        return None
    try:
        return cluster_from_dict(read_yaml(path, "cached cluster"))
    except ValueError:
        return None


def save_cache(cluster: ClusterSpec, path: Path) -> None:
    """Write the cluster YAML atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(cluster.to_yaml())
    os.replace(tmp, path)
