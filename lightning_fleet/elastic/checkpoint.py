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
:class:`VerifiedCheckpoint`. A checkpoint directory must be its user's alone, in a tree no other user can rearrange
(:func:`check_private`, :func:`check_ancestors`); everything in it is created with explicit modes whatever the umask
(:func:`make_dir`, :func:`seal_tree`, :func:`write_atomic`, whose temporary files are made with ``O_EXCL | O_NOFOLLOW``
under unpredictable names, never inside a step dir); a derived form (the universal one) is hashed into the manifest
when complete (:func:`list_derived`).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Protocol

from lightning_fleet.elastic.layout import (
    DIR_MODE,
    FILE_MODE,
    PROBE_PREFIX,
    ABANDONED_GLOB,
    LATEST,
    MANIFEST,
    SET_ASIDE,
    TMP_GLOB,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    Verdict,
    derived_listed,
    entry_of,
    step_of,
    tmp_name,
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


def write_atomic(path: Path, text: str, scratch: Path | None = None) -> None:
    """Write a small text file by temp file + fsync + rename + fsync of the directory. The temp file is made in
    ``scratch`` (default: ``path``'s directory; it must be on the same file system) under an unpredictable name, with
    ``O_EXCL | O_NOFOLLOW`` (a link planted there is never written through) and mode :data:`FILE_MODE` whatever the
    umask; a crash leaves it there as ``.tmp-<name>.*``, never inside a checkpoint (see :func:`remove_abandoned`)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=scratch or path.parent)  # O_EXCL|O_NOFOLLOW, 0600
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def make_dir(path: Path, mode: int = DIR_MODE) -> None:
    """Create one directory with exactly ``mode`` whatever the umask (FileExistsError when something is there)."""
    os.mkdir(path, mode)
    os.chmod(path, mode)  # the umask may have taken bits off: a checkpoint's entries have the same modes everywhere


def seal_tree(root: Path) -> None:
    """Give every entry below ``root`` (and root) the modes of a checkpoint whatever the umask and whoever wrote them
    (DeepSpeed, torch): directories :data:`DIR_MODE`, regular files at most :data:`FILE_MODE` (0644 or tighter), so
    that nobody but their owner can write any of them. Symbolic links are not followed (verify refuses them)."""
    for folder, dirs, names in os.walk(root, topdown=False):
        for name in names:
            entry = os.path.join(folder, name)
            info = os.lstat(entry)
            if stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) & ~FILE_MODE:
                os.chmod(entry, stat.S_IMODE(info.st_mode) & FILE_MODE)
        for name in dirs:
            entry = os.path.join(folder, name)
            if not os.path.islink(entry):
                os.chmod(entry, DIR_MODE)
    os.chmod(root, DIR_MODE)


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
    with suppress(FileExistsError):
        make_dir(target_dir)
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
    """Delete what saves and commits that never finished left in ``dirpath``: temporary step directories and the
    temporary files of :func:`write_atomic` (``latest``, a step's manifest being rewritten); only while ``lock`` holds
    the directory (another job's save in progress is never one of them). A symbolic link there is removed, not followed."""
    if not lock.held or lock.directory.resolve() != dirpath.resolve():
        raise FleetError(f"removing abandoned saves in {dirpath} needs its lock (held: {lock.held}, lock of {lock.directory})")
    if not dirpath.is_dir():
        return
    for tmp in dirpath.glob(TMP_GLOB):
        if tmp.is_dir() and not tmp.is_symlink():
            if tmp.match(ABANDONED_GLOB):
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            with suppress(FileNotFoundError):
                tmp.unlink()


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
    """FleetError unless ``directory`` is a real directory owned by this process's user and writable by nobody else, in
    a tree nobody else can rearrange (:func:`check_ancestors`): a checkpoint another local user can write, or move away
    and replace, could be replaced by theirs (a planted higher step, changed weights, a link at a temporary name). A
    missing directory passes when its existing ancestors do (the first save creates it privately)."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        check_ancestors(directory)
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
    check_ancestors(directory)


def check_ancestors(directory: Path) -> None:
    """FleetError unless every existing directory above ``directory`` (of its real path, and every symbolic link on the
    way to it) belongs to this user or root and is writable by nobody else, or only with the sticky bit (as /tmp): who
    can write a directory without it can rename what it holds, so another user could move the checkpoint directory away,
    put one of their own in its place and plant links at the names this job writes."""
    me, path = os.geteuid(), Path(os.path.abspath(directory))
    for step in (path, *path.parents):  # the names as given: a link on the way must not be another user's
        with suppress(OSError):
            info = os.lstat(step)
            if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, me):
                raise FleetError(f"checkpoint directory {directory} is reached through {step}, a symbolic link of uid "
                                 f"{info.st_uid}: another user can point it elsewhere; give a path of your own")
    for parent in Path(os.path.realpath(path)).parents:
        try:
            info = os.lstat(parent)
        except OSError:
            continue  # not there yet: created by this job (make_private_dir)
        problem = _foreign_writer(info, me)
        if problem:
            raise FleetError(
                f"checkpoint directory {directory} lies in {parent}, which {problem}: another user could move the checkpoint "
                f"directory away and put one of their own in its place; use a directory below one only you can write "
                f"(or run chmod +t {parent})"
            )


def _foreign_writer(info: os.stat_result, me: int) -> str:
    """Who else than this user (and root) can rename the entries of a directory, in words ('' when nobody can)."""
    if info.st_uid not in (0, me):
        return f"belongs to uid {info.st_uid}"
    mode = stat.S_IMODE(info.st_mode)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        who = "everyone" if info.st_mode & stat.S_IWOTH else "its group"
        return f"{who} can write (mode {mode:o}, no sticky bit)"
    return ""


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode :data:`DIR_MODE` whatever the umask (writable by this user
    only); then :func:`check_private`."""
    missing, path = [], Path(os.path.abspath(directory))
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with suppress(FileExistsError):
            make_dir(folder)
    check_private(directory)


def identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of ``directory`` itself (a link is not followed); None when nothing is there. Equal identities:
    the same directory, not one put in its place."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def still_there(step_dir: Path) -> str:
    """'' when a checkpoint this job committed is still there (its manifest parses and names this step, every listed
    file has its size), else what is wrong; no file is hashed (a message that calls a checkpoint intact checks this)."""
    try:
        manifest = Manifest.from_json((step_dir / MANIFEST).read_bytes())
        missing = next((name for name, entry in manifest.files.items() if (step_dir / name).stat().st_size != entry.bytes), None)
    except FileNotFoundError:
        return "no longer exists" if not os.path.lexists(step_dir) else "lost files (no manifest, or a listed file is gone)"
    except (OSError, FleetError) as err:
        return f"cannot be read ({getattr(err, 'strerror', None) or err})"
    return f"its file {missing} changed size" if missing else ""


def list_derived(step_dir: Path, manifest: Manifest, name: str) -> Manifest:
    """Add the derived form ``step_dir/name`` (complete, fsynced) to the step's manifest: hash its files and replace the
    manifest atomically. Returns the new manifest; until it is written the form is not listed and never loaded. The
    temporary manifest is written beside the step dir, not in it: a kill before the rename leaves the checkpoint as it
    was (it still verifies), and the stray file is removed under the directory's lock (:func:`remove_abandoned`)."""
    table = file_table(step_dir / name)
    files = {**{k: v for k, v in manifest.files.items() if not k.startswith(f"{name}/")}, **{f"{name}/{k}": v for k, v in table.items()}}
    listed = replace(manifest, files=files)
    write_atomic(step_dir / MANIFEST, listed.to_json(), scratch=step_dir.parent)
    return listed


def write_derived(checkpoint: "VerifiedCheckpoint", name: str, write: Callable[[Path], None]) -> "VerifiedCheckpoint":
    """The derived form ``step_dir/name`` of a verified checkpoint, written once: ``write(directory)`` fills a private
    temporary directory, which is sealed (0755 directories, files 0644 or tighter, whatever the umask), fsynced, renamed
    into place and then hashed into the manifest (:func:`list_derived`). A kill or an error midway leaves an unlisted
    temporary directory, which is never loaded and is replaced by the next attempt; a form already listed is kept."""
    step, manifest = checkpoint.path, checkpoint.manifest
    if derived_listed(manifest, name):
        return checkpoint
    target, tmp = step / name, step / tmp_name(name)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    make_dir(tmp, 0o700)  # nobody else enters it while converters and torch write with the umask's modes
    write(tmp)
    seal_tree(tmp)
    fsync_tree(tmp)
    tmp.rename(target)
    fsync_path(step)
    return VerifiedCheckpoint(step, list_derived(step, manifest, name))


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
