"""Reading checkpoint files without running code: our own restricted unpickler, per load, per file kind, then a check
of what was built.

A pickle can call any importable function while it is read, so a checkpoint file that somebody else could write is
code. Nothing here scans pickles for dangerous opcodes (a scanner misses protocol-0 ``INST``, operands fetched from
the memo, bytes after the first ``STOP``, a pickle with a zip appended, ...): every file is unpickled by
:class:`RestrictedUnpickler`, which resolves a global only from the allowlist of the file's kind (nothing is imported by
name), calls only the callables of that allowlist (the tensor rebuilders guarded: plain tensors, no hooks, no
attributes but the ones DeepSpeed sets), builds only the classes it names with only the attributes they have, and
fills only lists, dicts and sets. What it built is then checked against what the runtime expects of that kind
(:func:`check_loaded`: exact types, DeepSpeed's loss scaler with its own fields in their ranges, slice mappings,
paths whose text is their parts), so attacker-chosen state in admitted types never reaches DeepSpeed.

The restriction is a property of each load, not of the process: :func:`load_file` hands torch.load a pickle module
made for that call (``pickle_module=``, torch/serialization.py ``load``), with that file's allowlist. No environment
variable and no torch-wide safe-globals list is touched, so loads in other threads, the user's own
``torch.load(weights_only=False)``, subprocesses the user starts and the user's ``add_safe_globals`` entries are all
as they were; two of our loads in two threads each keep their own allowlist. The user's safe globals are admitted
(read, never changed) in the files that hold the user's hyper-parameters (:data:`USER_KINDS`), which is what the
refusal tells a user who trusts a class to do. What the kinds are, and which file is which, is elastic/layout.py's
(:func:`~lightning_fleet.elastic.layout.kind_of`; the manifest records each file's kind).

torch.distributed.checkpoint (DCP) writes two more kinds: its ``.metadata``, a plain pickle of DCP's own dataclasses
(:func:`load_dcp_metadata`: DCP's records built field by field and then checked whole, :func:`check_dcp_metadata`),
and its ``*.distcp`` data files, torch.save blobs end to end that the metadata locates (:func:`load_blob` unpickles
each: a plain tensor or plain Python values).

:func:`load_file` reads one file once, checks it against its manifest entry when given one, and unpickles those same
bytes, so a file swapped between the check and the load is never read. Refusals and damaged files are one
:class:`~lightning_fleet.planning.FleetError` line; a refusal is marked deterministic (every attempt would read the
same file, so torchrun does not restart for it).

Imports torch (and, by name when present, the few DeepSpeed and torch.distributed.checkpoint classes checkpoints
hold), elastic/layout.py and elastic/worker.py's error marks; imported by the strategy, the DeepSpeed runtime (its checked
engine, resharding and offline reader), the torch runtime's DCP reader (runtime/torch/dcp.py), elastic/compatibility.py
and ``python -m lightning_fleet.runtime.deepspeed.convert``.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import dataclasses
import hashlib
import importlib
import io
import math
import os
import pathlib
import pickle
import re
import tarfile
from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from lightning_fleet.elastic import layout
from lightning_fleet.elastic.layout import FileEntry
from lightning_fleet.elastic.worker import deterministic
from lightning_fleet.planning import FleetError

_TORCH_LOAD = torch.serialization.load
"""torch's own load, taken at import: the converter process (runtime/deepspeed/convert.py) replaces ``torch.load`` with a
function that calls :func:`load_file`, which must then reach torch's, not itself."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SCALERS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
_ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
_FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"
_DCP = "torch.distributed.checkpoint.metadata"
_DCP_RECORDS = (f"{_DCP}.Metadata", f"{_DCP}.TensorStorageMetadata", f"{_DCP}.BytesStorageMetadata",
                f"{_DCP}.ChunkStorageMetadata", f"{_DCP}.MetadataIndex", f"{_DCP}.StorageMeta",
                "torch.distributed.checkpoint.filesystem._StorageInfo")
"""DCP's dataclasses in its ``.metadata`` (torch 2.13 distributed/checkpoint/metadata.py, filesystem.py), each built
empty and given its own fields."""
_DCP_PROPERTIES = f"{_DCP}.TensorProperties"
"""DCP's tensor properties: built from a 5-tuple by its own ``__setstate__`` (dtype, layout, requires_grad, memory
format code, pin_memory)."""
_DCP_MEMORY_FORMAT = f"{_DCP}._MEM_FORMAT_ENCODING"
_LAYOUT = "torch.serialization._get_layout"
_HYPER = ("argparse.Namespace", "pathlib.PosixPath", "pathlib.PurePosixPath", "builtins.frozenset", "builtins.slice",
          "collections.defaultdict")

DCP_KINDS = frozenset({layout.KIND_DCP_METADATA, layout.KIND_DCP_DATA})
"""The kinds torch.distributed.checkpoint writes (runtime/torch/dcp.py reads them)."""
_DEEPSPEED_HOLDS = "tensors and DeepSpeed's own values"
_HOLDS = {layout.KIND_DCP_METADATA: "torch.distributed.checkpoint's own records",
          layout.KIND_DCP_DATA: "plain tensors and plain Python values"}
USER_KINDS = frozenset({layout.KIND_MODEL_STATES, layout.KIND_LIGHTNING, layout.KIND_CLIENT})
"""Kinds that hold the user's client state (hyper-parameters, callback state): there the globals the user admitted with
``torch.serialization.add_safe_globals`` are admitted too."""

ALLOWED_GLOBALS: Mapping[str, tuple[str, ...]] = {
    layout.KIND_MODEL_STATES: ("torch.Size", "torch.device", "builtins.set", *_SCALERS, _ZERO_STAGE, _FRAGMENT, *_HYPER),
    layout.KIND_LIGHTNING: ("torch.Size", "torch.device", "builtins.set", *_HYPER),
    layout.KIND_CLIENT: ("torch.Size", "torch.device", "builtins.set", *_HYPER),
    layout.KIND_LAYER_STATES: (),
    layout.KIND_UNSTAGED: (),
    layout.KIND_OPTIM_STATES: (*_SCALERS, _ZERO_STAGE, _FRAGMENT, "torch._tensor._rebuild_from_type_v2", "torch.Tensor"),
    layout.KIND_UNIVERSAL_OPTIMIZER: (*_SCALERS, _ZERO_STAGE, _FRAGMENT, "torch._tensor._rebuild_from_type_v2", "torch.Tensor"),
    layout.KIND_UNIVERSAL_FRAGMENT: (),
    layout.KIND_RNG: (),
    layout.KIND_DATA: (),
    layout.KIND_DCP_METADATA: (*_DCP_RECORDS, _DCP_PROPERTIES, _DCP_MEMORY_FORMAT, _LAYOUT, "torch.Size", "pathlib.PosixPath"),
    layout.KIND_DCP_DATA: (),
}
"""Per file kind, the globals a file may name besides every kind's tensors (``torch._utils._rebuild_tensor_v2``, the
storage types, dtypes and ``collections.OrderedDict``): what each kind holds, measured on DeepSpeed 0.19.8's ZeRO 0-3,
tensor- and pipeline-parallel checkpoints and their universal form (the loss scaler and ZeRO stage in optimizer
partitions, ``fragment_address`` in their slice mappings -- also in the model states where no ZeRO optimizer keeps
its own file: bf16 at ZeRO-0, e.g. under a pipeline --, ZeRO-3's flat groups as tensors with a ``ds_id``), and for the
files holding Lightning's client state the standard-library values hyper-parameters commonly hold (LightningCLI paths,
namespaces). A DCP metadata file holds DCP's records, sizes, the strided layout and the save dir's path (measured on
torch 2.13's saves of plain, DTensor and FSDP2 state dicts); a DCP data file only tensors and plain values. A
:data:`~lightning_fleet.elastic.layout.KIND_DATA` file is never unpickled."""

TENSOR_ATTRIBUTES: Mapping[str, frozenset[str]] = {
    layout.KIND_OPTIM_STATES: frozenset({"ds_id"}),
    layout.KIND_UNIVERSAL_OPTIMIZER: frozenset({"ds_id"}),
}
"""Per kind, the attributes a tensor may carry (DeepSpeed's ZeRO-3 names its flat groups with a ``ds_id`` string); in
every other kind a tensor carries none."""


class Refused(pickle.UnpicklingError):
    """What the restricted unpickler or :func:`check_loaded` refused, as the detail of the one line the caller prints."""


# --- the per-file policy -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What one load admits: the kind's globals by dotted name, which of them may be called, built (``NEWOBJ``) and
    given attributes (``BUILD``, with the names they may set; None: any string name), and the tensor attributes."""

    kind: str
    """The file kind (:data:`lightning_fleet.elastic.layout.FILE_KINDS`)."""
    globals: Mapping[str, Any] = field(hash=False)
    """Dotted name -> the object the unpickler pushes for it."""
    callables: frozenset[int] = frozenset()
    """ids of the objects ``REDUCE`` may call."""
    classes: frozenset[type] = frozenset()
    """Classes ``NEWOBJ`` may instantiate."""
    attributes: Mapping[type, frozenset[str] | None] = field(default_factory=dict, hash=False)
    """Types ``BUILD`` may set attributes on, and the names (None: any identifier)."""
    user: frozenset[type] = frozenset()
    """Classes the user admitted (``add_safe_globals``): built as torch's weights_only unpickler builds them."""
    states: Mapping[type, Callable[[Any], None]] = field(default_factory=dict, hash=False)
    """Types ``BUILD`` hands a non-mapping state to their own ``__setstate__``, once its check (the value) passes."""


def _resolve(dotted: str) -> Any:
    """The object named ``dotted``, or None when the installed packages lack it (no file can then hold it either)."""
    module_name, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


@cache
def _dtypes() -> dict[str, torch.dtype]:
    return {str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)}


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any,
                    metadata: Any = None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2`` for a plain tensor: no backward hooks, boolean flags, integer sizes."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise Refused(f"a tensor is rebuilt from a {type(storage).__name__}, not from a storage of the file")
    if type(backward_hooks) not in (OrderedDict, dict) or backward_hooks:
        raise Refused("a tensor carries backward hooks (they would run during training)")
    if type(requires_grad) is not bool or not _ints(size) or not _ints(stride) or type(storage_offset) is not int:
        raise Refused("a tensor's size, stride, offset or requires_grad is not what torch.save writes")
    if metadata is not None and not (type(metadata) is dict and all(type(v) is bool for v in metadata.values())):
        raise Refused("a tensor's metadata is not torch's flags")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata)


def _ints(values: Any) -> bool:
    return type(values) in (tuple, list, torch.Size) and all(type(v) is int and v >= 0 for v in values)


def _rebuild_from_type(kind: str) -> Callable[..., torch.Tensor]:
    """torch's ``_rebuild_from_type_v2`` for a plain tensor with the attributes :data:`TENSOR_ATTRIBUTES` allows in
    ``kind`` (never a Parameter or another subclass, never another attribute)."""
    allowed = TENSOR_ATTRIBUTES.get(kind, frozenset())

    def rebuild(func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor:
        if func is not _rebuild_tensor or new_type is not torch.Tensor:
            raise Refused(f"a tensor is rebuilt as {getattr(new_type, '__qualname__', type(new_type).__name__)} through "
                          f"{getattr(func, '__qualname__', type(func).__name__)}; only plain tensors are read")
        if type(state) is not dict or not all(type(k) is str and type(v) is str for k, v in state.items()) or set(state) - allowed:
            names = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise Refused(f"a tensor carries attributes {names}; a {kind} file's tensors carry at most {sorted(allowed)}")
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)

    return rebuild


def _path_factory(cls: type) -> Callable[..., Any]:
    """``cls(*parts)`` for string parts only (a path unpickles as its class called with its parts)."""
    def make(*parts: Any) -> Any:
        if not all(type(part) is str for part in parts):
            raise Refused(f"a {cls.__name__} is built from {[type(p).__name__ for p in parts]}, not from strings")
        return cls(*parts)

    return make


def _strided(name: Any) -> torch.layout:
    """torch's ``_get_layout`` for the one layout a DCP checkpoint records (``torch.strided``; its other fields are
    deprecated)."""
    if name != "torch.strided":
        raise Refused(f"a tensor layout {str(name)[:40]!r}; DCP records only torch.strided")
    return torch.strided


def _memory_format_code(enum: type) -> Callable[[Any], Any]:
    """DCP's ``_MEM_FORMAT_ENCODING(code)`` for an integer code only (an enum class called with more makes a new
    enum)."""
    def member(code: Any) -> Any:
        if type(code) is not int:
            raise Refused(f"a DCP memory format code of type {type(code).__name__}")
        return enum(code)

    return member


def _properties_state(memory_format: type) -> Callable[[Any], None]:
    """The check of DCP's ``TensorProperties`` state: (dtype, torch.strided, bool, a memory format code, bool)."""
    def check(state: Any) -> None:
        kinds = (torch.dtype, torch.layout, bool, memory_format, bool)
        if type(state) is not tuple or len(state) != 5 or not all(type(v) is k for v, k in zip(state, kinds)) \
                or state[1] is not torch.strided:
            raise Refused("DCP tensor properties that are not (dtype, torch.strided, bool, memory format, bool)")

    return check


_KindRules = tuple[dict[str, Any], tuple[Any, ...], frozenset[type], dict[type, frozenset[str] | None],
                   dict[type, Callable[[Any], None]]]
"""What :func:`_kind_rules` returns: globals, callables, classes, buildable types, checked ``__setstate__`` states."""


@cache
def _kind_rules(kind: str) -> _KindRules:
    """The globals, callables, classes, buildable types and checked ``__setstate__`` states of ``kind`` that do not
    depend on the user (cached)."""
    table: dict[str, Any] = {"torch._utils._rebuild_tensor_v2": _rebuild_tensor, "collections.OrderedDict": OrderedDict, **_dtypes()}
    callables: list[Any] = [_rebuild_tensor, OrderedDict]
    classes: set[type] = set()
    attributes: dict[type, frozenset[str] | None] = {}
    states: dict[type, Callable[[Any], None]] = {}
    if kind in (layout.KIND_MODEL_STATES, layout.KIND_LIGHTNING, layout.KIND_CLIENT, layout.KIND_LAYER_STATES, layout.KIND_UNSTAGED):
        attributes[OrderedDict] = frozenset({"_metadata"})  # a module's state_dict keeps its version metadata there
    for dotted in ALLOWED_GLOBALS[kind]:
        value = _resolve(dotted)
        if value is None:
            continue
        if dotted == "torch._tensor._rebuild_from_type_v2":
            value = _rebuild_from_type(kind)
        elif dotted in _PATHS:
            value = _path_factory(value)
        elif dotted == _LAYOUT:
            value = _strided
        elif dotted == _DCP_MEMORY_FORMAT:
            value = _memory_format_code(value)
        table[dotted] = value
        if dotted in _DCP_RECORDS:
            classes.add(value)
            attributes[value] = frozenset(f.name for f in dataclasses.fields(value))
        elif dotted == _DCP_PROPERTIES:
            classes.add(value)
            states[value] = _properties_state(_resolve(_DCP_MEMORY_FORMAT))
        elif dotted in _SCALERS:
            classes.add(value)
            attributes[value] = _scaler_fields(value)
        elif dotted == _FRAGMENT:
            classes.add(value)
            attributes[value] = frozenset({"numel", "start"})
        elif dotted == "argparse.Namespace":
            classes.add(value)
            attributes[value] = None
        elif dotted != "torch.Tensor":  # torch.Tensor is only _rebuild_from_type_v2's argument, never called
            callables.append(value)
    return table, tuple(callables), frozenset(classes), attributes, states


_PATHS = ("pathlib.PosixPath", "pathlib.PurePosixPath")


def policy(kind: str) -> Policy:
    """The :class:`Policy` of a file of ``kind``, with the user's safe globals (read now, never changed) for
    :data:`USER_KINDS`. :class:`Refused` for a kind that is never unpickled."""
    if kind not in ALLOWED_GLOBALS or kind == layout.KIND_DATA:
        raise Refused(f"its name is not that of a file lightning_fleet or DeepSpeed unpickles (kind {kind!r})")
    table, callables, classes, attributes, states = _kind_rules(kind)
    table, extra, user = dict(table), [], set()
    if kind in USER_KINDS:
        for entry in torch.serialization.get_safe_globals():
            obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
            table.setdefault(name, obj)
            extra.append(obj)
            if isinstance(obj, type):
                user.add(obj)
    return Policy(kind, table, frozenset(map(id, (*callables, *extra))), classes, attributes, frozenset(user), states)


@cache
def _scaler_fields(cls: type) -> frozenset[str]:
    """The attributes DeepSpeed's own constructor gives a loss scaler of ``cls`` (what a saved one must have)."""
    if cls.__name__ == "DynamicLossScaler":
        fresh = cls(init_scale=2.0, scale_window=1, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False)
    else:
        fresh = cls(1.0)
    return frozenset(vars(fresh))


# --- the unpickler -----------------------------------------------------------------------------------------------------


def _opcode(name: str) -> int:
    return getattr(pickle, name)[0]


class RestrictedUnpickler(pickle._Unpickler):  # the pure-Python unpickler: every opcode's handler can be replaced
    """Unpickles under one :class:`Policy`: globals from its table only (nothing imported), ``REDUCE``/``NEWOBJ``/``BUILD``
    only for what it admits, items only into lists, dicts and sets; no extension codes, text persistent ids, ``INST``,
    ``OBJ`` or out-of-band buffers. torch.load subclasses it (its ``find_class`` maps storage names first, its
    ``persistent_load`` reads the storages)."""

    policy: Policy  # set on the subclass made for each load (_PickleModule)

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # protocol 2 writes Python 2's names (builtins.set is __builtin__.set)
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        dotted = f"{module}.{name}"
        found = self.policy.globals.get(dotted)
        if found is None:
            raise Refused(f"GLOBAL {dotted} is not allowed in a {self.policy.kind} file")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id outside torch's storages")

    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in self.policy.callables or type(args) is not tuple:
            raise Refused(f"a call of {_name(func)}, which a {self.policy.kind} file never makes")
        try:
            self.stack[-1] = func(*args)
        except (TypeError, ValueError) as err:  # arguments no writer of ours gives it
            raise Refused(f"{_name(func)} called with what it does not take ({str(err)[:100]})") from None

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in self.policy.classes and cls not in self.policy.user:
            raise Refused(f"an instance of {_name(cls)} built without its constructor, which a {self.policy.kind} file never holds")
        if args != () and cls not in self.policy.user:
            raise Refused(f"an instance of {_name(cls)} built with arguments")
        self.append(cls.__new__(cls, *args))

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls in self.policy.user:  # the user trusts the class: as torch's weights_only unpickler builds it
            setstate = getattr(inst, "__setstate__", None)
            if setstate is not None:
                setstate(state)
            else:
                inst.__dict__.update(state)
            return
        if cls in self.policy.states:  # its own __setstate__, given only the state its check admits
            self.policy.states[cls](state)
            inst.__setstate__(state)
            return
        if cls not in self.policy.attributes:
            raise Refused(f"attributes set on a {_name(cls)}, which a {self.policy.kind} file never does")
        names = self.policy.attributes[cls]
        if type(state) is not dict or not all(type(k) is str and k.isidentifier() for k in state):
            raise Refused(f"the state of a {_name(cls)} is not a mapping of attribute names")
        if names is not None and set(state) - names:
            raise Refused(f"a {_name(cls)} given attributes {sorted(set(state) - names)}; it has only {sorted(names)}")
        inst.__dict__.update(state)

    def _container(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(target) not in kinds:
            raise Refused(f"{op} into a {_name(type(target))}")

    def _append(self) -> None:
        self._container(self.stack[-2], (list,), "APPEND")
        super().load_append()

    def _appends(self) -> None:
        self._container(self.metastack[-1][-1], (list,), "APPENDS")
        super().load_appends()

    def _setitem(self) -> None:
        self._container(self.stack[-3], (dict, OrderedDict, defaultdict), "SETITEM")
        super().load_setitem()

    def _setitems(self) -> None:
        self._container(self.metastack[-1][-1], (dict, OrderedDict, defaultdict), "SETITEMS")
        super().load_setitems()

    def _additems(self) -> None:
        self._container(self.metastack[-1][-1], (set,), "ADDITEMS")
        super().load_additems()

    def _refuse(self) -> None:
        raise Refused("an opcode torch.save never writes (INST, OBJ, an extension code, a text persistent id or a buffer)")

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[_opcode("REDUCE")] = _reduce
    dispatch[_opcode("NEWOBJ")] = _newobj
    dispatch[_opcode("NEWOBJ_EX")] = _refuse
    dispatch[_opcode("BUILD")] = _build
    dispatch[_opcode("APPEND")] = _append
    dispatch[_opcode("APPENDS")] = _appends
    dispatch[_opcode("SETITEM")] = _setitem
    dispatch[_opcode("SETITEMS")] = _setitems
    dispatch[_opcode("ADDITEMS")] = _additems
    for _name_ in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "NEXT_BUFFER", "READONLY_BUFFER"):
        dispatch[_opcode(_name_)] = _refuse
    del _name_


def _name(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return type(obj).__name__


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` uses (its ``Unpickler`` and ``load``), made for one load."""

    def __init__(self, rules: Policy) -> None:
        self.__name__ = f"lightning_fleet_restricted_{rules.kind}"
        self.Unpickler = type("Unpickler", (RestrictedUnpickler,), {"policy": rules})

    def load(self, file: Any, **kwargs: Any) -> Any:
        return self.Unpickler(file, **kwargs).load()


# --- what was built, against what the runtime expects ------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, str, bytes)


def check_loaded(value: Any, rules: Policy | str) -> Any:
    """``value`` (what a file of the policy's kind unpickled to), once every object in it is of a type that kind holds,
    no mapping carries attributes but a state_dict's ``_metadata``, no tensor carries hooks or attributes its kind does
    not give it, paths read as their parts, DeepSpeed's loss scalers and slice mappings have their own fields in their
    ranges and a DCP metadata file is DCP's record (:func:`check_dcp_metadata`); :class:`Refused` naming the first that
    is not."""
    rules = policy(rules) if isinstance(rules, str) else rules
    kind = rules.kind
    if kind == layout.KIND_DCP_METADATA:
        check_dcp_metadata(value)
    allowed = {dict, list, tuple, set, frozenset, torch.dtype, torch.Tensor, *rules.classes, *rules.user}
    allowed |= {v for v in rules.globals.values() if isinstance(v, type) and v is not torch.Tensor}
    allowed |= {_resolve(dotted) for dotted in _PATHS if dotted in rules.globals}
    attributes = TENSOR_ATTRIBUTES.get(kind, frozenset())
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        cls = type(item)
        if cls in _PLAIN or id(item) in seen:
            continue
        seen.add(id(item))
        if cls not in allowed:
            raise Refused(f"{where or 'the file'} is a {_name(cls)}, which a {kind} file never holds")
        if cls in rules.user:
            continue  # the user vouched for the class
        if cls is torch.Tensor:
            extra = set(vars(item)) - attributes
            if extra or item._backward_hooks:
                raise Refused(f"tensor {where or '(top)'} carries {sorted(extra) or 'backward hooks'}")
        elif isinstance(item, pathlib.PurePath):
            if str(item) != str(cls(*item.parts)):
                raise Refused(f"path {where or '(top)'} reads {str(item)!r} but is made of {item.parts}")
        elif cls.__name__ in ("LossScaler", "DynamicLossScaler"):
            _check_scaler(item, where)
        elif cls.__name__ == "fragment_address":
            if set(vars(item)) != {"numel", "start"} or not all(type(v) is int and v >= 0 for v in vars(item).values()):
                raise Refused(f"slice mapping {where} is {vars(item)}, expected non-negative integers numel and start")
        elif isinstance(item, dict):
            _check_mapping(item, where, kind, stack)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
        elif isinstance(item, argparse.Namespace):
            stack.extend((child, f"{where}.{name}") for name, child in vars(item).items())
    return value


def _check_mapping(item: dict, where: str, kind: str, stack: list[tuple[Any, str]]) -> None:
    """A dict's keys are plain, an OrderedDict carries nothing but ``_metadata`` (an attribute shadowing ``keys`` or
    ``items`` would hide its contents from a strict load), and a ``loss_scaler`` DeepSpeed would adopt is its own class."""
    own = vars(item) if hasattr(item, "__dict__") else {}
    if set(own) - {"_metadata"}:
        raise Refused(f"mapping {where or '(top)'} carries attributes {sorted(own)}, which would shadow its contents")
    if "_metadata" in own:
        stack.append((own["_metadata"], f"{where}._metadata"))
    scaler_here = kind not in USER_KINDS or where.startswith("/optimizer")  # elsewhere it may be a hyper-parameter's name
    for key, child in item.items():
        if type(key) not in _PLAIN:
            raise Refused(f"mapping {where or '(top)'} has a key of type {_name(type(key))}")
        if scaler_here and key == "loss_scaler" and type(child).__name__ not in ("LossScaler", "DynamicLossScaler"):
            raise Refused(f"{where}/loss_scaler is a {_name(type(child))}; DeepSpeed's loss scaler must be its LossScaler or DynamicLossScaler")
        stack.append((child, f"{where}/{key}"))


def _finite(low: float, high: float = math.inf, *, above: bool = True) -> Callable[[Any], bool]:
    return lambda v: type(v) in (int, float) and math.isfinite(v) and (v > low if above else v >= low) and v <= high


def _integer(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= low


_BOOL: Callable[[Any], bool] = lambda v: type(v) is bool  # noqa: E731
_SCALER_CHECKS: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "cur_scale": (_finite(0.0), "a finite number > 0"),
    "dynamic": (_BOOL, "a boolean"),
    "cur_iter": (_integer(0), "an integer >= 0"),
    "last_overflow_iter": (_integer(-1), "an integer >= -1"),
    "scale_factor": (_finite(1.0), "a finite number > 1"),
    "scale_window": (_integer(1), "an integer >= 1"),
    "min_scale": (_finite(0.0), "a finite number > 0"),
    "delayed_shift": (_integer(1), "an integer >= 1"),
    "cur_hysteresis": (_integer(1), "an integer >= 1"),
    "consecutive_hysteresis": (_BOOL, "a boolean"),
    "raise_error_at_min_scale": (_BOOL, "a boolean"),
    "dtype": (lambda v: v in (torch.float16, torch.bfloat16, torch.float32), "float16, bfloat16 or float32"),
}
"""What each field of DeepSpeed's loss scalers must be (runtime/fp16/loss_scaler.py sets them in its constructors)."""


def _check_scaler(scaler: Any, where: str) -> None:
    """DeepSpeed's loss scaler with exactly its constructor's fields, each in its range (a zero or NaN scale, a dynamic
    flag that is not its class's, a window of 0 would stop or corrupt training)."""
    cls, fields = type(scaler), vars(scaler)
    expected = _scaler_fields(cls)
    if set(fields) != expected:
        raise Refused(f"loss scaler {where} has fields {sorted(fields)}; DeepSpeed's {cls.__name__} has {sorted(expected)}")
    for name, value in fields.items():
        check, wanted = _SCALER_CHECKS.get(name, (lambda v: type(v) in _PLAIN, "a plain value"))
        if not check(value):
            raise Refused(f"loss scaler {where}.{name} is {value!r}, expected {wanted}")
    if fields.get("dynamic") is not (cls.__name__ == "DynamicLossScaler"):
        raise Refused(f"loss scaler {where} is a {cls.__name__} with dynamic={fields.get('dynamic')!r}")
    if "min_scale" in fields and fields["min_scale"] > fields["cur_scale"]:
        raise Refused(f"loss scaler {where} has cur_scale {fields['cur_scale']!r} below its min_scale {fields['min_scale']!r}")
    if "cur_hysteresis" in fields and fields["cur_hysteresis"] > fields["delayed_shift"]:
        raise Refused(f"loss scaler {where} has cur_hysteresis {fields['cur_hysteresis']} above its delayed_shift {fields['delayed_shift']}")


# --- DCP's metadata, field by field -----------------------------------------------------------------------------------

_DISTCP_NAME = re.compile(rf"^\w[\w.-]*{re.escape(layout.DCP_SUFFIX)}$")
"""A data file a DCP metadata may point at: a plain name in the save dir (no directory, no leading dot)."""


def check_dcp_metadata(metadata: Any) -> Any:
    """``metadata`` once it is torch.distributed.checkpoint's ``Metadata`` as its ``FileSystemWriter`` writes it: every
    entry a tensor (dtype, size, chunks inside it that add up to it) or a bytes item, planner paths of names and list
    positions, every chunk and bytes item stored at a non-negative offset and length of a ``.distcp`` file of the same
    directory without stream transforms; :class:`Refused` naming the first field that is not."""
    from torch.distributed.checkpoint import metadata as dcp

    if type(metadata) is not dcp.Metadata:
        raise Refused(f"the file is a {_name(type(metadata))}, not DCP's Metadata")
    entries = _field(metadata, "state_dict_metadata")
    if type(entries) is not dict or not all(type(fqn) is str for fqn in entries):
        raise Refused("DCP's state_dict_metadata is not a mapping of names")
    for fqn, entry in entries.items():
        _check_dcp_entry(fqn, entry, dcp)
    _check_planner_data(_field(metadata, "planner_data"), entries)
    _check_storage_data(_field(metadata, "storage_data"), entries, dcp)
    _check_storage_meta(_field(metadata, "storage_meta"), dcp)
    if type(_field(metadata, "version")) not in (str, type(None)):
        raise Refused("DCP's version is not a string")
    return metadata


def _field(record: Any, name: str) -> Any:
    """A field of a DCP record (its class default where the file left it out); Refused when it has none."""
    try:
        return getattr(record, name)
    except AttributeError:
        raise Refused(f"a DCP {type(record).__name__} without its field {name}") from None


def _size(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and n >= 0 for n in value)


def _inside(offsets: Any, sizes: Any, size: torch.Size) -> bool:
    """Whether a chunk (offsets, sizes) is a box of the tensor's dimensions inside it."""
    if not (_size(offsets) and _size(sizes) and len(offsets) == len(sizes) == len(size)):
        return False
    return all(o + n <= whole for o, n, whole in zip(offsets, sizes, size))


def _check_dcp_entry(fqn: str, entry: Any, dcp: Any) -> None:
    """One ``state_dict_metadata`` entry: a bytes item, or a tensor whose chunks lie inside it and add up to it."""
    if type(entry) is dcp.BytesStorageMetadata:
        return
    if type(entry) is not dcp.TensorStorageMetadata:
        raise Refused(f"DCP entry {fqn} is a {_name(type(entry))}, neither a tensor nor a bytes item")
    properties, size, chunks = _field(entry, "properties"), _field(entry, "size"), _field(entry, "chunks")
    if type(properties) is not dcp.TensorProperties or not isinstance(getattr(properties, "dtype", None), torch.dtype):
        raise Refused(f"DCP entry {fqn} has no tensor properties with a dtype")
    if not _size(size) or type(chunks) is not list:
        raise Refused(f"DCP entry {fqn} has no size of integers or no list of chunks")
    for chunk in chunks:
        if type(chunk) is not dcp.ChunkStorageMetadata or not _inside(_field(chunk, "offsets"), _field(chunk, "sizes"), size):
            raise Refused(f"DCP entry {fqn} has a chunk outside its size {tuple(size)}")
    if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(size):
        raise Refused(f"DCP entry {fqn}'s chunks do not add up to its size {tuple(size)}")


def _check_planner_data(paths: Any, entries: dict[str, Any]) -> None:
    """Where each entry sits in the nested state: a tuple of names and list positions (below the number of entries)."""
    if paths is None:
        return
    if type(paths) is not dict or set(paths) - set(entries):
        raise Refused("DCP's planner_data is not a mapping of the checkpoint's entries")
    for fqn, path in paths.items():
        ok = type(path) is tuple and len(path) > 0 and type(path[0]) is str
        if not ok or not all(type(p) is str or (type(p) is int and 0 <= p < len(entries)) for p in path):
            raise Refused(f"DCP's planner_data path of {fqn} is not a tuple of names and list positions")


def _check_storage_data(storage: Any, entries: dict[str, Any], dcp: Any) -> None:
    """Every chunk and bytes item stored, each in a plain ``.distcp`` file of the save dir, untransformed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if type(storage) is not dict:
        raise Refused("DCP's storage_data is not a mapping")
    for index, info in storage.items():
        if type(index) is not dcp.MetadataIndex or getattr(index, "fqn", None) not in entries \
                or not (index.offset is None or _size(index.offset)) or type(index.index) not in (int, type(None)):
            raise Refused("DCP's storage_data has a key that is not an index into the checkpoint's entries")
        where = getattr(info, "relative_path", None)
        if type(info) is not _StorageInfo or type(where) is not str or not _DISTCP_NAME.match(where):
            raise Refused(f"DCP item {index.fqn} is stored in {str(where)[:80]!r}, not in a .distcp file of the save dir")
        if not all(type(v) is int and v >= 0 for v in (_field(info, "offset"), _field(info, "length"))):
            raise Refused(f"DCP item {index.fqn} has an offset or length that is not a non-negative integer")
        if info.transform_descriptors:
            raise Refused(f"DCP item {index.fqn} is stored through stream transforms, which lightning_fleet does not read")
    for fqn, entry in entries.items():
        for chunk in entry.chunks if type(entry) is dcp.TensorStorageMetadata else [None]:
            if dcp.MetadataIndex(fqn, None if chunk is None else chunk.offsets) not in storage:
                raise Refused(f"DCP entry {fqn} has a part that no data file stores")


def _check_storage_meta(meta: Any, dcp: Any) -> None:
    """DCP's note of the save (its directory, ids, module names), or none."""
    if meta is None:
        return
    if type(meta) is not dcp.StorageMeta:
        raise Refused(f"DCP's storage_meta is a {_name(type(meta))}")
    ids = (_field(meta, "save_id"), _field(meta, "load_id"))
    path, modules = _field(meta, "checkpoint_id"), _field(meta, "modules")
    if type(path) not in (str, pathlib.PosixPath, type(None)) or not all(type(i) in (str, type(None)) for i in ids) \
            or type(modules) is not list or not all(type(m) is str for m in modules):
        raise Refused("DCP's storage_meta is not a path, ids and module names")


# --- loading one file --------------------------------------------------------------------------------------------------


def load_file(path: Path, entry: FileEntry | None = None, *, kind: str | None = None, map_location: Any = "cpu",
              mmap: bool = False) -> Any:
    """One checkpoint file of ``kind`` (by default the one its name says, :func:`~lightning_fleet.elastic.layout.kind_of`;
    a manifest's recorded kind when the caller has one), unpickled by :class:`RestrictedUnpickler` and checked by
    :func:`check_loaded`. With ``entry`` (its manifest record) the bytes read are checked against its size and sha256
    first and the same bytes are unpickled. Without one, ``mmap`` maps a torch.save zip (its tensors then read the file
    until they are dropped: never rewrite it meanwhile). A missing, mismatching, refused or damaged file is one
    FleetError line (deterministic for a refusal)."""
    kind = layout.kind_of(path.as_posix()) if kind is None else kind
    with _one_line(str(path), kind):
        if entry is not None:
            data = read_checked(path, entry)
            source: Any = io.BytesIO(data)
            mmap, head = False, data[:512]
        else:
            if not path.is_file():
                raise FleetError(f"checkpoint is incomplete: {path} is missing (a save that did not finish, or a partial copy); use another checkpoint")
            with open(path, "rb") as f:
                head = f.read(512)
            source, mmap = path, mmap and head[:4] == b"PK\x03\x04"
        return _torch_unpickled(source, head, policy(kind), map_location=map_location, mmap=mmap)


def load_blob(data: bytes, *, kind: str, what: str, map_location: Any = "cpu") -> Any:
    """One torch.save blob held in memory (an item of a DCP data file), unpickled as a file of ``kind`` by
    :class:`RestrictedUnpickler` and checked by :func:`check_loaded`; a refused or damaged blob is one FleetError line
    naming ``what`` (deterministic for a refusal)."""
    with _one_line(what, kind):
        return _torch_unpickled(io.BytesIO(data), data[:512], policy(kind), map_location=map_location, mmap=False)


def load_dcp_metadata(path: Path, entry: FileEntry | None = None) -> Any:
    """torch.distributed.checkpoint's ``.metadata`` (a plain pickle, not torch.save's zip), read once (checked against
    its manifest entry when given; never through a symbolic link), unpickled by :class:`RestrictedUnpickler` as a
    :data:`~lightning_fleet.elastic.layout.KIND_DCP_METADATA` file and checked whole (:func:`check_dcp_metadata`). A
    missing, mismatching, refused or damaged file is one FleetError line (deterministic for a refusal)."""
    kind = layout.KIND_DCP_METADATA
    data = read_bytes(path, entry)
    with _one_line(str(path), kind):
        rules = policy(kind)
        return check_loaded(_PickleModule(rules).load(io.BytesIO(data)), rules)


@contextmanager
def _one_line(what: str, kind: str) -> Iterator[None]:
    """A refusal inside the block as one deterministic FleetError line, anything else that is not a FleetError (a
    truncated zip, flipped bytes) as one line saying the file is damaged."""
    try:
        yield
    except FleetError:
        raise
    except pickle.UnpicklingError as err:
        raise deterministic(FleetError(refusal(what, err, kind))) from None
    except Exception as err:  # truncated zip, flipped bytes
        raise FleetError(unreadable(what, err)) from None


def _torch_unpickled(source: Any, head: bytes, rules: Policy, *, map_location: Any, mmap: bool) -> Any:
    """torch.load of ``source`` (whose first bytes are ``head``) with the restricted pickle module of ``rules``,
    checked."""
    if _is_tar(head):
        raise Refused("it is torch's legacy tar format, which no checkpoint of DeepSpeed or lightning_fleet uses")
    if _forced_weights_only():
        raise deterministic(FleetError(
            "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, which makes torch.load refuse lightning_fleet's own restricted "
            "unpickler (stricter than weights_only, per file kind): unset it for this job"
        ))
    loaded = _TORCH_LOAD(source, map_location=map_location, weights_only=False, pickle_module=_PickleModule(rules), mmap=mmap)
    return check_loaded(loaded, rules)


def _is_tar(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def _forced_weights_only() -> bool:
    """Whether the user's environment forces torch.load to weights_only (torch reads it at each call and then refuses
    any pickle module)."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def unpickles(step_dir: Path, files: Iterable[str], kinds: Mapping[str, str] | None = None) -> None:
    """FleetError (deterministic for a refusal) unless every ``.pt`` file among ``files`` (paths relative to
    ``step_dir``; ``kinds``: the manifest's record of what each holds) unpickles and checks as its kind, and every DCP
    ``.metadata`` as DCP's record. Memory-mapped: only the pickles are read, not the tensors' bytes (a DCP metadata
    file, a plain pickle of a few kB per tensor, is read whole). Run by rank 0 when it chooses a checkpoint, so that a
    file no rank could load stops the job before any rank loads its own part (each rank's load checks its files again
    as it reads them; a DCP data file's items are checked there, where its metadata locates them)."""
    for name in sorted(files):
        if name.endswith(".pt"):
            load_file(step_dir / name, kind=(kinds or {}).get(name), mmap=True)
        elif layout.kind_of(name) == layout.KIND_DCP_METADATA:
            load_dcp_metadata(step_dir / name)


def read_bytes(path: Path, entry: FileEntry | None = None) -> bytes:
    """The bytes of ``path``, read once and never through a symbolic link: checked against its manifest entry when
    given (:func:`read_checked`), else whole; FleetError for a missing file or a link."""
    if entry is not None:
        return read_checked(path, entry)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise FleetError(f"cannot read checkpoint file {path} ({err.strerror}): it is missing or a symbolic link; use another checkpoint") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


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


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refusal(what: str, err: Exception, kind: str = layout.KIND_LIGHTNING) -> str:
    """One line for a file the restricted unpickler (or the check after it) refused: the global it would have imported
    or what it holds that its kind never does, and what to do."""
    text = _ANSI.sub("", str(err)).strip().splitlines()
    detail = text[0][:300] if text else type(err).__name__
    found = _REFUSED_GLOBAL.findall(detail)
    writer = "torch.distributed.checkpoint" if kind in DCP_KINDS else "DeepSpeed or lightning_fleet"
    if not found:
        return (f"cannot read {what}: it holds what a {kind} file never does ({detail}; nothing of it was used): it is "
                f"damaged, or was not written by {writer}; use another checkpoint")
    name = found[0]
    hint = (
        "keep hyper-parameters to plain types (str, int, float, bool, None, lists, dicts: str(path), enum.value) or leave "
        f"them out with save_hyperparameters(ignore=[...]); if you trust this file and the class, call "
        f"torch.serialization.add_safe_globals([{name.rpartition('.')[2]}]) before fitting"
    ) if kind in USER_KINDS else f"a {kind} file holds only {_HOLDS.get(kind, _DEEPSPEED_HOLDS)}; use another checkpoint"
    return (f"cannot read {what}: it would import {name} when loaded, which the restricted unpickler refuses (it could run "
            f"code; nothing of it ran): {hint}")


def unreadable(path: Path | str, err: Exception) -> str:
    """One line for a file torch cannot read at all."""
    text = _ANSI.sub("", str(err)).strip()
    reason = text.splitlines()[0] if text else type(err).__name__
    return f"cannot read {path} ({reason[:200]}): truncated, corrupted or not a checkpoint file"
