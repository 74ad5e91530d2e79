"""Worker for the error-line tests: a fit of the example GPT that ends in a FleetError (or another exception).

    python tests/workers/fleet_error.py --plan dp=3,zero=1            # Lightning's launcher, 2 processes
    torchrun --nproc-per-node=2 tests/workers/fleet_error.py --plan dp=3,zero=1

``--plan`` forces a plan (a bad one fails at start-up on every rank); ``--fail-on-rank R`` raises a FleetError
at the start of training on rank R only; ``--value-error`` raises a ValueError there on every rank. With ``--dir``
every process appends ``<RANK> <TORCHELASTIC_RESTART_COUNT>`` to ``<dir>/starts.txt`` as it starts.
``--checkpoint-dir`` and ``--seed`` train with checkpoints there under that data-order seed (a second run with
another seed meets a checkpoint of another job).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_fleet.planning import FleetError  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.train_gpt import DATA, SIZES  # noqa: E402


class FailAtStart(Callback):
    """Raises at the start of training: a FleetError on one rank, or a ValueError on every rank."""

    def __init__(self, rank: int | None, value_error: bool) -> None:
        self.rank, self.value_error = rank, value_error

    def on_train_start(self, trainer, pl_module):
        if self.value_error:
            raise ValueError("not a FleetError")
        if trainer.global_rank == self.rank:
            raise FleetError(f"only rank {self.rank} fails")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default=None)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fail-on-rank", type=int, default=None)
    parser.add_argument("--value-error", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.dir is not None:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(Path(args.dir) / "starts.txt", "a") as f:
            f.write(f"{rank} {attempt}\n")
    seed_everything(args.seed)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,  # under torchrun the strategy takes the world from the launcher
        strategy=lightning_fleet.FleetStrategy(plan=args.plan, global_batch_size=8, checkpoint_dir=args.checkpoint_dir),
        max_steps=2,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[FailAtStart(args.fail_on_rank, args.value_error)],
    )
    trainer.fit(GPT(**SIZES), StdlibText(**DATA))


if __name__ == "__main__":
    main()
