"""The torch runtime's checkpoints through torch.distributed.checkpoint (DCP): save, load in place (resharded to this
job's layout by DCP), and read whole in one process -- every byte read back unpickled by the restricted unpickler and,
for a verified checkpoint, checked against its manifest first.

DCP's own reader runs code from disk: ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata`` and
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every non-tensor item (torch 2.13
distributed/checkpoint/filesystem.py, default_planner.py). Here the metadata is read before DCP starts
(:func:`~lightning_fleet.elastic.safe_load.load_dcp_metadata`: restricted, then checked field by field) and
:class:`CheckedReader` hands DCP that record; its ``read_data`` reads each data file once
(:func:`~lightning_fleet.elastic.safe_load.read_bytes`: against the manifest entry when a checkpoint is given, never
through a symbolic link) and unpickles each item's bytes restricted (:func:`~lightning_fleet.elastic.safe_load.load_blob`):
tensor slices itself, plain values through :class:`RestrictedLoadPlanner`, whose ``load_bytes`` does the same. With a
checkpoint, a file of the save dir that its manifest does not list is refused before anything is read.

Every failure is one :class:`~lightning_fleet.planning.FleetError` line, a refusal marked deterministic: DCP gathers each
rank's exception into a ``CheckpointException`` on every rank, raised here as the first failing rank's own line, and
the metadata is agreed on before DCP's collectives start (no rank enters them alone).

Imports torch.distributed.checkpoint, elastic/checkpoint.py (:class:`VerifiedCheckpoint`), elastic/layout.py's names
and kinds, elastic/safe_load.py and elastic/worker.py's error marks; imported by the torch runtime's backend (a fit's
save and resume) and by offline export (:func:`read_full`).
"""

from __future__ import annotations

import io
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint
from lightning_fleet.elastic.layout import DCP_METADATA, KIND_DCP_DATA, FileEntry
from lightning_fleet.elastic.safe_load import load_blob, load_dcp_metadata, read_bytes
from lightning_fleet.elastic.worker import deterministic, is_deterministic
from lightning_fleet.planning import FleetError

_NO_PROCESS_GROUP = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of the warning DCP gives for a save or load in one process (which is what was asked for here)."""


# --- the three calls ---------------------------------------------------------------------------------------------------


def save_state(directory: Path, state: dict[str, Any], *, alone: bool = False) -> None:
    """Save ``state`` (a nested dict of tensors, DTensors or ShardedTensors and plain Python values, e.g.
    ``{"model": ..., "optimizer": ...}`` from ``get_state_dict``) into ``directory`` with DCP: collective over the
    default process group (every rank writes its own ``__<rank>_0.distcp``, rank 0 the ``.metadata``), or one process
    when there is none or ``alone`` (whole tensors this process holds, e.g. another runtime's checkpoint imported)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _quiet(), _one_line(directory, "save"):
        dcp.save(state, storage_writer=writer, no_dist=alone or not _distributed())


def load_state(directory: Path, state: dict[str, Any], *, checkpoint: VerifiedCheckpoint | None) -> None:
    """Load the DCP save in ``directory`` into ``state`` in place (its structure; DCP reshards to this job's world size
    and layout): collective over the default process group, or one process when there is none. ``checkpoint``: the
    verified step ``directory`` lies in, whose manifest every file is checked against (None: a plain save dir, whose
    files are only restricted)."""
    source = _Source(directory, checkpoint)
    metadata = _agreed(source.metadata)
    with _quiet(), _one_line(directory, "load"):
        dcp.load(state, storage_reader=CheckedReader(source, metadata), planner=RestrictedLoadPlanner(),
                 no_dist=not _distributed())


def read_full(directory: Path, *, checkpoint: VerifiedCheckpoint | None = None) -> dict[str, Any]:
    """The whole DCP save in ``directory`` in this process, no process group needed: a nested dict of full plain tensors
    and Python values as saved (for exporting weights offline), read through the same checks as :func:`load_state`."""
    source = _Source(directory, checkpoint)
    metadata = source.metadata()
    with _quiet(), _one_line(directory, "read"):
        state = _empty_state(metadata)
        dcp.load(state, storage_reader=CheckedReader(source, metadata), planner=RestrictedLoadPlanner(), no_dist=True)
    return state


def _empty_state(metadata: Metadata) -> dict[str, Any]:
    """The nested state a checkpoint holds, built from its (checked) metadata: zeros of each tensor's full size and
    dtype, None for each plain value, at the place DCP's planner data records (as torch's ``_EmptyStateDictLoadPlanner``
    builds it, with zeros: no memory is left unwritten)."""
    state: dict[str, Any] = {}
    paths = metadata.planner_data or {}
    for fqn, entry in metadata.state_dict_metadata.items():
        value = torch.zeros(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        if fqn in paths:
            set_element(state, paths[fqn], value)
        else:
            state[fqn] = value
    return state


# --- where the bytes come from -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A DCP save dir's files: read once each, never through a symbolic link, checked against the manifest of the
    verified checkpoint the directory lies in (None: a plain save dir, its files only restricted)."""

    directory: Path
    checkpoint: VerifiedCheckpoint | None

    def metadata(self) -> Metadata:
        """The save's ``.metadata``, restricted and checked (with a checkpoint, once no file of the directory is
        unlisted)."""
        if not self.directory.is_dir():
            raise FleetError(f"{self.directory} is no directory: there is no DCP checkpoint to read; use another checkpoint")
        self._refuse_unlisted()
        return load_dcp_metadata(self.directory / DCP_METADATA, self._entry(DCP_METADATA))

    def read(self, name: str) -> bytes:
        """The bytes of the data file ``name`` of the directory."""
        return read_bytes(self.directory / name, self._entry(name))

    def _entry(self, name: str) -> FileEntry | None:
        """The manifest entry of the file ``name`` (None without a checkpoint); FleetError when it is not listed."""
        if self.checkpoint is None:
            return None
        root = self.checkpoint.path.resolve()
        try:
            key = (self.directory.resolve() / name).relative_to(root).as_posix()
        except ValueError:
            raise deterministic(FleetError(
                f"{self.directory} is outside the verified checkpoint {self.checkpoint.path}; refusing to read it")) from None
        entry = self.checkpoint.manifest.files.get(key)
        if entry is None:
            raise deterministic(FleetError(
                f"{key} is not listed in the manifest of {self.checkpoint.path} (added after the save); refusing to read "
                "it: use another checkpoint"))
        return entry

    def _refuse_unlisted(self) -> None:
        """FleetError naming the first entry of the directory (besides subdirectories) its manifest does not list."""
        if self.checkpoint is None:
            return
        try:
            with os.scandir(self.directory) as entries:
                names = sorted(e.name for e in entries if e.is_symlink() or not e.is_dir())
        except OSError as err:
            raise FleetError(f"cannot list the DCP checkpoint in {self.directory} ({err.strerror}); use another checkpoint") from None
        for name in names:
            self._entry(name)


# --- DCP's reader and planner, restricted ------------------------------------------------------------------------------


class _Blob(io.BytesIO):
    """An item's bytes, with what they are (for the one line a refusal gives)."""

    def __init__(self, data: bytes, what: str) -> None:
        super().__init__(data)
        self.what = what


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (flattening, resharding, in-place copies) whose plain values are unpickled by the
    restricted unpickler as :data:`~lightning_fleet.elastic.layout.KIND_DCP_DATA`, never by ``torch.load``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put the plain value of ``read_item`` (its torch.save bytes) in its place in the state."""
        fqn = read_item.dest_index.fqn
        loaded = load_blob(value.getvalue(), kind=KIND_DCP_DATA, what=getattr(value, "what", f"DCP item {fqn}"))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class CheckedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is the record read and checked before the load started, and whose data
    files are read once each (checked when a checkpoint is given), every item's bytes unpickled restricted."""

    def __init__(self, source: _Source, metadata: Metadata) -> None:
        super().__init__(source.directory)
        self._source = source
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked record (nothing is read here), with this load's id as DCP's reader sets it."""
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the items of ``plan`` into ``planner``'s state, one data file at a time."""
        if not isinstance(planner, RestrictedLoadPlanner):
            raise deterministic(FleetError(
                f"CheckedReader was given a {type(planner).__name__}, whose plain values torch.load would unpickle: "
                "pass a RestrictedLoadPlanner"))
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            data = self._source.read(name)
            for item in items:
                self._load_item(item, name, data, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _load_item(self, item: ReadItem, name: str, data: bytes, planner: RestrictedLoadPlanner) -> None:
        """One item of the data file ``name`` (whose bytes are ``data``): a plain value to the planner, a tensor slice
        copied into its target."""
        info = self.storage_data[item.storage_index]
        path, end = self._source.directory / name, info.offset + info.length
        what = f"DCP item {item.storage_index.fqn} of {path}"
        if end > len(data):
            raise FleetError(f"cannot read {what}: it lies at bytes {info.offset}-{end} of a file of {len(data)} bytes "
                             "(truncated); use another checkpoint")
        blob = data[info.offset:end]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, _Blob(blob, what))
        else:
            _copy_slice(item, load_blob(blob, kind=KIND_DCP_DATA, what=what), planner, what)


def _copy_slice(item: ReadItem, saved: Any, planner: LoadPlanner, what: str) -> None:
    """Copy the part of the saved chunk ``saved`` that ``item`` asks for into its target tensor."""
    if type(saved) is not torch.Tensor or saved.dim() != len(item.storage_offsets):
        raise deterministic(FleetError(
            f"cannot read {what}: it holds a {type(saved).__name__} where DCP's metadata records a slice of "
            f"{len(item.storage_offsets)} dimensions; use another checkpoint"))
    piece = saved
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        piece = piece.narrow(dim, start, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != piece.size():
        raise deterministic(FleetError(
            f"cannot read {what}: its slice has shape {tuple(piece.size())}, the state's {tuple(target.size())}; load it "
            "into the model that saved it, or use another checkpoint"))
    target.copy_(piece)
    planner.commit_tensor(item, target)


# --- one line per failure ----------------------------------------------------------------------------------------------


def _distributed() -> bool:
    """Whether a default process group is up (else DCP runs in this process alone)."""
    return dist.is_available() and dist.is_initialized()


def _agreed(read: Callable[[], Any]) -> Any:
    """``read()`` on every rank; under a process group, when any rank failed, every rank raises the first failing
    rank's line (so that no rank enters DCP's collectives while another has stopped)."""
    try:
        value, failure = read(), None
    except FleetError as err:
        value, failure = None, (str(err), is_deterministic(err))
    if _distributed():
        failures: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise deterministic(FleetError(failure[0]), failure[1])
    return value


@contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that a call runs in one process (asked for: no process group is up)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP)
        yield


@contextmanager
def _one_line(directory: Path, action: str) -> Iterator[None]:
    """DCP's failures inside the block as one FleetError line: a rank's own FleetError as it was (the first failing
    rank's), anything else named with its rank and what to do."""
    try:
        yield
    except FleetError:
        raise
    except CheckpointException as err:
        rank, error = min(err.failures.items(), key=lambda pair: (not isinstance(pair[1][0], FleetError), pair[0]))
        raise _line(error[0], rank, directory, action) from None
    except Exception as err:
        raise _line(err, dist.get_rank() if _distributed() else 0, directory, action) from None


_HINTS = {
    "save": "the state holds what DCP cannot save (tensors on several devices, a value torch.save refuses); save plain "
            "tensors, DTensors and Python values",
    "load": "the state differs from the one saved (keys, shapes), or the checkpoint is damaged; load it into the model "
            "and optimizer that saved it, or use another checkpoint",
    "read": "the checkpoint is damaged or was not written by torch.distributed.checkpoint; use another checkpoint",
}
"""What to do about a failure inside DCP that is no FleetError of ours, per action."""


def _line(error: BaseException, rank: int, directory: Path, action: str) -> FleetError:
    """One FleetError line for ``error`` raised on ``rank`` while DCP did ``action`` in ``directory``."""
    if isinstance(error, FleetError):
        return deterministic(FleetError(str(error)), is_deterministic(error))
    text = str(error).strip().splitlines()
    detail = f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
    hint = "free space or fix the directory's permissions" if isinstance(error, OSError) else _HINTS[action]
    line = FleetError(f"cannot {action} the DCP checkpoint in {directory} (rank {rank}: {detail}): {hint}")
    return deterministic(line, not isinstance(error, OSError))
