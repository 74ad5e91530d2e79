"""Reading checkpoint files without running code: torch's restricted unpickler with our allowlist, for every load.

A pickle can call any importable function while it is read, so a checkpoint file that somebody else could write is
code. Nothing here scans pickles for dangerous opcodes (a scanner misses protocol-0 ``INST``, operands fetched from
the memo, bytes after the first ``STOP``, a pickle with a zip appended, ...): every file is unpickled by torch's
``weights_only`` unpickler, which builds only tensors, plain containers and numbers and the globals of
:data:`ALLOWED_GLOBALS`; anything else is refused before it is called.

:func:`restricted` makes that hold for every ``torch.load`` made inside it, including DeepSpeed's and Lightning's
(which pass ``weights_only=False``): it sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which torch.load reads at each call
(torch/serialization.py ``load``), and admits the allowlist with ``torch.serialization.safe_globals``.
:func:`load_file` reads one file once, checks it against its manifest entry when given one, and unpickles those same
bytes, so a file swapped between the check and the load is never read. Refusals and damaged files are one
:class:`~lightning_fleet.planning.FleetError` line; a refused global is marked deterministic (every attempt would read
the same file, so torchrun does not restart for it).

Imports torch (and, by name when present, the few DeepSpeed classes its checkpoints hold) and elastic/worker.py's
error marks; imported by the strategy,
the DeepSpeed runtime (its checkpoint engine, resharding and offline reader) and ``python -m
lightning_fleet.runtime.deepspeed.convert``.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import pickle
import re
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from lightning_fleet.elastic.layout import FileEntry
from lightning_fleet.elastic.worker import deterministic, is_deterministic
from lightning_fleet.planning import FleetError

ALLOWED_GLOBALS = (
    "collections.OrderedDict",
    "collections.defaultdict",
    "builtins.set",
    "builtins.frozenset",
    "builtins.slice",
    "torch.Size",
    "torch.device",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
)
"""Globals a checkpoint may hold besides what torch's ``weights_only`` unpickler admits itself (tensors, storages,
dtypes, plain containers and numbers): the few classes DeepSpeed stores (measured on its ZeRO 0-3, tensor- and
pipeline-parallel checkpoints) and the standard-library values hyper-parameters commonly hold (LightningCLI paths: a
path unpickles as ``PosixPath(*parts)``, string parsing only). Each is built by the restricted unpickler; none can
run a command."""

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
"""torch's environment switch that turns every ``torch.load`` into ``weights_only=True`` (read at each call)."""
_FORCE_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both at once: cleared inside restricted()
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's weights_only message is coloured
_REFUSED = re.compile(r"(?:GLOBAL|global) ([\w.]+)")  # how torch's refusal names the global
_depth = 0  # restricted() blocks entered and not left (only the outermost sets and clears anything)


@cache
def allowed_objects() -> tuple[Any, ...]:
    """:data:`ALLOWED_GLOBALS` as objects for ``torch.serialization.safe_globals`` (a DeepSpeed class missing from the
    installed DeepSpeed is left out: no file can then hold it either)."""
    found = []
    for dotted in ALLOWED_GLOBALS:
        module_name, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


@contextmanager
def restricted() -> Iterator[None]:
    """Every ``torch.load`` inside the block (ours, DeepSpeed's, Lightning's) uses torch's restricted unpickler with
    :data:`ALLOWED_GLOBALS`, whatever ``weights_only`` it passes; a refused global becomes one FleetError line."""
    global _depth
    if _depth:  # nested (our load_file inside DeepSpeed's load): the outer block holds the switch and the allowlist
        yield
        return
    saved = {name: os.environ.pop(name, None) for name in (FORCE_WEIGHTS_ONLY, _FORCE_NO)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    _depth += 1
    try:
        with torch.serialization.safe_globals(list(allowed_objects())):  # its exit removes them all: enter it once
            yield
    except pickle.UnpicklingError as err:
        raise deterministic(FleetError(refusal("a checkpoint file", err))) from None
    finally:
        _depth -= 1
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_file(path: Path, entry: FileEntry | None = None, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """One checkpoint file, unpickled by the restricted unpickler; with ``entry`` (its manifest record) the bytes read
    are checked against its size and sha256 first and the same bytes are unpickled. Without one, ``mmap`` maps a
    torch.save zip (its tensors then read the file until they are dropped: never rewrite it meanwhile). A missing,
    mismatching, refused or damaged file is one FleetError line."""
    try:
        if entry is not None:
            source: Any = io.BytesIO(read_checked(path, entry))
            mmap = False
        else:
            if not path.is_file():
                raise FleetError(f"checkpoint is incomplete: {path} is missing (a save that did not finish, or a partial copy); use another checkpoint")
            source, mmap = path, mmap and _is_torch_zip(path)
        with restricted():
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except FleetError as err:
        raise deterministic(FleetError(str(err).replace("a checkpoint file", str(path), 1)), is_deterministic(err)) from None
    except pickle.UnpicklingError as err:
        raise deterministic(FleetError(refusal(str(path), err))) from None
    except Exception as err:  # truncated zip, flipped bytes
        raise FleetError(unreadable(path, err)) from None


def unpickles(step_dir: Path, files: Iterable[str]) -> None:
    """FleetError (deterministic for a refused global) unless every ``.pt`` file among ``files`` (paths relative to
    ``step_dir``) unpickles with the restricted unpickler. Memory-mapped: only the pickles are read, not the tensors'
    bytes. Run by rank 0 when it chooses a checkpoint, so that a file no rank could load stops the job before any rank
    loads its own part (each rank's load checks its files again as it reads them)."""
    for name in sorted(files):
        if name.endswith(".pt"):
            load_file(step_dir / name, mmap=True)


def _is_torch_zip(path: Path) -> bool:
    """Whether the file starts as torch.save's zip archive does (torch.load decides by the start, not by the end)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def read_checked(path: Path, entry: FileEntry) -> bytes:
    """The bytes of ``path`` (read once, never through a symbolic link), checked against its manifest entry."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise FleetError(f"cannot read checkpoint file {path} ({err.strerror}): it is missing or a symbolic link; use another checkpoint") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(entry.bytes + 1)
    if len(data) != entry.bytes:
        raise FleetError(f"checkpoint file {path} has {len(data) if len(data) <= entry.bytes else 'more'} bytes, its manifest says {entry.bytes}: it changed after the checkpoint was verified")
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise FleetError(f"checkpoint file {path} does not match its manifest's sha256: it changed after the checkpoint was verified")
    return data


def refusal(what: str, err: Exception) -> str:
    """One line for a file the restricted unpickler refused: the global it would have imported, and what to do."""
    text = _ANSI.sub("", str(err))
    found = _REFUSED.findall(text)
    if not found:
        detail = text.partition("WeightsUnpickler error:")[2].strip().splitlines()
        reason = detail[0][:200] if detail else "not a pickle"
        return f"cannot read {what}: its pickle holds what the restricted unpickler refuses ({reason}; nothing of it ran): it is damaged or was not written by torch.save"
    name = found[0]
    return (
        f"cannot read {what}: it would import {name} when loaded, which the restricted unpickler refuses (it could run "
        "code; nothing of it ran): "
        "keep hyper-parameters to plain types (str, int, float, bool, None, lists, dicts: str(path), enum.value) or leave "
        f"them out with save_hyperparameters(ignore=[...]); if you trust this file and the class, call "
        f"torch.serialization.add_safe_globals([{name.rpartition('.')[2]}]) before fitting"
    )


def unreadable(path: Path | str, err: Exception) -> str:
    """One line for a file torch cannot read at all."""
    text = _ANSI.sub("", str(err)).strip()
    reason = text.splitlines()[0] if text else type(err).__name__
    return f"cannot read {path} ({reason[:200]}): truncated, corrupted or not a checkpoint file"
