"""The worker's side of a launch: a process group that survives torchrun restarts, and one line per FleetError.

**Restarts under plain torchrun.** torchrun's agent hosts one TCP store for the whole job and, unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, hands its address to every attempt's workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; torch/distributed/elastic/rendezvous/dynamic_rendezvous.py
``next_rendezvous`` caches ``_shared_tcp_store_server``, static_tcp_rendezvous.py keeps ``self._store``).
torch's ``_create_c10d_store`` connects to it without a per-attempt prefix (torch/distributed/rendezvous.py:
"We create a new TCPStore for every retry so no need to add prefix", which the shared server contradicts), and
``init_process_group`` names the default group ``default_pg`` + ``0/`` + ``cpu/`` every time
(distributed_c10d.py ``PrefixStore("default_pg", store)``, ``_process_group_name``). So a restarted worker finds
the dead attempt's gloo addresses under the very keys it waits for: ``wait`` returns at once with a stale
peer address and gloo's ``connectFullMesh`` fails with "Connection refused" (or connects to a wrong peer),
depending on which rank writes first. :func:`open_process_group` opens the group on a prefix of this attempt's
own, agreed through the store by :func:`attempt_store`, so nothing an earlier attempt left can be read.

**One line per FleetError.** :func:`install_error_hook` makes an uncaught
:class:`~lightning_fleet.planning.FleetError` print ``lightning_fleet: error: <message>`` on rank 0's stderr
(nothing on the other ranks) and exit with code 2; other exceptions keep their traceback. A deterministic
FleetError (every attempt would raise it again: the planning core's SpecError, PlanError and NoFeasiblePlanError,
and whatever the strategy marks with :func:`deterministic`, e.g. an incompatible checkpoint) also ends a torchrun
job at once, without spending its restarts: each node's local rank 0 sends SIGTERM to its torchrun agent, which
stops its workers and exits 1 (``fleet launch`` exits 2).

**No hangs, no orphans.** :func:`die_with_agent` makes a torchrun worker die with its agent (a SIGKILLed agent
otherwise leaves its workers training unsupervised, their saves racing the relaunch's), :func:`module_command` makes
a helper subprocess die with its parent, and :func:`strict_sigterm_broadcast` replaces Lightning's per-step SIGTERM
broadcast, which swallows a timed-out collective, with one that fails the step with :func:`peer_lost`'s line.
:func:`install_error_hook` also writes torchrun's error file, so that ``fleet launch`` names the root cause.
:func:`destroy_groups_at_exit` destroys the process groups at the exit of a job that raised nothing (a gloo group left
to the interpreter's teardown can abort a finished job).

Imports torch.distributed (at call time) and the planning core's errors; imported by the strategy, elastic/launch.py,
callback.py and safe_load.py (the error marks), and the DeepSpeed runtime's universal conversion.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback as tb
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from lightning_fleet.planning import FleetError, NoFeasiblePlanError, PlanError, SpecError

EXIT_CODE = 2
"""Exit code of a process ended by a FleetError (the ``fleet`` command uses the same)."""
PEER_GRACE_S = 10.0
"""How long a rank other than 0 waits for rank 0 (or the agent) to end the job before it reports the error itself."""
STOP_FILE_ENV = "LIGHTNING_FLEET_STOP_FILE"
"""Set by ``fleet launch``: the file a worker writes before it stops its agent for a deterministic error."""
_DETERMINISTIC = "fleet_deterministic"
_HOOK_MARK = "_lightning_fleet_error_hook"
_STORE_ROOT = "lightning_fleet/attempt"  # the process group's keys: <root>/<token>/...
_HANDSHAKE_ROOT = "lightning_fleet/handshake"  # agreeing on the token: <root>/<token>/w<world>/...
_LEADER_KEY = f"{_HANDSHAKE_ROOT}/leader"
_POLL_S = 0.05
_OWN_LINE = "fleet_own_line"  # a FleetError every rank that meets it reports at once (see peer_lost)
_parent_at_install: int | None = None
_stop_signal_seen = False  # a SIGTERM/SIGHUP reached this process's stop handler (note_stop_signal)
_PARENT_AT_IMPORT = os.getppid()  # a torchrun worker's agent, observed as early as this package is imported
PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal Linux sends a process when the thread that started it exits (linux/prctl.h)."""

E = TypeVar("E", bound=BaseException)


# --- a process group of this attempt's own ----------------------------------------------------------


def agent_store_shared() -> bool:
    """Whether torchrun gave this worker its agent's long-lived store (plain torchrun, the default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def open_process_group(backend: str, rank: int, world_size: int, timeout: timedelta, device_id: Any = None) -> bool:
    """Under torchrun's shared store, initialise torch.distributed on a key prefix of this attempt's own.

    Returns False (and does nothing) when the group exists already or the store is not the agent's
    (Lightning's launcher, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): then every attempt has a fresh store.
    ``device_id`` binds the group to a CUDA device as DeepSpeed's ``init_distributed`` would.
    """
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    if dist.is_initialized() or not agent_store_shared():
        return False
    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))  # a client of the agent's store
    store.set_timeout(timeout)
    options: dict[str, Any] = {"device_id": device_id} if device_id is not None and world_size > 1 else {}
    dist.init_process_group(backend, store=attempt_store(store, rank, world_size, timeout), rank=rank, world_size=world_size,
                            timeout=timeout, **options)
    return True


def launch_advice() -> str | None:
    """One line for what the worker cannot fix: plain torchrun with ``--nnodes=MIN:MAX`` (read from the agent's
    command line or ``PET_NNODES``) and the shared store. Measured here (torch 2.13): restarts work, but a second
    agent joining later deadlocks both agents' rendezvous (dynamic_rendezvous.py ``next_rendezvous`` rebuilds the
    bootstrap info only for a new rank 0, so the joiner waits for a MASTER_ADDR nobody writes: "wait timeout ...
    role_info" after 60 s), and every start and restart waits the 30 s ``last_call_timeout`` for more agents."""
    argv = _agent_argv()
    nnodes = _flag(argv, "--nnodes") or os.environ.get("PET_NNODES", "")
    low, _, high = nnodes.partition(":")
    if not agent_store_shared() or not high or low == high:
        return None
    conf = _flag(argv, "--rdzv-conf") or _flag(argv, "--rdzv_conf") or os.environ.get("PET_RDZV_CONF", "")
    waits = "" if "last_call_timeout" in conf else " and --rdzv-conf last_call_timeout=1 (each restart waits 30 s for agents)"
    return (
        f"lightning_fleet: note: torchrun --nnodes={nnodes} shares its rendezvous store with the workers: restarts work, "
        f"but an agent joining later deadlocks the rendezvous; launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1{waits}, "
        "or with fleet launch"
    )


def announce_launch_advice(rank: int) -> None:
    """Print :func:`launch_advice` once per job: on rank 0 of the first attempt."""
    advice = launch_advice() if rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None
    if advice:
        print(advice, flush=True)


def rendezvous_endpoint() -> str:
    """The rendezvous endpoint this worker's torchrun agent was started with (``--rdzv-endpoint``, read from the agent's
    command line, else ``PET_RDZV_ENDPOINT``); '' where there is none (torchrun's static rendezvous, not torchrun)."""
    argv = _agent_argv()
    endpoint = _flag(argv, "--rdzv-endpoint") or _flag(argv, "--rdzv_endpoint") or os.environ.get("PET_RDZV_ENDPOINT", "")
    return endpoint.strip()


def _agent_argv() -> list[str]:
    """The command line of this worker's parent (torchrun's agent), empty where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _flag(argv: list[str], name: str) -> str:
    """The value of ``name=V`` or ``name V`` in ``argv`` ("" when absent)."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and i > 0:
            break  # the training script: what follows are its own arguments
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def attempt_store(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A prefix of ``store`` that only this attempt's ``world_size`` ranks use, whatever earlier attempts left there.

    Rank 0 publishes a fresh token as the leader, waits until the other ranks have joined it and then says go.
    A rank trusts a token only when its own join count was within ``world_size - 1`` and the go came after
    that: a dead attempt's go implies its count was full already, so a stale token always fails the count
    (or never gets its go), and the rank moves on as soon as the live rank 0 replaces the leader.
    """
    from torch.distributed import PrefixStore

    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_LEADER_KEY, token)
        if world_size > 1:
            store.wait([_attempt_key(token, world_size, "all-joined")], timeout)
            store.set(_attempt_key(token, world_size, "go"), "1")
    else:
        token = _join_live_leader(store, world_size, deadline)
    return PrefixStore(f"{_STORE_ROOT}/{token}/", store)


def _attempt_key(token: str, world_size: int, name: str) -> str:
    return f"{_HANDSHAKE_ROOT}/{token}/w{world_size}/{name}"


def _join_live_leader(store: Any, world_size: int, deadline: float) -> str:
    """The live rank 0's token (a rank other than 0)."""
    tried: set[str] = set()
    while True:
        store.wait([_LEADER_KEY], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        token = store.get(_LEADER_KEY).decode()
        if token not in tried:
            tried.add(token)
            joined = store.add(_attempt_key(token, world_size, "joined"), 1)
            if joined == world_size - 1:
                store.set(_attempt_key(token, world_size, "all-joined"), "1")
            if joined <= world_size - 1 and _go_or_new_leader(store, token, world_size, deadline):
                return token
        elif time.monotonic() > deadline:
            raise FleetError(
                f"rank 0 of this attempt did not appear in torchrun's store within the process-group timeout; the last "
                f"token {token!r} belongs to an attempt that is gone: check that every worker of the job was restarted"
            )
        else:
            time.sleep(_POLL_S)


def _go_or_new_leader(store: Any, token: str, world_size: int, deadline: float) -> bool:
    """True once rank 0 says go for ``token``; False as soon as another leader replaces it."""
    from torch.distributed import DistStoreError

    while time.monotonic() < deadline:
        try:
            store.wait([_attempt_key(token, world_size, "go")], timedelta(seconds=0.5))
            return True
        except DistStoreError:
            if store.get(_LEADER_KEY).decode() != token:
                return False
    raise FleetError(f"rank 0 of this attempt (token {token!r}) did not start the process group within the process-group timeout")


# --- no hangs, no orphans ----------------------------------------------------------------------------


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Have Linux send ``sig`` to this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``); False where that is
    not available (not Linux). When ``parent`` is gone already (this process was re-parented before the call), this
    process is sent ``sig`` at once: the death signal it asked for would never come."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        print(f"lightning_fleet: the process that started this one (PID {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os.kill(os.getpid(), sig)
    return True


def die_with_agent() -> bool:
    """Under torchrun or ``fleet launch`` (``TORCHELASTIC_RUN_ID`` set), make this worker die (SIGKILL) with its agent;
    a SIGKILLed agent otherwise leaves its workers training unsupervised while a relaunch starts new ones (measured: both
    workers trained on to the end). Not under Lightning's own launcher, where rank 0 is the user's own process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return die_with_parent(_PARENT_AT_IMPORT)


_DIE_WITH_PARENT_MAIN = (
    "import ctypes, os, runpy, signal, sys\n"
    "parent, module = int(sys.argv[1]), sys.argv[2]\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != parent:\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.argv = [module, *sys.argv[3:]]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def module_command(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` as a child that dies (SIGKILL) with this process on Linux, so that
    a kill of this process does not orphan it (measured: DeepSpeed's universal converter ran on after its parent was
    SIGKILLed). It starts in the standard library only and then runs the module as ``-m`` would."""
    if not sys.platform.startswith("linux"):
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-c", _DIE_WITH_PARENT_MAIN, str(os.getpid()), module, *args]


def peer_lost(error: BaseException, timeout: timedelta | None, during: str = "") -> FleetError:
    """The FleetError for a collective that failed because a peer hung past the process-group timeout or is gone;
    ``during`` names where (e.g. "FleetCheckpoint's agreement on saving").

    Every rank that meets it prints its line at once and exits (no rank waits for rank 0 to speak: rank 0 may be the
    hung one); it is not deterministic, so torchrun restarts the job from its last checkpoint while restarts are left."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    where = f" in {during}" if during else ""
    if "timeout" in first.lower() or "timed out" in first.lower():  # gloo: "Timed out waiting", then "Application timeout"
        within = f" within FleetStrategy(timeout={timeout.total_seconds():g} s)" if timeout is not None else ""
        what = f"a collective{where} did not complete{within}: a peer process is hung"
    else:  # gloo: "Connection closed by peer", NCCL: a remote error
        what = f"a collective{where} failed: a peer process is gone"
    failure = FleetError(
        f"rank {_global_rank()}: {what} ({type(error).__name__}: {first}); stopping this rank (torchrun restarts the job "
        "from its last checkpoint while restarts are left)"
    )
    setattr(failure, _OWN_LINE, True)
    return failure


_COLLECTIVE_MARKS = ("gloo", "nccl", "timed out", "connection closed by peer", "connection reset by peer", "broken pipe")
"""Words of a collective's failure as gloo and NCCL raise it (gloo raises a plain RuntimeError whose text starts with
its source path, e.g. ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv``)."""


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed (a peer hung past the timeout, or gone): torch's DistError family,
    or a RuntimeError in gloo's or NCCL's words. Anything else (a bug, a user's exception) is not."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(error, dist_error):
        return True
    first = (str(error).strip().splitlines() or [""])[0].lower()
    return type(error) is RuntimeError and any(mark in first for mark in _COLLECTIVE_MARKS)


@contextmanager
def collectives(during: str, timeout: timedelta | None) -> Iterator[None]:
    """Run a block of collectives (ours or the runtime's): one that fails because a peer hung or is gone ends this rank
    with :func:`peer_lost`'s one line naming ``during``, chained to the original error (never swallowed); every other
    exception passes unchanged."""
    try:
        yield
    except Exception as err:
        if isinstance(err, FleetError) or not collective_failure(err):
            raise
        raise peer_lost(err, timeout, during) from err


def strict_sigterm_broadcast(loop: Any, timeout: timedelta | None) -> Callable[[], None] | None:
    """A replacement for Lightning's per-step SIGTERM broadcast of ``loop`` (a training epoch loop of ``lightning`` or
    ``pytorch_lightning``) that fails the step when the broadcast fails; None when the loop has no such method.

    Lightning's ``_broadcast_sigterm_tensor`` catches every exception, so a broadcast that timed out because a peer hung
    is taken as "no SIGTERM" and the job goes on into the next collective (measured: a SIGSTOPped peer hung the job
    past 120 s with a timeout of 8 s). This one does what Lightning's does and raises :func:`peer_lost` instead.
    """
    original = getattr(type(loop), "_broadcast_sigterm_tensor", None)
    sigterm_exception = getattr(original, "__globals__", {}).get("SIGTERMException")
    if sigterm_exception is None:
        return None

    def broadcast_sigterm_tensor() -> None:
        import torch

        trainer = loop.trainer
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0], device=trainer.strategy.root_device)
        try:
            torch.distributed.broadcast(flag, src=0)
        except Exception as err:  # a timed-out or broken collective (DistBackendError, RuntimeError)
            raise peer_lost(err, timeout, "the per-step SIGTERM broadcast") from err
        if flag.item() == 1:
            with contextlib.suppress(Exception):
                torch.distributed.barrier()  # as Lightning's: let every rank reach the exit
            raise sigterm_exception()

    return broadcast_sigterm_tensor


# --- one line per FleetError, no restarts for a deterministic one --------------------------------


DETERMINISTIC_TYPES: tuple[type[FleetError], ...] = (SpecError, PlanError, NoFeasiblePlanError)
"""FleetErrors deterministic unless marked otherwise: the planning core's verdicts are functions of the job's inputs
(model, cluster, plan, world), so every attempt at the same world raises them again."""


def deterministic(error: E, value: bool = True) -> E:
    """Mark a FleetError as one every attempt of this job would raise again (or, ``value=False``, as one a restart may
    cure); returns it: ``raise deterministic(FleetError(...))``. The mark survives pickling (``FitCore.on_rank_zero``)."""
    setattr(error, _DETERMINISTIC, value)
    return error


def is_deterministic(error: BaseException) -> bool:
    """Whether ``error`` ends the job without restarts: its :func:`deterministic` mark, else its type."""
    return bool(getattr(error, _DETERMINISTIC, isinstance(error, DETERMINISTIC_TYPES)))


@contextmanager
def deterministic_errors() -> Iterator[None]:
    """Mark every FleetError raised inside the block as deterministic (e.g. around start-up planning)."""
    try:
        yield
    except FleetError as error:
        deterministic(error)
        raise


def install_error_hook() -> None:
    """Route uncaught FleetErrors to :func:`end_job`; every other exception goes to the hook installed before. Every
    uncaught exception is first written to torchrun's error file (:func:`write_error_file`).

    Idempotent: does nothing while the outermost ``sys.excepthook`` is this one; when another hook has
    wrapped it since (``init_process_group`` installs one that buffers stderr), wraps again so that the
    line is written before anything else sees the exception. Hooks the user installs later see every
    exception first, as usual.
    """
    global _parent_at_install
    previous = sys.excepthook
    if getattr(previous, _HOOK_MARK, False):
        return
    if _parent_at_install is None:
        _parent_at_install = os.getppid()

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        global _exit_after_error
        _exit_after_error = True  # (destroy_groups_at_exit) a peer may still be in a collective with this rank
        write_error_file(error, traceback)
        if isinstance(error, FleetError):
            end_job(error)
        previous(kind, error, traceback)

    setattr(hook, _HOOK_MARK, True)
    sys.excepthook = hook


def end_job(error: FleetError) -> None:
    """Print the error once for the job, stop a torchrun agent for a deterministic error, and exit with code 2
    (:func:`_announce`), without the interpreter's teardown (:func:`exit_without_teardown`)."""
    try:
        _announce(error)
    except SystemExit as stop:  # the agent's SIGTERM while this rank waits ends it the same way
        exit_without_teardown(int(stop.code) if isinstance(stop.code, int) else EXIT_CODE)


def exit_without_teardown(code: int) -> None:
    """Exit with ``code`` after the atexit handlers (the user's, logging's) and a flush of the standard streams, but
    without the interpreter's teardown. After an error this rank's gloo groups are still alive (a peer may be inside a
    collective with it, so they are not destroyed: :func:`destroy_groups_at_exit`); the teardown then destroys their
    C++ worker threads while they are joinable, and the process aborts ("terminate called without an active
    exception", exit -6 instead of 2: seen on rank 0 under Lightning's launcher, a bad plan refused while rank 1 waited
    for it, on a loaded machine). Non-daemon threads are not waited for: a job that failed does not hang on one. The
    operating system frees what the teardown would have."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _announce(error: FleetError) -> None:
    """What :func:`end_job` does before it exits, ending in ``SystemExit(EXIT_CODE)``.

    Rank 0 prints ``lightning_fleet: error: <message>``. The other ranks print nothing and wait up to
    :data:`PEER_GRACE_S` for the job to end around them (rank 0 exiting, the agent's SIGTERM); if it does not,
    rank 0 did not raise this error, and they print it themselves with their rank. A :func:`peer_lost` error is printed
    by every rank that raises it, at once. Under ``fleet launch`` a deterministic error is also written to its stop file
    (restarts left or not), so that the launcher exits 2 without a line of its own.
    """
    rank = _global_rank()
    message = error_message(error)
    if getattr(error, _OWN_LINE, False):  # every rank that met it says so, with its rank (peer_lost)
        print(f"lightning_fleet: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE)
    if rank == 0:
        print(f"lightning_fleet: error: {message}", file=sys.stderr, flush=True)
    if is_deterministic(error) and os.environ.get("LOCAL_RANK", "0") == "0":
        _write_stop_file(message)
    agent = _agent_to_stop(error)
    if agent is not None:
        os.kill(agent, signal.SIGTERM)
    if rank != 0 and _stop_signal_seen:
        raise SystemExit(EXIT_CODE)  # the job is being stopped around this rank: rank 0 speaks (note_stop_signal)
    if rank != 0 or agent is not None:
        ended = _ended_around_us(PEER_GRACE_S)  # the agent's SIGTERM exits from inside
        if not ended and rank != 0:
            print(f"lightning_fleet: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)


def error_message(error: BaseException) -> str:
    """``error``'s text on one line (its type's name when it has none)."""
    return " ".join(str(error).split("\n")).strip() or type(error).__name__


def error_line(error: FleetError) -> str:
    """The line this rank prints (or would print, after its grace period) for ``error``: ``lightning_fleet: error:
    <message>``, with ``rank R:`` on ranks other than 0 (a :func:`peer_lost` message names its rank itself)."""
    rank = _global_rank()
    who = f"rank {rank}: " if rank != 0 and not getattr(error, _OWN_LINE, False) else ""
    return f"lightning_fleet: error: {who}{error_message(error)}"


def _global_rank() -> int:
    """This process's global rank: the process group's, else the launcher's variables (0 when there are none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    local, node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
    return local + node  # Lightning's launcher sets no RANK: zero only on the first process of the first node


def _agent_to_stop(error: FleetError) -> int | None:
    """The torchrun agent's PID when this process should stop it: a deterministic error, restarts left, local rank 0
    (without restarts left the agent stops by itself once this rank exits)."""
    if not is_deterministic(error) or "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    parent = os.getppid()
    return parent if restarts_left > 0 and parent > 1 else None


def _write_stop_file(message: str) -> None:
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        try:
            Path(path).write_text(message + "\n")
        except OSError:
            pass  # fleet launch then reports the agent's signal instead; the error line was printed already


def note_stop_signal() -> None:
    """Record that a stop signal (SIGTERM, SIGHUP) reached this process: FleetCheckpoint's handler calls it. A rank
    other than 0 whose FleetError follows one is being ended around it (torchrun's agent, stopped by rank 0 for a
    deterministic error, stops every worker with SIGTERM, which may land before this rank's own error does):
    :func:`end_job` then exits at once without a line of its own."""
    global _stop_signal_seen
    _stop_signal_seen = True


def _ended_around_us(grace_s: float) -> bool:
    """Wait until the agent's SIGTERM (exit 2 at once) or the parent's exit (True), or ``grace_s`` (False)."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(EXIT_CODE)

    signal.signal(signal.SIGTERM, stop)
    parent, deadline = _parent_at_install or os.getppid(), time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return True  # Lightning's launcher: rank 0 is our parent and has exited (after printing the line)
        time.sleep(_POLL_S)
    return False


def write_error_file(error: BaseException, traceback: Any) -> None:
    """Write ``error`` to the file torchrun gives each worker (``TORCHELASTIC_ERROR_FILE``), in the format of torch's
    ``ErrorHandler.record_exception``, so that the agent knows the root cause without the script's entry point being
    decorated with ``@record``. Does nothing outside torchrun.

    torchrun's failure summary shows each failed rank's ``py_callstack`` where there is one, else its ``message``
    (torch/distributed/elastic/multiprocessing/errors ``ChildFailedError._format_failure``): a FleetError is written as
    its one line and no call stack, so that plain torchrun's summary ends in that line instead of the worker's
    traceback (measured: 106 lines after the line, two tracebacks of 36 lines each); every other exception keeps its
    traceback there. ``fleet launch`` names the root cause from the same message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"timestamp": str(int(time.time()))}
    if isinstance(error, FleetError):
        message = error_line(error)
    else:
        line = error_message(error)
        message = f"{type(error).__name__}: {line}" if str(error).strip() else type(error).__name__
        info["py_callstack"] = "".join(tb.format_exception(type(error), error, traceback))
    _write_whole(Path(path), json.dumps({"message": {"message": message, "extraInfo": info}}))


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` by renaming a complete temporary file over it: the agent reads either nothing or all of it
    (measured before: a worker ended mid-write left an empty error file, on which torch's failure record, and with it
    ``fleet launch``, failed with "JSONDecodeError: Expecting value")."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(text)
        os.replace(tmp, path)


# --- a clean exit -------------------------------------------------------------------------------------

_exit_registered = False
_exit_after_error = False


def destroy_groups_at_exit() -> None:
    """At interpreter exit, destroy the process groups of a job whose main thread raised nothing (idempotent).

    A process that exits with its gloo group alive leaves the group's C++ worker threads to the interpreter's
    teardown: when a module dict is cleared before ``ProcessGroupGloo``'s destructor joins them, a joinable
    ``std::thread`` is destroyed and the process aborts after a finished fit ("terminate called without an active
    exception", exit -6; pytorch/pytorch#65231, whose fix was an explicit ``destroy_process_group()``, and #190489).
    After an uncaught exception the groups are left alone: a peer may still be inside a collective with this rank,
    and destroying then can block (pytorch/torchtitan#1342 destroys only after a clean exit)."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        import atexit

        atexit.register(_destroy_groups_unless_failed)


def _destroy_groups_unless_failed() -> None:
    dist = sys.modules.get("torch.distributed")
    if _exit_after_error or dist is None or not dist.is_available() or not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # exiting anyway: a group that cannot be destroyed is left to the OS
        dist.destroy_process_group()
