"""Plain torchrun, as users launch it: restarts after killed workers, one line per FleetError, no crash loops.

"Plain" = ``python -m torch.distributed.run`` with the rendezvous store shared with the workers (no
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) and torchrun's own ``--rdzv-conf`` defaults. Before
:mod:`lightning_fleet.elastic.worker`, a restarted group read the dead attempt's gloo addresses from that store and
failed ("Gloo connectFullMesh failed ... Connection refused") or hung in ``init_process_group``. Kills are real
SIGKILLs by PID; every launch runs in its own process group, bounded in time, and only that group is killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from lightning_fleet.cli import main
from lightning_fleet.elastic import worker
from tests.multiprocess import ROOT, finish, free_port, kill_family, worker_env
from tests.test_elastic import assert_nothing_lost, steps_done, worker_pid

ELASTIC = ROOT / "tests" / "workers" / "elastic_gpt.py"
FAILING = ROOT / "tests" / "workers" / "fleet_error.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BAD_PLAN = "dp=3,zero=1"  # 8 samples do not split over dp=3: refused at start-up on every rank


def plain_env(tmp: Path) -> dict[str, str]:
    """A worker environment without anything that would make torchrun's store per-attempt."""
    env = worker_env(tmp)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.pop(worker.STOP_FILE_ENV, None)
    return env


_launched: list[psutil.Popen] = []


@pytest.fixture(autouse=True)
def reap_launches():
    """After each test, kill whatever it launched and left running (a failed assertion mid-run)."""
    yield
    while _launched:
        kill_family(_launched.pop())


def start(cmd: list[str], tmp: Path, env: dict[str, str] | None = None, merged: bool = False) -> psutil.Popen:
    """Launch in a session of our own; stdout to tmp/out.log, stderr to tmp/err.log (``merged``: both to out.log, in the
    order a terminal shows them)."""
    out = open(tmp / "out.log", "a")
    err = out if merged else open(tmp / "err.log", "a")
    _launched.append(psutil.Popen(cmd, env=env or plain_env(tmp), cwd=ROOT, stdout=out, stderr=err, start_new_session=True))
    return _launched[-1]


def output(tmp: Path, stream: str = "both") -> str:
    """What the launch printed: "out", "err" or both."""
    names = {"out": ["out.log"], "err": ["err.log"], "both": ["out.log", "err.log"]}[stream]
    return "".join((tmp / name).read_text() for name in names if (tmp / name).exists())


def kill_between_steps(proc: psutil.Popen, tmp: Path, kills: int, timeout: float = 120) -> None:
    """SIGKILL local rank 0, 1, 0, ... once the job has made 2 more steps since the last kill (a restarted group must train)."""
    for kill in range(kills):
        target, deadline = steps_done(tmp) + 2, time.monotonic() + timeout
        while steps_done(tmp) < target:
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"kill {kill}: no progress to step {target}:\n{output(tmp)[-3000:]}"
            )
            time.sleep(0.2)
        victim = worker_pid(proc, kill % 2)
        assert psutil.Process(victim).environ()["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the shared store, as plain torchrun
        os.kill(victim, signal.SIGKILL)


def restarts_seen(tmp: Path) -> set[int]:
    lines = (tmp / "consumed-rank0.jsonl").read_text().splitlines()
    return {json.loads(line)["restart"] for line in lines}


# --- restarts ----------------------------------------------------------------------------------------


@pytest.mark.elastic
def test_five_kills_in_one_plain_c10d_job_lose_nothing(tmp_path):
    """torchrun --rdzv-backend=c10d --max-restarts=5, shared store: 5 kills in a row, 5 restarts, the reference's weights."""
    cmd = [*TORCHRUN, "--nproc-per-node=2", "--max-restarts=5", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(ELASTIC), "--dir", str(tmp_path), "--steps", "16", "--every", "2", "--sleep", "0.3", "--plan", "dp=2,zero=2"]
    proc = start(cmd, tmp_path)
    kill_between_steps(proc, tmp_path, kills=5)
    assert finish(proc, timeout=240) == 0, output(tmp_path)[-3000:]
    assert "connectFullMesh" not in output(tmp_path)
    assert restarts_seen(tmp_path) == {0, 1, 2, 3, 4, 5}
    assert_nothing_lost(tmp_path, 16)


@pytest.mark.elastic
def test_static_launch_restarts_after_a_kill(tmp_path):
    """torchrun's static rendezvous (no --rdzv-* flags: the agent's store at --master-port is the workers'), one kill."""
    cmd = [*TORCHRUN, "--nproc-per-node=2", "--max-restarts=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(ELASTIC), "--dir", str(tmp_path), "--steps", "8", "--every", "2", "--sleep", "0.3", "--plan", "dp=2,zero=1"]
    proc = start(cmd, tmp_path)
    kill_between_steps(proc, tmp_path, kills=1)
    assert finish(proc, timeout=180) == 0, output(tmp_path)[-3000:]
    assert restarts_seen(tmp_path) == {0, 1}
    assert_nothing_lost(tmp_path, 8)


# --- the attempt's own store prefix, on a real TCPStore ---------------------------------------------------


def attempt(port: int, world: int, delays: dict[int, float], timeout_s: float = 20, ranks: list[int] | None = None) -> dict:
    """Run attempt_store for ``ranks`` (default 0..world-1) in threads, rank r after delays[r] s; rank -> store or error."""
    out: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        time.sleep(delays.get(rank, 0))
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        try:
            out[rank] = worker.attempt_store(client, rank, world, timedelta(seconds=timeout_s))
        except Exception as err:  # a dead attempt's ranks time out: that is what the test builds
            out[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
        assert not t.is_alive(), "attempt_store did not return within its timeout"
    return out


def shared(stores: dict[int, object], world: int) -> bool:
    """Whether all ranks' stores are one namespace: each rank writes a key, rank 0 reads them all."""
    for rank in range(world):
        stores[rank].set(f"hello-{rank}", str(rank))  # type: ignore[union-attr]
    return all(stores[0].check([f"hello-{r}"]) for r in range(world))  # type: ignore[union-attr]


@pytest.mark.unit
@pytest.mark.parametrize("old_world, rank_zero_died", [(3, False), (2, False), (3, True)])
def test_attempt_store_ignores_what_earlier_attempts_left(old_world, rank_zero_died):
    """A finished attempt (same or other world size), perhaps followed by one whose rank 0 died waiting for its peers: the
    next attempt's ranks, the slowest being rank 0, agree on a namespace of their own that shares nothing with the earlier
    ones (a naive reader would take the stale leader, whose go key exists or never comes)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    finished = attempt(server.port, old_world, {})
    assert shared(finished, old_world)
    if rank_zero_died:
        partial = attempt(server.port, 3, {1: 0.2}, timeout_s=1.5, ranks=[0, 1])  # rank 2 never comes: 0 and 1 give up
        assert all(isinstance(partial[r], Exception) for r in (0, 1)), partial
    fresh = attempt(server.port, 3, {0: 1.0, 1: 0, 2: 0.1})
    assert all(not isinstance(fresh[r], Exception) for r in range(3)), fresh
    assert not fresh[0].check(["hello-0"])  # type: ignore[union-attr]  # the finished attempt's keys are not visible
    assert shared(fresh, 3)
    fresh[0].set("only-new", "1")  # type: ignore[union-attr]
    assert not finished[0].check(["only-new"])  # type: ignore[union-attr]


# --- one line per FleetError, no crash loop ---------------------------------------------------------------


def run_script(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c code`` without any launcher's variables (an in-process Trainer may have left RANK and such)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")}
    clean = {k: v for k, v in clean.items() if not k.startswith("TORCHELASTIC_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **(env or {})}, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


HOOKED = (
    "from lightning_fleet.elastic import worker\nfrom lightning_fleet.planning import FleetError\nworker.install_error_hook()\n"
)


@pytest.mark.unit
def test_rank_zero_prints_one_line_and_exits_2():
    done = run_script(HOOKED + "raise FleetError('bad plan\\nsecond line')", {"RANK": "0"})
    assert (done.returncode, done.stderr, done.stdout) == (2, "lightning_fleet: error: bad plan second line\n", "")


@pytest.mark.unit
def test_other_rank_is_quiet_while_rank_zero_ends_the_job_and_speaks_up_when_it_does_not():
    """A rank other than 0 waits for the job to end around it; when nobody ends it, rank 0 had no such error: say it."""
    started = time.monotonic()
    done = run_script(HOOKED + "worker.PEER_GRACE_S = 0.5\nraise FleetError('only here')", {"RANK": "1"})
    assert (done.returncode, done.stderr) == (2, "lightning_fleet: error: rank 1: only here\n")
    assert time.monotonic() - started < 20


@pytest.mark.unit
def test_torchruns_error_file_holds_the_line_of_a_fleet_error_and_the_traceback_of_anything_else(tmp_path):
    """torchrun's summary shows an error file's call stack where it has one: a FleetError's file holds its one line and
    none (before: its type and the worker's whole traceback, 36 lines of each rank in torchrun's table)."""
    errors = {"fleet": tmp_path / "fleet.json", "value": tmp_path / "value.json"}
    run_script(HOOKED + "raise FleetError('bad plan')", {"RANK": "0", "TORCHELASTIC_ERROR_FILE": str(errors["fleet"])})
    run_script(HOOKED + "raise ValueError('boom')", {"RANK": "0", "TORCHELASTIC_ERROR_FILE": str(errors["value"])})
    fleet, value = (json.loads(errors[k].read_text())["message"] for k in ("fleet", "value"))
    assert fleet["message"] == "lightning_fleet: error: bad plan" and "py_callstack" not in fleet["extraInfo"]
    assert value["message"] == "ValueError: boom" and value["extraInfo"]["py_callstack"].startswith("Traceback")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.json", "value.json"]  # written whole, no temporary left


@pytest.mark.unit
def test_other_exceptions_keep_their_traceback_and_hooks_chain():
    """Non-FleetErrors reach the hook installed before ours; installing twice changes nothing; a hook installed after
    ours (like init_process_group's stderr-buffering one) is wrapped again so that the line is not swallowed."""
    before = "import sys\nsys.excepthook = lambda *a: print('user hook', a[1], file=sys.stderr)\n"
    again = "h = sys.excepthook\nworker.install_error_hook()\nassert sys.excepthook is h\nraise ValueError('boom')"
    done = run_script(before + HOOKED + again)
    assert (done.returncode, done.stderr) == (1, "user hook boom\n")
    plain = run_script(HOOKED + "raise ValueError('boom')")
    assert plain.returncode == 1 and "Traceback" in plain.stderr and plain.stderr.endswith("ValueError: boom\n")
    buffering = (
        "import io, sys\ninner = sys.excepthook\n"
        "def swallow(*a):\n    sys.stderr, old = io.StringIO(), sys.stderr\n"
        "    try:\n        inner(*a)\n    finally:\n        sys.stderr = old\n"
        "sys.excepthook = swallow\nworker.install_error_hook()\nraise FleetError('seen')"
    )
    wrapped = run_script(HOOKED + buffering, {"RANK": "0"})
    assert (wrapped.returncode, wrapped.stderr) == (2, "lightning_fleet: error: seen\n")


@pytest.mark.pure
def test_which_fleet_errors_are_deterministic():
    """The planning core's verdicts by type, others when marked (also inside deterministic_errors()); marks survive pickling."""
    import pickle

    from lightning_fleet.planning import FleetError, NoFeasiblePlanError, PlanError

    assert worker.is_deterministic(PlanError("p")) and worker.is_deterministic(NoFeasiblePlanError("n"))
    assert not worker.is_deterministic(FleetError("y"))
    assert not worker.is_deterministic(worker.deterministic(PlanError("p"), False))
    with pytest.raises(FleetError) as err, worker.deterministic_errors():
        raise FleetError("x")
    assert worker.is_deterministic(err.value) and worker.is_deterministic(pickle.loads(pickle.dumps(err.value)))


@pytest.mark.pure
@pytest.mark.parametrize(
    "shared, argv, expected",
    [
        (True, ["python", "-m", "torch.distributed.run", "--nnodes=1:8", "t.py", "--nnodes", "2"], "last_call_timeout=1"),
        (True, ["torchrun", "--nnodes", "1:8", "--rdzv_conf", "last_call_timeout=2", "t.py"], "given"),
        (True, ["torchrun", "--nnodes=2", "t.py", "--nnodes=1:2"], None),
        (False, ["torchrun", "--nnodes=1:8", "t.py"], None),
    ],
)
def test_launch_advice_names_what_only_the_launch_can_fix(monkeypatch, shared, argv, expected):
    """Plain torchrun with --nnodes=MIN:MAX and the shared store: one note naming the variable (and last_call_timeout
    when the agents were not given one); nothing for a fixed node count, a per-attempt store, or the script's own flags."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(shared))
    monkeypatch.delenv("PET_NNODES", raising=False)
    monkeypatch.delenv("PET_RDZV_CONF", raising=False)
    monkeypatch.setattr(worker, "_agent_argv", lambda: argv)
    advice = worker.launch_advice()
    if expected is None:
        assert advice is None
    else:
        assert advice is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in advice and "--nnodes=1:8" in advice
        assert ("last_call_timeout=1" in advice) == (expected == "last_call_timeout=1")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "lightning_fleet: error:" in line]


@pytest.mark.multiprocess
def test_bad_plan_under_lightnings_launcher_is_one_line(tmp_path):
    """Trainer(devices=2) (Lightning's subprocess launcher): rank 0 prints the line, rank 1 nothing; exit code 2."""
    env = {**plain_env(tmp_path), "MASTER_PORT": str(free_port())}
    code = finish(start([sys.executable, str(FAILING), "--plan", BAD_PLAN, "--dir", str(tmp_path)], tmp_path, env), timeout=180)
    out = output(tmp_path)
    assert code == 2, out[-3000:]
    lines = error_lines(output(tmp_path, "err"))
    assert len(lines) == 1 and lines[0].startswith("lightning_fleet: error: ") and "dp(3)" in lines[0], out[-3000:]
    assert "Traceback" not in out and "FleetError" not in out
    assert sorted((tmp_path / "starts.txt").read_text().split("\n")[:-1]) == ["0 0", "1 0"]


@pytest.mark.multiprocess
def test_fleet_error_on_one_rank_only_is_still_reported(tmp_path):
    """Only rank 1 raises (rank 0 goes on into a collective): rank 1 speaks up after its grace period, the job ends
    (rank 0's collective then fails: it may say that its peer is gone)."""
    env = {**plain_env(tmp_path), "MASTER_PORT": str(free_port())}
    code = finish(start([sys.executable, str(FAILING), "--fail-on-rank", "1"], tmp_path, env), timeout=180)
    assert code != 0
    lines = error_lines(output(tmp_path, "err"))
    assert lines[0] == "lightning_fleet: error: rank 1: only rank 1 fails", output(tmp_path)[-3000:]
    assert all(re.match(r"lightning_fleet: error: rank 0: a collective( in .+?)? failed: a peer process is gone", line)
               for line in lines[1:]), lines


@pytest.mark.elastic
def test_deterministic_error_ends_a_plain_torchrun_job_at_once(tmp_path):
    """A bad plan under --max-restarts=3: one attempt (not 4), one error line, no worker traceback; rank 0's local agent is
    stopped by its worker (torchrun then reports its SignalException and exits 1)."""
    cmd = [*TORCHRUN, "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(FAILING), "--plan", BAD_PLAN, "--dir", str(tmp_path)]
    started = time.monotonic()
    proc = start(cmd, tmp_path)
    code = finish(proc, timeout=180)
    elapsed = time.monotonic() - started
    log = output(tmp_path)
    assert code == 1 and len(error_lines(log)) == 1, log[-3000:]
    assert sorted((tmp_path / "starts.txt").read_text().split("\n")[:-1]) == ["0 0", "1 0"]  # one attempt
    assert "Received 15 death signal" in log and "FleetError" not in log and "[rank0]:" not in log and "[rank1]:" not in log
    assert elapsed < 90


@pytest.mark.elastic
def test_a_checkpoint_of_another_job_ends_the_job_at_once(tmp_path):
    """A changed data-order seed against a checkpoint dir of the same model: refused in one line, in one attempt, not
    retried --max-restarts times (each retry would refuse it again)."""
    ckpt = tmp_path / "ckpt"
    first = start([*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(FAILING),
                   "--checkpoint-dir", str(ckpt), "--seed", "0"], tmp_path)
    assert finish(first, timeout=180) == 0, output(tmp_path)[-3000:]
    (tmp_path / "out.log").unlink()
    (tmp_path / "err.log").unlink()
    cmd = [*TORCHRUN, "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(FAILING), "--checkpoint-dir", str(ckpt), "--seed", "1", "--dir", str(tmp_path)]
    code = finish(start(cmd, tmp_path), timeout=180)
    log = output(tmp_path)
    lines = error_lines(log)
    assert code == 1 and len(lines) == 1 and "its data order was seeded with 0, this job seeds it with 1" in lines[0], log[-3000:]
    assert sorted((tmp_path / "starts.txt").read_text().split("\n")[:-1]) == ["0 0", "1 0"]  # one attempt


@pytest.mark.elastic
@pytest.mark.parametrize("restarts", [3, 0])
def test_deterministic_error_under_fleet_launch_exits_2(tmp_path, restarts):
    """The same through fleet launch, with restarts left or none: exit code 2, the line once and last on screen, no
    line of the launcher's own (before: with restarts, torchrun's 3 lines about stopping the workers after it; with
    --max-restarts=0 the line twice, the launcher's copy last, exit 1)."""
    cmd = [sys.executable, "-m", "lightning_fleet", "launch", "--nproc-per-node=2", f"--max-restarts={restarts}", str(FAILING),
           "--plan", BAD_PLAN, "--dir", str(tmp_path)]
    proc = start(cmd, tmp_path, merged=True)
    code = finish(proc, timeout=180)
    log = output(tmp_path)
    assert code == 2 and len(error_lines(log)) == 1 and "fleet launch:" not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == error_lines(log)[0], log[-3000:]
    assert sorted((tmp_path / "starts.txt").read_text().split("\n")[:-1]) == ["0 0", "1 0"]


@pytest.mark.elastic
def test_deterministic_error_under_plain_torchrun_without_restarts_ends_in_its_line(tmp_path):
    """The README's main job form (plain torchrun, static rendezvous, no --max-restarts): after the line, only torchrun's
    own short summary, whose root cause is that line (before: 106 lines after it, torchrun's table holding both workers'
    36-line tracebacks). torchrun's own lines (its traceback of ChildFailedError, the table) stay: they are the agent's."""
    cmd = [*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(FAILING),
           "--plan", BAD_PLAN]
    code = finish(start(cmd, tmp_path, merged=True), timeout=180)
    lines = output(tmp_path).strip().splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("lightning_fleet: error: ")]
    assert code == 1 and len(ours) == 1, "\n".join(lines[-60:])
    after = lines[ours[0] + 1 :]
    assert len(after) <= 45, "\n".join(after)
    root = after[after.index("Root Cause (first observed failure):") :]
    assert f"  traceback : {lines[ours[0]]}" in root and "  exitcode  : 2 " in "\n".join(root), "\n".join(after)
    ours_code = [line for line in after if "error_file" not in line and not line.endswith(f"{FAILING} FAILED")]  # torchrun's title
    assert not any("lightning_fleet/" in line or "fleet_error.py" in line for line in ours_code), "\n".join(after)


# --- fleet launch --help and bad values -------------------------------------------------------------------


@pytest.mark.pure
def test_fleet_launch_help_prints_torchruns_help_and_the_defaults(capsys):
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fleet launch: torchrun with fast, safe elastic defaults")
    assert "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120" in out
    assert "usage: fleet launch" in out and "--max-restarts" in out and "--rdzv-endpoint" in out


@pytest.mark.pure
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node=two", "t.py"], "--nproc-per-node=two: expected an integer or one of auto, cpu, gpu, xpu"),
        (["--max-restarts=x", "t.py"], "argument --max-restarts/--max_restarts: invalid int value: 'x'"),
        (["--nnodes=1:b", "t.py"], "--nnodes=1:b: expected N or MIN:MAX (integers)"),
        (["--bogus", "t.py"], "unrecognized arguments: --bogus"),
        (["--rdzv-conf=read_timeout=soon", "--rdzv-endpoint=127.0.0.1:1", "t.py"], "read_timeout='soon': expected an integer"),
    ],
)
def test_fleet_launch_bad_values_are_one_line(capsys, argv, message):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fleet: error: ") and message in err
