"""Worker for tests/test_uneven_dp.py: the training worker (train_gpt.py) with each rank pinned to its own core and
rank 1 moved into the CPU cgroup named by FLEET_TEST_THROTTLED_CGROUP (whose quota the test set), before torch loads.

    FLEET_TEST_THROTTLED_CGROUP=/sys/fs/cgroup/cpu/x python tests/workers/throttled_gpt.py --plans "dp=2,zero=1" --out r.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher re-runs this script for rank 1
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    if rank == 1:
        Path(os.environ["FLEET_TEST_THROTTLED_CGROUP"], "cgroup.procs").write_text(str(os.getpid()))

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.workers import train_gpt  # noqa: E402

if __name__ == "__main__":
    train_gpt.main()
