"""Atomic saves and commits of FleetCheckpoint checkpoints, the choice of the newest good one, who may write them.

Pure: imports neither torch nor deepspeed (files are unpickled only by elastic/safe_load.py); imported by
elastic/callback.py (saving), the strategy and the decision (resuming), export and the DeepSpeed runtime. Every name
and path of the layout, the typed manifest and :func:`~lightning_fleet.elastic.layout.verify` live in
:mod:`lightning_fleet.elastic.layout`.

A save goes to the temporary directory; every rank fsyncs what it wrote; after a barrier rank 0
hashes every file into the manifest, fsyncs it, points ``latest`` at the step's name, renames the
directory into place, fsyncs the parent, sets aside any higher-numbered directory and only then
prunes beyond ``keep``. A checkpoint counts only if its manifest verifies: a torn save (no
manifest), a truncated or bit-flipped or missing shard (size or hash mismatch), a malformed
manifest is named and skipped for the previous good one. ``latest`` is read only when it is a
small regular file (:func:`read_latest`), and the checkpoint it names wins over higher-numbered
ones. Only the job holding the directory's lock (elastic/lock.py) writes, sets aside or removes.

Reading a checkpoint once: :func:`newest_verified` (or ``layout.verify``) hashes every file once and returns a
:class:`~lightning_fleet.elastic.layout.Verdict` carrying the typed manifest; :func:`accept` turns an ok verdict into a
:class:`VerifiedCheckpoint`. A checkpoint directory must be its user's alone (:func:`check_private`); a derived form
(the universal one) is hashed into the manifest when complete (:func:`list_derived`).
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Protocol

from lightning_fleet.elastic.layout import (
    PROBE_PREFIX,
    ABANDONED_GLOB,
    LATEST,
    MANIFEST,
    SET_ASIDE,
    FileEntry,
    Manifest,
    Verdict,
    entry_of,
    step_of,
    verify,
)
from lightning_fleet.planning import FleetError


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root`` (and root itself)."""
    for path in sorted(root.rglob("*")):
        fsync_path(path)
    fsync_path(root)


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file by temp file + fsync + rename + fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def files_of(root: Path) -> list[Path]:
    """Every regular file below ``root`` except the manifest, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_table(root: Path) -> dict[str, FileEntry]:
    """The manifest's ``files``: size and sha256 of every file of a checkpoint directory, by relative path."""
    return {p.relative_to(root).as_posix(): entry_of(p) for p in files_of(root)}


def committed(dirpath: Path) -> list[Path]:
    """Committed checkpoint directories (named step-N), newest first; nothing is verified here."""
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(found, key=lambda p: step_of(p.name) or 0, reverse=True)


LATEST_MAX_BYTES = 256
"""``latest`` is read only when it is a regular file of at most this many bytes (it holds one step dir's name)."""


def read_latest(dirpath: Path, log: Callable[[str], None] = print) -> str | None:
    """The step dir name ``latest`` holds; None when there is none, and None with a line when it is not a small regular
    file (a FIFO, a device, a symbolic link: never followed, never blocked on, never read past LATEST_MAX_BYTES) or does
    not hold a step dir's name."""
    hint = dirpath / LATEST
    try:
        info = os.lstat(hint)
    except FileNotFoundError:
        return None
    except OSError as err:
        log(f"lightning_fleet: ignoring '{hint}': it cannot be examined ({err.strerror})")
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > LATEST_MAX_BYTES:
        what = f"{info.st_size} bytes long" if stat.S_ISREG(info.st_mode) else f"{_file_kind(info.st_mode)}, not a regular file"
        log(f"lightning_fleet: ignoring '{hint}': it is {what}; it should name a checkpoint in at most {LATEST_MAX_BYTES} bytes")
        return None
    try:
        fd = os.open(hint, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        log(f"lightning_fleet: ignoring '{hint}': it cannot be opened ({err.strerror})")
        return None
    with os.fdopen(fd, "rb") as f:
        regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)  # replaced since the lstat: read nothing
        data = f.read(LATEST_MAX_BYTES + 1) if regular else b""
    name = data.decode("ascii", errors="replace").strip()
    if not regular or step_of(name) is None:
        log(f"lightning_fleet: ignoring '{hint}': it does not hold a checkpoint's name ({len(data)} bytes: {data[:40]!r})")
        return None
    return name


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def newest_verified(dirpath: Path, log: Callable[[str], None] = print) -> Verdict | None:
    """The checkpoint to resume: the one ``latest`` names when it verifies, even where a higher-numbered one exists (an
    operator's copy or a planted directory does not win over it; FleetCheckpoint sets such directories aside at its next
    commit); else the newest that verifies. Every skip is logged."""
    found = committed(dirpath)
    name = read_latest(dirpath, log)
    tried: Path | None = None
    if name is not None and (dirpath / name) in found:
        tried = dirpath / name
        verdict = verify(tried)
        if verdict.ok:
            higher = [p.name for p in found if (step_of(p.name) or 0) > (step_of(name) or 0)]
            if higher:
                log(f"lightning_fleet: resuming {tried}, which '{dirpath / LATEST}' names, not the higher-numbered "
                    f"{', '.join(higher)} (not written as this directory's newest; set aside at the next commit)")
            return verdict
        log(f"lightning_fleet: skipping checkpoint {tried}, which '{dirpath / LATEST}' names: {verdict.reason}")
    elif name is not None:
        log(f"lightning_fleet: '{dirpath / LATEST}' points to {name!r}, which does not exist; scanning for the newest "
            "verified checkpoint")
    elif found and not os.path.lexists(dirpath / LATEST):
        log(f"lightning_fleet: '{dirpath / LATEST}' is missing; scanning for the newest verified checkpoint")
    for candidate in found:
        if candidate == tried:
            continue
        verdict = verify(candidate)
        if verdict.ok:
            return verdict
        log(f"lightning_fleet: skipping checkpoint {candidate}: {verdict.reason}")
    return None


def prune(dirpath: Path, keep: int, protect: Iterable[Path]) -> None:
    """Remove committed checkpoints beyond the newest ``keep``, except the ``protect``ed ones."""
    protected = {p.resolve() for p in protect}
    for old in committed(dirpath)[keep:]:
        if old.resolve() not in protected:
            shutil.rmtree(old, ignore_errors=True)


def set_aside(dirpath: Path, checkpoint: Path) -> Path:
    """Move a committed checkpoint into ``dirpath/set-aside/`` (a new name if taken) and drop ``latest`` if it named it."""
    target_dir = dirpath / SET_ASIDE
    target_dir.mkdir(exist_ok=True)
    target, n = target_dir / checkpoint.name, 1
    while target.exists():
        target, n = target_dir / f"{checkpoint.name}.{n}", n + 1
    checkpoint.rename(target)
    if read_latest(dirpath, log=lambda line: None) == checkpoint.name:
        (dirpath / LATEST).unlink()
    fsync_path(dirpath)
    return target


def set_aside_newer(dirpath: Path, step: int, log: Callable[[str], None] = print) -> list[Path]:
    """Set aside every committed checkpoint numbered above ``step``, the one just committed as the newest: a copy or a
    planted directory there would otherwise be resumed or kept by pruning instead of this job's own. Never deletes."""
    moved = []
    for newer in committed(dirpath):
        if (step_of(newer.name) or 0) > step:
            moved.append(set_aside(dirpath, newer))
            log(f"lightning_fleet: {newer} is numbered above step {step}, this job's newest checkpoint; moved to {moved[-1]}")
    return moved


class DirectoryLock(Protocol):
    """What :func:`remove_abandoned` reads of a directory's lock (:class:`lightning_fleet.elastic.lock.DirLock`)."""

    held: bool
    directory: Path


def remove_abandoned(dirpath: Path, lock: DirectoryLock) -> None:
    """Delete temporary directories of saves that never committed; only while ``lock`` holds the directory (another
    job's save in progress is never one of them)."""
    if not lock.held or lock.directory.resolve() != dirpath.resolve():
        raise FleetError(f"removing abandoned saves in {dirpath} needs its lock (held: {lock.held}, lock of {lock.directory})")
    if dirpath.is_dir():
        for tmp in dirpath.glob(ABANDONED_GLOB):
            shutil.rmtree(tmp, ignore_errors=True)


def directory_bytes(root: Path) -> int:
    """Bytes of the regular files below ``root`` (symbolic links not followed)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def probe_writable(dirpath: Path) -> str:
    """'' when a file can be created, written, fsynced and removed in ``dirpath``, else what failed (the OS's words)."""
    probe = dirpath / f"{PROBE_PREFIX}{os.getpid()}"
    step = "create"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            step = "write"
            os.write(fd, b"lightning_fleet probe\n" * 64)
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "remove"
        os.unlink(probe)
    except OSError as err:
        if step != "create":
            try:
                os.unlink(probe)
            except OSError:
                pass
        return f"cannot {step} a file there ({err.strerror})"
    return ""


# --- who may write a checkpoint directory, and its derived forms ---------------------------------------------


def check_private(directory: Path) -> None:
    """FleetError unless ``directory`` is a real directory owned by this process's user and writable by nobody else: a
    checkpoint another local user can write could be replaced by theirs (a planted higher step, changed weights). A
    missing directory passes (the first save creates it privately)."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return
    except OSError as err:
        raise FleetError(f"checkpoint directory {directory} cannot be examined ({err.strerror})") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise FleetError(f"checkpoint directory {directory} is {kind}: give the real directory's path")
    me = os.geteuid()
    if info.st_uid != me:
        raise FleetError(
            f"checkpoint directory {directory} belongs to uid {info.st_uid}, but this job runs as uid {me}: another user could "
            "have put checkpoints there; use a directory of your own (or chown it after checking what it holds)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "everyone" if info.st_mode & stat.S_IWOTH else "its group"
        raise FleetError(
            f"checkpoint directory {directory} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o}): another user could "
            f"plant a checkpoint there; run chmod go-w {directory}"
        )


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and its parents) writable by this user only, whatever the umask; then :func:`check_private`."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    check_private(directory)


def list_derived(step_dir: Path, manifest: Manifest, name: str) -> Manifest:
    """Add the derived form ``step_dir/name`` (complete, fsynced) to the step's manifest: hash its files and replace the
    manifest atomically. Returns the new manifest; until it is written the form is not listed and never loaded."""
    table = file_table(step_dir / name)
    files = {**{k: v for k, v in manifest.files.items() if not k.startswith(f"{name}/")}, **{f"{name}/{k}": v for k, v in table.items()}}
    listed = replace(manifest, files=files)
    write_atomic(step_dir / MANIFEST, listed.to_json())
    return listed


@dataclass(frozen=True, slots=True)
class VerifiedCheckpoint:
    """A committed checkpoint whose files matched its manifest: what a fit continues (read with the restricted
    unpickler, each file checked against ``manifest`` again as it is read)."""

    path: Path
    """The step directory."""
    manifest: Manifest
    """Its typed manifest, as read by the verification."""


def accept(verdict: Verdict) -> VerifiedCheckpoint:
    """An ok verdict's checkpoint (no file is hashed again; its files are unpickled only by the restricted unpickler,
    :mod:`lightning_fleet.elastic.safe_load`); FleetError naming the reason for a verdict that is not ok."""
    if not verdict.ok or verdict.manifest is None:
        raise FleetError(f"checkpoint {verdict.path} cannot be used: {verdict.reason}")
    return VerifiedCheckpoint(verdict.path, verdict.manifest)
