"""Tier 2: how a worker process ends — its process groups destroyed at a clean exit, kept after an uncaught error, and
no interpreter teardown after a FleetError."""

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


ENDED_BY_A_FLEET_ERROR = """
import atexit, os, sys
import torch.distributed as dist
from lightning_fleet.elastic.worker import destroy_groups_at_exit, install_error_hook
from lightning_fleet.planning import FleetError
import threading
def witness():  # a non-daemon thread: the interpreter's shutdown waits for it, os._exit does not
    threading.main_thread().join()
    os.write(1, b"interpreter shutdown ran\\n")
threading.Thread(target=witness).start()
atexit.register(lambda: print("atexit ran, group alive:", dist.is_initialized(), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
install_error_hook()
destroy_groups_at_exit()
print("buffered, not flushed", end="")
raise FleetError("bad plan")
"""


def test_a_fleet_error_exits_2_after_the_atexit_handlers_without_the_teardown():
    """A FleetError ends the process with exit 2 after every atexit handler (the user's too) and with the standard
    streams flushed, but without the interpreter's teardown, which would destroy the still-alive gloo group's threads
    while joinable and can abort the process (exit -6, "terminate called without an active exception")."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", ENDED_BY_A_FLEET_ERROR, str(port)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == "lightning_fleet: error: bad plan\n"
    assert "buffered, not flushed" in done.stdout and "atexit ran, group alive: True" in done.stdout, done.stdout
    assert "interpreter shutdown ran" not in done.stdout
