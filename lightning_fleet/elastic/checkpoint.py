"""Atomic, verified checkpoints, and the choice of the newest good one to resume from.

Layout under ``dirpath``::

    step-000000012/           a committed checkpoint
        state/                DeepSpeed's sharded checkpoint (+ Lightning's loop/callback state)
        rank-00000.pt ...     each rank's RNG states (plain tensors and numbers only)
        manifest.json         written last, by rank 0: step, world, plan, every file's size and sha256
    .tmp-step-000000015/      a save in progress (never resumed from; removed by the next save)
    latest                    the name of the newest committed checkpoint (a hint, never trusted)

A save goes to the temporary directory; every rank fsyncs what it wrote; after a barrier rank 0
hashes every file into the manifest, fsyncs it, renames the directory into place, fsyncs the
parent, and only then moves ``latest`` and prunes beyond ``keep``. A checkpoint counts only if
its manifest verifies: a torn save (no manifest), a truncated or bit-flipped or missing shard
(size or hash mismatch) is named and skipped for the previous good one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from lightning_fleet.planning import FleetError

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{9})$")


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:09d}"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def build_manifest(root: Path, meta: dict) -> dict:
    """Sizes and hashes of every file of a checkpoint directory, plus ``meta``."""
    files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files_of(root)}
    return {**meta, "files": files}


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a checkpoint directory can be resumed from, and if not, why."""

    path: Path
    """The checkpoint directory."""
    ok: bool
    """Every file the manifest lists is there with its size and hash."""
    reason: str
    """Why it cannot be used ('' when ok)."""
    manifest: dict | None
    """The parsed manifest (None when missing or unreadable)."""


def verify(root: Path) -> Verdict:
    """Check a checkpoint directory against its manifest; name the first problem."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return Verdict(root, False, "no manifest (the save did not finish)", None)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return Verdict(root, False, "manifest is not valid JSON with a 'files' table", None)
    for name, entry in files.items():
        path = root / name
        if not path.is_file():
            return Verdict(root, False, f"file {name} is missing", manifest)
        size = path.stat().st_size
        if size != entry["bytes"]:
            return Verdict(root, False, f"file {name} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)", manifest)
        if sha256_of(path) != entry["sha256"]:
            return Verdict(root, False, f"file {name} does not match its sha256 (corrupted)", manifest)
    return Verdict(root, True, "", manifest)


def committed(dirpath: Path) -> list[Path]:
    """Committed checkpoint directories (named step-N), newest first; nothing is verified here."""
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)


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
    """Remove committed checkpoints beyond the newest ``keep`` and abandoned temporary saves."""
    protected = {p.resolve() for p in protect}
    for old in committed(dirpath)[keep:]:
        if old.resolve() not in protected:
            shutil.rmtree(old, ignore_errors=True)


SET_ASIDE = "set-aside"
"""Subdirectory of a checkpoint dir that holds checkpoints moved out of the way (never resumed, never pruned)."""


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
        for tmp in dirpath.glob(".tmp-step-*"):
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
