"""Worker for the fault-tolerance tests: train the example GPT with FleetCheckpoint and record what it consumed.

Every rank appends, per optimizer step it completes, the dataset indices it read to
``<dir>/consumed-rank<R>.jsonl``; rank 0 writes the final eval loss and weights to ``<dir>/final.pt``.
Test switches (test code, not the library): ``--die-in-save STEP`` kills rank 0 with SIGKILL inside
the save of STEP after the shards are written and before the manifest; ``--sleep S`` slows each
step so that a test can deliver a signal mid-run (``--sleep-only-alone``: only while the world is one process,
so that a scale-up test sees the join mid-run without slowing the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.train_gpt import DATA, SIZES, eval_batch, full_state  # noqa: E402


class Recorder(Callback):
    """Logs the dataset indices each optimizer step read, per rank (the committed history is the last write per step)."""

    def __init__(self, dataset, out: Path, sleep: float, only_alone: bool = False) -> None:
        self.seen: list[int] = []
        self.out, self.sleep, self.only_alone = out, sleep, only_alone
        original = dataset.__getitem__.__func__

        def getitem(ds, i):
            self.seen.append(int(i))
            return original(ds, i)

        type(dataset).__getitem__ = getitem

    def on_train_start(self, trainer, pl_module):
        self.seen = []  # the strategy's profiling read the first samples; that is not training

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.out / f"consumed-rank{trainer.global_rank}.jsonl", "a") as f:
            record = {"step": trainer.global_step, "indices": self.seen, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "time": time.time()}
            f.write(json.dumps(record) + "\n")
        self.seen = []
        if self.sleep and not (self.only_alone and trainer.world_size > 1):
            time.sleep(self.sleep)


class DieInSave(lightning_fleet.FleetCheckpoint):
    """FleetCheckpoint that SIGKILLs rank 0 between writing the shards and committing, at one step."""

    def __init__(self, *args, die_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.die_at = die_at

    def _commit(self, trainer, tmp, final):
        if trainer.global_step == self.die_at and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._commit(trainer, tmp, final)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--plan", default=None)
    parser.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages the planner may use")
    parser.add_argument("--max-tp", type=int, default=1, help="FleetStrategy(max_tp=...): 1 by default, since these jobs "
                        "resize and a tensor-parallel checkpoint does not reshard (Capabilities.reshard_data_parallel_only); "
                        "a calibration taken on a loaded machine made the planner choose tp=2 and the resize fail")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--sleep-only-alone", action="store_true")
    parser.add_argument("--die-in-save", type=int, default=None)
    args = parser.parse_args()
    out = Path(args.dir)
    seed_everything(0)
    model = GPT(**SIZES)
    dm = StdlibText(**DATA)
    dm.setup("fit")
    checkpoint_cls = DieInSave if args.die_in_save is not None else lightning_fleet.FleetCheckpoint
    extra = {"die_at": args.die_in_save} if args.die_in_save is not None else {}
    checkpoint = checkpoint_cls(out / "ckpt", every_n_steps=args.every, **extra)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,  # deliberately not the launcher's: the strategy takes devices and nodes from torchrun
        strategy=lightning_fleet.FleetStrategy(
            plan=args.plan, global_batch_size=args.gbs, zero_stages=tuple(int(z) for z in args.zero_stages.split(",")),
            max_tp=args.max_tp,
        ),
        max_steps=args.steps,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[checkpoint, Recorder(dm.train_set, out, args.sleep, args.sleep_only_alone)],
    )
    dm.setup = lambda stage: None  # keep the recorded dataset object
    trainer.fit(model, dm)
    state = full_state(trainer, model)
    x, y = eval_batch(StdlibText(**DATA))
    with torch.no_grad():
        loss = float(model.loss((x, y)))
    if trainer.global_rank == 0:
        torch.save({"eval_loss": loss, "state": state, "global_step": trainer.global_step, "preempted": checkpoint.preempted,
                    "save_seconds": checkpoint.save_seconds,
                    "resumed_from": str(trainer.strategy.resumed_from), "plan": str(trainer.strategy.plan)}, out / "final.pt")


if __name__ == "__main__":
    main()
