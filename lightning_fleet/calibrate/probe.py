"""The training probe: the framework's own time per step and per micro-batch, measured through FleetStrategy.

A tiny model (``PROBE_LAYERS`` Linear(16, 16)) is trained through Lightning, FleetStrategy and each
installed runtime at every shard level it runs, with and without gradient accumulation (and, where
the runtime offloads, with offload); what the cost model already prices for it is taken off each
measured step, and the rest becomes the cluster's framework constants, each runtime's own per
shard level (:func:`with_framework_overheads`, ``Calibration.runtimes``). :func:`quiet_output` keeps those runs'
messages off the terminal.

Above the strategy: it imports :class:`lightning_fleet.strategy.FleetStrategy` (inside the probe,
so that importing this module loads neither Lightning nor DeepSpeed), and builds on
:mod:`lightning_fleet.calibrate.measure`. Imported only by :mod:`lightning_fleet.calibrate.command`
and tests; nothing below the strategy may import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from lightning_fleet.calibrate.measure import across_ranks
from lightning_fleet.planning import ClusterSpec, RuntimeOverheads
from lightning_fleet.runtime.base import HOST_OFFLOADS, Capabilities

PROBE_LAYERS = 16
"""Linear layers of the framework probe (width 16: its compute is negligible)."""


def probe_plan(world: int, zero: int, gas: int, offload: str = "none", runtime: str | None = None) -> str:
    """The probe's plan, every axis fixed (a partial plan would let the planner choose, e.g., recomputation), on
    ``runtime`` when given."""
    text = f"dp={world},tp=1,pp=1,zero={zero},mbs=1,gas={gas},recompute=none,sp=false,vpp=1,offload={offload}"
    return text if runtime is None else f"{text},runtime={runtime}"


@contextlib.contextmanager
def quiet_output(tail_bytes: int = 20000) -> Iterator[None]:
    """While the block runs, what this process writes to stdout and stderr (Python, C++ and subprocesses alike) goes
    to a temporary file, and Python warnings are ignored; both are restored afterwards. If the block raises, the last
    ``tail_bytes`` of what it wrote are put on stderr before the error propagates. For calibration's own runs only:
    the user's process never runs this."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    failed = False
    with tempfile.TemporaryFile() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fd in saved:
            os.dup2(log.fileno(), fd)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            if failed:
                log.seek(max(log.seek(0, os.SEEK_END) - tail_bytes, 0))
                sys.stderr.write(log.read().decode(errors="replace"))
                sys.stderr.flush()


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameworkOverheads:
    """Seconds the framework itself (Lightning's loop, FleetStrategy, the runtime's engine) adds on one runtime, per
    shard level it runs."""

    runtime: str
    """The runtime the probe trained through."""
    zero_stages: tuple[int, ...]
    """The shard levels measured (the runtime's own), in order."""
    step_s: tuple[float, ...]
    """Per optimizer step (optimizer launch, boundary bookkeeping, callbacks), at each of ``zero_stages``."""
    microbatch_s: tuple[float, ...]
    """Per micro-batch beyond its operators' dispatch (engine forward/backward wrappers, ZeRO / FSDP hooks), for the
    probe, at each of ``zero_stages``."""
    probe_tensors: int
    """Parameter tensors of the probe (the extra per-micro-batch time is taken to scale with them)."""
    offload_microbatch_s: tuple[float, float] | None
    """Extra per micro-batch of optimizer offload (ZeRO-2) and of optimizer + parameter offload (ZeRO-3), for the
    probe; None where the runtime offloads nothing."""


def framework_overheads(cluster: ClusterSpec, *, steps: int = 8, warmup: int = 2, accumulation: int = 4) -> tuple[FrameworkOverheads, ...]:
    """Train a probe model (``PROBE_LAYERS`` Linear(16, 16)) through FleetStrategy on each installed runtime (the
    runtime table's order) at every shard level it runs, with 1 and with ``accumulation`` micro-batches per step. What
    the cost model already prices for the probe on ``cluster`` (its compute, operator dispatch, collectives, optimizer
    step, offload transfers: the estimate with no framework constants) is taken off each measured step; of the rest,
    the growth per micro-batch is the micro-batch overhead and the remainder the step overhead. Every rank of the live
    process group must call this together.

    What the probe's runs print (Lightning's and the runtimes' messages, the plan tables, warnings) is kept out of
    the terminal while it runs (:func:`quiet_output`), and shown only if the probe fails."""
    from lightning_fleet.runtime import RUNTIMES

    with quiet_output():
        return tuple(_probe_overheads(cluster, runtime.capabilities, steps=steps, warmup=warmup, accumulation=accumulation)
                     for runtime in RUNTIMES if runtime.installed())


def _probe_overheads(cluster: ClusterSpec, runtime: Capabilities, *, steps: int, warmup: int, accumulation: int) -> FrameworkOverheads:
    """:func:`framework_overheads` of one runtime, unquieted."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback

    from lightning_fleet.strategy import FleetStrategy

    world = cluster.world_size

    class Probe(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(PROBE_LAYERS)])

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.layers(batch).square().mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(torch.randn(4096, 16), batch_size=1)

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.ends.append(time.perf_counter())

    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if accelerator == "gpu" else torch.device("cpu")

    def median_step(zero: int, gas: int, offload: str = "none") -> float:
        clock = Clock()
        plan = probe_plan(world, zero, gas, offload, runtime.name)
        trainer = Trainer(accelerator=accelerator, devices=1, strategy=FleetStrategy(plan=plan, cluster=cluster, global_batch_size=world * gas),
                          max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock])
        trainer.fit(Probe())
        gaps = sorted(b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1 :]))
        return across_ranks(gaps[len(gaps) // 2], device, dist.ReduceOp.MAX)

    from lightning_fleet.planning import estimate, parse_plan
    from lightning_fleet.profiling import profile_module

    spec = profile_module(Probe(), torch.zeros(1, 16), global_batch_size=1)
    unpriced = cluster.with_calibration(dataclasses.replace(
        cluster.calibration, step_overhead_s=0.0, microbatch_overhead_s=0.0, zero_step_overhead_s=(), zero_tensor_overhead_s=(),
        offload_tensor_overhead_s=()))

    def excess(zero: int, gas: int, offload: str = "none") -> float:
        """Measured step time of the probe beyond what the model prices without framework constants."""
        batch = world * gas
        plan = parse_plan(probe_plan(world, zero, gas, offload, runtime.name), global_batch_size=batch)
        priced = estimate(dataclasses.replace(spec, global_batch_size=batch), unpriced, plan, overlaps=runtime.overlaps).time.step_s
        return median_step(zero, gas, offload) - priced

    step, micro, many = [], [], {}
    for zero in runtime.zero_stages:
        one = excess(zero, 1)
        many[zero] = excess(zero, accumulation)
        per_micro = max((many[zero] - one) / (accumulation - 1), 0.0)
        micro.append(per_micro)
        step.append(max(one - per_micro, 0.0))
    offloads = None
    if set(HOST_OFFLOADS) <= set(runtime.offloads) and {2, 3} <= set(runtime.zero_stages):
        # the extra unpriced time of the probe (host copies and bookkeeping per parameter tensor), per micro-batch,
        # against the same stage without offload
        offloaded = (excess(2, accumulation, "optimizer") - many[2]) / accumulation
        params = (excess(3, accumulation, "optimizer+params") - many[3]) / accumulation
        offloads = (max(offloaded, 0.0), max(params, 0.0))
    return FrameworkOverheads(runtime=runtime.name, zero_stages=runtime.zero_stages, step_s=tuple(step), microbatch_s=tuple(micro),
                              probe_tensors=2 * PROBE_LAYERS, offload_microbatch_s=offloads)


def with_framework_overheads(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with its per-step and per-micro-batch framework time measured on the probe (all ranks together): the
    least zero-0 time of the runtimes as the base, each runtime's extra per shard level in ``calibration.runtimes``, and
    as the default for a runtime without an entry the extras of the runtime measured at every shard level (DeepSpeed)."""
    measured = framework_overheads(cluster)
    base_step = min(m.step_s[m.zero_stages.index(0)] for m in measured)
    base_micro = min(m.microbatch_s[m.zero_stages.index(0)] for m in measured)

    def steps(m: FrameworkOverheads) -> tuple[float, ...]:
        return tuple(float(f"{max(v - base_step, 0.0):.3g}") for v in m.step_s)

    def tensors(m: FrameworkOverheads) -> tuple[float, ...]:  # the extra per micro-batch comes from per-parameter hooks
        return tuple(float(f"{max(v - base_micro, 0.0) / m.probe_tensors:.3g}") for v in m.microbatch_s)

    every = next((m for m in measured if m.zero_stages == (0, 1, 2, 3)), None)
    offloading = next((m for m in measured if m.offload_microbatch_s is not None), None)
    calibration = dataclasses.replace(
        cluster.calibration,
        step_overhead_s=float(f"{base_step:.3g}"),
        microbatch_overhead_s=float(f"{base_micro:.3g}"),
        zero_step_overhead_s=steps(every) if every else (),
        zero_tensor_overhead_s=tensors(every) if every else (),
        offload_tensor_overhead_s=tuple(float(f"{v / offloading.probe_tensors:.3g}") for v in offloading.offload_microbatch_s)
        if offloading and offloading.offload_microbatch_s else (),
        runtimes=tuple(RuntimeOverheads(runtime=m.runtime, zero_stages=m.zero_stages, step_overhead_s=steps(m),
                                        tensor_overhead_s=tensors(m)) for m in measured),
    )
    return cluster.with_calibration(calibration)
