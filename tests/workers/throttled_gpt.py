"""Worker for tests/test_uneven_dp.py: the training worker (train_gpt.py) with each rank pinned to its own core and
rank 1 moved into the CPU cgroup named by FLEET_TEST_THROTTLED_CGROUP before torch loads (without that variable: ranks
unpinned and unthrottled, as Lightning's launcher starts them). With
FLEET_TEST_QUOTA_AT_STEP=K and FLEET_TEST_QUOTA_US=Q, rank 0 sets that cgroup's quota to Q (per 10 ms period) when step K
starts (a slowdown in the middle of the run); FLEET_TEST_REBALANCE_EVERY=N is FleetStrategy(rebalance_every_n_steps=N).
The model is the example GPT at SIZES.

    FLEET_TEST_THROTTLED_CGROUP=/sys/fs/cgroup/cpu/x python tests/workers/throttled_gpt.py --plans "dp=2,zero=1" --out r.pt
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

if __name__ == "__main__" and "FLEET_TEST_THROTTLED_CGROUP" in os.environ:
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher re-runs this script for rank 1
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    if rank == 1:
        Path(os.environ["FLEET_TEST_THROTTLED_CGROUP"], "cgroup.procs").write_text(str(os.getpid()))

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning.pytorch import Callback  # noqa: E402

import lightning_fleet  # noqa: E402
from tests.workers import train_gpt  # noqa: E402


class QuotaAtStep(Callback):
    """Rank 0 sets the throttled cgroup's CPU quota when optimizer step ``step`` starts."""

    def __init__(self, step: int, quota_us: int) -> None:
        self.step, self.quota_us = step, quota_us

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            Path(os.environ["FLEET_TEST_THROTTLED_CGROUP"], "cpu.cfs_quota_us").write_text(str(self.quota_us))


SIZES = dict(num_layers=4, hidden_size=256, num_heads=4)
"""The example GPT here: large enough that its compute, which a CPU quota slows, outweighs the step's all-reduce (with
train_gpt's 2 x 32 it is the other way round, and no split of the batch is predicted faster)."""

if __name__ == "__main__":
    train_gpt.SIZES.update(SIZES)
    if "FLEET_TEST_QUOTA_AT_STEP" in os.environ:
        callback = QuotaAtStep(int(os.environ["FLEET_TEST_QUOTA_AT_STEP"]), int(os.environ["FLEET_TEST_QUOTA_US"]))
        train_gpt.QUIET_TRAINER = {**train_gpt.QUIET_TRAINER, "callbacks": [callback]}
    if "FLEET_TEST_REBALANCE_EVERY" in os.environ:
        every = int(os.environ["FLEET_TEST_REBALANCE_EVERY"])
        train_gpt.lightning_fleet = type(sys)("fleet_for_test")
        train_gpt.lightning_fleet.FleetStrategy = functools.partial(lightning_fleet.FleetStrategy, rebalance_every_n_steps=every)
    train_gpt.main()
