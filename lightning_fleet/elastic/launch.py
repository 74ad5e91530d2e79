"""``fleet launch``: torchrun with defaults that make elastic jobs restart fast and resize safely.

Measured on this kind of machine (see the README's elastic section): with torchrun's defaults a
restart waits ~31 s (the c10d rendezvous' 30 s ``last_call_timeout``) and a second agent joining a
running job deadlocks on the shared TCP store. ``fleet launch`` takes torchrun's own arguments and
adds, unless given:

* ``--rdzv-backend=c10d`` for multi-node / elastic launches;
* ``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120`` (a dead agent
  is noticed in ~3-6 s; fewer than 3 attempts produced a split brain here, so it is refused);
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment (scale-up works; a restart of a fixed-size
  job works either way: the worker opens its process group on a store prefix of its own attempt, see
  :mod:`lightning_fleet.elastic.worker`).

Bad values are one line and exit code 2 (torchrun's own parser decides what is valid); ``fleet launch --help``
prints these defaults and torchrun's help. A worker that ends the job for a deterministic FleetError (its line
printed by rank 0) stops the agent; ``fleet launch`` then exits 2 without a line of its own.

A wrong endpoint is one line and a bounded wait, never a hang (measured with torchrun alone: an
unroutable host took 158 s and printed C++ stack traces; a port that accepts connections but is
not a rendezvous store hung for good): the host must resolve, a remote endpoint must accept a TCP
connection within ``read_timeout`` (torchrun's own store timeout, 60 s unless given), and the first
rendezvous must start the workers within ``join_timeout + read_timeout``.

Imports the standard library, torch's launcher and psutil (at call time) and elastic/worker.py's exit conventions;
imported by the CLI only.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from lightning_fleet.elastic.worker import EXIT_CODE, STOP_FILE_ENV
from lightning_fleet.planning import FleetError

RDZV_DEFAULTS = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "120"}
TORCHRUN_READ_TIMEOUT_S = 60
"""torchrun's c10d store timeout when ``--rdzv-conf read_timeout`` is not given."""
MIN_KEEP_ALIVE_ATTEMPTS = 3


_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module", "-h", "--help"}
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_NO_SCRIPT = "fleet launch needs a training script, e.g. fleet launch --nproc-per-node=2 train.py"


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
        raise FleetError(_NO_SCRIPT)
    conf = _option(parsed, "rdzv-conf")
    given = _rdzv_conf(parsed)
    attempts = _integer("--rdzv-conf keep_alive_max_attempt", given.get("keep_alive_max_attempt", str(MIN_KEEP_ALIVE_ATTEMPTS)))
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


def _endpoint(argv: Sequence[str]) -> tuple[str, int | None] | None:
    """(host, port) of ``--rdzv-endpoint`` if given (port None when left out)."""
    endpoint = _option(_parse_options(list(argv))[0], "rdzv-endpoint")
    if endpoint is None or not endpoint[1]:
        return None
    text = endpoint[1]
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    return host, int(port) if port.isdigit() else None


def _rdzv_conf(parsed: list[tuple[int, str, str, int]]) -> dict[str, str]:
    """The key=value pairs of ``--rdzv-conf`` (empty when not given)."""
    conf = _option(parsed, "rdzv-conf")
    return dict(item.split("=", 1) for item in conf[1].split(",") if "=" in item) if conf else {}


def _rdzv_seconds(argv: Sequence[str], key: str, default: int) -> int:
    return _integer(f"--rdzv-conf {key}", _rdzv_conf(_parse_options(list(argv))[0]).get(key, str(default)))


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FleetError(f"{name}={text!r}: expected an integer") from None


def check_arguments(argv: Sequence[str]) -> None:
    """Refuse what torchrun would refuse (its own parser decides), and the node and process counts it would only
    reject after starting, each as one FleetError line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        if "training_script" in message:  # argparse's "the following arguments are required: training_script, ..."
            raise FleetError(_NO_SCRIPT)
        raise FleetError(f"fleet launch: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    args = parser.parse_args(list(argv))
    low, _, high = args.nnodes.partition(":")
    if not low.isdigit() or (high and not high.isdigit()) or args.nnodes.count(":") > 1:
        raise FleetError(f"fleet launch: --nnodes={args.nnodes}: expected N or MIN:MAX (integers)")
    if not (args.nproc_per_node.isdigit() or args.nproc_per_node in _NPROC_WORDS):
        words = ", ".join(_NPROC_WORDS)
        raise FleetError(f"fleet launch: --nproc-per-node={args.nproc_per_node}: expected an integer or one of {words}")


def help_text() -> str:
    """``fleet launch --help``: what fleet adds to torchrun, then torchrun's own help."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "fleet launch"
    conf = ",".join(f"{k}={v}" for k, v in RDZV_DEFAULTS.items())
    return (
        "fleet launch: torchrun with fast, safe elastic defaults. It takes torchrun's arguments and adds, unless given:\n"
        f"  --rdzv-conf {conf}\n"
        "      (keys you give win; keep_alive_max_attempt below 3 is refused: it split one job into two worlds here)\n"
        "  --rdzv-backend=c10d   when --rdzv-endpoint or --nnodes=MIN:MAX is given\n"
        "  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the agents' environment (a joining agent deadlocks on the shared store)\n"
        "A wrong --rdzv-endpoint fails in one line within read_timeout (or join_timeout + read_timeout) instead of hanging.\n"
        "A deterministic FleetError in the workers ends the job at once (no restarts spent) with exit code 2.\n\n"
        + parser.format_help()
    )


def _wants_help(argv: Sequence[str]) -> bool:
    parsed, _ = _parse_options(list(argv))
    return any(key in ("-h", "--help") for _, key, _, _ in parsed)


def check_endpoint(argv: Sequence[str]) -> None:
    """Fail with one line when the rendezvous host does not resolve, or, being another machine's (or a port in
    use here), does not accept a connection within ``read_timeout`` (torchrun would retry for minutes)."""
    found = _endpoint(argv)
    if found is None:
        return
    host, port = found
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise FleetError(f"--rdzv-endpoint {host}: host {host!r} does not resolve ({err.strerror}); give the address of the rendezvous host") from None
    if port is None or _can_host(host, port):
        return  # this agent will host the store
    wait_s = _rdzv_seconds(argv, "read_timeout", TORCHRUN_READ_TIMEOUT_S)
    deadline, reason = time.monotonic() + wait_s, ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            reason = err.strerror or type(err).__name__
            time.sleep(0.5)  # the host's agent may simply not be up yet
    raise FleetError(
        f"--rdzv-endpoint {host}:{port} did not accept a connection within {wait_s} s ({reason}): start the agent on the "
        "rendezvous host first, or fix the address and port"
    )


def _can_host(host: str, port: int) -> bool:
    """Whether this machine could open the rendezvous store at host:port (a local address with the port free)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
        return True
    except OSError:
        return False


def _watch_first_rendezvous(argv: Sequence[str]) -> None:
    """Exit with one line if no worker was started within join_timeout + read_timeout (an endpoint that accepts
    connections but never answers as a rendezvous store hangs torchrun for good)."""
    import psutil

    bound = _rdzv_seconds(argv, "join_timeout", int(RDZV_DEFAULTS["join_timeout"])) + _rdzv_seconds(
        argv, "read_timeout", TORCHRUN_READ_TIMEOUT_S
    )
    found = _endpoint(argv)
    where = f"{found[0]}:{found[1]}" if found and found[1] else "the rendezvous endpoint"

    def watch() -> None:
        deadline, me = time.monotonic() + bound, psutil.Process()
        while time.monotonic() < deadline:
            if me.children():
                return  # the rendezvous completed: workers are running
            time.sleep(0.5)
        print(f"fleet launch: no rendezvous at {where} within {bound} s (join_timeout + read_timeout): it does not answer as "
              "a torchrun rendezvous store; check --rdzv-endpoint and that the agents can reach each other", flush=True)
        os._exit(2)

    threading.Thread(target=watch, name="fleet-rendezvous-watchdog", daemon=True).start()


def launch(argv: Sequence[str]) -> int:
    """Run torch.distributed.run with the fleet defaults; returns its exit code (2 when a worker ended the job for a
    deterministic FleetError, whose line rank 0 printed)."""
    if _wants_help(argv):
        print(help_text(), end="")
        return 0
    check_arguments(argv)
    args = torchrun_argv(argv)
    check_endpoint(argv)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _watch_first_rendezvous(args)
    with tempfile.TemporaryDirectory(prefix="fleet-launch-") as tmp:
        stop_file = Path(tmp) / "stopped"
        os.environ[STOP_FILE_ENV] = str(stop_file)  # inherited by the workers (see worker.end_job)
        try:
            return _run_torchrun(args, stop_file)
        finally:
            os.environ.pop(STOP_FILE_ENV, None)


def _run_torchrun(args: list[str], stop_file: Path) -> int:
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except SystemExit as stop:
        return int(stop.code or 0)
    except Exception as err:  # torchrun's ChildFailedError and rendezvous errors: report, don't dump a traceback
        if stop_file.exists():
            return EXIT_CODE  # a worker stopped the agent for a deterministic FleetError; rank 0 printed its line
        name = type(err).__name__
        first = str(err).strip().splitlines()
        print(f"fleet launch: {name}: {first[0] if first else ''}", flush=True)
        return 1
    return 0
