"""``fleet launch``: torchrun with defaults that make elastic jobs restart fast and resize safely.

Measured on this kind of machine (see the README's elastic section): with torchrun's defaults a
restart waits ~31 s (the c10d rendezvous' 30 s ``last_call_timeout``) and a second agent joining a
running job deadlocks on the shared TCP store. ``fleet launch`` takes torchrun's own arguments and
adds, unless given:

* ``--rdzv-backend=c10d`` for multi-node / elastic launches;
* ``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120`` (a dead agent
  is noticed in ~3-6 s; fewer than 3 attempts produced a split brain here, so it is refused);
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment (scale-up works).
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

from lightning_fleet.planning import FleetError

RDZV_DEFAULTS = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "120"}
MIN_KEEP_ALIVE_ATTEMPTS = 3


_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module"}


def _parse_options(argv: list[str]) -> tuple[list[tuple[int, str, str, int]], int]:
    """torchrun's options before the script as (index, --key, value, tokens), and the script's index."""
    found, i = [], 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        width = 1 if (eq or arg in _FLAGS) else 2
        found.append((i, key.replace("_", "-"), value if eq else (argv[i + 1] if width == 2 and i + 1 < len(argv) else ""), width))
        i += width
    return found, i


def _option(options: list[tuple[int, str, str, int]], name: str) -> tuple[int, str, int] | None:
    """(index, value, tokens) of ``--name``, if given."""
    for index, key, value, width in options:
        if key == f"--{name}":
            return index, value, width
    return None


def torchrun_argv(argv: Sequence[str]) -> list[str]:
    """torchrun's argv with the fleet defaults added where the user left them out."""
    argv = list(argv)
    parsed, cut = _parse_options(argv)
    options, script = argv[:cut], argv[cut:]
    if not script:
        raise FleetError("fleet launch needs a training script, e.g. fleet launch --nproc-per-node=2 train.py")
    conf = _option(parsed, "rdzv-conf")
    given = dict(item.split("=", 1) for item in conf[1].split(",") if "=" in item) if conf else {}
    attempts = int(given.get("keep_alive_max_attempt", MIN_KEEP_ALIVE_ATTEMPTS))
    if attempts < MIN_KEEP_ALIVE_ATTEMPTS:
        raise FleetError(
            f"--rdzv-conf keep_alive_max_attempt={attempts}: fewer than {MIN_KEEP_ALIVE_ATTEMPTS} lets two halves of a job "
            "form separate worlds (seen here); use 3 or more"
        )
    if conf:
        options = options[: conf[0]] + options[conf[0] + conf[2] :]
    options.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in {**RDZV_DEFAULTS, **given}.items()))
    nnodes = _option(parsed, "nnodes")
    elastic = _option(parsed, "rdzv-endpoint") is not None or (nnodes is not None and ":" in nnodes[1])
    if elastic and _option(parsed, "rdzv-backend") is None:
        options.append("--rdzv-backend=c10d")
    return options + script


def check_endpoint(argv: Sequence[str]) -> None:
    """Fail at once, with one line, when the rendezvous host does not resolve (torchrun would retry for minutes)."""
    endpoint = _option(_parse_options(list(argv))[0], "rdzv-endpoint")
    if endpoint is None or not endpoint[1]:
        return
    host = endpoint[1].rsplit(":", 1)[0].strip("[]") if ":" in endpoint[1] else endpoint[1]
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise FleetError(f"--rdzv-endpoint {endpoint[1]}: host {host!r} does not resolve ({err.strerror}); give the address of the rendezvous host") from None


def launch(argv: Sequence[str]) -> int:
    """Run torch.distributed.run with the fleet defaults; returns its exit code."""
    check_endpoint(argv)
    args = torchrun_argv(argv)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except SystemExit as stop:
        return int(stop.code or 0)
    except Exception as err:  # torchrun's ChildFailedError and rendezvous errors: report, don't dump a traceback
        name = type(err).__name__
        first = str(err).strip().splitlines()
        print(f"fleet launch: {name}: {first[0] if first else ''}", flush=True)
        return 1
    return 0
