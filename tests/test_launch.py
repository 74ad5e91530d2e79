"""fleet launch: torchrun's arguments with the elastic defaults added, and bad endpoints refused at once."""

from __future__ import annotations

import time

import pytest

from lightning_fleet.cli import main
from lightning_fleet.elastic.launch import torchrun_argv
from lightning_fleet.planning import FleetError

CONF = "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


def test_defaults_are_added_before_the_script():
    """Elastic launches get the c10d backend and fast rendezvous settings; the script's own arguments are untouched."""
    argv = torchrun_argv(["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-endpoint=127.0.0.1:29400", "train.py", "--rdzv-conf", "mine"])
    assert argv == ["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-endpoint=127.0.0.1:29400", CONF, "--rdzv-backend=c10d", "train.py", "--rdzv-conf", "mine"]


def test_user_settings_win_and_are_merged():
    """A given --rdzv-conf (either spelling) keeps its values; missing keys get the defaults; a given backend stays."""
    argv = torchrun_argv(["--nproc_per_node", "2", "--rdzv_conf", "keep_alive_interval=2", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1", "t.py"])
    assert "--rdzv-conf=last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=120" in argv
    assert "--rdzv-backend=c10d" not in argv and argv[-1] == "t.py"


def test_fewer_than_three_keep_alive_attempts_are_refused():
    """keep_alive_max_attempt=2 produced a split brain here: refused with the reason."""
    with pytest.raises(FleetError, match="keep_alive_max_attempt=2: fewer than 3"):
        torchrun_argv(["--rdzv-conf=keep_alive_max_attempt=2", "t.py"])


def test_script_is_required():
    with pytest.raises(FleetError, match="needs a training script"):
        torchrun_argv(["--nproc-per-node=2"])


def test_unresolvable_endpoint_fails_at_once_with_one_line(capsys):
    """Scenario 11: a rendezvous host that does not exist is one error line and exit 2 within a second, not minutes of retries."""
    started = time.monotonic()
    code = main(["launch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=no-such-host.invalid:29400", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 5
    assert err.count("\n") == 1 and "host 'no-such-host.invalid' does not resolve" in err
