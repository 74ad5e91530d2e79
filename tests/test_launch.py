"""fleet launch: torchrun's arguments with the elastic defaults added, and bad endpoints refused at once."""

from __future__ import annotations

import time

import pytest

from lightning_fleet.cli import main
from lightning_fleet.elastic.launch import torchrun_argv
from lightning_fleet.planning import FleetError

CONF = "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


@pytest.mark.pure
def test_defaults_are_added_before_the_script():
    """Elastic launches get the c10d backend and fast rendezvous settings; the script's own arguments are untouched."""
    argv = torchrun_argv(["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-endpoint=127.0.0.1:29400", "train.py", "--rdzv-conf", "mine"])
    assert argv == ["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-endpoint=127.0.0.1:29400", CONF, "--rdzv-backend=c10d", "train.py", "--rdzv-conf", "mine"]


@pytest.mark.pure
def test_user_settings_win_and_are_merged():
    """A given --rdzv-conf (either spelling) keeps its values; missing keys get the defaults; a given backend stays."""
    argv = torchrun_argv(["--nproc_per_node", "2", "--rdzv_conf", "keep_alive_interval=2", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1", "t.py"])
    assert "--rdzv-conf=last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=120" in argv
    assert "--rdzv-backend=c10d" not in argv and argv[-1] == "t.py"


@pytest.mark.pure
def test_fewer_than_three_keep_alive_attempts_are_refused():
    """keep_alive_max_attempt=2 produced a split brain here: refused with the reason."""
    with pytest.raises(FleetError, match="keep_alive_max_attempt=2: fewer than 3"):
        torchrun_argv(["--rdzv-conf=keep_alive_max_attempt=2", "t.py"])


@pytest.mark.pure
def test_script_is_required():
    with pytest.raises(FleetError, match="needs a training script"):
        torchrun_argv(["--nproc-per-node=2"])


@pytest.mark.unit
def test_unresolvable_endpoint_fails_at_once_with_one_line(capsys):
    """Scenario 11: a rendezvous host that does not exist is one error line and exit 2 within a second, not minutes of retries."""
    started = time.monotonic()
    code = main(["launch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=no-such-host.invalid:29400", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 5
    assert err.count("\n") == 1 and "host 'no-such-host.invalid' does not resolve" in err


@pytest.mark.unit
@pytest.mark.serial
def test_unreachable_endpoint_fails_within_read_timeout(capsys):
    """Scenario 11: a remote endpoint that accepts no connection (TEST-NET-1 address) is one line and exit 2 after
    read_timeout, instead of torchrun's 158 s of retries with C++ stack traces (measured)."""
    started = time.monotonic()
    code = main(["launch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=192.0.2.1:29400", "--rdzv-conf=read_timeout=3", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 10
    assert err.count("\n") == 1 and "--rdzv-endpoint 192.0.2.1:29400 did not accept a connection within 3 s" in err


@pytest.mark.unit
def test_silent_endpoint_is_a_bounded_failure(tmp_path):
    """Scenario 11: a port that accepts connections but is no rendezvous store (torchrun alone hangs for good here):
    the launcher exits 2 with one line after join_timeout + read_timeout, and started no worker."""
    import socket
    import subprocess
    import sys

    from tests.multiprocess import ROOT, worker_env

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        cmd = [sys.executable, "-m", "lightning_fleet", "launch", "--nnodes=2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-conf=join_timeout=4,read_timeout=2", str(ROOT / "tests" / "workers" / "elastic_gpt.py"), "--dir", str(tmp_path)]
        started = time.monotonic()
        done = subprocess.run(cmd, env=worker_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 30, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"fleet launch: no rendezvous at 127.0.0.1:{port} within 6 s" in done.stdout
    assert not (tmp_path / "consumed-rank0.jsonl").exists()
