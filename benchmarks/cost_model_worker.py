"""Run one plan of the cost-model benchmark for real and measure what it cost (used by ``benchmarks/cost_model.py``).

:func:`run_forked` forks one child per rank from the already-imported benchmark process, gives
them torchrun's environment (127.0.0.1, a free port) and trains the plan through
``Trainer(strategy=FleetStrategy(plan=..., cluster=<calibrated file>))``. Forking keeps the
import cost (~10 s here) out of every plan, and every plan starts from the same clean process:
its peak memory is the child's resident-set high-water mark (Linux ``VmHWM``; on a GPU
``torch.cuda.max_memory_allocated``), with nothing left over from earlier plans, and a plan that
fails or hangs takes nothing else down. (CUDA is first touched in the children, never in the
parent, so forking is safe there too.)

The step time is the median of the steps after the warm-up ones (time between consecutive
optimizer-step ends, the slowest rank); the peak memory is the largest rank's. Each rank is pinned
to one core (rank i to core i): the scheduler then never moves it mid-step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402,F401  (imported once here, not in every forked plan)

try:  # DeepSpeed imports this (and with it torch.compile's inductor, ~3.5 s here) on every ZeRO engine's first start
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
except ImportError:  # a DeepSpeed without Muon: nothing to pre-import
    pass
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
import lightning_fleet.strategy  # noqa: E402,F401
from lightning_fleet.calibrate.measure import across_ranks  # noqa: E402
from benchmarks.cost_model_sizes import DATA_BYTES, GLOBAL_BATCH, SIZES  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402


class StepClock(Callback):
    """Wall time between consecutive optimizer-step ends (each Lightning batch is one optimizer step here)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1 :])]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _gather_max(value: float, device: str) -> float:
    """The largest ``value`` over the ranks (on the GPU under nccl, which reduces no CPU tensor)."""
    return across_ranks(value, torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu"),
                         dist.ReduceOp.MAX)


def run_plan(size: str, plan: str, cluster: str, steps: int, warmup: int, device: str = "cpu") -> dict:
    """Train one plan in this process; returns its measured step time and peak memory (all ranks call this together)."""
    rss_before = _rss_kib("VmRSS") * 1024
    seed_everything(0, verbose=False)
    shape = SIZES[size]
    clock = StepClock()
    trainer = Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        strategy=lightning_fleet.FleetStrategy(plan=plan, cluster=cluster, global_batch_size=GLOBAL_BATCH),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    error = ""
    try:
        trainer.fit(GPT(**shape), StdlibText(seq_length=shape["seq_length"], batch_size=1, limit_bytes=DATA_BYTES))
    except Exception as err:  # a plan that does not run is reported, not hidden
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        traceback.print_exc()
    times = clock.step_times(warmup)
    step_s = _gather_max(statistics.median(times) if times and not error else float("nan"), device)
    # CPU: the process' resident high-water mark; GPU: what the caching allocator handed out at most
    peak = _gather_max(torch.cuda.max_memory_allocated() if device == "cuda" else _rss_kib("VmHWM") * 1024, device)
    estimate = trainer.strategy.estimate
    result = {
        "size": size,
        "plan": plan,
        "world": trainer.world_size,
        "measured_step_s": step_s,
        "step_samples": len(times),
        "measured_peak_bytes": peak,
        "rss_before_bytes": _gather_max(rss_before, device),
        "error": error,
    }
    if estimate is not None:
        result.update(
            predicted_step_s=estimate.time.step_s,
            predicted_terms=estimate.time.to_dict(),
            predicted_memory=estimate.memory.to_dict(),
        )
    del trainer
    return result


def preload(device: str) -> None:
    """Load in this (parent) process what every forked plan would otherwise load again: on CPU, DeepSpeed's shared-memory
    collective op (~0.15 s a process). CUDA is not touched here: the children must be the first to."""
    if device == "cpu":
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


def run_forked(size: str, plan: str, cluster: str, *, world: int, steps: int, warmup: int, timeout_s: float, port: int, device: str = "cpu") -> dict:
    """Train ``plan`` on ``world`` forked processes; returns rank 0's record (an ``error`` when it failed or timed out)."""
    import select
    import signal

    children: list[tuple[int, int]] = []
    for rank in range(world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one rank
            os.close(read)
            os.sched_setaffinity(0, {rank % os.cpu_count()})  # one core per rank: no migrations between cores mid-step
            payload: dict
            try:
                if world > 1:
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), WORLD_SIZE=str(world),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                      TORCHELASTIC_RUN_ID=f"cost-model-{port}")
                payload = run_plan(size, plan, cluster, steps, warmup, device)
            except BaseException as err:  # noqa: BLE001 - reported to the parent, whatever it was
                payload = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(payload))
            os._exit(0)
        os.close(write)
        children.append((pid, read))
    deadline = time.monotonic() + timeout_s
    texts = {fd: b"" for _, fd in children}
    open_fds = set(texts)
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                texts[fd] += chunk
            else:
                open_fds.discard(fd)
    timed_out = bool(open_fds)
    for pid, fd in children:
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    record = {"size": size, "plan": plan, "world": world, "measured_step_s": float("nan"), "measured_peak_bytes": float("nan")}
    first = texts[children[0][1]]
    if timed_out:
        record["error"] = f"did not finish within {timeout_s:.0f} s"
    elif not first:
        record["error"] = "rank 0 died without a result"
    else:
        record.update(json.loads(first))
        record.setdefault("error", "")
    return record
