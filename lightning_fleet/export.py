"""Getting the weights out of any plan: one plain state_dict, one single-file checkpoint, the user's module handed back.

Offline (no process group, no model code): :func:`export_state_dict` reads a checkpoint written under any plan
(ZeRO 0-3, offload, AutoTP tensor parallel, DeepSpeed pipeline, and their data-parallel products) and returns the
full fp32 weights with exactly the keys and shapes of the user's LightningModule ``state_dict()``;
:func:`export_checkpoint` writes them as one Lightning-style file that ``MyModule.load_from_checkpoint`` and
``torch.load(weights_only=True)`` read without lightning_fleet. Every file is read with ``weights_only=True``,
memory-mapped, one after another; only the weights are copied out. Trainable parameters are DeepSpeed's fp32
masters wherever it keeps them, so a mixed-precision run exports full precision.

What a DeepSpeed checkpoint does not say -- which tensor-parallel shard is split along which dimension, which
pipeline layer file holds which module key, which parameters ZeRO-0's fp16/bf16 optimizer wrapper holds in which
group, the original keys, shapes and dtypes -- is the *layout* (``fleet_layout.json``), written next to DeepSpeed's
files by :func:`write_layout` on every save.

Live (collective, every rank calls it): :func:`full_state_dict` gathers the full weights from a running
FleetStrategy; :func:`restore_module` ends a fit by handing the user's module back in its original structure
(AutoTP's replaced layers put back, ZeRO-3 partitions gathered into ordinary tensors, DeepSpeed's hooks and
attributes gone, every pipeline stage's weights on every rank). It needs the :class:`ModuleRecord` taken by
:func:`record_module` before ``deepspeed.initialize``. The DeepSpeed engine keeps a mirror of the module
tree it trained, so a ``trainer.save_checkpoint`` after the restore still writes the same checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import pickle
import re
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lightning_fleet.elastic.checkpoint import _SAFE_PATTERN as _TORCH_TYPE  # dtypes and storages torch admits itself
from lightning_fleet.elastic.checkpoint import (
    MANIFEST,
    SAFE_GLOBALS,
    fsync_path,
    newest_verified,
    torch_file_globals,
    verify,
    write_atomic,
)
from lightning_fleet.planning import FleetError

LAYOUT = "fleet_layout.json"
"""File name of the layout inside a DeepSpeed checkpoint directory (next to ``latest`` and the tag directory)."""
UNSTAGED = "fleet_unstaged.pt"
"""Under pipeline parallelism: the module's tensors that no pipeline layer holds (DeepSpeed saves only the layers)."""
LAYOUT_FORMAT = "lightning_fleet.layout/1"
"""The layout version this module writes and reads."""
TAG = "checkpoint"
"""The tag under which Lightning's DeepSpeedStrategy.save_checkpoint saves (``engine.save_checkpoint(tag=...)``)."""

_RESTORED = "_fleet_restored"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's weights_only message is coloured
_HOOK_DICTS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# Module attributes DeepSpeed 0.19.8 sets (runtime/zero/parameter_offload.py: _original_parameters, pre_bwd_fn,
# post_bwd_fn, applied_pre_backward_ref_cnt, ds_*; zero/partition_parameters.py: _external_params, all_parameters,
# ds_external_parameters, _ds_child_entered, to_empty; engine.py: ds_autotp_parsed, universal_checkpoint_info,
# wall_clock_breakdown). Removed on restore unless the module had them before deepspeed.initialize.
_DEEPSPEED_ATTRIBUTES = frozenset(
    {
        "_original_parameters",
        "_external_params",
        "all_parameters",
        "pre_bwd_fn",
        "post_bwd_fn",
        "applied_pre_backward_ref_cnt",
        "universal_checkpoint_info",
        "wall_clock_breakdown",
        "_ds_child_entered",
        "to_empty",
    }
)


# --- the record taken before deepspeed.initialize --------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of the original module's ``state_dict()``."""

    key: str
    """The state_dict key."""
    shape: tuple[int, ...]
    """Its full shape."""
    dtype: str
    """Its dtype, e.g. ``"float32"``."""
    alias_of: str | None
    """The earlier key holding the same tensor (tied weights), else None."""

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON values."""
        return {"key": self.key, "shape": list(self.shape), "dtype": self.dtype, "alias_of": self.alias_of}

    @staticmethod
    def from_json(entry: Mapping[str, Any]) -> "TensorInfo":
        """Inverse of :meth:`to_json`."""
        return TensorInfo(str(entry["key"]), tuple(int(n) for n in entry["shape"]), str(entry["dtype"]), entry["alias_of"])


@dataclass(frozen=True, slots=True)
class _ModuleEntry:
    """What one module object of the tree held before DeepSpeed touched it."""

    module: nn.Module
    children: tuple[tuple[str, nn.Module | None], ...]
    params: tuple[tuple[str, str | None, bool], ...]  # (name, canonical state_dict key or None, requires_grad)
    buffers: tuple[tuple[str, str | None, torch.dtype | None], ...]  # (name, canonical key or None if non-persistent, dtype)
    non_persistent: frozenset[str]
    hooks: tuple[tuple[str, tuple[tuple[Any, Any], ...]], ...]  # (hook dict attribute, its items)
    attributes: frozenset[str]


@dataclass(frozen=True, slots=True)
class ModuleRecord:
    """The user's module as it was before ``deepspeed.initialize``: what :func:`restore_module` puts back."""

    tensors: tuple[TensorInfo, ...]
    """The original ``state_dict()`` entries, in order."""
    entries: tuple[_ModuleEntry, ...]
    """Every module object of the tree (each once): its children, parameters, buffers, hooks and attributes."""


def record_module(module: nn.Module) -> ModuleRecord:
    """Record ``module`` (the LightningModule) before ``deepspeed.initialize`` replaces, partitions or hooks it."""
    canonical: dict[int, str] = {}
    tensors = []
    for key, tensor in module.state_dict(keep_vars=True).items():
        alias = canonical.get(id(tensor))
        canonical.setdefault(id(tensor), key)
        tensors.append(TensorInfo(key, _full_shape(tensor), _dtype_name(tensor.dtype), alias))
    entries = tuple(_entry(m, canonical) for m in module.modules())
    return ModuleRecord(tuple(tensors), entries)


def _entry(module: nn.Module, canonical: dict[int, str]) -> _ModuleEntry:
    params = tuple(
        (name, None if p is None else canonical.get(id(p)), bool(p is not None and p.requires_grad))
        for name, p in module._parameters.items()
    )
    transient = module._non_persistent_buffers_set
    buffers = tuple(
        (name, None if b is None or name in transient else canonical.get(id(b)), None if b is None else b.dtype)
        for name, b in module._buffers.items()
    )
    hooks = tuple((attr, tuple(getattr(module, attr).items())) for attr in _HOOK_DICTS if attr in module.__dict__)
    return _ModuleEntry(
        module=module,
        children=tuple(module._modules.items()),
        params=params,
        buffers=buffers,
        non_persistent=frozenset(module._non_persistent_buffers_set),
        hooks=hooks,
        attributes=frozenset(module.__dict__),
    )


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's unpartitioned shape (ZeRO-3 keeps it as ``ds_shape``)."""
    return tuple(int(n) for n in getattr(tensor, "ds_shape", tensor.shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_export(tensor: torch.Tensor) -> torch.Tensor:
    """Floating tensors as fp32, others as they are; detached, on the CPU, always a compact copy of its own (never a view
    into a flat group or a memory-mapped file, whose whole storage ``torch.save`` would write)."""
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to("cpu", dtype, memory_format=torch.contiguous_format, copy=True)


# --- live: gather the full weights from a running strategy -----------------------------------------


def full_state_dict(strategy: Any, record: ModuleRecord | None = None) -> dict[str, torch.Tensor]:
    """The full weights of the strategy's module on every rank, keyed like the original ``state_dict()`` (collective).

    Trainable parameters come from DeepSpeed's fp32 master copies when it keeps them (ZeRO 1-3, its bf16 optimizer,
    and at ZeRO-0 under fp16/bf16 mixed precision its FP16 optimizer wrappers), else from the parameters themselves
    (ZeRO-3 partitions gathered); AutoTP shards are all-gathered over the tensor-parallel group and concatenated
    along their split dimension; each pipeline stage broadcasts its layers. Floating tensors are fp32, everything is
    on the CPU.
    """
    engine = _engine_of(strategy)
    module = strategy.lightning_module
    if engine is None or getattr(engine, _RESTORED, False):  # a plain module that holds the full weights
        return {k: _as_export(v) for k, v in module.state_dict().items()}
    infos = record.tensors if record is not None else _live_infos(module, engine)
    masters = {id(param): master for group in _wrapper_masters(getattr(engine, "optimizer", None)) for param, master in group}
    device = strategy.root_device
    if _is_pipeline(engine):
        return _pipeline_state(engine, module, infos, device, masters)
    return _replica_state(engine.module, infos, device, masters)


def _engine_of(strategy: Any) -> Any:
    """The strategy's DeepSpeed engine, or None when it runs none (before a fit, or during a plain evaluation)."""
    from deepspeed import DeepSpeedEngine

    model = getattr(strategy, "model", None)
    return model if isinstance(model, DeepSpeedEngine) else None


def _is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def _live_infos(module: nn.Module, engine: Any) -> tuple[TensorInfo, ...]:
    """The state_dict entries of a module already under DeepSpeed (no record): AutoTP shards at their full shape."""
    full = _tensor_parallel_shapes(engine.module) if not _is_pipeline(engine) else {}
    canonical: dict[int, str] = {}
    infos = []
    for key, tensor in module.state_dict(keep_vars=True).items():
        alias = canonical.get(id(tensor))
        canonical.setdefault(id(tensor), key)
        infos.append(TensorInfo(key, full.get(key, _full_shape(tensor)), _dtype_name(tensor.dtype), alias))
    return tuple(infos)


def _wrapper_masters(optimizer: Any) -> list[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Per optimizer group, in the wrapper's order: (parameter, its fp32 master) of each trainable parameter of
    DeepSpeed's fp16/bf16 optimizer wrapper; empty for any other optimizer.

    DeepSpeed 0.19.8 wraps the optimizer at ZeRO-0 under fp16 (and under bf16 without a pipeline)
    (``engine._do_optimizer_sanity_check`` returns FP16 / DDP_BFLOAT16): ``FP16_Optimizer`` (a fused optimizer)
    keeps one flat fp32 copy per group (``fp32_groups_flat``, the group's parameters back to back,
    runtime/fp16/fused_optimizer.py), ``FP16_UnfusedOptimizer`` (any other, e.g. torch's AdamW) one fp32
    tensor per parameter (``fp32_groups``, runtime/fp16/unfused_optimizer.py); ``fp16_groups`` lists the
    parameters. ``deepspeed.utils.safe_get_full_fp32_param`` covers neither."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(optimizer, FP16_Optimizer):
        flats = zip(optimizer.fp32_groups_flat, optimizer.fp16_groups)
        return [list(zip(group, _unflat(flat, [p.shape for p in group]))) for flat, group in flats]
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return [list(zip(group, masters)) for masters, group in zip(optimizer.fp32_groups, optimizer.fp16_groups)]
    return []


def _unflat(flat: torch.Tensor, shapes: Iterable[Iterable[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` holding tensors of ``shapes`` back to back (torch._utils._flatten_dense_tensors, no padding)."""
    views, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat.narrow(0, offset, numel).view(tuple(shape)))
        offset += numel
    if offset != flat.numel():
        raise FleetError(
            f"fp32 master group holds {flat.numel()} elements, its parameters {offset}: the files do not belong together"
        )
    return views


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _full_value(tensor: torch.Tensor, is_param: bool, masters: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """One parameter or buffer whole (collective over its data-parallel group where DeepSpeed partitions it);
    ``masters``: parameter id -> fp32 master of ZeRO-0's fp16/bf16 optimizer wrapper (:func:`_wrapper_masters`)."""
    if not is_param:
        return tensor.detach().clone()
    if id(tensor) in masters:
        return masters[id(tensor)].detach().clone()
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(tensor)  # ZeRO 1-3 and the bf16 optimizer keep fp32 masters
    if master is not None:
        return master.detach().clone()
    if hasattr(tensor, "ds_id"):  # a ZeRO-3 parameter without a master (frozen)
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            return tensor.detach().clone()
    return tensor.detach().clone()


def _replica_state(
    view: nn.Module, infos: Iterable[TensorInfo], device: torch.device, masters: Mapping[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every key of a (possibly tensor-parallel, ZeRO-partitioned) replica, gathered in the same order on every rank."""
    named = _named_tensors(view)
    params = {id(p) for p in view.parameters()}
    splits = _tensor_parallel_splits(view)
    out: dict[str, torch.Tensor] = {}
    for info in infos:
        if info.alias_of is not None:
            out[info.key] = out[info.alias_of]
            continue
        tensor = named[info.key]
        value = _full_value(tensor, id(tensor) in params, masters)
        if info.key in splits:
            dim, group = splits[info.key]
            value = _gather_along(value, dim, group, device)
        elif id(tensor) not in params:
            value = _from_rank_zero(value, device)  # DeepSpeed never syncs buffers; a checkpoint holds rank 0's
        out[info.key] = _as_export(value)
    return out


def _from_rank_zero(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    value = tensor.to(device).contiguous()
    dist.broadcast(value, src=0)
    return value


def _tensor_parallel_splits(view: nn.Module) -> dict[str, tuple[int, Any]]:
    """Key -> (split dim, tp process group) of every AutoTP-sharded tensor under ``view``."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    splits: dict[str, tuple[int, Any]] = {}
    for path, layer in view.named_modules(remove_duplicate=False):
        if not isinstance(layer, TensorParallel_Layer) or layer.tp_world_size <= 1:
            continue
        for name, dim in _split_dims_of(path, layer).items():
            splits[name] = (dim, layer.mp_group)
    return splits


def _split_dims_of(path: str, layer: nn.Module) -> dict[str, int]:
    """The split dimension of each sharded tensor of one AutoTP layer, from DeepSpeed's own partition metadata."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    dims = {}
    for name, param in layer.named_parameters(recurse=False):
        meta = getattr(param, DS_AUTOTP_UC_META, None)
        key = f"{path}.{name}" if path else name
        if meta is None:
            raise FleetError(
                f"AutoTP layer {key} ({type(layer).__name__}) carries no partition metadata; its weights cannot be exported"
            )
        if meta.get("replicated") or meta.get("partition_dim") is None:
            continue
        if meta.get("sub_param_shape") or meta.get("sub_param_sizes") or meta.get("unsupported_reason"):
            raise FleetError(
                f"AutoTP split {key} ({type(layer).__name__}) into sub-parameters; export handles plain column and row "
                "splits only: use 'column'/'row' patterns on unfused Linear layers"
            )
        dims[key] = int(meta["partition_dim"])
    return dims


def _tensor_parallel_shapes(view: nn.Module) -> dict[str, tuple[int, ...]]:
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.module_inject.layers import TensorParallel_Layer

    shapes = {}
    for path, layer in view.named_modules(remove_duplicate=False):
        if isinstance(layer, TensorParallel_Layer):
            for name, param in layer.named_parameters(recurse=False):
                meta = getattr(param, DS_AUTOTP_UC_META, None) or {}
                if meta.get("logical_shape"):
                    shapes[f"{path}.{name}" if path else name] = tuple(int(n) for n in meta["logical_shape"])
    return shapes


def _gather_along(tensor: torch.Tensor, dim: int, group: Any, device: torch.device) -> torch.Tensor:
    """All-gather a tensor's shards over ``group`` (uneven sizes allowed) and concatenate them along ``dim``."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    local = tensor.to(device).contiguous()
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.shape[dim]], dtype=torch.long, device=device), group=group)
    counts = [int(s.item()) for s in sizes]
    padded_shape = list(local.shape)
    padded_shape[dim] = max(counts)
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    chunks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([chunk.narrow(dim, 0, n) for chunk, n in zip(chunks, counts)], dim=dim)


def pipeline_layer_keys(module: nn.Module) -> list[dict[str, str]]:
    """For each layer of the module's ``fleet_pipeline()``: its own state_dict keys -> the module's keys (by identity)."""
    from lightning_fleet.runtime.pipeline import pipeline_hook

    spec = pipeline_hook(module)
    if spec is None:
        raise FleetError(f"{type(module).__name__} has no fleet_pipeline() hook; a pipeline checkpoint of it cannot be mapped")
    owners: dict[int, str] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        owners.setdefault(id(tensor), key)
    layers = []
    for layer in spec["layers"]:
        local = layer.state_dict(keep_vars=True) if isinstance(layer, nn.Module) else {}
        layers.append({name: owners[id(t)] for name, t in local.items() if id(t) in owners})
    return layers


def _layer_owners(layer_keys: list[dict[str, str]]) -> dict[str, tuple[int, str]]:
    """Module key -> (first pipeline layer index holding it, its name in that layer)."""
    owners: dict[str, tuple[int, str]] = {}
    for index, mapping in enumerate(layer_keys):
        for local, key in mapping.items():
            owners.setdefault(key, (index, local))
    return owners


def _pipeline_state(
    engine: Any, module: nn.Module, infos: Iterable[TensorInfo], device: torch.device, masters: Mapping[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each stage gathers its own layers (over its data-parallel group), then broadcasts every key from its owner."""
    import torch.distributed as dist

    pipe, grid = engine.module, engine.grid
    owners = _layer_owners(pipeline_layer_keys(module))
    stage = grid.get_stage_id()
    first, last = pipe.parts[stage], pipe.parts[stage + 1]
    local: dict[str, torch.Tensor] = {}
    children = dict(pipe.named_children())  # DeepSpeed registers layer i as child "i"
    for index in range(first, last):
        layer = children.get(str(index))
        if layer is None:
            continue
        named, params = _named_tensors(layer), {id(p) for p in layer.parameters()}
        for key, (owner, name) in owners.items():
            if owner == index and key not in local:
                local[key] = _full_value(named[name], id(named[name]) in params, masters)
    out: dict[str, torch.Tensor] = {}
    current = module.state_dict()
    for info in infos:
        if info.alias_of is not None:
            out[info.key] = out[info.alias_of]
            continue
        owner = owners.get(info.key)
        source = 0 if owner is None else _stage_of(pipe.parts, owner[0])
        src_rank = grid.stage_to_global(stage_id=source, data=0)
        dtype = torch.float32 if _is_floating(info.dtype) else getattr(torch, info.dtype)
        if owner is None:
            value = current[info.key].to(device, dtype) if dist.get_rank() == src_rank else None
        else:
            value = local[info.key].to(device, dtype) if info.key in local else None
        buffer = value.contiguous() if value is not None else torch.empty(info.shape, dtype=dtype, device=device)
        dist.broadcast(buffer, src=src_rank)
        out[info.key] = _as_export(buffer)
    return out


def _stage_of(parts: list[int], layer: int) -> int:
    return next(s for s in range(len(parts) - 1) if parts[s] <= layer < parts[s + 1])


def _is_floating(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point


# --- live: hand the user's module back -------------------------------------------------------------


def restore_module(strategy: Any, record: ModuleRecord) -> None:
    """End of fit (collective): the strategy's LightningModule becomes a plain module again, with the trained weights.

    AutoTP's layers are replaced by the original ones, every parameter becomes an ordinary full tensor on the CPU in its
    original dtype (fresh objects: DeepSpeed's partitioned ones stay with the engine), buffers are whole,
    DeepSpeed's hooks and attributes are gone and the user's own hooks are kept. Every rank ends with the same
    weights (pipeline stages included). The engine goes on training nothing but keeps a mirror of the tree it
    trained, so saving a checkpoint afterwards writes what it would have written before. Calling it again is a no-op.
    """
    engine = _engine_of(strategy)
    if engine is None or getattr(engine, _RESTORED, False):
        return
    full = full_state_dict(strategy, record)
    _hand_engine_its_mirror(engine)
    # on the CPU, where Lightning's teardown puts a trained module anyway: a model that needed its parameters
    # partitioned to train would not fit on one accelerator whole
    _restore_tree(record, full, torch.device("cpu"))
    setattr(engine, _RESTORED, True)


def mirror_module(module: nn.Module) -> tuple[nn.Module, dict[int, nn.Module]]:
    """A copy of the module tree for the engine to keep: every module object shallow-copied (tensors shared, hook
    dicts copied). Returns the copy of ``module`` and original id -> copy for every module of the tree."""
    memo: dict[int, nn.Module] = {}

    def twin_of(original: nn.Module) -> nn.Module:
        if id(original) in memo:
            return memo[id(original)]
        twin = copy.copy(original)
        memo[id(original)] = twin
        twin.__dict__["_modules"] = OrderedDict((n, None if c is None else twin_of(c)) for n, c in original._modules.items())
        for attr in _HOOK_DICTS:  # the engine's copy keeps DeepSpeed's hooks; the user's module loses them in place
            if attr in original.__dict__:
                twin.__dict__[attr] = OrderedDict(original.__dict__[attr])
        for name, value in list(twin.__dict__.items()):  # methods DeepSpeed bound to the module (ds_external_parameters)
            if isinstance(value, types.MethodType) and value.__self__ is original:
                twin.__dict__[name] = types.MethodType(value.__func__, twin)
        return twin

    root = twin_of(module)
    for twin in memo.values():
        funcs = twin.__dict__.get("forward_funcs")  # DeepSpeed's PipelineModule runs its layers from this list
        if isinstance(funcs, list):
            twin.__dict__["forward_funcs"] = [memo.get(id(f), f) for f in funcs]
    return root, memo


def _hand_engine_its_mirror(engine: Any) -> None:
    """Point the engine and the DeepSpeed objects that hold the module (ZeRO-3's optimizer and its parameter offload,
    deepspeed/runtime/zero/stage3.py and parameter_offload.py ``self.module``) at a mirror of the tree."""
    root, memo = mirror_module(engine.module)
    optimizer = getattr(engine, "optimizer", None)
    holders = [engine, optimizer, getattr(optimizer, "parameter_offload", None), getattr(optimizer, "optimizer", None)]
    for holder in [h for h in holders if h is not None]:
        for name, value in list(vars(holder).items()):
            if isinstance(value, nn.Module) and id(value) in memo:
                holder.__dict__[name] = memo[id(value)]
    engine._modules["module"] = root  # DeepSpeedEngine._set_client_model keeps it in both places
    engine.__dict__["module"] = root


def _restore_tree(record: ModuleRecord, full: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Put every recorded module object back as it was, with fresh full tensors from ``full``."""
    dtypes = {info.key: getattr(torch, info.dtype) for info in record.tensors}
    fresh: dict[str, nn.Parameter] = {}

    def param(module: nn.Module, name: str, key: str | None, grad: bool) -> nn.Parameter | None:
        if key is None or key not in full:  # None, or a parameter the state_dict never showed: leave it
            return module._parameters.get(name)
        if key not in fresh:  # tied parameters share one fresh Parameter
            fresh[key] = nn.Parameter(full[key].to(device=device, dtype=dtypes[key]).clone(), requires_grad=grad)
        return fresh[key]

    def buffer(module: nn.Module, name: str, key: str | None, dtype: torch.dtype | None) -> torch.Tensor | None:
        value = full[key] if key is not None and key in full else module._buffers.get(name)
        return None if value is None else value.to(device=device, dtype=dtype or value.dtype).clone()

    for entry in record.entries:
        module = entry.module
        module.__dict__["_modules"] = OrderedDict(entry.children)
        module.__dict__["_parameters"] = OrderedDict((name, param(module, name, key, grad)) for name, key, grad in entry.params)
        module.__dict__["_buffers"] = OrderedDict((name, buffer(module, name, key, dtype)) for name, key, dtype in entry.buffers)
        module.__dict__["_non_persistent_buffers_set"] = set(entry.non_persistent)
        for attr, items in entry.hooks:
            _keep_only(module.__dict__[attr], dict(items))
        for attr in [a for a in module.__dict__ if a not in entry.attributes and _is_deepspeed_attribute(a)]:
            del module.__dict__[attr]


def _is_deepspeed_attribute(name: str) -> bool:
    return name.startswith(("ds_", "_ds_")) or name in _DEEPSPEED_ATTRIBUTES


def _keep_only(hooks: dict, recorded: dict) -> None:
    """Reduce a hook dict to the recorded hooks, in place (so the user's RemovableHandles keep working)."""
    for handle_id in [k for k in hooks if k not in recorded]:
        del hooks[handle_id]
    for handle_id, hook in recorded.items():
        hooks.setdefault(handle_id, hook)


# --- the layout, written next to DeepSpeed's files on every save -------------------------------------


def write_layout(strategy: Any, directory: str | Path, record: ModuleRecord | None) -> Path | None:
    """Write ``fleet_layout.json`` (and, under pipeline parallelism, ``fleet_unstaged.pt``) into a DeepSpeed
    checkpoint directory, after the engine saved. Every rank calls it (a collective where ZeRO-0 keeps fp32 masters in
    DeepSpeed's fp16/bf16 optimizer wrapper: each model-parallel rank says which parameters its groups hold); rank 0
    writes. Returns the layout's path on rank 0; None elsewhere or when the strategy has no plan (nothing trained)."""
    plan = getattr(strategy, "plan", None)
    if plan is None:
        return None
    directory = Path(directory)
    module, engine = strategy.lightning_module, _engine_of(strategy)
    if engine is None:
        return None
    wrapper_groups = _wrapper_groups(engine)
    if int(strategy.global_rank) != 0:
        return None
    restored = getattr(engine, _RESTORED, False)
    infos = record.tensors if record is not None else _live_infos(module, engine)
    layout: dict[str, Any] = {
        "format": LAYOUT_FORMAT,
        "plan": str(plan),
        "world_size": int(strategy.world_size),
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "zero": plan.zero,
        "tag": TAG,
        "tensors": [info.to_json() for info in infos],
        "tensor_parallel": {},
        "pipeline": None,
    }
    if plan.tp > 1:
        view = engine.module  # the engine's own tree: AutoTP layers, before or after restore_module
        layout["tensor_parallel"] = {key: dim for key, (dim, _) in _tensor_parallel_splits(view).items()}
    if plan.pp > 1:
        layers = pipeline_layer_keys(module)
        covered = {key for mapping in layers for key in mapping.values()}
        unstaged = [i.key for i in infos if i.alias_of is None and i.key not in covered]
        layout["pipeline"] = {"layers": layers, "unstaged": unstaged}
        if unstaged:
            current = module.state_dict()
            _save_atomic({k: _as_export(current[k]) for k in unstaged}, directory / UNSTAGED)
    layout["restored"] = bool(restored)
    layout["wrapper_masters"] = wrapper_groups
    write_atomic(directory / LAYOUT, json.dumps(layout, indent=1))
    return directory / LAYOUT


def _wrapper_groups(engine: Any) -> list[list[list[Any]]] | None:
    """ZeRO-0 under fp16/bf16 mixed precision (collective): for each model-parallel rank (its ``mp_rank_XX`` model-states
    file, whose ``optimizer`` entry holds the wrapper's fp32 masters), each optimizer group's parameters as
    ``[DeepSpeed name, shape]`` in the group's order. None (on every rank, no communication) for any other optimizer."""
    import torch.distributed as dist

    groups = _wrapper_masters(getattr(engine, "optimizer", None))
    if not groups:
        return None
    names: dict[int, str] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    mine = [[[names.get(id(param)), list(param.shape)] for param, _ in group] for group in groups]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (int(getattr(engine, "checkpoint_mp_rank", 0)), mine))
    by_rank: dict[int, list[list[list[Any]]]] = {}
    for mp, entry in everyone:
        by_rank.setdefault(mp, entry)  # data-parallel replicas of one model-parallel rank hold the same groups
    return [by_rank[mp] for mp in sorted(by_rank)]


def _save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary file, fsync, rename into place, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


# --- offline: a checkpoint directory -> the full state_dict ------------------------------------------


@dataclass(frozen=True, slots=True)
class Source:
    """A checkpoint located, verified and its layout read."""

    path: Path
    """What the user gave."""
    deepspeed_dir: Path
    """The DeepSpeed checkpoint directory (holds the layout, ``latest`` and the tag directory)."""
    layout: Mapping[str, Any]
    """The parsed ``fleet_layout.json``."""

    @property
    def files(self) -> Path:
        """The tag directory holding DeepSpeed's files."""
        return self.deepspeed_dir / str(self.layout["tag"])


def locate(checkpoint: str | Path) -> Source:
    """Find the DeepSpeed checkpoint and its layout under ``checkpoint``: a FleetCheckpoint step dir (its manifest is
    verified first), a FleetCheckpoint directory (its newest verified step), a step's ``state/`` dir, or a
    ``trainer.save_checkpoint`` dir. Raises FleetError (one line) for anything else."""
    path = Path(checkpoint)
    if not path.exists():
        raise FleetError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise FleetError(
            f"{path} is a file; give a checkpoint directory (a FleetCheckpoint step-N dir, its state/ dir or a "
            "trainer.save_checkpoint dir)"
        )
    if (path / MANIFEST).is_file():
        verdict = verify(path)
        if not verdict.ok:
            raise FleetError(f"checkpoint {path} cannot be exported: {verdict.reason}")
        return Source(path, path / "state", _read_layout(path / "state"))
    if not (path / LAYOUT).is_file() and any(p.is_dir() and p.name.startswith("step-") for p in path.iterdir()):
        verdict = newest_verified(path, log=lambda line: None)
        if verdict is None:
            raise FleetError(f"checkpoint directory {path} holds no step-N checkpoint whose manifest verifies")
        return locate(verdict.path)
    return Source(path, path, _read_layout(path))


def _read_layout(directory: Path) -> dict[str, Any]:
    layout_path = directory / LAYOUT
    if not layout_path.is_file():
        if (directory / "latest").is_file() or (directory / TAG).is_dir():
            raise FleetError(
                f"{directory} is a DeepSpeed checkpoint without {LAYOUT} (saved by another strategy or an older "
                "lightning_fleet): for a data-parallel one use Lightning's convert_zero_checkpoint_to_fp32_state_dict, "
                "or save it again with strategy 'fleet'"
            )
        if any(directory.glob("*model_states.pt")):
            raise FleetError(
                f"{directory} holds DeepSpeed's files of one tag; give the checkpoint directory above it, {directory.parent}"
            )
        raise FleetError(f"{directory} is not a checkpoint: no {MANIFEST}, no {LAYOUT}, no DeepSpeed files")
    try:
        layout = json.loads(layout_path.read_text())
    except ValueError:
        raise FleetError(f"{layout_path} is not valid JSON (corrupted); use another checkpoint") from None
    if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT:
        found = layout.get("format") if isinstance(layout, dict) else None
        raise FleetError(
            f"{layout_path} has layout format {found!r}; this lightning_fleet reads {LAYOUT_FORMAT!r}: "
            "export it with the version that wrote it"
        )
    return layout


def _safe_globals() -> list[Any]:
    """The checkpoint module's allowlist as objects for ``torch.serialization.safe_globals``."""
    found = []
    for dotted in sorted(SAFE_GLOBALS):
        module_name, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue  # e.g. a DeepSpeed class in a DeepSpeed without it: such a file cannot hold it either
    return found


def _load(path: Path, allowed: list[Any]) -> Any:
    """torch.load(weights_only=True) with the allowlist, memory-mapped when the file is torch.save's zip archive (a
    tensor's bytes are read only when something uses them); a missing, unreadable or refused file is one FleetError line."""
    if not path.is_file():
        raise FleetError(
            f"checkpoint is incomplete: {path} is missing (a save that did not finish, or a partial copy); use another checkpoint"
        )
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:  # weights_only refused a global, or the pickle itself is damaged
        refused = _refused_globals(path, allowed)
        if refused:
            raise FleetError(_refusal(path, refused)) from None
        raise FleetError(_unreadable(path, err)) from None
    except Exception as err:  # truncated zip, flipped bytes
        raise FleetError(_unreadable(path, err)) from None


def _unreadable(path: Path, err: Exception) -> str:
    text = _ANSI.sub("", str(err)).strip()
    reason = text.splitlines()[0] if text else type(err).__name__
    return f"cannot read {path} ({reason[:200]}): truncated, corrupted or not a checkpoint file"


def _refused_globals(path: Path, allowed: list[Any]) -> list[str]:
    """The globals the file's pickles would import that neither the allowlist nor torch's own (dtypes, storages) nor
    ``torch.serialization.add_safe_globals`` admit; empty when the file cannot be scanned."""
    try:
        found = torch_file_globals(path)
    except Exception:  # not a zip of pickles nor a pickle: damaged
        return []
    admitted = set(SAFE_GLOBALS) | {_dotted(g) for g in [*allowed, *torch.serialization.get_safe_globals()]}
    return sorted(g for g in found if g not in admitted and not _TORCH_TYPE.match(g))


def _dotted(entry: Any) -> str:
    """``module.name`` of an allowlist entry (an object, or an (object, name) pair as add_safe_globals takes)."""
    if isinstance(entry, tuple):
        return str(entry[1])
    return f"{entry.__module__}.{entry.__qualname__}"


def _refusal(path: Path, refused: list[str]) -> str:
    names = ", ".join(name.rpartition(".")[2] for name in refused)
    return (
        f"cannot read {path}: it would import {', '.join(refused)} when loaded, which torch.load(weights_only=True) refuses "
        "(it could run code): keep hyper-parameters to plain types (str, int, float, bool, None, lists, dicts: str(path), "
        f"enum.value) or leave them out with save_hyperparameters(ignore=[...]); if you trust the class, call "
        f"torch.serialization.add_safe_globals([{names}]) before reading"
    )


def export_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The full weights of a checkpoint written under any plan, keyed and shaped like the original module's
    ``state_dict()`` (buffers included); floating tensors in fp32. Raises FleetError (one line) on bad input.

    Files are memory-mapped and read one after another; only the weights are copied out (optimizer moments are never
    read), so the peak memory is about the exported weights plus the part of one file they come from."""
    return _export(locate(checkpoint))[0]


def _export(source: Source) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, Lightning's client state from the first model-states file)."""
    layout, allowed = source.layout, _safe_globals()
    reader = _Reader(source.files, layout, allowed)
    # DeepSpeed saves its fp32 groups with requires_grad=True: a copy out of them under autograd would keep a graph node
    # holding the source tensor, and with it the whole memory-mapped file
    with torch.no_grad():
        if int(layout["pp"]) > 1:
            named = _from_pipeline(reader.pipeline_values(), layout)
        else:
            named = _from_replicas(reader, layout)
        return _assemble(named, layout, source.deepspeed_dir), reader.client_state()


_CLIENT_KEYS = ("pytorch-lightning_version", "epoch", "global_step", "hyper_parameters", "hparams_name")


class _Reader:
    """Reads the DeepSpeed files of one checkpoint, knowing their names from the layout: each file memory-mapped when
    needed, what is wanted copied out, the file let go before the next one (nothing is cached)."""

    def __init__(self, files: Path, layout: Mapping[str, Any], allowed: list[Any]) -> None:
        self.files, self.layout, self.allowed = files, layout, allowed
        self.dp, self.zero = int(layout["dp"]), int(layout["zero"])
        self._client: dict[str, Any] | None = None

    def load(self, name: str) -> Any:
        return _load(self.files / name, self.allowed)

    def model_states(self, mp: int, dp: int = 0) -> dict[str, Any]:
        """The model-states file of model-parallel rank ``mp`` (ZeRO-3: of data-parallel rank ``dp`` too)."""
        name = f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt" if self.zero == 3 else f"mp_rank_{mp:02d}_model_states.pt"
        states = self.load(name)
        if mp == 0 and dp == 0 and self._client is None:
            self._client = {key: states[key] for key in _CLIENT_KEYS if key in states}
        return states

    def client_state(self) -> dict[str, Any]:
        """What Lightning saved next to the weights (version, epoch, step, hyper-parameters), from the first file."""
        if self._client is None:
            self.model_states(0)
        return self._client or {}

    def optim_names(self, mp: int) -> list[str]:
        """The optimizer shard files of model-parallel rank ``mp``, data-parallel rank 0..dp-1 (bf16 runs prefix them);
        at ZeRO-0 only DeepSpeed's bf16 optimizer writes them (else none)."""
        plain = f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt"
        prefix = "bf16_" if not (self.files / plain).is_file() and (self.files / f"bf16_{plain}").is_file() else ""
        if self.zero == 0 and not (self.files / f"{prefix}{plain}").is_file():
            return []
        return [f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt" for d in range(self.dp)]

    def masters(
        self, mp: int, shapes: Mapping[str, tuple[int, ...]], states: Mapping[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """The fp32 master weights of model-parallel rank ``mp`` keyed by DeepSpeed's parameter names (empty when it keeps
        none); ``shapes`` gives the shapes of the parameters the optimizer files name without one (ZeRO 1/2, bf16
        optimizer); ``states``: its model-states file when already read."""
        if self.zero == 3:
            return self._zero3_masters(mp)
        names = self.optim_names(mp)
        if names:  # ZeRO 1/2, or DeepSpeed's bf16 optimizer (ZeRO-0 pipeline under bf16)
            return _sliced_merge((self.load(name)["optimizer_state_dict"] for name in names), shapes)
        wrapper = self.layout.get("wrapper_masters")
        if wrapper:  # ZeRO-0 under fp16/bf16 mixed precision: the model-states file holds the wrapper's masters
            states = states if states is not None else self.model_states(mp)
            return _wrapper_merge(states.get("optimizer"), wrapper[mp])
        return {}

    def _zero3_masters(self, mp: int) -> dict[str, torch.Tensor]:
        first = self.model_states(mp)
        param_shapes, frozen_shapes = first["param_shapes"], first.get("frozen_param_shapes") or {}
        del first
        partitions = (self.load(name)["optimizer_state_dict"]["fp32_flat_groups"] for name in self.optim_names(mp))
        merged = _zero3_merge(param_shapes, partitions, self.dp)
        merged.update(self._zero3_frozen(mp, frozen_shapes))
        return merged

    def _zero3_frozen(self, mp: int, shapes: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Parameters no optimizer owns: each data-parallel rank's model-states file holds a fragment."""
        if not shapes:
            return {}
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
        for d in range(self.dp):
            fragments = self.model_states(mp, d).get("frozen_param_fragments") or {}
            for name in shapes:
                pieces[name].append(fragments[name].flatten().clone())
        return {
            name: torch.cat(pieces[name]).narrow(0, 0, math.prod(shape)).view(tuple(shape)) for name, shape in shapes.items()
        }

    def replica_values(self, mp: int) -> dict[str, torch.Tensor]:
        """Everything model-parallel rank ``mp`` holds, by DeepSpeed name: its fp32 masters, and the module state of
        what has none (buffers, frozen or unmastered parameters), copied out so that the file is let go on return."""
        states = self.model_states(mp)
        module = states.get("module") or {}
        values = self.masters(mp, {name: tuple(t.shape) for name, t in module.items()}, states)
        values.update({name: t.detach().clone() for name, t in module.items() if name not in values})
        return values

    def pipeline_values(self) -> dict[str, torch.Tensor]:
        """Every pipeline layer's tensors by ``"<layer index>.<name in the layer>"`` (DeepSpeed's names): the fp32
        masters, and the layer files' tensors that have none (each layer file is read for its shapes first, then again
        for what is left, one file at a time)."""
        layers = [index for index, mapping in enumerate(self.layout["pipeline"]["layers"]) if mapping]
        shapes: dict[str, tuple[int, ...]] = {}
        for index in layers:
            shapes.update({f"{index}.{name}": tuple(t.shape) for name, t in self._layer(index).items()})
        values: dict[str, torch.Tensor] = {}
        for stage in range(int(self.layout["pp"])):
            values.update(self.masters(stage, shapes))
        for index in layers:
            values.update(_copied_except(self._layer(index), f"{index}.", values))
        return values

    def _layer(self, index: int) -> dict[str, torch.Tensor]:
        return self.load(f"layer_{index:02d}-model_states.pt")


def _copied_except(tensors: Mapping[str, torch.Tensor], prefix: str, have: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of the tensors whose prefixed name is not in ``have`` (so that the file they map can be let go)."""
    return {prefix + name: t.detach().clone() for name, t in tensors.items() if prefix + name not in have}


def _sliced_merge(shards: Iterable[Mapping[str, Any]], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """ZeRO 1/2 and the bf16 optimizer: each data-parallel rank holds one slice of every flat fp32 group and names the
    fragment of each parameter in it (``param_slice_mappings``: numel, start); a parameter is its fragments in rank order.
    Shards are taken one at a time: each is copied into the whole parameters and let go before the next is read."""
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for shard in shards:
        _copy_fragments(shard, shapes, out, filled)
    for name, whole in out.items():
        if filled[name] != whole.numel():
            raise FleetError(
                f"optimizer shards hold {filled[name]} elements of {name}, the module {shapes[name]}: "
                "the files do not belong together"
            )
    return {name: whole.view(shapes[name]) for name, whole in out.items()}


def _copy_fragments(
    shard: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], out: dict[str, torch.Tensor], filled: dict[str, int]
) -> None:
    """Copy one data-parallel rank's fragments into the flat whole parameters ``out`` (``filled``: elements so far)."""
    if "param_slice_mappings" not in shard:
        raise FleetError(
            "optimizer shard has no param_slice_mappings (written by another DeepSpeed version): "
            "its fp32 weights cannot be mapped"
        )
    for flat, mapping in zip(shard["single_partition_of_fp32_groups"], shard["param_slice_mappings"]):
        for name, fragment in mapping.items():
            start, numel = filled.get(name, 0), int(fragment.numel)
            whole = out.get(name)
            if whole is None:
                whole = out[name] = torch.empty(math.prod(_shape_of(shapes, name)), dtype=flat.dtype)
            if start + numel > whole.numel():
                raise FleetError(
                    f"optimizer shards hold more than {whole.numel()} elements of {name}, the module "
                    f"{_shape_of(shapes, name)}: the files do not belong together"
                )
            whole.narrow(0, start, numel).copy_(flat.narrow(0, int(fragment.start), numel))
            filled[name] = start + numel


def _shape_of(shapes: Mapping[str, tuple[int, ...]], name: str) -> tuple[int, ...]:
    if name not in shapes:
        raise FleetError(f"optimizer shards hold {name}, which the module does not: the files do not belong together")
    return shapes[name]


def _zero3_merge(
    param_shapes: list[Mapping[str, Any]], partitions: Iterable[list[torch.Tensor]], world: int
) -> dict[str, torch.Tensor]:
    """ZeRO-3: every parameter is split into ``world`` pieces of ceil(numel/world) elements, each rank holding its
    pieces of all parameters back to back (deepspeed/utils/zero_to_fp32.py ``_zero3_merge_trainable_params``).
    Partitions are taken one rank at a time, copied into the whole parameters and let go before the next."""
    shapes = [(name, tuple(int(n) for n in shape)) for group in param_shapes for name, shape in group.items()]
    pieces = [math.ceil(math.prod(shape) / world) for _, shape in shapes]
    out: dict[str, torch.Tensor] = {}
    ranks = 0
    for rank, groups in enumerate(partitions):
        _copy_pieces(rank, [g.flatten() for g in groups], shapes, pieces, out, world)
        ranks = rank + 1
    if ranks != world:
        raise FleetError(f"ZeRO-3 checkpoint holds {ranks} partitions, its layout says {world}: the files do not belong together")
    return {name: out[name].narrow(0, 0, math.prod(shape)).view(shape) for name, shape in shapes}


def _copy_pieces(
    rank: int,
    groups: list[torch.Tensor],
    shapes: list[tuple[str, tuple[int, ...]]],
    pieces: list[int],
    out: dict[str, torch.Tensor],
    world: int,
) -> None:
    """Copy one rank's ZeRO-3 partition (its pieces of every parameter, back to back over its flat groups taken as one)
    into the whole parameters."""
    held = sum(g.numel() for g in groups)
    if sum(pieces) > held:
        raise FleetError(
            f"ZeRO-3 partitions hold {held} elements a rank but the parameters need {sum(pieces)}: "
            "the shards do not belong together"
        )
    offset = 0
    for (name, _), piece in zip(shapes, pieces):
        whole = out.setdefault(name, torch.empty(piece * world, dtype=groups[0].dtype))
        target = whole.narrow(0, rank * piece, piece)
        for start, part in _spans(groups, offset, piece):
            target.narrow(0, start, part.numel()).copy_(part)
        offset += piece


def _spans(groups: list[torch.Tensor], offset: int, length: int) -> list[tuple[int, torch.Tensor]]:
    """The elements ``offset .. offset+length`` of the groups concatenated, as (position in that range, view) pairs
    (usually one), without concatenating anything."""
    spans, start = [], 0
    for group in groups:
        end = start + group.numel()
        low, high = max(offset, start), min(offset + length, end)
        if low < high:
            spans.append((low - offset, group.narrow(0, low - start, high - low)))
        start = end
    return spans


def _wrapper_merge(saved: Any, groups: list[list[list[Any]]]) -> dict[str, torch.Tensor]:
    """ZeRO-0's fp16/bf16 optimizer wrapper: the fp32 masters its ``state_dict()`` put into the model-states file's
    ``optimizer`` entry (FP16_Optimizer: ``fp32_groups_flat``, one flat tensor per group; FP16_UnfusedOptimizer:
    ``fp32_groups``, one tensor per parameter), keyed by the ``[name, shape]`` the layout recorded for each group."""
    if not isinstance(saved, Mapping) or not ({"fp32_groups_flat", "fp32_groups"} & set(saved)):
        raise FleetError(
            f"a model-states file holds no fp32 master weights although its {LAYOUT} records them: the files do not match"
        )
    if "fp32_groups_flat" in saved:
        tensors = [_unflat(flat, [shape for _, shape in group]) for flat, group in zip(saved["fp32_groups_flat"], groups)]
    else:
        tensors = [list(masters) for masters in saved["fp32_groups"]]
    if [len(t) for t in tensors] != [len(g) for g in groups]:
        raise FleetError(f"the fp32 master groups do not hold the parameters its {LAYOUT} records: the files do not match")
    out: dict[str, torch.Tensor] = {}
    for group, masters in zip(groups, tensors):
        for (name, shape), master in zip(group, masters):
            if tuple(master.shape) != tuple(shape):
                raise FleetError(f"fp32 master of {name} has shape {tuple(master.shape)}, its {LAYOUT} says {tuple(shape)}")
            if name is not None:
                out.setdefault(name, master.detach().clone())  # copied out: the file is let go
    return out


def _from_replicas(reader: _Reader, layout: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Non-pipeline plans: DeepSpeed's names are the module's keys; AutoTP shards concatenated along their dim."""
    tp = int(layout["tp"])
    shards = [reader.replica_values(mp) for mp in range(tp)]
    splits = layout["tensor_parallel"]
    out = {}
    for key in list(shards[0]):
        if key in splits:
            parts = [_required(shard, key, f"tensor-parallel rank {mp}") for mp, shard in enumerate(shards)]
            out[key] = torch.cat(parts, dim=int(splits[key]))
            for shard in shards:
                del shard[key]  # its pieces go as soon as the whole is built
        else:
            out[key] = shards[0].pop(key)
    return out


def _from_pipeline(values: dict[str, torch.Tensor], layout: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Pipeline plans: each module key from the first layer that holds it."""
    out: dict[str, torch.Tensor] = {}
    for index, mapping in enumerate(layout["pipeline"]["layers"]):
        for local, key in mapping.items():
            if key not in out:
                out[key] = _required(values, f"{index}.{local}", f"pipeline layer {index}")
    return out


def _required(values: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in values:
        raise FleetError(f"checkpoint lacks {name} of {where}; the files do not match their {LAYOUT}")
    return values[name]


def _assemble(named: dict[str, torch.Tensor], layout: Mapping[str, Any], directory: Path) -> dict[str, torch.Tensor]:
    """The original state_dict: every recorded key, in order, with its recorded shape; aliases share their tensor.
    Takes the tensors out of ``named`` as it goes (each source is let go once its export copy exists)."""
    pipeline = layout.get("pipeline") or {}
    unstaged = _load(directory / UNSTAGED, _safe_globals()) if pipeline.get("unstaged") else {}
    out: dict[str, torch.Tensor] = {}
    for entry in layout["tensors"]:
        info = TensorInfo.from_json(entry)
        if info.alias_of is not None:
            out[info.key] = out[info.alias_of]
            continue
        value = named.pop(info.key, None)
        value = unstaged.get(info.key) if value is None else value
        if value is None:
            raise FleetError(f"checkpoint lacks {info.key}; the files do not match their {LAYOUT}")
        if tuple(value.shape) != info.shape:
            raise FleetError(
                f"checkpoint holds {info.key} with shape {tuple(value.shape)} but the module's is {info.shape}: "
                f"the files do not match their {LAYOUT}"
            )
        out[info.key] = _as_export(value)
    return out


# --- offline: one file loadable without lightning_fleet ----------------------------------------------


def export_checkpoint(checkpoint: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's full weights as one Lightning-style file (:func:`lightning_checkpoint`), atomically:
    ``MyModule.load_from_checkpoint(out_file)`` and ``torch.load(out_file, weights_only=True)`` read it."""
    out = Path(out_file)
    _save_atomic(lightning_checkpoint(checkpoint), out)
    return out


def lightning_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint written under any plan as one Lightning-style dict of plain types and tensors: ``state_dict`` (full
    weights), ``hyper_parameters`` (when the module saved them; paths as str), ``pytorch-lightning_version``, ``epoch``,
    ``global_step`` and ``lightning_fleet`` (plan and source)."""
    source = locate(checkpoint)
    state_dict, client = _export(source)
    payload: dict[str, Any] = {
        "state_dict": state_dict,
        "pytorch-lightning_version": str(client.get("pytorch-lightning_version", "")),
        "epoch": int(client.get("epoch", 0)),
        "global_step": int(client.get("global_step", 0)),
        "lightning_fleet": {"plan": str(source.layout["plan"]), "source": str(source.path.resolve()), "layout": LAYOUT_FORMAT},
    }
    if client.get("hyper_parameters") is not None:
        payload["hyper_parameters"] = _plain(client["hyper_parameters"])
        if client.get("hparams_name") is not None:
            payload["hparams_name"] = str(client["hparams_name"])
    return payload


def _plain(value: Any) -> Any:
    """Hyper-parameters as types ``torch.load(weights_only=True)`` reads anywhere: containers as plain dict/list (Lightning
    may keep them in its own dict types), paths as str, argparse Namespaces as dicts (as Lightning's own
    ``save_hyperparameters`` stores a Namespace)."""
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value) if isinstance(value, tuple) else [_plain(v) for v in value]
    return value
