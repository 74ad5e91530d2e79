"""Worker for the hang tests (tests/test_hangs.py): the example GPT under ``FleetStrategy(timeout=...)`` with FleetCheckpoint.

Every rank appends ``<global step> <restart count>`` per optimizer step it completes to ``<dir>/steps-rank<R>.txt``
and, at the start of training, writes the timeout of every process group it belongs to (torch's default group and
every group DeepSpeed created) to ``<dir>/groups-rank<R>-attempt<A>.json``; rank 0 writes ``<dir>/final.json`` (the
global step, the checkpoint it resumed from, whether a SIGTERM stopped it). ``--sleep S`` slows each step so that a
test can deliver a signal mid-run: after the step's checkpoint callback (the default), or with ``--sleep-at`` before it
(``checkpoint``: a peer stopped there leaves the others in FleetCheckpoint's per-step agreement) or before the backward
(``backward``: in DeepSpeed's gradient reduction); each rank appends a line to ``<dir>/sleeping-rank<R>.txt`` as it
starts each sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.train_gpt import DATA, SIZES  # noqa: E402


def group_timeouts() -> list[dict]:
    """Name, ranks and collective timeout (seconds) of every process group this process belongs to."""
    from torch.distributed import distributed_c10d as c10d

    found = []
    for group in list(c10d._world.pg_map):
        backend = group._get_backend(torch.device("cpu"))
        found.append({"name": c10d._get_process_group_name(group), "ranks": c10d.get_process_group_ranks(group),
                      "timeout_s": backend.options._timeout.total_seconds()})
    return found


class Record(Callback):
    """Writes the process groups' timeouts at the start of training and one line per completed step."""

    def __init__(self, out: Path, sleep: float, at: str = "end") -> None:
        self.out, self.sleep, self.at = out, sleep, at
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def on_train_start(self, trainer, pl_module):
        path = self.out / f"groups-rank{trainer.global_rank}-attempt{self.attempt}.json"
        path.write_text(json.dumps(group_timeouts()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.out / f"steps-rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{trainer.global_step} {self.attempt}\n")
        if self.at != "backward":
            self._sleep(trainer)

    def on_before_backward(self, trainer, pl_module, loss):
        if self.at == "backward":
            self._sleep(trainer)

    def _sleep(self, trainer) -> None:
        if self.sleep:
            with open(self.out / f"sleeping-rank{trainer.global_rank}.txt", "a") as f:
                f.write(f"{trainer.global_step}\n")
            time.sleep(self.sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--plan", default="dp=2,zero=2")
    parser.add_argument("--timeout", type=float, default=600.0, help="FleetStrategy(timeout=...) in seconds")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--sleep-at", choices=["end", "checkpoint", "backward"], default="end")
    args = parser.parse_args()
    out = Path(args.dir)
    seed_everything(0)
    checkpoint = lightning_fleet.FleetCheckpoint(out / "ckpt", every_n_steps=args.every)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lightning_fleet.FleetStrategy(plan=args.plan, global_batch_size=8, timeout=timedelta(seconds=args.timeout)),
        max_steps=args.steps,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[Record(out, args.sleep, args.sleep_at), checkpoint] if args.sleep_at == "checkpoint" else [checkpoint, Record(out, args.sleep, args.sleep_at)],
    )
    trainer.fit(GPT(**SIZES), StdlibText(**DATA))
    if trainer.global_rank == 0:
        final = {"global_step": trainer.global_step, "resumed_from": str(trainer.strategy.resumed_from)}
        (out / "final.json").write_text(json.dumps({**final, "preempted": checkpoint.preempted}))


if __name__ == "__main__":
    main()
