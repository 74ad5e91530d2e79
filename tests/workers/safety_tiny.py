"""Worker for tests/test_checkpoint_safety.py: a tiny regression module under strategy 'fleet' with FleetCheckpoint.

Every rank appends, per optimizer step it completes, the dataset indices it read to ``<dir>/consumed-rank<R>.jsonl``;
rank 0 writes the final weights, the step and what the strategy reported to ``<dir>/final.pt``.
Test switches (test code, not the library): ``--nan-at STEP`` makes the loss of optimizer step STEP (1-based) NaN on the
ranks in ``--nan-ranks``; ``--fill-at STEP`` fills the checkpoint directory's file system (leaving ``--fill-leave``
bytes) right before the save of STEP starts writing; ``--sleep S`` slows each step so that a test can act mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fleet  # noqa: E402
from lightning_fleet.elastic.callback import NonFiniteGuard  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402

SAMPLES = 64


class Tiny(LightningModule):
    """Two linear layers; the loss of one chosen step is NaN on the chosen ranks."""

    def __init__(self, nan_at: int | None, nan_ranks: tuple[int, ...]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.nan_at, self.nan_ranks = nan_at, nan_ranks

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.trainer.global_step + 1 == self.nan_at and self.trainer.global_rank in self.nan_ranks:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Indexed(TensorDataset):
    """Records the indices read (the committed history is each rank's last write per step)."""

    seen: list[int] = []

    def __getitem__(self, i):
        Indexed.seen.append(int(i))
        return super().__getitem__(i)


class Recorder(Callback):
    def __init__(self, out: Path, sleep: float) -> None:
        self.out, self.sleep = out, sleep

    def on_train_start(self, trainer, pl_module):
        Indexed.seen.clear()  # profiling read the first samples; that is not training

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.out / f"consumed-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "indices": list(Indexed.seen), "time": time.time()}) + "\n")
        Indexed.seen.clear()
        if self.sleep:
            time.sleep(self.sleep)


class FillDisk(lightning_fleet.FleetCheckpoint):
    """FleetCheckpoint that fills its file system (leaving ``leave`` bytes) before the save of one step writes."""

    def __init__(self, *args, fill_at: int, leave: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fill_at, self.leave = fill_at, leave

    def _write(self, trainer, tmp, final):
        if trainer.global_step == self.fill_at and trainer.is_global_zero:
            import shutil

            free = shutil.disk_usage(self.dirpath).free
            with open(self.dirpath.parent / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - self.leave))
        trainer.strategy.barrier("test-filled")
        return super()._write(trainer, tmp, final)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--ckpt", default=None, help="checkpoint dir (default <dir>/ckpt)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--plan", default="dp=2,zero=0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank-seeds", action="store_true", help="seed_everything(seed + rank) (a common per-rank pattern)")
    parser.add_argument("--nan-at", type=int, default=None)
    parser.add_argument("--nan-ranks", default="0,1")
    parser.add_argument("--non-finite", default=None)
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--fill-at", type=int, default=None)
    parser.add_argument("--fill-leave", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.dir)
    rank = int(os.environ.get("RANK", 0))
    seed_everything(args.seed + (rank if args.rank_seeds else 0))
    g = torch.Generator().manual_seed(1234)
    data = Indexed(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    module = Tiny(args.nan_at, tuple(int(r) for r in args.nan_ranks.split(",")))
    ckpt = Path(args.ckpt) if args.ckpt else out / "ckpt"
    extra = {"fill_at": args.fill_at, "leave": args.fill_leave} if args.fill_at is not None else {}
    kind = FillDisk if args.fill_at is not None else lightning_fleet.FleetCheckpoint
    checkpoint = kind(ckpt, every_n_steps=args.every, keep=args.keep, **extra)
    options = {"non_finite": args.non_finite} if args.non_finite else {}
    strategy = lightning_fleet.FleetStrategy(plan=args.plan, global_batch_size=8, resume=args.resume, **options)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, **QUIET_TRAINER,
                      limit_val_batches=0, callbacks=[checkpoint, Recorder(out, args.sleep)])
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({"state": state, "global_step": trainer.global_step, "resumed_from": str(strategy.resumed_from),
                    "skipped": [s for c in trainer.callbacks if isinstance(c, NonFiniteGuard) for s in c.skipped]},
                   out / "final.pt")


if __name__ == "__main__":
    main()
