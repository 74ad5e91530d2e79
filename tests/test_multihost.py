"""Tier 4 across two "hosts": scenarios 1 and 7 with each torchrun agent in its own Linux network namespace.

Host A and host B are network namespaces joined by a veth pair in a random private /24; each has only
`lo` and its end of the veth, so every byte between the two halves of the job (torchrun's rendezvous,
the workers' TCP store, gloo's collectives) crosses the veth, as between two machines. Both hosts see
the same filesystem: the shared checkpoint directory of a real cluster. Needs root (skipped otherwise).

What it takes to run torchrun and gloo this way (the same holds on real hosts whose hostname does not
resolve to the address the others reach them at; here both "hosts" are called the same and resolve it
to 127.0.0.1):

* ``--rdzv-conf=is_host=true`` on host A (``false`` on B): torchrun guesses whether it hosts the
  rendezvous store by matching the endpoint against its hostname's addresses; that guess fails here and
  both agents wait as clients for a store nobody serves.
* ``--local-addr=<own veth address>`` on each agent: the rank-0 agent advertises it as the workers'
  MASTER_ADDR; without it the workers are sent to "localhost" and the job hangs.
* ``GLOO_SOCKET_IFNAME=<own veth>`` in each agent's environment: gloo otherwise binds to the address
  of the hostname, 127.0.0.1, which the other host cannot reach.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.multiprocess import ROOT, free_port, worker_env
from tests.test_elastic import FLEET, WORKER, assert_nothing_lost, finish, records, worker_pid

pytestmark = pytest.mark.elastic


@dataclass(frozen=True)
class Host:
    name: str  # also the log's name
    netns: str
    ifname: str
    addr: str


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)


@pytest.fixture
def hosts():
    """Two namespaces, fleet-a-<pid> and fleet-b-<pid>, joined by a veth pair; removed afterwards whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    pid, net = os.getpid(), f"10.{random.randint(0, 255)}.{random.randint(0, 255)}"
    a = Host("host-a", f"fleet-a-{pid}", f"fva{pid}", f"{net}.1")
    b = Host("host-b", f"fleet-b-{pid}", f"fvb{pid}", f"{net}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            done = ip("netns", "add", host.netns)
            if done.returncode:
                pytest.skip(f"`ip netns add` failed: {done.stderr.strip()}")
            created.append(host.netns)
        steps = [
            ("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname, "netns", b.netns),
            *[("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname) for h in (a, b)],
            *[("-n", h.netns, "link", "set", dev, "up") for h in (a, b) for dev in ("lo", h.ifname)],
        ]
        for step in steps:
            done = ip(*step)
            if done.returncode:
                pytest.skip(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
        yield a, b
    finally:
        for netns in created:  # deleting a namespace deletes the veth end inside it, and so the pair
            ip("netns", "delete", netns)


def launch_on(host: Host, rdzv: Host, port: int, tmp: Path, *worker_args: str) -> psutil.Popen:
    """`fleet launch` inside host's namespace (its own process group), one process, elastic 1:2; output to tmp/<host>.log."""
    cmd = ["ip", "netns", "exec", host.netns, *FLEET, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
           f"--rdzv-endpoint={rdzv.addr}:{port}", "--rdzv-backend=c10d", f"--rdzv-conf=is_host={str(host is rdzv).lower()}",
           f"--local-addr={host.addr}", str(WORKER), "--dir", str(tmp), *worker_args]
    env = {**worker_env(tmp), "GLOO_SOCKET_IFNAME": host.ifname}
    with open(tmp / f"{host.name}.log", "a") as log:
        return psutil.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)


def kill_ours(tmp: Path) -> None:
    """SIGKILL what is left of this test's agents and workers: the processes whose command line names its directory
    (torchrun starts each worker in a session of its own, so the agents' process groups do not hold them)."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(tmp) in (proc.info["cmdline"] or []):
                proc.kill()


def wait_for_both_ranks(tmp: Path, since: float, step: int, logs: Callable[[], str], timeout: float = 120) -> None:
    """Until both ranks have trained `step` (or later) after time `since`: the two hosts train together."""
    deadline = time.monotonic() + timeout
    while not all(any(r["time"] > since and r["step"] >= step for r in records(tmp, rank)) for rank in (0, 1)):
        assert time.monotonic() < deadline, f"both ranks did not reach step {step} within {timeout} s:\n{logs()}"
        time.sleep(0.2)


def test_worker_then_agent_killed_on_another_host(hosts, tmp_path):
    """Scenarios 1 and 7 across two hosts in one job of 24 steps, one process per host under --nnodes=1:2.

    Checkpoints every 3 steps, so that both kills land between two and steps are redone. Scenario 1: SIGKILL
    host B's worker after step 5: torchrun restarts the group on both hosts, the job resumes at world 2 from
    the newest checkpoint. Scenario 7: SIGKILL host B's agent and its worker once both ranks are past step 13
    again: host A, which serves the rendezvous, re-rendezvouses alone, re-plans for one process, reshards and
    finishes. Nothing is lost: the final weights and eval loss equal the one-process reference and every
    step's committed samples are exactly those the global order gives it.
    """
    a, b = hosts
    port = free_port()
    args = ("--steps", "24", "--every", "3", "--sleep", "0.4", "--zero-stages", "3")
    agents = {host: launch_on(host, a, port, tmp_path, *args) for host in (a, b)}
    logs = lambda: "".join(f"--- {h.name}\n" + (tmp_path / f"{h.name}.log").read_text()[-2500:] for h in agents)
    try:
        wait_for_both_ranks(tmp_path, since=0, step=5, logs=logs)  # A may first start alone: --nnodes=1:2
        killed_worker = time.time()
        os.kill(worker_pid(agents[b], 0), signal.SIGKILL)
        wait_for_both_ranks(tmp_path, since=killed_worker, step=13, logs=logs)
        for proc in [*agents[b].children(recursive=True), agents[b]]:
            proc.kill()
        assert finish(agents[a], timeout=180) == 0, logs()
    finally:
        kill_ours(tmp_path)
        for proc in agents.values():
            proc.wait(10)
    log = (tmp_path / f"{a.name}.log").read_text() + (tmp_path / f"{b.name}.log").read_text()
    assert "same plan and world" in log, logs()  # scenario 1: resumed at world 2
    assert "resharded from 2 to 1 processes" in log, logs()  # scenario 7
    result = assert_nothing_lost(tmp_path, 24)
    assert result["plan"].startswith("dp=1,")
