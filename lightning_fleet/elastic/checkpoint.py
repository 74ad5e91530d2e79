"""Atomic saves and commits of FleetCheckpoint checkpoints, the choice of the newest good one, and the pickle screen.

Pure: imports neither torch nor deepspeed (pickles are screened with pickletools, never unpickled); imported by
elastic/callback.py (saving), the strategy and the decision (resuming), export and the DeepSpeed runtime. Every name
and path of the layout, the typed manifest and :func:`~lightning_fleet.elastic.layout.verify` live in
:mod:`lightning_fleet.elastic.layout`.

A save goes to the temporary directory; every rank fsyncs what it wrote; after a barrier rank 0
hashes every file into the manifest, fsyncs it, renames the directory into place, fsyncs the
parent, and only then moves ``latest`` and prunes beyond ``keep``. A checkpoint counts only if
its manifest verifies: a torn save (no manifest), a truncated or bit-flipped or missing shard
(size or hash mismatch), a malformed manifest is named and skipped for the previous good one.

Reading a checkpoint once: :func:`newest_verified` (or ``layout.verify``) hashes every file once and returns a
:class:`~lightning_fleet.elastic.layout.Verdict` carrying the typed manifest; :func:`accept` turns an ok verdict into a
:class:`VerifiedCheckpoint` after screening its pickles, without hashing again.
"""

from __future__ import annotations

import os
import pickletools
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from lightning_fleet.elastic.layout import (
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


def newest_verified(dirpath: Path, log: Callable[[str], None] = print) -> Verdict | None:
    """The newest checkpoint whose manifest verifies. ``latest`` is only a hint; every skip is logged."""
    hint = dirpath / LATEST
    if hint.exists():
        name = hint.read_text().strip()
        if not (dirpath / name).is_dir():
            log(f"lightning_fleet: '{hint}' points to {name!r}, which does not exist; scanning for the newest verified checkpoint")
    elif committed(dirpath):
        log(f"lightning_fleet: '{hint}' is missing; scanning for the newest verified checkpoint")
    for candidate in committed(dirpath):
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
    hint = dirpath / LATEST
    if hint.is_file() and hint.read_text().strip() == checkpoint.name:
        hint.unlink()
    fsync_path(dirpath)
    return target


def remove_abandoned(dirpath: Path) -> None:
    """Delete temporary directories of saves that never committed."""
    if dirpath.is_dir():
        for tmp in dirpath.glob(ABANDONED_GLOB):
            shutil.rmtree(tmp, ignore_errors=True)


# --- refusing pickles that would run code --------------------------------------------------------

SAFE_GLOBALS = {
    "collections.OrderedDict",
    "collections.defaultdict",
    "builtins.set",
    "builtins.frozenset",
    "builtins.slice",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._tensor._rebuild_from_type_v2",
    "torch.Tensor",
    "torch.Size",
    "torch.device",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
}
"""Globals a checkpoint pickle may import: tensor rebuilding, plain containers, and the few classes
DeepSpeed stores (measured on its ZeRO 0-3, tensor- and pipeline-parallel checkpoints), plus the
standard-library values hyper-parameters commonly hold (LightningCLI paths: a path unpickles as
``PosixPath(*parts)``, string parsing only). Anything else (os.system, subprocess, eval,
builtins.exec, ...) is refused before the file is unpickled."""

_SAFE_PATTERN = re.compile(r"^torch\.(\w+Storage|float\d*|bfloat16|half|double|int\d+|uint8|bool|long)$")


def pickle_globals(data: bytes) -> set[str]:
    """Every module.name a pickle stream would import, found without executing it."""
    found: set[str] = set()
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif opcode.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add(f"{module}.{name}")
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


def torch_file_globals(path: Path) -> set[str]:
    """Globals of a torch.save file (zip with data.pkl) or of a raw pickle file."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return set().union(*(pickle_globals(archive.read(n)) for n in archive.namelist() if n.endswith(".pkl")))
    return pickle_globals(path.read_bytes())


def refuse_unsafe_pickles(root: Path) -> None:
    """Raise FleetError if any .pt file below ``root`` would import a global outside the allowlist."""
    for path in sorted(root.rglob("*.pt")):
        try:
            imports = torch_file_globals(path)
        except Exception as err:  # a file that is not a pickle at all
            raise FleetError(f"checkpoint file {path} is not a readable torch file ({type(err).__name__}); refusing to load it") from None
        unsafe = sorted(g for g in imports if g not in SAFE_GLOBALS and not _SAFE_PATTERN.match(g))
        if unsafe:
            raise FleetError(f"checkpoint file {path} would import {', '.join(unsafe)} when loaded; refusing it (the payload was not run)")


@dataclass(frozen=True, slots=True)
class VerifiedCheckpoint:
    """A committed checkpoint whose files matched its manifest and whose pickles were screened: safe to load."""

    path: Path
    """The step directory."""
    manifest: Manifest
    """Its typed manifest, as read by the verification."""


def accept(verdict: Verdict) -> VerifiedCheckpoint:
    """An ok verdict's checkpoint after screening its pickles (no file is hashed again); FleetError naming the reason
    for a verdict that is not ok, or the first pickle that would import a global outside the allowlist."""
    if not verdict.ok or verdict.manifest is None:
        raise FleetError(f"checkpoint {verdict.path} cannot be used: {verdict.reason}")
    refuse_unsafe_pickles(verdict.path)
    return VerifiedCheckpoint(verdict.path, verdict.manifest)
