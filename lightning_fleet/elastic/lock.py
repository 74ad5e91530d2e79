"""Exclusive ownership of a checkpoint directory: one job writes it at a time.

Two jobs pointed at one directory would overwrite each other's checkpoints, resume each other's live saves and delete
each other's saves in progress. A job's rank 0 therefore holds a lock file in the directory (:data:`LOCK`) naming its
host, process, job (torchrun's run id and its rendezvous, :func:`job_rendezvous`) and a heartbeat (a counter and a
time) that a thread of that process refreshes every :data:`HEARTBEAT_S`. The file is created with ``O_CREAT | O_EXCL``
(atomic: of two jobs starting at once one wins); every decision about it (take, refresh, take over, release) is made
under a record lock of a guard file (:data:`GUARD`, never deleted) and written in place at a fixed size
(:data:`LOCK_BYTES`), so a full disk cannot stop a heartbeat. A second job gets one line naming the holder and what to
do. A lock is taken over, with a line saying so, when its holder is gone: the same job restarted (same run id and
rendezvous), its process dead on this machine, or, on another machine, its heartbeat not moving while this process
watches it for :data:`STALE_AFTER_S` by its own clock. The holder's heartbeat time is never compared with this
machine's clock (another machine's clock may be behind, ahead, or the file may hold garbage or NaN there): only whether
the file changes. A holder that finds its lock taken over (it was stopped longer than that) stops before it writes
again (:meth:`DirLock.verify`).

Pure (standard library, the planning core's FleetError and the worker's reading of its agent's rendezvous endpoint);
imported by elastic/callback.py (FleetCheckpoint takes the lock at setup and releases it at the end of fit) and
elastic/checkpoint.py (removing abandoned saves needs the lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from lightning_fleet.elastic.layout import GUARD, LOCK
from lightning_fleet.elastic.worker import rendezvous_endpoint
from lightning_fleet.planning import FleetError

LOCK_BYTES = 1024
"""Size of the lock file: every write rewrites these bytes in place (no new blocks are needed on a full disk)."""
HEARTBEAT_S = 5.0
"""How often the holder refreshes its heartbeat."""
STALE_AFTER_S = 6 * HEARTBEAT_S
"""A lock on another machine whose heartbeat does not move while it is watched this long (by the watcher's own clock)
is taken over: six missed heartbeats (a holder stopped or gone)."""
GUARD_TIMEOUT_S = 30.0
"""Longest wait for the guard (held only for a read and a write of LOCK_BYTES)."""
_THREADS = threading.Lock()  # POSIX record locks do not exclude the threads of one process: this does


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds a checkpoint directory."""

    host: str
    """Host name (for people)."""
    machine: str
    """The kernel boot and pid namespace of the holder: PIDs are only comparable where this is equal."""
    pid: int
    """The holder's process (rank 0 of its job)."""
    job: str
    """torchrun's run id (TORCHELASTIC_RUN_ID), '' when the job has none (another launcher, or torchrun's 'none')."""
    token: str
    """Unique to one holding: a lock is ours exactly when its token is."""
    heartbeat: float
    """Unix time of the holder's last heartbeat, by the holder's clock (for people: never compared with another clock)."""
    rendezvous: str = ""
    """What tells the holder's job from another with the same run id (:func:`job_rendezvous`); '' in a lock written by
    an older version or outside torchrun: that holder is then never taken for an earlier attempt of this job."""
    beat: int = 0
    """How many heartbeats the holder wrote: the file changes at every one even when the holder's clock does not."""

    def describe(self, now: float) -> str:
        """E.g. ``host node3, pid 4242, run id job7, last heartbeat 2 s ago`` (``now``: this machine's time)."""
        job = f", run id {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, {_heartbeat_age(self.heartbeat, now)}"

    def encode(self) -> bytes:
        """The lock file's bytes: JSON padded with spaces to :data:`LOCK_BYTES`."""
        data = json.dumps(asdict(self), sort_keys=True).encode()
        if len(data) > LOCK_BYTES:
            raise FleetError(f"the lock's holder takes {len(data)} bytes, more than {LOCK_BYTES}: shorten the host name or run id")
        return data.ljust(LOCK_BYTES, b" ")

    @classmethod
    def decode(cls, data: bytes) -> LockHolder | None:
        """The holder a lock file names; None when its bytes are not one (torn or foreign)."""
        try:
            table = json.loads(data.decode("utf-8"))
            holder = cls(**table)
        except (ValueError, TypeError):
            return None
        ok = isinstance(holder.pid, int) and isinstance(holder.beat, int) and isinstance(holder.heartbeat, (int, float)) and all(
            isinstance(v, str) for v in (holder.host, holder.machine, holder.job, holder.token, holder.rendezvous))
        return holder if ok else None


def _heartbeat_age(heartbeat: float, now: float) -> str:
    """The holder's last heartbeat in words, by this machine's clock where the two clocks allow it."""
    age = now - heartbeat
    if not math.isfinite(age):
        return f"heartbeat time {heartbeat!r} (not a time)"
    if age < 0:
        return f"last heartbeat stamped {-age:.0f} s ahead of this machine's clock"
    return f"last heartbeat {age:.0f} s ago"


def job_id() -> str:
    """This job's id: torchrun's run id, '' when there is none (``none`` is torchrun's default, shared by every job)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if run in ("", "none") else run


def machine_id() -> str:
    """The kernel boot id and pid namespace of this process: two processes see each other's PIDs only when equal."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"host:{socket.gethostname()}"
    return f"{boot}/{namespace}"


def job_rendezvous() -> str:
    """What tells this torchrun job from another with the same run id (``--rdzv-id``): the rendezvous endpoint its agents
    were given, the same string on every node of one job. A loopback or unspecified host (``127.0.0.1``, ``localhost``,
    ``0.0.0.0``), a port 0 or no endpoint at all names no place beyond this machine (two single-host jobs on two hosts
    may both use ``127.0.0.1:29400`` and one run id): it is qualified by this machine and the launching agent (its pid
    and start time), which every restart of the job on this machine shares. '' outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    endpoint = rendezvous_endpoint()
    host, _, port = endpoint.rpartition(":") if endpoint.count(":") == 1 or endpoint.startswith("[") else (endpoint, "", "")
    host = host.strip("[]").lower()
    local = host in ("", "localhost", "0.0.0.0", "::", "::1") or host.startswith("127.") or port == "0"
    return f"{endpoint}@{machine_id()}/agent {_agent()}" if local else endpoint


def _agent() -> str:
    """This process's parent (a torchrun worker's agent): its pid and start time (a pid alone may be reused)."""
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{parent}/{started}"


def process_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this machine and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class DirLock:
    """The lock of one checkpoint directory, held by this process from :meth:`acquire` to :meth:`release`.

    Args:
        directory: the checkpoint directory (created if missing).
        job: this job's id (default :func:`job_id`).
        rendezvous: what tells this job from another with the same id (default :func:`job_rendezvous`).
        heartbeat_s: how often a thread refreshes the heartbeat.
        stale_after_s: how long a holder on another machine is watched, by ``clock``, before a heartbeat that did not
            move in that time makes its lock stale.
        log: where the waiting and take-over lines go.
        clock: seconds of this process's monotonic clock (the watch's clock).
        sleep: how this process waits between two reads of a watched lock.
    """

    def __init__(self, directory: Path, *, job: str | None = None, rendezvous: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S,
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.directory = Path(directory)
        self.job = job_id() if job is None else job
        self.rendezvous = job_rendezvous() if rendezvous is None else rendezvous
        self.heartbeat_s, self.stale_after_s, self.log = heartbeat_s, stale_after_s, log
        self.clock, self.sleep = clock, sleep
        self.token = uuid.uuid4().hex
        self.held = False
        """True from acquire to release."""
        self.lost: str | None = None
        """Set when the heartbeat found the lock taken over: who holds it now."""
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        """The lock file."""
        return self.directory / LOCK

    # --- taking it ---------------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Hold the directory, taking over a stale lock (with a line); FleetError naming the holder when another live
        job holds it. A holder on another machine is watched (a line says so): it is alive once its lock file changes
        (a heartbeat), and stale when it has not changed for ``stale_after_s`` of this process's clock: the wait is
        at most that long, whatever times the file holds."""
        if self.held:
            return
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        watched: tuple[bytes, float] | None = None
        while (found := self._try_take(watched)) is not None:
            holder, raw = found
            if watched is None:
                self.log(f"lightning_fleet: checkpoint directory {self.directory} is locked by a job on another machine "
                         f"({holder.describe(time.time())}); taking it over unless its heartbeat moves within "
                         f"{self.stale_after_s:.0f} s")
                watched = (raw, self.clock())
            self.sleep(min(1.0, self.heartbeat_s / 2))
        self.held, self.lost = True, None
        self._start_heartbeat()

    def _try_take(self, watched: tuple[bytes, float] | None) -> tuple[LockHolder, bytes] | None:
        """Under the guard: take the lock when there is none or it is stale (None); FleetError when its holder is alive
        on this machine or its file changed since ``watched`` (its bytes as first read, and when); else that holder and
        the bytes read (a holder on another machine, not watched long enough to tell)."""
        with self._guard():
            holder, raw = self._read()
            if raw is None:
                self._create()
                return None
            reason = self._stale(holder, raw, watched)
            if reason:
                self._write()
                self.log(f"lightning_fleet: took over the lock of checkpoint directory {self.directory}: {reason}")
                return None
            assert holder is not None  # a lock naming no holder is stale
            if self._alive_here(holder) or (watched is not None and watched[0] != raw):
                raise self._refusal(holder)
            return holder, raw

    def _me(self) -> LockHolder:
        return LockHolder(host=socket.gethostname(), machine=machine_id(), pid=os.getpid(), job=self.job, token=self.token,
                          heartbeat=time.time(), rendezvous=self.rendezvous, beat=self._beats)

    def _stale(self, holder: LockHolder | None, raw: bytes, watched: tuple[bytes, float] | None) -> str:
        """Why the lock found (its ``raw`` bytes) may be taken over ('' when it may not, or not yet)."""
        now = time.time()
        if holder is None:
            return f"its lock file held {len(raw)} bytes that name no holder (a holder that died while taking it)"
        if holder.token == self.token:
            return ""
        here = holder.machine == machine_id()
        if self._same_job(holder) and not (here and process_alive(holder.pid) and holder.pid != os.getpid()):
            return f"it was held by an earlier attempt of this job ({holder.describe(now)})"
        if here and (holder.pid == os.getpid() or not process_alive(holder.pid)):
            gone = "this process's earlier fit" if holder.pid == os.getpid() else "its process is gone"
            return f"it was held by {holder.describe(now)}, and {gone}"
        if not here and watched is not None and watched[0] == raw and self.clock() - watched[1] >= self.stale_after_s:
            return (f"it was held by {holder.describe(now)} on another machine, and its heartbeat did not move for "
                    f"{self.stale_after_s:.0f} s")
        return ""

    def _same_job(self, holder: LockHolder) -> bool:
        """Whether ``holder`` is an earlier attempt of this job: the same run id and the same rendezvous."""
        return bool(holder.job and holder.rendezvous) and (holder.job, holder.rendezvous) == (self.job, self.rendezvous)

    def _alive_here(self, holder: LockHolder) -> bool:
        return holder.machine == machine_id() and process_alive(holder.pid)

    def _refusal(self, holder: LockHolder) -> FleetError:
        return FleetError(
            f"checkpoint directory {self.directory} is in use by another job ({holder.describe(time.time())}): two jobs "
            f"writing one directory overwrite each other's checkpoints; give this job another checkpoint_dir, or stop that "
            f"job (its lock {self.path} is taken over once its heartbeat has not moved for {self.stale_after_s:.0f} s)"
        )

    # --- the file, under the guard ----------------------------------------------------------------------------

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Exclusive against every other process (a POSIX record lock of :data:`GUARD`: unlike ``flock``, not inherited
        by a child forked meanwhile, e.g. a DataLoader worker, and kept by NFS) and every other thread of this one."""
        with _THREADS:
            fd = os.open(self.directory / GUARD, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                deadline = time.monotonic() + GUARD_TIMEOUT_S
                while True:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as err:
                        if err.errno not in (errno.EACCES, errno.EAGAIN):
                            raise
                        if time.monotonic() > deadline:
                            raise FleetError(f"the lock guard {self.directory / GUARD} stayed locked for {GUARD_TIMEOUT_S:.0f} "
                                             "s: is a process hung while holding it?") from None
                        time.sleep(0.01)
                yield
            finally:
                os.close(fd)  # releases the record lock

    def _read(self) -> tuple[LockHolder | None, bytes | None]:
        """(holder, raw bytes) of the lock file; (None, None) when there is none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None, None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return None, b""  # a symbolic link: names no holder, replaced by a file of ours
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None, b""  # a FIFO, a device: names no holder, replaced by a file of ours (never read)
            raw = f.read(LOCK_BYTES + 1)
        return LockHolder.decode(raw), raw

    def _create(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._beats += 1
        try:
            os.write(fd, self._me().encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write(self) -> None:
        """Rewrite the lock file in place (a symbolic link, FIFO or other non-file there is replaced by a new file)."""
        try:
            regular = stat.S_ISREG(os.lstat(self.path).st_mode)
        except FileNotFoundError:
            regular = None
        if not regular:
            if regular is not None:
                os.unlink(self.path)
            self._create()
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        self._beats += 1
        try:
            os.pwrite(fd, self._me().encode(), 0)
            os.ftruncate(fd, LOCK_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- holding it -------------------------------------------------------------------------------------------

    def verify(self) -> None:
        """FleetError unless this process still holds the lock (read from the file, not from the heartbeat's flag)."""
        if not self.held:
            raise FleetError(f"this process does not hold the lock of checkpoint directory {self.directory}")
        with self._guard():
            holder, raw = self._read()
        if holder is None or holder.token != self.token:
            who = holder.describe(time.time()) if holder is not None else "nobody (the lock file is gone)"
            self.lost = who
            raise FleetError(
                f"this job lost checkpoint directory {self.directory} to another job ({who}) while it was stopped longer "
                f"than {self.stale_after_s:.0f} s; it stops without writing: give one of the jobs another checkpoint_dir"
            )

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="lightning_fleet-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                with self._guard():
                    holder, _ = self._read()
                    if holder is None or holder.token != self.token:
                        self.lost = holder.describe(time.time()) if holder is not None else "nobody (the lock file is gone)"
                        return
                    self._write()
            except (OSError, FleetError):
                continue  # the next beat tries again; verify() reads the file itself before every write

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=GUARD_TIMEOUT_S)
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            with self._guard():
                holder, _ = self._read()
                if holder is not None and holder.token == self.token:
                    os.unlink(self.path)
        except OSError:
            pass  # the directory went away; nothing to release
