"""The on-disk layout of FleetCheckpoint checkpoints: every name and path, the typed manifest, and its verification.

Pure: imports neither torch nor deepspeed (stdlib and :class:`~lightning_fleet.planning.FleetError` only); imported
by everything that reads or writes checkpoints (elastic/checkpoint.py, elastic/callback.py, elastic/compatibility.py,
the strategy, the decision, the DeepSpeed runtime's save/load/reshard and export, the torch runtime's DCP
reader). No other module spells these names.

The tree under a ``FleetCheckpoint(dirpath)``::

    <dirpath>/
        latest                        name of the newest committed step dir (elastic/callback.py FleetCheckpoint._commit,
                                      rank 0): resumed when it is a small regular file naming a step dir that verifies
        .fleet-lock                   the job that owns the directory: host, pid, run id, heartbeat (elastic/lock.py)
        .fleet-lock.guard             its record lock, serialising who takes the lock over (never deleted)
        step-000000012/               a committed checkpoint: the temporary dir renamed into place (_commit, rank 0)
            manifest.json             written last, by rank 0: the :class:`Manifest` (format, step, world size, plan,
                                      global batch, model structure, data-order seed, every file's bytes and sha256)
            rank-00000.pt ...         each rank's RNG states, plain tensors and numbers (FleetCheckpoint.save, every rank)
            state/                    Lightning's DeepSpeed save dir (trainer.save_checkpoint, every rank):
                latest                    DeepSpeed's pointer to its tag
                checkpoint/               DeepSpeed's shards under the tag Lightning saves with (:data:`TAG`)
                fleet_layout.json         how to rebuild full weights offline (runtime.deepspeed.weights, rank 0)
                fleet_unstaged.pt         pipeline plans only: tensors no pipeline layer holds (runtime.deepspeed.weights, rank 0)
                (torch runtime)           torch.distributed.checkpoint's save dir instead (runtime/torch/dcp.py, every rank):
                .metadata                     DCP's plan of the whole state (rank 0)
                __<rank>_<n>.distcp           each rank's tensor slices and plain values, one torch.save blob per item
            universal/                DeepSpeed's universal form for resharding, written after the commit
                                      (runtime/deepspeed/universal.make_universal, rank 0) and then added to the
                                      manifest (atomically, by rename): until it is listed there it is never loaded
                latest_universal          DeepSpeed's pointer to the universal tag (never read: the tag is passed)
                checkpoint/               per-parameter fp32 weights and optimizer moments
            .tmp-universal/           a conversion in progress (replaced by the next one)
        .tmp-step-000000015/          a save in progress (mode 0700 until sealed): never resumed, removed by the next save
        .tmp-latest.k3j2x9            a temporary file of an atomic write (here of ``latest``; ``.tmp-manifest.json.*``:
                                      a step's manifest being rewritten), never inside a step dir; removed under the lock
        set-aside/                    checkpoints moved out of the way (resume='if_compatible'/'never', a step dir newer
                                      than the one just committed, one replaced at the same step): never resumed or pruned

A checkpoint counts only if :func:`verify` accepts it: the step dir is a real directory (not a symbolic link), its
manifest parses into a :class:`Manifest` whose step is the one the directory is named after, the files below it are
exactly those the manifest lists (no symbolic link, FIFO or other non-regular file anywhere; nothing unlisted but a
derived form not yet listed, which is never loaded), every entry (the step dir, the manifest, every directory and file)
belongs to the owner of the directory holding the step dir and is writable by nobody else (directories are created
0755 and files 0644 whatever the umask), and every listed file has its size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from lightning_fleet.planning import FleetError

# --- names and paths ----------------------------------------------------------------------------------------------

LATEST = "latest"
"""File in the checkpoint directory naming the newest committed step dir (a hint: resume scans and verifies)."""
STEP_PREFIX = "step-"
"""Committed checkpoints are ``step-`` + the optimizer step in 9 digits."""
TMP_PREFIX = ".tmp-"
"""A directory being written under its final name with this prefix; renamed into place when complete."""
ABANDONED_GLOB = f"{TMP_PREFIX}{STEP_PREFIX}*"
"""Glob of temporary step dirs in the checkpoint directory (saves that never committed)."""
TMP_GLOB = f"{TMP_PREFIX}*"
"""Glob of everything temporary in the checkpoint directory: step dirs being saved, and the temporary files of an
atomic write (``latest``, a step's manifest being rewritten: ``.tmp-<name>.<random>``)."""
DIR_MODE = 0o755
"""Mode of every directory FleetCheckpoint creates, whatever the umask."""
FILE_MODE = 0o644
"""Widest mode of every file of a checkpoint, whatever the umask or the writer (bits beyond it are taken off)."""
WRITABLE_BY_OTHERS = 0o022
"""Mode bits that let another user write an entry: :func:`verify` refuses a checkpoint with any entry having one."""
LOCK = ".fleet-lock"
"""The lock file in a checkpoint directory: the job that owns it (host, pid, run id, heartbeat; elastic/lock.py), as
JSON padded with spaces to a fixed size."""
GUARD = ".fleet-lock.guard"
"""An empty file in a checkpoint directory whose record lock serialises every decision about :data:`LOCK` (never
deleted)."""
PROBE_PREFIX = ".fleet-probe-"
"""Name prefix of the file the setup probe creates, writes, fsyncs and removes (elastic/checkpoint.probe_writable)."""
SET_ASIDE = "set-aside"
"""Subdirectory of a checkpoint dir that holds checkpoints moved out of the way (never resumed, never pruned)."""
MANIFEST = "manifest.json"
"""The manifest file of a step dir, written last."""
MANIFEST_FORMAT = 1
"""The manifest format this module writes and reads."""
STATE = "state"
"""Subdirectory of a step dir that Lightning's DeepSpeed strategy saves into (``trainer.save_checkpoint``)."""
TAG = "checkpoint"
"""The tag under which Lightning's DeepSpeedStrategy.save_checkpoint saves (``engine.save_checkpoint(tag=...)``), i.e.
the subdirectory of ``state/`` (and of ``universal/``) holding DeepSpeed's files."""
DEEPSPEED_LATEST = "latest"
"""DeepSpeed's own file in ``state/`` naming its tag (not the checkpoint directory's :data:`LATEST` hint)."""
EXPORT_LAYOUT = "fleet_layout.json"
"""File name of the export layout inside ``state/`` (next to DeepSpeed's ``latest`` and the tag directory)."""
UNSTAGED = "fleet_unstaged.pt"
"""Under pipeline parallelism, in ``state/``: the module's tensors no pipeline layer holds (DeepSpeed saves only
the layers)."""
CLIENT = "fleet_client.pt"
"""The torch runtime's file beside its DCP dir: Lightning's client state of a save (loops, callbacks, hyper-parameters),
written by rank 0."""
DCP_DIR = "dcp"
"""The torch runtime's torch.distributed.checkpoint directory inside a save dir (``state/dcp/``)."""
UNIVERSAL = "universal"
"""Subdirectory of a step dir holding its universal (layout-free) form, written when resharding."""
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's metadata file in its save dir (``FileSystemWriter``, torch 2.13
distributed/checkpoint/filesystem.py ``_metadata_fn``): a plain pickle of its ``Metadata``."""
DCP_SUFFIX = ".distcp"
"""Name suffix of torch.distributed.checkpoint's data files (``__<rank>_<n>.distcp``: torch.save blobs end to end)."""
UNIVERSAL_LATEST = "latest_universal"
"""DeepSpeed's file in ``universal/`` naming the tag it loads with ``load_universal`` (DeepSpeed 0.19.8
engine.load_checkpoint)."""

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{9}})$")


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"{STEP_PREFIX}{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a committed checkpoint's directory name; None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def tmp_name(name: str) -> str:
    """Name of the temporary directory a save or conversion writes before renaming it to ``name``."""
    return f"{TMP_PREFIX}{name}"


def state_dir(step_dir: Path) -> Path:
    """Lightning's DeepSpeed save dir of a checkpoint."""
    return step_dir / STATE


def deepspeed_files(step_dir: Path) -> Path:
    """The directory of DeepSpeed's shards of a checkpoint (``state/<tag>``)."""
    return state_dir(step_dir) / TAG


def rank_file_name(rank: int) -> str:
    """File name of one rank's RNG states."""
    return f"rank-{rank:05d}.pt"


def rank_file(step_dir: Path, rank: int) -> Path:
    """Where one rank's RNG states of a checkpoint live."""
    return step_dir / rank_file_name(rank)


def universal_dir(step_dir: Path) -> Path:
    """Where the layout-free (universal) form of a checkpoint lives."""
    return step_dir / UNIVERSAL


IMPORTED = "imported"
"""A step dir's subdirectory holding the checkpoint in the form of a runtime other than the one that wrote it (its full
state imported, :meth:`lightning_fleet.runtime.base.Backend.import_state`), when that runtime's own derived form is not
:data:`UNIVERSAL`."""


def imported_dir(step_dir: Path) -> Path:
    """Where a checkpoint imported into another runtime's form lives."""
    return step_dir / IMPORTED


DERIVED = (UNIVERSAL, IMPORTED)
"""Subdirectories of a step dir that are written after its commit and listed in its manifest once complete."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""A manifest larger than this is not one FleetCheckpoint wrote (it lists each file in about 150 bytes)."""


# --- what each file holds -------------------------------------------------------------------------------------------

KIND_MODEL_STATES = "model-states"
"""DeepSpeed's model-states file of a rank (``[zero_pp_rank_D_]mp_rank_MM_model_states.pt``): the module's tensors, their
shapes, DeepSpeed's counters and Lightning's client state (loops, callbacks, hyper-parameters); at ZeRO-0 the
optimizer's state too."""
KIND_LAYER_STATES = "layer-states"
"""One pipeline layer's tensors (``layer_LL-model_MM-model_states.pt``, DeepSpeed's PipelineModule)."""
KIND_OPTIM_STATES = "optim-states"
"""One rank's ZeRO (or bf16) optimizer partition (``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt``): flat fp32
groups, moments, the loss scaler and the slice mappings."""
KIND_UNIVERSAL_FRAGMENT = "universal-fragment"
"""The universal form's file of one parameter (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``): a tensor, or
``{"param": tensor, "cat_dim": int}``, or the step."""
KIND_UNIVERSAL_OPTIMIZER = "universal-optimizer"
"""The universal form's ``zero/optimizer_state.pt``: the optimizer's global state (param groups, loss scaler, step)."""
KIND_RNG = "rng"
"""A rank's RNG states (``rank-RRRRR.pt``): plain tensors and numbers."""
KIND_UNSTAGED = "unstaged"
"""``state/fleet_unstaged.pt``: the module's tensors no pipeline layer holds."""
KIND_LIGHTNING = "lightning"
"""A single-file Lightning checkpoint given to validate/test/predict (never part of a FleetCheckpoint step)."""
KIND_CLIENT = "client-state"
"""The torch runtime's :data:`CLIENT` file: Lightning's checkpoint dict without weights or optimizer states."""
KIND_DATA = "data"
"""A file that is not a pickle (JSON, text, DeepSpeed's ``latest`` and scripts): never unpickled."""
KIND_DCP_METADATA = "dcp-metadata"
"""torch.distributed.checkpoint's :data:`DCP_METADATA`: its ``Metadata`` record (tensor shapes, dtypes and chunks, where
each item lies in which file), a plain pickle of DCP's own dataclasses."""
KIND_DCP_DATA = "dcp-data"
"""A torch.distributed.checkpoint data file (``*.distcp``): torch.save blobs of plain tensors (a rank's slices) and of
plain Python values (e.g. an optimizer's learning rates), located by the metadata's offsets."""
FILE_KINDS = (KIND_MODEL_STATES, KIND_LAYER_STATES, KIND_OPTIM_STATES, KIND_UNIVERSAL_FRAGMENT, KIND_UNIVERSAL_OPTIMIZER,
              KIND_RNG, KIND_UNSTAGED, KIND_LIGHTNING, KIND_CLIENT, KIND_DATA, KIND_DCP_METADATA, KIND_DCP_DATA)
"""Every kind a file can be; the restricted loader (elastic/safe_load.py) admits and checks per kind."""

_MODEL_STATES = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
_LAYER_STATES = re.compile(r"^layer_\d+-model(_\d+)?-model_states\.pt$|^layer_\d+-model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_RNG = re.compile(r"^rank-\d{5}\.pt$")
_FRAGMENTS = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt")


def kind_of(name: str) -> str:
    """What the file at ``name`` (a ``/``-separated path; only its last components count) must hold: one of
    :data:`FILE_KINDS`, :data:`KIND_DATA` for any name no writer of ours or DeepSpeed's gives a pickle."""
    parts = PurePosixPath(name).parts
    base = parts[-1] if parts else ""
    if _MODEL_STATES.match(base):
        return KIND_MODEL_STATES
    if _OPTIM_STATES.match(base):
        return KIND_OPTIM_STATES
    if _LAYER_STATES.match(base):
        return KIND_LAYER_STATES
    if _RNG.match(base):
        return KIND_RNG
    if base == UNSTAGED:
        return KIND_UNSTAGED
    if base == CLIENT:
        return KIND_CLIENT
    if base == "optimizer_state.pt" and parts[-2:-1] == ("zero",):
        return KIND_UNIVERSAL_OPTIMIZER
    if base in _FRAGMENTS and len(parts) >= 3 and parts[-3] == "zero":
        return KIND_UNIVERSAL_FRAGMENT
    if base == DCP_METADATA:
        return KIND_DCP_METADATA
    if base.endswith(DCP_SUFFIX) and len(base) > len(DCP_SUFFIX):
        return KIND_DCP_DATA
    return KIND_DATA


def derived_listed(manifest: Manifest, name: str) -> bool:
    """Whether the manifest lists the derived form ``name`` (e.g. :data:`UNIVERSAL`): its files were hashed when it was
    complete, so it may be loaded."""
    prefix = f"{name}/"
    return any(path.startswith(prefix) for path in manifest.files)


# --- the manifest -------------------------------------------------------------------------------------------------


class ManifestError(FleetError):
    """A manifest that is not what FleetCheckpoint writes; the message names the field and what is wrong with it."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    """What the manifest records of one file of a checkpoint."""

    bytes: int
    """Its size."""
    sha256: str
    """Hex sha256 of its content."""


@dataclass(frozen=True, slots=True)
class TensorFact:
    """One parameter or buffer of the module that wrote a checkpoint."""

    name: str
    """Its state_dict key."""
    shape: tuple[int, ...]
    """Its shape (``()`` for a scalar)."""
    dtype: str
    """Its dtype without the ``torch.`` prefix, e.g. ``float32``."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The structure of the module that wrote a checkpoint (elastic/compatibility.model_facts computes it)."""

    sha256: str
    """Digest of the tensor list (equal digests: equal structure)."""
    tensors: tuple[TensorFact, ...]
    """Every parameter and buffer in state_dict order."""

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``model`` entry: ``{"sha256": ..., "tensors": [[name, [shape...], dtype], ...]}``."""
        return {"sha256": self.sha256, "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """The typed ``manifest.json`` of a committed checkpoint; its JSON form is what FleetCheckpoint has always written."""

    format: int = MANIFEST_FORMAT
    """Manifest format (:data:`MANIFEST_FORMAT`)."""
    step: int
    """Optimizer steps taken when the checkpoint was written."""
    world_size: int
    """Processes that wrote it."""
    plan: str | None
    """The plan that was trained (``str(Plan)``), None if the strategy had none."""
    global_batch_size: int | None
    """The plan's global batch, None if the strategy had no plan."""
    model: ModelFacts | None
    """The module's structure; None for checkpoints written before it was recorded (absent from the JSON)."""
    data_seed: int | None
    """The data-order seed; None for checkpoints written before it was recorded (absent from the JSON)."""
    files: Mapping[str, FileEntry] = field(hash=False)
    """Every file of the checkpoint but the manifest, by path relative to the step dir (``/``-separated)."""
    kinds: Mapping[str, str] = field(default_factory=dict, hash=False)
    """What each file of :attr:`files` must hold (one of :data:`FILE_KINDS`; the restricted loader admits and checks
    that): recorded for every file, taken from its name where a manifest written before it was recorded lacks it, and
    a recorded kind that is not its name's is refused."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", dict(self.files))  # a copy: the caller's dict cannot change it
        recorded = dict(self.kinds)
        for name, kind in recorded.items():
            if name in self.files and kind != kind_of(name):
                raise ManifestError(f"manifest says file {name!r} holds {kind!r}, but its name is that of a {kind_of(name)!r} file")
        object.__setattr__(self, "kinds", {name: kind_of(name) for name in self.files})  # a file added by replace() too
        if self.format != MANIFEST_FORMAT:
            raise ManifestError(f"manifest has format {self.format!r}; this lightning_fleet reads format {MANIFEST_FORMAT}")
        bounds = (("step", self.step, 0), ("world_size", self.world_size, 1), ("global_batch_size", self.global_batch_size, 1))
        for name, value, least in bounds:
            if value is not None and value < least:
                raise ManifestError(f"manifest field {name!r} is {value}, expected at least {least}")
        for name, entry in self.files.items():
            _check_file_name(name)
            if entry.bytes < 0 or not _SHA256.match(entry.sha256):
                raise ManifestError(f"manifest entry for file {name!r} has bytes={entry.bytes!r}, sha256={entry.sha256!r}")

    def to_json(self) -> str:
        """The manifest file's text (``model`` and ``data_seed`` only when recorded), as always written plus ``kinds``."""
        data: dict[str, Any] = {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "plan": self.plan,
            "global_batch_size": self.global_batch_size,
            "files": {name: {"bytes": e.bytes, "sha256": e.sha256} for name, e in self.files.items()},
            "kinds": dict(self.kinds),
        }
        if self.model is not None:
            data["model"] = self.model.to_json()
        if self.data_seed is not None:
            data["data_seed"] = self.data_seed
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest file's text; raise :class:`ManifestError` naming what is wrong (not JSON, a missing,
        unknown or ill-typed field)."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ManifestError("manifest is nested too deeply to be one FleetCheckpoint wrote") from None
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8 (a flipped byte)
            is_json = isinstance(err, json.JSONDecodeError)
            detail = f"{err.msg} at line {err.lineno} column {err.colno}" if is_json else type(err).__name__
            raise ManifestError(f"manifest is not valid JSON ({detail})") from None
        table = _object(data, "manifest")
        if "format" not in table:
            raise ManifestError("manifest has no 'format' field")
        if _int(table["format"], "format") != MANIFEST_FORMAT:
            raise ManifestError(f"manifest has format {table['format']!r}; this lightning_fleet reads format {MANIFEST_FORMAT}")
        unknown = sorted(set(table) - _FIELDS)
        if unknown:
            known = ", ".join(sorted(_FIELDS))
            raise ManifestError(f"manifest has unknown field {unknown[0]!r} (format {MANIFEST_FORMAT} has {known})")
        missing = [name for name in _REQUIRED if name not in table]
        if missing:
            raise ManifestError(f"manifest has no {missing[0]!r} field")
        gbs = table["global_batch_size"]
        return cls(
            format=MANIFEST_FORMAT,
            step=_int(table["step"], "step"),
            world_size=_int(table["world_size"], "world_size"),
            plan=None if table["plan"] is None else _str(table["plan"], "plan"),
            global_batch_size=None if gbs is None else _int(gbs, "global_batch_size"),
            model=_model(table["model"]) if "model" in table else None,
            data_seed=_int(table["data_seed"], "data_seed") if "data_seed" in table else None,
            files={name: _file_entry(name, entry) for name, entry in _object(table["files"], "manifest field 'files'").items()},
            kinds=_kinds(table["kinds"]) if "kinds" in table else {},
        )


_REQUIRED = ("step", "world_size", "plan", "global_batch_size", "files")
_FIELDS = frozenset({"format", *_REQUIRED, "model", "data_seed", "kinds"})
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


_JSON_KINDS = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} is a JSON {_kind(value)}, expected an object")
    return value


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"manifest field {name!r} is {value!r} ({_kind(value)}), expected an integer")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"manifest field {name!r} is {value!r} ({_kind(value)}), expected a string")
    return value


def _check_file_name(name: str) -> None:
    """A listed file must lie inside the step dir: relative, no ``..``, not the manifest itself."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name == MANIFEST:
        raise ManifestError(f"manifest lists file {name!r}, which is not a file inside the checkpoint")


def _file_entry(name: str, entry: Any) -> FileEntry:
    table = _object(entry, f"manifest entry for file {name!r}")
    if set(table) != {"bytes", "sha256"}:
        raise ManifestError(f"manifest entry for file {name!r} has fields {sorted(table)}, expected ['bytes', 'sha256']")
    size, digest = table["bytes"], table["sha256"]
    if isinstance(size, bool) or not isinstance(size, int) or not isinstance(digest, str):
        raise ManifestError(f"manifest entry for file {name!r} has bytes={size!r}, sha256={digest!r}")
    return FileEntry(bytes=size, sha256=digest)


def _kinds(value: Any) -> dict[str, str]:
    table = _object(value, "manifest field 'kinds'")
    for name, kind in table.items():
        if kind not in FILE_KINDS:
            raise ManifestError(f"manifest says file {name!r} holds {kind!r}, which is none of {', '.join(FILE_KINDS)}")
    return table


def _model(value: Any) -> ModelFacts:
    table = _object(value, "manifest field 'model'")
    if set(table) != {"sha256", "tensors"} or not isinstance(table["sha256"], str) or not isinstance(table["tensors"], list):
        raise ManifestError("manifest field 'model' is not {'sha256': <hex>, 'tensors': [[name, [shape...], dtype], ...]}")
    return ModelFacts(sha256=table["sha256"], tensors=tuple(_tensor(entry) for entry in table["tensors"]))


def _tensor(entry: Any) -> TensorFact:
    ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[2], str)
    shape = entry[1] if ok else None
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
        raise ManifestError(f"manifest field 'model' lists tensor {entry!r}, expected [name, [shape...], dtype]")
    return TensorFact(name=entry[0], shape=tuple(shape), dtype=entry[2])


# --- verification -------------------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


def entry_of(path: Path) -> FileEntry:
    """The manifest entry of a file as it is on disk (hashes it)."""
    return FileEntry(bytes=path.stat().st_size, sha256=sha256_of(path))


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a checkpoint directory can be resumed from, and if not, why; carries the manifest read to decide it."""

    path: Path
    """The checkpoint directory."""
    ok: bool
    """The manifest parses and every file it lists is there with its size and hash."""
    reason: str
    """Why it cannot be used ('' when ok)."""
    manifest: Manifest | None
    """The parsed manifest (None when missing or malformed; always set when ok)."""


def verify(step_dir: Path) -> Verdict:
    """Check a checkpoint directory against its manifest, hashing every listed file once; name the first problem."""
    try:
        info = os.lstat(step_dir)
        if stat.S_ISLNK(info.st_mode):
            return Verdict(step_dir, False, "the checkpoint directory is a symbolic link; only real directories are resumed", None)
        owner = os.lstat(step_dir.parent).st_uid
        problem = _foreign(".", info, owner) or _foreign(MANIFEST, _lstat_or_none(step_dir / MANIFEST), owner)
        if problem:
            return Verdict(step_dir, False, problem, None)
        text = _read_manifest(step_dir / MANIFEST)
        if text is None:
            return Verdict(step_dir, False, "no manifest (the save did not finish)", None)
        manifest = Manifest.from_json(text)
    except ManifestError as err:
        return Verdict(step_dir, False, str(err), None)
    except OSError as err:
        return Verdict(step_dir, False, f"cannot read it ({err.strerror})", None)
    named = step_of(step_dir.name)
    if named is not None and named != manifest.step:
        return Verdict(step_dir, False, f"its manifest records step {manifest.step}, not the step {named} it is named after (a copy or a planted directory)", manifest)
    problem = _tree_problem(step_dir, manifest, owner)
    if problem:
        return Verdict(step_dir, False, problem, manifest)
    for name, entry in manifest.files.items():
        problem = _file_problem(step_dir / name, name, entry)
        if problem:
            return Verdict(step_dir, False, problem, manifest)
    return Verdict(step_dir, True, "", manifest)


def _lstat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _foreign(name: str, info: os.stat_result | None, owner: int) -> str:
    """'' when an entry of a checkpoint (``.``: the step dir) can be written by its owner alone and that owner is the
    checkpoint directory's (``owner``), else why another user could have replaced it."""
    if info is None:
        return ""
    where = "the checkpoint directory" if name == "." else name
    if info.st_uid != owner:
        return (f"{where} belongs to uid {info.st_uid}, not to uid {owner} who owns the directory holding it: another user "
                "could have replaced it")
    if info.st_mode & WRITABLE_BY_OTHERS:
        who = "everyone" if info.st_mode & stat.S_IWOTH else "its group"
        return (f"{where} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o}): another user could have replaced it; "
                "if it is yours, run chmod -R go-w on the checkpoint")
    return ""


def _read_manifest(path: Path) -> bytes | None:
    """The manifest's bytes (None when there is none); ManifestError for a symbolic link, a FIFO, a device or a file
    over :data:`MAX_MANIFEST_BYTES` (never followed, never blocked on, never read whole)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ManifestError(f"manifest cannot be opened ({err.strerror}; a symbolic link is refused)") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ManifestError("manifest is not a regular file")
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes: not one FleetCheckpoint wrote")
    return data


_LEGACY_TMP_MANIFEST = re.compile(rf"^\.{re.escape(MANIFEST)}\.tmp\d+$")
"""The temporary manifest earlier versions of lightning_fleet wrote inside a step dir (``.manifest.json.tmp<pid>``); left by a
kill while a derived form was being listed, it is never loaded and does not invalidate the checkpoint."""


def _tree_problem(step_dir: Path, manifest: Manifest, owner: int) -> str:
    """'' when the entries below ``step_dir`` are exactly the manifest's files (besides the manifest itself, a derived
    form not yet listed, a conversion in progress and a stray temporary manifest), each belonging to ``owner`` and
    writable by nobody else; else the first symbolic link, non-regular, unlisted or foreign entry."""
    skipped = {tmp_name(name) for name in DERIVED} | {name for name in DERIVED if not derived_listed(manifest, name)}
    found: set[str] = set()
    stack = [(step_dir, "")]
    while stack:
        directory, prefix = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                name = prefix + entry.name
                if not prefix and (entry.name in skipped or entry.name == MANIFEST or _LEGACY_TMP_MANIFEST.match(entry.name)):
                    continue
                if entry.is_symlink():
                    return f"{name} is a symbolic link; a checkpoint holds only its own files"
                problem = _foreign(name, entry.stat(follow_symlinks=False), owner)
                if problem:
                    return problem
                if entry.is_dir(follow_symlinks=False):
                    stack.append((Path(entry.path), name + "/"))
                elif entry.is_file(follow_symlinks=False):
                    found.add(name)
                else:
                    return f"{name} is not a regular file (a FIFO, socket or device); a checkpoint holds only regular files"
    unlisted = sorted(found - set(manifest.files))
    if unlisted:
        return f"file {unlisted[0]} is not listed in the manifest (added after the save)"
    return ""


def _file_problem(path: Path, name: str, entry: FileEntry) -> str:
    """'' when the file is there with the recorded size and hash, else what is wrong with it."""
    if not path.is_file():
        return f"file {name} is missing"
    size = path.stat().st_size
    if size != entry.bytes:
        return f"file {name} has {size} bytes, the manifest says {entry.bytes} (truncated or overwritten)"
    if sha256_of(path) != entry.sha256:
        return f"file {name} does not match its sha256 (corrupted)"
    return ""
