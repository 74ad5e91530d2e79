"""Tier 2: how a worker process ends — its process groups destroyed at a clean exit, kept after an uncaught error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multiprocess import ROOT

pytestmark = pytest.mark.unit

CHILD = """
import atexit, os, sys
import torch.distributed as dist
from lightning_fleet.elastic.worker import destroy_groups_at_exit, install_error_hook
# registered first, so it runs last: what the interpreter's teardown will find
atexit.register(lambda: print("alive at teardown:", dist.is_initialized(), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
install_error_hook()
destroy_groups_at_exit()
destroy_groups_at_exit()  # idempotent
if sys.argv[2] == "fail":
    raise RuntimeError("the user's step failed")
"""


@pytest.mark.parametrize(("how", "alive"), [("clean", False), ("fail", True)])
def test_groups_are_destroyed_at_a_clean_exit_only(how, alive):
    """A finished job leaves no gloo group to the interpreter's teardown (where its threads can abort the process,
    exit -6); after an uncaught exception the group is left as it is (a peer may be inside a collective with it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", CHILD, str(port), how], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if how == "clean" else 1), done.stderr[-3000:]
    assert f"alive at teardown: {alive}" in done.stdout, done.stdout + done.stderr[-3000:]
