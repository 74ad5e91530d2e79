"""One rank of one run of the heterogeneous benchmark (``benchmarks/heterogeneous.py`` launches it under torchrun).

``python -m torch.distributed.run --nproc-per-node 2 benchmarks/heterogeneous_worker.py '<job JSON>'`` pins this rank
to CPU core ``LOCAL_RANK`` and, when the job names a CPU cgroup for it, moves itself into that cgroup (whose quota the
driver set) before importing torch; then trains the example GPT with ``strategy=FleetStrategy(plan=...)`` for a few
steps and writes ``rank<R>.json`` into the job's directory: the time between consecutive optimizer-step ends after the
warm-up, the plan it ran, and the first line of any error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _place(job: dict) -> None:
    """Pin this rank to its own core and join its CPU cgroup, if the job gives one."""
    rank = int(os.environ["LOCAL_RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    group = (job.get("cgroups") or {}).get(str(rank))
    if group:
        Path(group, "cgroup.procs").write_text(str(os.getpid()))


if __name__ == "__main__":
    _place(json.loads(sys.argv[1]))
    sys.path.insert(0, str(ROOT))

import statistics  # noqa: E402

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from benchmarks.vs_presets_worker import StepClock, one_line  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class QuotaAtStep(Callback):
    """Rank 0 writes a CPU quota into a cgroup when an optimizer step starts (a slowdown in the middle of the run)."""

    def __init__(self, step: int, cgroup: str, quota_us: int) -> None:
        self.step, self.cgroup, self.quota_us = step, cgroup, quota_us

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            Path(self.cgroup, "cpu.cfs_quota_us").write_text(str(self.quota_us))


def main() -> None:
    job = json.loads(sys.argv[1])
    out = Path(job["dir"]) / f"rank{os.environ['RANK']}.json"
    result: dict = {"plan": None, "step_s": None, "error": None}
    try:
        seed_everything(0)
        model = GPT(**job["model"])
        data = StdlibText(seq_length=job["model"]["seq_length"], batch_size=job["gbs"] // 2, limit_bytes=job["data_bytes"])
        clock = StepClock()
        callbacks = [clock] + ([QuotaAtStep(*job["quota_at_step"])] if job.get("quota_at_step") else [])
        strategy = lightning_fleet.FleetStrategy(plan=job["plan"], global_batch_size=job["gbs"], cluster=job["cluster"],
                                                 rebalance_every_n_steps=job.get("rebalance_every"))
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=job["steps"], callbacks=callbacks,
                          limit_val_batches=0, num_sanity_val_steps=0, **QUIET)
        trainer.fit(model, data)
        times = clock.step_times(job["warmup"])
        result.update(plan=str(trainer.strategy.plan), step_s=statistics.median(times), steps=len(times),
                      all_step_s=clock.step_times(0), rebalances=list(trainer.strategy.rebalances))
    except Exception as err:  # reported, not raised: the driver reads every rank's file
        result["error"] = one_line(err)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
