"""Exclusive ownership of a checkpoint directory: one job writes it at a time.

Two jobs pointed at one directory would overwrite each other's checkpoints, resume each other's live saves and delete
each other's saves in progress. A job's rank 0 therefore holds a lock file in the directory (:data:`LOCK`) naming its
host, process, job (torchrun's run id) and a heartbeat time that a thread of that process refreshes every
:data:`HEARTBEAT_S`. The file is created with ``O_CREAT | O_EXCL`` (atomic: of two jobs starting at once one wins);
every decision about it (take, refresh, take over, release) is made under a record lock of a guard file
(:data:`GUARD`, never deleted) and written in place at a fixed size (:data:`LOCK_BYTES`), so a full disk cannot stop a
heartbeat. A second job gets one line naming the holder and what to do. A lock is taken over, with a line saying so,
when its holder is gone: the same job restarted (same run id), its process dead on this machine, or no heartbeat for
:data:`STALE_AFTER_S`. A holder that finds its lock taken over (it was stopped longer than that) stops before it writes
again (:meth:`DirLock.verify`).

Pure (standard library and the planning core's FleetError); imported by elastic/callback.py (FleetCheckpoint takes the
lock at setup and releases it at the end of fit) and elastic/checkpoint.py (removing abandoned saves needs the lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
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
from lightning_fleet.planning import FleetError

LOCK_BYTES = 1024
"""Size of the lock file: every write rewrites these bytes in place (no new blocks are needed on a full disk)."""
HEARTBEAT_S = 5.0
"""How often the holder refreshes its heartbeat."""
STALE_AFTER_S = 6 * HEARTBEAT_S
"""A lock whose heartbeat is older than this is taken over: six missed heartbeats (a holder stopped or gone)."""
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
    """Unix time of the holder's last heartbeat."""

    def describe(self, now: float) -> str:
        """E.g. ``host node3, pid 4242, run id job7, last heartbeat 2 s ago``."""
        job = f", run id {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago"

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
        ok = isinstance(holder.pid, int) and isinstance(holder.heartbeat, (int, float)) and all(
            isinstance(v, str) for v in (holder.host, holder.machine, holder.job, holder.token))
        return holder if ok else None


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
        heartbeat_s: how often a thread refreshes the heartbeat.
        stale_after_s: a heartbeat older than this makes another holder's lock stale.
        log: where the take-over lines go.
    """

    def __init__(self, directory: Path, *, job: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S, log: Callable[[str], None] = print) -> None:
        self.directory = Path(directory)
        self.job = job_id() if job is None else job
        self.heartbeat_s, self.stale_after_s, self.log = heartbeat_s, stale_after_s, log
        self.token = uuid.uuid4().hex
        self.held = False
        """True from acquire to release."""
        self.lost: str | None = None
        """Set when the heartbeat found the lock taken over: who holds it now."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        """The lock file."""
        return self.directory / LOCK

    # --- taking it ---------------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Hold the directory, taking over a stale lock (with a line); FleetError naming the holder when another live
        job holds it. A holder on another machine is taken to be alive once its heartbeat moves, and stale once it has
        not for ``stale_after_s``: the wait is at most that long."""
        if self.held:
            return
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        watched: tuple[str, float] | None = None
        deadline = time.monotonic() + self.stale_after_s + 2 * self.heartbeat_s
        while (holder := self._try_take(watched)) is not None:
            if time.monotonic() > deadline:
                raise self._refusal(holder)
            watched = (holder.token, holder.heartbeat)
            time.sleep(min(1.0, self.heartbeat_s / 2))
        self.held, self.lost = True, None
        self._start_heartbeat()

    def _try_take(self, watched: tuple[str, float] | None) -> LockHolder | None:
        """Under the guard: take the lock when there is none or it is stale (None); FleetError when its holder is alive
        on this machine or has heartbeaten since ``watched``; else that holder (on another machine, alive or not)."""
        with self._guard():
            holder, raw = self._read()
            if raw is None:
                self._create()
                return None
            reason = self._stale(holder, raw)
            if reason:
                self._write()
                self.log(f"lightning_fleet: took over the lock of checkpoint directory {self.directory}: {reason}")
                return None
            assert holder is not None  # a lock naming no holder is stale
            if self._alive_here(holder) or (watched is not None and watched != (holder.token, holder.heartbeat)):
                raise self._refusal(holder)
            return holder

    def _me(self) -> LockHolder:
        return LockHolder(host=socket.gethostname(), machine=machine_id(), pid=os.getpid(), job=self.job, token=self.token,
                          heartbeat=time.time())

    def _stale(self, holder: LockHolder | None, raw: bytes) -> str:
        """Why the lock found may be taken over ('' when it may not)."""
        now = time.time()
        if holder is None:
            return f"its lock file held {len(raw)} bytes that name no holder (a holder that died while taking it)"
        if holder.token == self.token:
            return ""
        here = holder.machine == machine_id()
        if holder.job and holder.job == self.job and not (here and process_alive(holder.pid) and holder.pid != os.getpid()):
            return f"it was held by an earlier attempt of this job ({holder.describe(now)})"
        if here and (holder.pid == os.getpid() or not process_alive(holder.pid)):
            gone = "this process's earlier fit" if holder.pid == os.getpid() else "its process is gone"
            return f"it was held by {holder.describe(now)}, and {gone}"
        if now - holder.heartbeat > self.stale_after_s:
            return f"it was held by {holder.describe(now)}: stale (no heartbeat for more than {self.stale_after_s:.0f} s)"
        return ""

    def _alive_here(self, holder: LockHolder) -> bool:
        return holder.machine == machine_id() and process_alive(holder.pid)

    def _refusal(self, holder: LockHolder) -> FleetError:
        return FleetError(
            f"checkpoint directory {self.directory} is in use by another job ({holder.describe(time.time())}): two jobs "
            f"writing one directory overwrite each other's checkpoints; give this job another checkpoint_dir, or stop that "
            f"job (its lock {self.path} is taken over {self.stale_after_s:.0f} s after its last heartbeat)"
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
