"""Launching real multi-process jobs from tests: free loopback ports, bounded time, only our own processes killed."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "train_gpt.py"
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
"""Trainer keywords of the tests' and workers' Trainers: no logger, checkpoints, progress bar or model summary."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set by an in-process Trainer or by a launcher; a worker that inherits them believes it was
# launched externally (LOCAL_RANK) and waits forever for peers nobody starts.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@functools.cache
def shared_cache() -> Path:
    """The calibration cache the jobs of one test run share: ``FLEET_TEST_CACHE`` where set (scripts/suite.py sets it
    for every lane), else a directory made on first use and removed at exit. The first job
    of each world shape measures the machine (about 5 s of GEMM, attention and collective probes) and writes it, later
    jobs read it, as a user's later jobs on one host do; each job still probes its ranks at its start. A test about
    measuring or about the cache passes ``private_cache=True``."""
    if os.environ.get("FLEET_TEST_CACHE"):
        return Path(os.environ["FLEET_TEST_CACHE"])
    path = Path(tempfile.mkdtemp(prefix="fleet-test-calibration-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def worker_env(tmp: Path, *, private_cache: bool = False) -> dict[str, str]:
    """Environment of a worker: one thread, loopback, the run's shared calibration cache (``tmp/cache`` when
    ``private_cache``), no inherited launch state."""
    inherited = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "PL_"))}
    return {
        **inherited,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FLEET_CACHE_DIR": str(tmp / "cache" if private_cache else shared_cache()),
    }


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill that group (and nothing else) and fail."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_worker(tmp: Path, *args: str, torchrun: bool = False, timeout: float = 600, worker: Path = WORKER,
               private_cache: bool = False) -> tuple[list[dict], str]:
    """Run a worker script (the training worker by default; Lightning's launcher, or torchrun) and load its results."""
    out = tmp / f"result-{free_port()}.pt"
    env = worker_env(tmp, private_cache=private_cache)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={env['MASTER_PORT']}", str(worker)]
    else:
        cmd = [sys.executable, str(worker)]
    done = run([*cmd, *args, "--out", str(out)], env, timeout)
    assert done.returncode == 0, done.stdout[-6000:]
    import torch

    return torch.load(out, weights_only=False), done.stdout  # our own file, written by our worker


def kill_family(proc) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL a launcher (a psutil.Popen) and its descendants by PID (torchrun starts each worker in a session of its
    own: killing the launcher's process group would orphan them)."""
    import psutil

    try:
        family = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


def finish(proc, timeout: float = 300) -> int:  # type: ignore[no-untyped-def]
    """The launcher's exit code; past ``timeout`` kill it with its workers and fail."""
    import psutil

    try:
        return proc.wait(timeout)
    except psutil.TimeoutExpired:
        kill_family(proc)
        raise AssertionError(f"launcher did not finish in {timeout} s") from None
