"""``fleet calibrate``'s measuring process: ``python -m lightning_fleet.calibrate.command --out FILE``.

The ``fleet`` command (:mod:`lightning_fleet.cli`) runs this module alone or under torchrun; each
process measures (:mod:`lightning_fleet.calibrate.measure`), trains the framework probe
(:mod:`lightning_fleet.calibrate.probe`) unless ``--no-framework``, and rank 0 writes the cluster
YAML and prints :func:`summary`.

The top of the calibration package: it imports measure and probe (so it sits above the strategy
too); nothing in lightning_fleet imports it (the CLI starts it as a process).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from lightning_fleet.calibrate.measure import AttentionFit, MatmulFit, Measurement, WorldShape, measure, write_cluster
from lightning_fleet.calibrate.probe import quiet_output, with_framework_overheads
from lightning_fleet.planning import ClusterSpec, LinkSpec
from lightning_fleet.planning.cluster import ATTENTION_EFFICIENCY_MAX
from lightning_fleet.planning.time import FUSED_ATTENTION_BACKWARD
from lightning_fleet.runtime.deepspeed.backend import DeepSpeedBackend

def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_fleet.calibrate.command --out FILE``: measure this machine (alone, or every rank of a
    torchrun job) and write the cluster YAML (rank 0). ``fleet calibrate`` runs this under torchrun for you."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_fleet.calibrate.command")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-framework", action="store_true", help="skip the framework probe (Lightning + each runtime)")
    args = parser.parse_args(argv)
    with quiet_output():  # DeepSpeed's accelerator warning on import, gloo's messages on init
        import lightning.pytorch  # noqa: F401  (a training process has these loaded: the memory baseline must include them)

        DeepSpeedBackend().preload()

        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if world > 1:
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    baseline = psutil.Process().memory_info().rss  # before any microbenchmark allocates
    measured = measure(device, WorldShape(world_size=world, num_nodes=max(1, world // local), local_world_size=local), baseline)
    cluster = measured.cluster if args.no_framework else with_framework_overheads(measured.cluster)
    if int(os.environ.get("RANK", "0")) == 0:
        write_cluster(cluster, Path(args.out))
        lines = summary(measured, cluster, args.out, time.perf_counter() - started, framework=not args.no_framework)
        print("\n".join(lines), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def summary(measured: Measurement, cluster: ClusterSpec, out: str, seconds: float, *, framework: bool) -> list[str]:
    """What ``fleet calibrate`` prints: what was measured, the figures written, and where (eight lines)."""
    group = cluster.groups[0]
    c = cluster.calibration
    peaks = ", ".join(_peak_text(fit) for fit in measured.matmul)
    link = _link_text(cluster.intra_node) if cluster.world_size > 1 else "one process: no collective to measure"
    probed = "; ".join(f"{r.runtime} at zero {', '.join(map(str, r.zero_stages))}: +{max(r.step_overhead_s) * 1e3:.3g} ms per "
                       "step at most" for r in c.runtimes) or "ZeRO 0-3"
    probe = (
        f"{c.step_overhead_s * 1e3:.3g} ms per step, {c.microbatch_overhead_s * 1e3:.3g} ms per micro-batch "
        f"(a probe trained through FleetStrategy on each runtime: {probed})" if framework else "not measured (--no-framework)"
    )
    host = f", host {cluster.host.memory_gib:g} GiB (copies {cluster.host.pcie_GBps:g} GB/s)" if cluster.host is not None else ""
    return [
        f"fleet calibrate: {cluster.world_size} x {group.device.name} on {group.nodes} node(s), measured in {seconds:.1f} s",
        f"  GEMM peak   {peaks}; half rate at d={c.matmul_half_dim:g}" + _ranks_text(measured, cluster),
        f"  memory      {group.device.memory_gib:g} GiB per device (runtime reserve {c.memory_reserve_gib:g} GiB){host}",
        f"  link        {link}",
        f"  operators   dispatch {c.op_overhead_s * 1e6:.3g} us, element-wise {(c.elementwise_s or 0.0) * 1e9:.3g} ns per element, "
        f"AdamW {c.adam_params_per_s / 1e6:.3g} M params/s",
        f"  attention   {_attention_text(measured.attention, c.attention_efficiency)}",
        f"  framework   {probe}",
        f"  written to  {out} (fleet plan --model MODEL --cluster {out})",
    ]


def _ranks_text(measured: Measurement, cluster: ClusterSpec) -> str:
    """'' for one process, else why the ranks were judged alike or different, with each rank's figures round by round
    (:meth:`~lightning_fleet.calibrate.ranks.RankJudgement.line`), and where they differ each rank's fp32 peak, host
    slowdown and memory as the file keeps them."""
    if measured.ranks is None or measured.ranks.world_size == 1:
        return ""
    text = "; " + measured.ranks.judged().line().removeprefix("ranks    ")
    if cluster.rank_devices:
        ranks = ", ".join(f"{d.peak_tflops.fp32:.3g} TFLOP/s, host x{d.host_slowdown:.2g}, {d.memory_gib:.3g} GiB"
                          for d in cluster.rank_devices)
        text += f"; by rank (fp32 peak, host time, memory): {ranks} (each kept: rank_devices)"
    return text


def _link_text(link: LinkSpec) -> str:
    """The link line: each collective's ring-model fit, and the large-tensor time of the all-gather and the
    reduce-scatter as a fraction of an all-reduce's (the ring model says 0.5)."""
    ag_GBps, rs_GBps = (1e-9 / beta for beta in (link.allgather_beta_s_per_byte, link.reduce_scatter_beta_s_per_byte))
    ag_us, rs_us = (alpha * 1e6 for alpha in (link.allgather_alpha_s, link.reduce_scatter_alpha_s))
    return (f"all-reduce {link.bandwidth_GBps:.4g} GB/s + {link.latency_us:.4g} us; all-gather {ag_GBps:.4g} GB/s + "
            f"{ag_us:.4g} us ({link.bandwidth_GBps / ag_GBps / 2:.2f} x an all-reduce); reduce-scatter {rs_GBps:.4g} GB/s + "
            f"{rs_us:.4g} us ({link.bandwidth_GBps / rs_GBps / 2:.2f} x; ring model 0.50)")


def _attention_text(fit: AttentionFit | None, written: float) -> str:
    """The attention line: the efficiency written, the shapes' spread and backward ratio, and shapes at the bound."""
    if fit is None:
        return f"causal scaled_dot_product_attention runs the math path here: efficiency not measured (default {written:g} kept)"
    low, high = min(fit.efficiencies), max(fit.efficiencies)
    text = (f"fused kernel at {written:g} x the GEMM rate (causal SDPA, {fit.backend} {fit.precision}, median of "
            f"{len(fit.points)} shapes {low:.3g}-{high:.3g}); backward {fit.backward_ratio:.3g} x forward (priced "
            f"{FUSED_ATTENTION_BACKWARD:g})")
    if fit.capped:
        text += (f"; {fit.capped} shape(s) at the bound {ATTENTION_EFFICIENCY_MAX:g} "
                 f"(measured faster than the bound allows)")
    return text


def _peak_text(fit: MatmulFit) -> str:
    text = f"{fit.precision} {fit.peak_flops / 1e12:.3g} TFLOP/s"
    if fit.bounded:
        text += f" (the fastest GEMM measured; the unbounded fit said {fit.unbounded_peak_flops / 1e12:.3g})"
    if fit.still_rising:
        text += f" (still rising at d={fit.points[-1][0]:.0f}, the largest measured)"
    return text


if __name__ == "__main__":
    main()
