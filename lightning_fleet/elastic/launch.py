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

Bad values are one line and exit code 2 before torchrun starts: torchrun's own parser decides what is valid (reading
integers in ASCII digits only), and what it would refuse only after starting is checked first (node and process
counts, --rdzv-conf and --rdzv-endpoint values, ports, timeouts, output filters, a training script that does not
exist; :func:`check_arguments`, :func:`check_script`); ``fleet launch --help``
prints these defaults and torchrun's help. A worker that ends the job for a deterministic FleetError (its line
printed by rank 0) stops the agent (or, without restarts left, just exits); ``fleet launch`` then exits 2 and its
line is the last on screen (torchrun's own lines about stopping the workers are dropped). When restarts are used up,
one line names the first failed rank, its exit code or signal and its root-cause message (torchrun's own last line is
a separator). SIGTERM or SIGHUP to the launcher (a scheduler's preemption, a closed session) is forwarded to the
workers by torchrun; when every worker then exits 0 (FleetCheckpoint saved and stopped them), ``fleet launch`` exits
0, not torchrun's 1.

A wrong endpoint is one line and a bounded wait, never a hang (measured with torchrun alone: an
unroutable host took 158 s and printed C++ stack traces; a port that accepts connections but is
not a rendezvous store hung for good): the host must resolve, a remote endpoint must accept a TCP
connection within ``read_timeout`` (torchrun's own store timeout, 60 s unless given), and the first
rendezvous must start the workers within ``join_timeout + read_timeout``.

Imports the standard library, torch's launcher and psutil (at call time) and elastic/worker.py's exit conventions;
imported by the CLI only.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from lightning_fleet.elastic.worker import EXIT_CODE, STOP_FILE_ENV
from lightning_fleet.planning import FleetError
from lightning_fleet.planning.cluster import MAX_WORLD_SIZE
from lightning_fleet.planning.yamlspec import ascii_int, shown

RDZV_DEFAULTS = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "120"}
TORCHRUN_READ_TIMEOUT_S = 60
"""torchrun's c10d store timeout when ``--rdzv-conf read_timeout`` is not given."""
MIN_KEEP_ALIVE_ATTEMPTS = 3
_CAUSE_CHARS = 500  # the most of a worker's root-cause message in fleet launch's line
SAVING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals torchrun's agent forwards to its workers and FleetCheckpoint answers by saving and stopping (the agent
forwards the signal it got: torch/distributed/elastic/agent/server/api.py ``_shutdown(e.sigval)``)."""


_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module", "-h", "--help"}
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
MAX_NPROC_PER_NODE = 1024
"""Most processes fleet launches (or fleet calibrate measures) on one machine: a node has at most a few hundred cores or
a few dozen accelerators; torchrun given 10**30 allocated memory until it was killed (measured: 3.9 GB in 60 s)."""
MAX_WAIT_S = 7 * 24 * 3600
"""Longest timeout or interval accepted (a week): torch turns them into timedelta and C++ durations, which overflow."""
_RDZV_SECONDS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "read_timeout", "timeout")
_RDZV_COUNTS = ("keep_alive_interval", "keep_alive_max_attempt")
"""The --rdzv-conf keys torch reads as integers (torch.distributed.elastic.rendezvous: get_as_int), all positive."""
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
    return _split_endpoint(endpoint[1]) if endpoint is not None else None


def _split_endpoint(text: str) -> tuple[str, int | None] | None:
    """``host[:port]`` or ``[IPv6]:port`` as torch reads it (torch.distributed.elastic.rendezvous.utils
    .parse_rendezvous_endpoint), None when empty; FleetError for a port that is not 0-65535 or a host that is not
    ASCII letters, digits, '.', ':', '-' and '_'."""
    text = text.strip()
    if not text:
        return None
    if text[0] == "[" and text[-1] == "]" or ":" not in text:
        host, port_text = text, None
    else:
        host, port_text = text.rsplit(":", 1)
    host = host[1:-1] if len(host) > 1 and host[0] == "[" and host[-1] == "]" else host
    if port_text is not None and not (re.fullmatch("[0-9]{1,5}", port_text) and int(port_text) < 2**16):
        raise FleetError(f"fleet launch: --rdzv-endpoint={shown(text)}: the port must be an integer from 0 to 65535")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", host):
        raise FleetError(f"fleet launch: --rdzv-endpoint={shown(text)}: the host must be a host name, an IPv4 address or "
                         "an [IPv6] address")
    return host, None if port_text is None else int(port_text)


def _rdzv_conf(parsed: list[tuple[int, str, str, int]]) -> dict[str, str]:
    """The key=value pairs of ``--rdzv-conf`` (empty when not given)."""
    conf = _option(parsed, "rdzv-conf")
    return _conf_pairs(conf[1]) if conf else {}


def _conf_pairs(text: str) -> dict[str, str]:
    """``key=value,...`` as torch reads it (rendezvous.utils._parse_rendezvous_config: a key and a value in each item),
    with the integer keys checked (ASCII digits, 1 to a week); FleetError naming the item otherwise."""
    pairs: dict[str, str] = {}
    text = text.strip()
    for item in text.split(",") if text else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not key or not eq or not value:
            raise FleetError(f"fleet launch: --rdzv-conf item {shown(item)} is not key=value (write e.g. "
                             "--rdzv-conf join_timeout=300,read_timeout=60)")
        if key in _RDZV_SECONDS or key in _RDZV_COUNTS:
            _bounded(f"--rdzv-conf {key}", value, low=1, high=MAX_WAIT_S)
        pairs[key] = value
    return pairs


def _rdzv_seconds(argv: Sequence[str], key: str, default: int) -> int:
    return _integer(f"--rdzv-conf {key}", _rdzv_conf(_parse_options(list(argv))[0]).get(key, str(default)))


def _integer(name: str, text: str) -> int:
    try:
        return ascii_int(text)
    except ValueError as err:
        raise FleetError(f"{name}={shown(text)}: expected an integer ({err})") from None


def _bounded(name: str, text: str, *, low: int, high: int) -> int:
    """``text`` as an integer from ``low`` to ``high`` (ASCII digits), or one FleetError line."""
    value = _integer(name, text)
    if not low <= value <= high:
        raise FleetError(f"fleet launch: {name}={value}: expected an integer from {low} to {high:,}")
    return value


def check_arguments(argv: Sequence[str]) -> None:
    """Refuse what torchrun would refuse (its own parser decides, with integers and numbers in ASCII digits only), and
    what it would only reject after starting (node and process counts, --rdzv-conf, --rdzv-endpoint, ports, timeouts,
    output filters), each as one FleetError line."""
    args = _parsed(argv)
    _check_nnodes(args.nnodes)
    _check_nproc(args.nproc_per_node)
    _check_numbers(args)
    _conf_pairs(args.rdzv_conf)
    _split_endpoint(args.rdzv_endpoint)
    _check_output_options(args)


def check_script(argv: Sequence[str]) -> None:
    """Refuse a training script that does not exist (a path; with --no-python a command on PATH; -m names a module and
    is left to Python) before torchrun starts workers that would fail on it and be restarted."""
    args = _parsed(argv)
    script = args.training_script
    if args.module:
        return
    if args.no_python:
        if shutil.which(script) is None:
            raise FleetError(f"fleet launch: --no-python {shown(script, 200)}: no such executable (a path, or a command on PATH)")
    elif not (os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))):
        raise FleetError(f"fleet launch: training script {shown(script, 200)} does not exist: give the path of a Python script "
                         "(or -m module.name)")


def _parsed(argv: Sequence[str]) -> Any:
    """torchrun's own parser on ``argv``, reading integers and numbers in ASCII digits only (``int()`` takes '١٢');
    its errors as one FleetError line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        if "training_script" in message:  # argparse's "the following arguments are required: training_script, ..."
            raise FleetError(_NO_SCRIPT)
        raise FleetError(f"fleet launch: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    for action in parser._actions:
        if action.type is int:
            action.type = _int_option
        elif action.type is float:
            action.type = _number_option
    return parser.parse_args(list(argv))


def _int_option(text: str) -> int:
    return ascii_int(text)


def _number_option(text: str) -> float:
    if not re.fullmatch(r"[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?|[0-9]+\.", text) or not math.isfinite(float(text)):
        raise ValueError(text)
    return float(text)


_int_option.__name__, _number_option.__name__ = "int", "float"  # argparse's "invalid int value: '١'"


def _clip(text: str) -> str:
    """An option's value as given, or :func:`shown` (quoted, bounded) when it is long."""
    return text if len(text) <= 40 and text.isprintable() else shown(text)


def _check_nnodes(text: str) -> None:
    """--nnodes: N or MIN:MAX, 1 <= MIN <= MAX <= MAX_WORLD_SIZE (torchrun asserts only after it started)."""
    parts = text.split(":")
    if len(parts) > 2 or not all(re.fullmatch("[0-9]{1,18}", part) for part in parts):
        raise FleetError(f"fleet launch: --nnodes={_clip(text)}: expected N or MIN:MAX (integers)")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high <= MAX_WORLD_SIZE:
        raise FleetError(f"fleet launch: --nnodes={text}: expected 1 <= N (or MIN <= MAX) <= {MAX_WORLD_SIZE:,}")


def _check_nproc(text: str) -> None:
    """--nproc-per-node: 1 to MAX_NPROC_PER_NODE, or a word torch resolves here (gpu without CUDA is refused now)."""
    if text in _NPROC_WORDS:
        from torch.distributed.run import determine_local_world_size

        try:
            determine_local_world_size(text)
        except ValueError as err:
            raise FleetError(f"fleet launch: --nproc-per-node={text}: {err}") from None
        return
    if not re.fullmatch("[0-9]{1,18}", text):
        words = ", ".join(_NPROC_WORDS)
        raise FleetError(f"fleet launch: --nproc-per-node={_clip(text)}: expected an integer or one of {words}")
    if not 1 <= int(text) <= MAX_NPROC_PER_NODE:
        raise FleetError(f"fleet launch: --nproc-per-node={text}: expected 1 to {MAX_NPROC_PER_NODE} processes on this machine")


def _check_numbers(args: Any) -> None:
    """The integer and number options torchrun takes as they come (it asserts max_restarts >= 0 only after starting)."""
    ranges = {"max_restarts": (0, 10**6), "node_rank": (0, MAX_WORLD_SIZE - 1), "master_port": (0, 2**16 - 1),
              "shutdown_timeout": (0, MAX_WAIT_S)}
    for name, (low, high) in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not low <= value <= high:
            raise FleetError(f"fleet launch: --{name.replace('_', '-')}={value}: expected an integer from {low} to {high:,}")
    if not 0 < args.monitor_interval <= MAX_WAIT_S:
        raise FleetError(f"fleet launch: --monitor-interval={args.monitor_interval:g}: expected seconds > 0 and <= {MAX_WAIT_S}")


def _check_output_options(args: Any) -> None:
    """--local-ranks-filter (comma-separated ranks) and --redirects/--tee (torch's Std.from_str), which torchrun reads
    only after it started."""
    from torch.distributed.elastic.multiprocessing import Std

    if args.local_ranks_filter and not re.fullmatch("[0-9]{1,7}(,[0-9]{1,7})*", args.local_ranks_filter):
        filters = shown(args.local_ranks_filter)
        raise FleetError(f"fleet launch: --local-ranks-filter={filters}: expected local ranks such as 0,1,2")
    for name in ("redirects", "tee"):
        try:
            Std.from_str(getattr(args, name))
        except ValueError:
            raise FleetError(f"fleet launch: --{name}={shown(getattr(args, name))}: expected 0-3, or local_rank:0-3 pairs such "
                             "as 0:3,1:0") from None


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
    deterministic FleetError, whose line rank 0 printed; 0 after a SIGTERM that every worker answered by exiting 0)."""
    if _wants_help(argv):
        print(help_text(), end="")
        return 0
    check_arguments(argv)
    args = torchrun_argv(argv)
    check_endpoint(argv)
    check_script(argv)
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
    """torchrun's main in this process; its failures as one line and an exit code (see :func:`launch`)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with _worker_exits() as exits, _quiet_once_stopped(stop_file):
        try:
            torchrun_main(args)
        except SystemExit as stop:
            return int(stop.code or 0)
        except Exception as err:  # torchrun's ChildFailedError, SignalException, rendezvous errors: a line, no traceback
            if stop_file.exists():
                return EXIT_CODE  # a worker stopped the agent for a deterministic FleetError; rank 0 printed its line
            if isinstance(err, ChildFailedError):
                print(root_cause_line(err), flush=True)
                return 1
            if isinstance(err, SignalException):
                _exit_at_once(_stopped_by_signal(err.sigval, exits[-1] if exits else {}), stop_file.parent)
            first = str(err).strip().splitlines()
            print(f"fleet launch: {type(err).__name__}: {first[0] if first else ''}", flush=True)
            return 1
    return 0


class _AfterStop:
    """A logging filter that drops every record once ``stop_file`` exists: a worker has printed the job's one error
    line and stopped it, and torchrun's own lines about stopping the other workers would bury it."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file

    def filter(self, record: Any) -> bool:
        """Keep ``record`` while no worker has stopped the job."""
        return not self.stop_file.exists()


@contextmanager
def _quiet_once_stopped(stop_file: Path) -> Iterator[None]:
    """While torchrun runs here, its elastic loggers (the agent's, its process context's, its error handler's) go quiet
    once a worker stopped the job for a deterministic FleetError (measured before: "Received 15 death signal", two
    "Sending process ... closing signal SIGTERM" lines after the error line; with --max-restarts=0 the agent's
    "failed (exitcode: 2)" and "no error file defined for parent" lines and the error repeated in the launcher's)."""
    import logging

    import torch.distributed.run  # noqa: F401  (imports the agent's modules, which create their loggers)

    quiet = _AfterStop(stop_file)
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _exit_at_once(code: int, tmp: Path) -> None:
    """End the launcher now with ``code``. After a signal torchrun leaves the rendezvous as it is (torch/distributed/
    run.py ``launch_agent`` skips its shutdown so that other agents may go on) and with it the handler's keep-alive
    thread, whose finalizer then fails at interpreter exit with a traceback ("cannot join current thread", measured
    here after the one line of a SIGTERM); nothing else is left to clean up but the stop file's directory."""
    shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def root_cause_line(error: Any) -> str:
    """One line for torchrun's ChildFailedError (restarts used up): the first failed rank, how it ended (exit code or
    signal) and the root-cause message from its error file (the worker's hook writes one, lightning_fleet.elastic.worker;
    torch's ``@record`` does too), instead of the first line of torchrun's table (a separator of '='). The ranks the agent
    stopped after it are in torchrun's table above."""
    rank, failure = error.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    cause = " ".join(str(message).split()) if os.path.isfile(failure.error_file) else ""
    if not cause and failure.exitcode > 0:
        cause = "it left no error file; its traceback is in the output above"
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    line = f"fleet launch: the job failed, restarts used up: {who} {how}"
    return f"{line}: {cause[:_CAUSE_CHARS]}" if cause else line


def _stopped_by_signal(sigval: Any, exits: dict[int, int | None]) -> int:
    """The exit code after torchrun's agent got ``sigval`` and stopped its workers with it (their exit codes by local
    rank): 0 for a SIGTERM (a scheduler's preemption) or SIGHUP (a closed terminal or session) after which every worker
    exited 0 (FleetCheckpoint saved and stopped them), else 1, with one line either way."""
    name = getattr(sigval, "name", str(sigval))
    if sigval in SAVING_SIGNALS and exits and all(code == 0 for code in exits.values()):
        print(f"fleet launch: stopped by {name}; all {len(exits)} local workers exited 0 (a FleetCheckpoint saves the step they "
              "stopped at: relaunch to resume from it)", flush=True)
        return 0
    failed = {rank: code for rank, code in exits.items() if code != 0}
    if failed:
        ends = ", ".join(f"local rank {rank}: {_ending(code)}" for rank, code in sorted(failed.items()))
    else:
        ends = f"all {len(exits)} local workers exited 0" if exits else "no workers were running"
    print(f"fleet launch: stopped by {name}; {ends}", flush=True)
    return 1


def _ending(code: int | None) -> str:
    """How a worker process ended, from its return code (negative: a signal)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@contextmanager
def _worker_exits() -> Iterator[list[dict[int, int | None]]]:
    """Each time torchrun's agent (in this process) closes its workers, their return codes by local rank; torch keeps
    them in its process context only (torch.distributed.elastic.multiprocessing.api ``SubprocessContext``)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    exits: list[dict[int, int | None]] = []
    original = PContext.close

    def close(self: Any, death_sig: Any = None, timeout: int = 30) -> None:
        try:
            original(self, death_sig, timeout)
        finally:
            handlers = getattr(self, "subprocess_handlers", None) or {}
            exits.append({rank: handler.proc.poll() for rank, handler in handlers.items()})

    PContext.close = close  # type: ignore[method-assign]
    try:
        yield exits
    finally:
        PContext.close = original  # type: ignore[method-assign]
