"""No hangs, no orphans, and the launcher's last line (issue 11): real fleet launch (torchrun in-process), real
SIGSTOP / SIGKILL / SIGTERM of processes these tests started, by PID.

* A SIGSTOPped (hung) peer fails the job within the strategy's timeout + a few seconds, and the restart resumes from
  the last checkpoint (every process group, DeepSpeed's included, carries that timeout).
* The workers die with their agent; DeepSpeed's universal converter dies with its parent.
* Restarts used up: one line naming the failed rank, how it ended and its root cause.
* SIGTERM to the launcher (a preemption): the workers save, the launcher exits 0, a relaunch resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lightning_fleet.elastic.layout import LATEST, MANIFEST
from tests.multiprocess import ROOT, finish, free_port, kill_family, worker_env

WORKER = ROOT / "tests" / "workers" / "hang_gpt.py"
FLEET = [sys.executable, "-m", "lightning_fleet", "launch"]
TIMEOUT_S = 8
"""FleetStrategy(timeout=...) of the hang test, in seconds."""
REPORT_SLACK_S = 10
"""How much longer than the timeout a hung peer may take to fail the job (a step's sleep, Lightning's teardown, exit)."""


def launch(tmp: Path, *args: str, restarts: int = 0, script: Path = WORKER, log_name: str = "launch.log") -> psutil.Popen:
    """Start ``fleet launch`` with 2 processes in its own session; output goes to tmp/<log_name>."""
    log = open(tmp / log_name, "a")
    cmd = [*FLEET, "--nnodes=1", "--nproc-per-node=2", f"--max-restarts={restarts}", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--rdzv-backend=c10d", str(script), *args]
    return psutil.Popen(cmd, env=worker_env(tmp), cwd=ROOT, stdout=log, stderr=log, start_new_session=True)


def train(tmp: Path, *args: str, restarts: int = 0) -> psutil.Popen:
    """The hang worker under fleet launch, checkpointing to tmp/ckpt."""
    return launch(tmp, "--dir", str(tmp), *args, restarts=restarts)


def log_of(tmp: Path, name: str = "launch.log") -> str:
    return (tmp / name).read_text()


def steps_done(tmp: Path, rank: int = 0) -> int:
    path = tmp / f"steps-rank{rank}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_steps(tmp: Path, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(tmp) < count:
        assert time.monotonic() < deadline, f"no {count} steps within {timeout} s:\n{log_of(tmp)[-3000:]}"
        time.sleep(0.2)


def workers(proc: psutil.Popen) -> dict[int, psutil.Process]:
    """The launcher's training processes by LOCAL_RANK."""
    found = {}
    for child in proc.children(recursive=True):
        try:
            if str(WORKER) in child.cmdline():
                found[int(child.environ()["LOCAL_RANK"])] = child
        except (psutil.NoSuchProcess, KeyError):
            continue
    return found


def alive(process: psutil.Process) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in processes if alive(p)]


def kill_all(processes: list[psutil.Process]) -> None:
    """SIGCONT and SIGKILL each of ``processes`` still alive (our own, by PID)."""
    for process in processes:
        try:
            process.resume()
            process.kill()
        except psutil.NoSuchProcess:
            pass


def committed_step(ckpt: Path) -> tuple[str, int]:
    """The step directory ``latest`` names and the step its manifest records."""
    name = (ckpt / LATEST).read_text().strip()
    return name, json.loads((ckpt / name / MANIFEST).read_text())["step"]


def final(tmp: Path) -> dict:
    return json.loads((tmp / "final.json").read_text())


@pytest.mark.elastic
@pytest.mark.serial
def test_hung_peer_fails_within_the_timeout_and_the_restart_resumes(tmp_path):
    """Every process group (the default one and DeepSpeed's data-parallel one) carries FleetStrategy(timeout=8 s); a
    SIGSTOPped rank 1 makes rank 0 fail with one line within timeout + REPORT_SLACK_S (before: Lightning's per-step
    broadcast swallowed the timeout and DeepSpeed's group waited torch's 30 min: still hung after 120 s); torchrun's
    restart resumes from the newest checkpoint and finishes. The stopped process is continued once the failure is
    reported, so that it answers torchrun's SIGTERM (a process that never does is SIGKILLed by torchrun after 30 s)."""
    proc = train(tmp_path, "--steps", "10", "--every", "2", "--sleep", "0.4", "--timeout", str(TIMEOUT_S), restarts=1)
    started = []
    try:
        wait_for_steps(tmp_path, 3)
        started = list(workers(proc).values())
        for rank in (0, 1):
            groups = json.loads((tmp_path / f"groups-rank{rank}-attempt0.json").read_text())
            assert len(groups) >= 2 and {g["timeout_s"] for g in groups} == {TIMEOUT_S}, groups
        hung, survivor = workers(proc)[1], workers(proc)[0]
        done = steps_done(tmp_path, 1)
        while steps_done(tmp_path, 1) == done:  # stop it between steps (in its sleep): rank 0 then waits in the next step
            time.sleep(0.01)
        hung.suspend()
        stopped_at = time.monotonic()
        bound = TIMEOUT_S + REPORT_SLACK_S
        assert not wait_gone([survivor], bound), f"rank 0 still waits {bound} s after its peer hung"
        failed_after = time.monotonic() - stopped_at
        newest, _ = committed_step(tmp_path / "ckpt")
        hung.resume()
        assert finish(proc, timeout=180) == 0, log_of(tmp_path)[-3000:]
    finally:
        kill_all(started)
        kill_family(proc)
    log = log_of(tmp_path)
    said = (f"rank 0: a collective in the per-step SIGTERM broadcast did not complete within FleetStrategy(timeout={TIMEOUT_S} "
            "s): a peer process is hung (")
    assert f"lightning_fleet: error: {said}" in log
    result = final(tmp_path)
    assert result["global_step"] == 10 and result["resumed_from"].endswith(newest), (result, newest)
    assert TIMEOUT_S <= failed_after <= TIMEOUT_S + REPORT_SLACK_S


def sleeps_started(tmp: Path, rank: int) -> int:
    path = tmp / f"sleeping-rank{rank}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.elastic
@pytest.mark.parametrize("where, during", [
    ("checkpoint", "FleetCheckpoint's per-step agreement on saving"),
    ("backward", "the backward pass (the loss check and DeepSpeed's gradient reduction)"),
])
@pytest.mark.serial
def test_a_peer_hung_at_the_save_agreement_or_the_gradient_reduction_is_one_line(tmp_path, where, during):
    """Rank 1 SIGSTOPped right before FleetCheckpoint's per-step all-reduce, or before its backward (rank 0 then waits in
    DeepSpeed's gradient reduction of ZeRO-2): rank 0 ends in peer_lost's one line naming that collective, within the
    timeout + REPORT_SLACK_S (before: a 41-118-line traceback of gloo's RuntimeError "Timed out waiting 8000ms")."""
    proc = train(tmp_path, "--steps", "40", "--every", "100", "--sleep", "0.4", "--sleep-at", where, "--timeout", str(TIMEOUT_S),
                 "--plan", "dp=2,zero=2,runtime=deepspeed")  # the line names the runtime reducing the gradient
    started = []
    try:
        wait_for_steps(tmp_path, 2)
        started = list(workers(proc).values())
        hung, survivor = workers(proc)[1], workers(proc)[0]
        done = sleeps_started(tmp_path, 1)
        while sleeps_started(tmp_path, 1) == done:  # stop it in its sleep: rank 0 goes on into the collective
            time.sleep(0.01)
        hung.suspend()
        bound = TIMEOUT_S + REPORT_SLACK_S
        assert not wait_gone([survivor], bound), f"rank 0 still waits {bound} s after its peer hung"
        hung.resume()
        assert finish(proc, timeout=120) != 0
    finally:
        kill_all(started)
        kill_family(proc)
    log = log_of(tmp_path)
    said = (f"lightning_fleet: error: rank 0: a collective in {during} did not complete within FleetStrategy(timeout="
            f"{TIMEOUT_S} s): a peer process is hung (RuntimeError: ")
    assert said in log and "Traceback" not in log, log[-4000:]


@pytest.mark.elastic
@pytest.mark.serial
def test_workers_die_with_their_agent(tmp_path):
    """SIGKILL of the agent (fleet launch runs torchrun's agent in-process): both workers are gone within 5 s (before:
    both trained on, unsupervised, to the end of the run)."""
    proc = train(tmp_path, "--steps", "60", "--every", "100", "--sleep", "0.4", "--timeout", "60")
    started = []
    try:
        wait_for_steps(tmp_path, 2)
        started = list(workers(proc).values())
        assert len(started) == 2
        proc.kill()
        proc.wait(10)
        left = wait_gone(started, 5)
        assert not left, f"workers {[p.pid for p in left]} outlived their agent"
    finally:
        kill_all(started)
        kill_family(proc)


_CONVERTING_PARENT = """
import sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from lightning_fleet.runtime.deepspeed.universal import make_universal
step = Path(sys.argv[1])
make_universal(SimpleNamespace(path=step, manifest=SimpleNamespace(files={{}})), source_zero=2, timeout_s=600)
"""


@pytest.mark.unit
@pytest.mark.serial
def test_universal_converter_dies_with_its_parent(tmp_path):
    """make_universal's converter subprocess dies when its parent is SIGKILLed (before: still there 10 s later,
    re-parented to PID 1). The parent is killed as soon as the converter appears, while it still imports torch and
    DeepSpeed (seconds; checked to be running then: the restricted loader never opens a shard that is not a regular
    file, so a FIFO cannot hold it); the checkpoint object is a stand-in with the two attributes make_universal reads."""
    from lightning_fleet.elastic.layout import deepspeed_files

    step = tmp_path / "step-000000002"
    shards = deepspeed_files(step)
    shards.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))):
        os.mkfifo(shards / name)
    script = tmp_path / "parent.py"
    script.write_text(_CONVERTING_PARENT.format(root=str(ROOT)))
    parent = psutil.Popen([sys.executable, str(script), str(step)], env=worker_env(tmp_path), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    converter: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not converter and time.monotonic() < deadline and parent.is_running():
            converter = [c for c in parent.children() if "lightning_fleet.runtime.deepspeed.convert" in c.cmdline()]
            time.sleep(0.1)
        assert converter, "make_universal did not start its converter within 60 s"
        assert converter[0].status() != psutil.STATUS_ZOMBIE, "the converter ended before its parent was killed"
        parent.kill()
        parent.wait(10)
        assert not wait_gone(converter, 5), "the converter outlived its parent"
    finally:
        kill_all(converter)
        kill_family(parent)


_FAILING_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
import lightning_fleet
lightning_fleet.FleetStrategy()  # installs the error hook, as every fleet job does
if os.environ["RANK"] == "1":
    raise RuntimeError("the disk is on fire (attempt " + os.environ["TORCHELASTIC_RESTART_COUNT"] + ")")
time.sleep(60)
"""


@pytest.mark.elastic
def test_used_up_restarts_name_the_rank_and_the_root_cause(tmp_path):
    """Rank 1 raises on every attempt; with --max-restarts=1 used up, the launcher's last line names rank 1, its exit
    code and the exception of the last attempt (before: "fleet launch: ChildFailedError: =====...")."""
    script = tmp_path / "failing.py"
    script.write_text(_FAILING_SCRIPT.format(root=str(ROOT)))
    proc = launch(tmp_path, restarts=1, script=script)
    assert finish(proc, timeout=120) == 1
    last = log_of(tmp_path).strip().splitlines()[-1]
    assert last.startswith("fleet launch: the job failed, restarts used up: rank 1 (local rank 1, pid "), last
    assert last.endswith("exited with code 1: RuntimeError: the disk is on fire (attempt 1)"), last


@pytest.mark.pure
def test_root_cause_of_a_signal_without_error_file_is_named():
    """A worker killed by a signal leaves no error file: the line names the signal (torchrun's own failure record)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from lightning_fleet.elastic.launch import root_cause_line

    failures = {3: ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file="/nonexistent/error.json"),
                2: ProcessFailure(local_rank=0, pid=4241, exitcode=-signal.SIGTERM, error_file="/nonexistent/error.json")}
    failures[2].timestamp = failures[3].timestamp + 1
    line = root_cause_line(ChildFailedError("train.py", failures))
    assert line == "fleet launch: the job failed, restarts used up: rank 3 (local rank 1, pid 4242) was killed by SIGKILL"


@pytest.mark.elastic
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_to_the_launcher_saves_exits_0_and_the_relaunch_resumes(tmp_path, sig):
    """SIGTERM to fleet launch (a scheduler's preemption), or SIGHUP (a closed terminal or session): torchrun forwards
    it, FleetCheckpoint commits the step the workers stop at, every worker exits 0 and so does the launcher (before: 1,
    "SignalException"; with SIGHUP the workers died without saving); a relaunch resumes (checked once, after SIGTERM)."""
    proc = train(tmp_path, "--steps", "40", "--every", "100", "--sleep", "0.4", "--timeout", "60", restarts=1)
    try:
        wait_for_steps(tmp_path, 3)
        proc.send_signal(sig)
        assert finish(proc, timeout=120) == 0, log_of(tmp_path)[-3000:]
    finally:
        kill_family(proc)
    stopped = final(tmp_path)
    assert stopped["preempted"] and 3 <= stopped["global_step"] < 40
    name, step = committed_step(tmp_path / "ckpt")
    assert step == stopped["global_step"]
    after = log_of(tmp_path).split(f"fleet launch: stopped by {sig.name}; all 2 local workers exited 0")
    assert len(after) == 2 and "Traceback" not in after[1], after[-1][-3000:]  # the line is the launcher's last word
    if sig != signal.SIGTERM:
        return
    again = train(tmp_path, "--steps", str(step + 2), "--every", "100", "--timeout", "60")
    assert finish(again, timeout=120) == 0, log_of(tmp_path)[-3000:]
    resumed = final(tmp_path)
    assert resumed["global_step"] == step + 2 and resumed["resumed_from"].endswith(name)


@pytest.mark.pure
def test_sigterm_with_a_failed_worker_is_not_success(capsys):
    """After a SIGTERM, a worker that did not exit 0 (it failed to save, or was killed) makes the launcher exit 1 and
    say which."""
    from lightning_fleet.elastic.launch import _stopped_by_signal

    assert _stopped_by_signal(signal.SIGTERM, {0: 0, 1: -signal.SIGKILL}) == 1
    assert capsys.readouterr().out == "fleet launch: stopped by SIGTERM; local rank 1: killed by SIGKILL\n"
    assert _stopped_by_signal(signal.SIGINT, {0: 0, 1: 0}) == 1
    assert _stopped_by_signal(signal.SIGHUP, {0: 0, 1: 0}) == 0  # a closed session: the workers saved, as for SIGTERM
    assert capsys.readouterr().out.splitlines()[-1].startswith("fleet launch: stopped by SIGHUP; all 2 local workers exited 0")
    assert _stopped_by_signal(signal.SIGTERM, {}) == 1
