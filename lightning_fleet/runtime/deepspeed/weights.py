"""Live (collective, every rank calls it): a running DeepSpeed engine's full weights, the user's module handed back,
and the layout written next to every save.

:func:`full_state_dict` gathers the full weights from a running FleetStrategy; :func:`restore_module` ends a fit by
handing the user's module back in its original structure (AutoTP's replaced layers put back, ZeRO-3 partitions
gathered into ordinary tensors, DeepSpeed's hooks and attributes gone, every pipeline stage's weights on every rank).
It needs the :class:`ModuleRecord` taken by :func:`record_module` before ``deepspeed.initialize``. The DeepSpeed engine
keeps a mirror of the module tree it trained, so a ``trainer.save_checkpoint`` after the restore still writes the same
checkpoint.

What a DeepSpeed checkpoint does not say -- which tensor-parallel shard is split along which dimension, which
pipeline layer file holds which module key, which parameters ZeRO-0's fp16/bf16 optimizer wrapper holds in which
group, the original keys, shapes and dtypes -- is the *layout* (``fleet_layout.json``), written next to DeepSpeed's
files by :func:`write_layout` on every save; :mod:`lightning_fleet.runtime.deepspeed.reader` reads the files back
through it.

The record (:func:`record_module`) lives here rather than with the runtime-neutral :mod:`lightning_fleet.export`: it
exists to undo what DeepSpeed does to the module (its hooks, attributes and ZeRO-3 shapes) and only this module
consumes it; the facade stays offline-only and imports nothing live.

Imports deepspeed only inside its functions (they run beside an engine). Imported by the DeepSpeed backend, by
:mod:`lightning_fleet.runtime.deepspeed.reader` (:class:`TensorInfo`, :func:`as_export`, :func:`unflat`) and by
:mod:`lightning_fleet.export` (:data:`LAYOUT_FORMAT`).
"""

from __future__ import annotations

import copy
import json
import math
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lightning_fleet.elastic.checkpoint import write_atomic
from lightning_fleet.elastic.layout import EXPORT_LAYOUT, TAG, UNSTAGED
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime import runtime_named
from lightning_fleet.runtime.common import save_atomic

LAYOUT_FORMAT = runtime_named("deepspeed").layout_format
"""The version of the layout's content (what :func:`write_layout` writes and the DeepSpeed reader reads); its file name
and place are :data:`lightning_fleet.elastic.layout.EXPORT_LAYOUT` and :data:`~lightning_fleet.elastic.layout.UNSTAGED`."""

_RESTORED = "_fleet_restored"
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


def as_export(tensor: torch.Tensor) -> torch.Tensor:
    """Floating tensors as fp32, others as they are; detached, on the CPU, always a compact copy of its own (never a view
    into a flat group or a memory-mapped file, whose whole storage ``torch.save`` would write)."""
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to("cpu", dtype, memory_format=torch.contiguous_format, copy=True)


# --- live: gather the full weights from a running strategy -----------------------------------------


def full_state_dict(fit: Any, record: ModuleRecord | None = None) -> dict[str, torch.Tensor]:
    """The full weights of the fit's module (``fit``: a :class:`~lightning_fleet.runtime.base.FitView`) on every rank, keyed like the original ``state_dict()`` (collective).

    Trainable parameters come from DeepSpeed's fp32 master copies when it keeps them (ZeRO 1-3, its bf16 optimizer,
    and at ZeRO-0 under fp16/bf16 mixed precision its FP16 optimizer wrappers), else from the parameters themselves
    (ZeRO-3 partitions gathered); AutoTP shards are all-gathered over the tensor-parallel group and concatenated
    along their split dimension; each pipeline stage broadcasts its layers. Floating tensors are fp32, everything is
    on the CPU.
    """
    engine = _engine_of(fit)
    module = fit.module
    if engine is None or getattr(engine, _RESTORED, False):  # a plain module that holds the full weights
        return {k: as_export(v) for k, v in module.state_dict().items()}
    infos = record.tensors if record is not None else _live_infos(module, engine)
    masters = {id(param): master for group in _wrapper_masters(getattr(engine, "optimizer", None)) for param, master in group}
    device = fit.device
    if _is_pipeline(engine):
        return _pipeline_state(engine, module, infos, device, masters)
    return _replica_state(engine.module, infos, device, masters)


def _engine_of(fit: Any) -> Any:
    """The fit's DeepSpeed engine, or None when it has none (before a fit, or one of another runtime)."""
    from deepspeed import DeepSpeedEngine

    engine = getattr(fit, "engine", None)
    return engine if isinstance(engine, DeepSpeedEngine) else None


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
        return [list(zip(group, unflat(flat, [p.shape for p in group]))) for flat, group in flats]
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return [list(zip(group, masters)) for masters, group in zip(optimizer.fp32_groups, optimizer.fp16_groups)]
    return []


def unflat(flat: torch.Tensor, shapes: Iterable[Iterable[int]]) -> list[torch.Tensor]:
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
        out[info.key] = as_export(value)
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
    from lightning_fleet.hooks import pipeline_hook

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
        out[info.key] = as_export(buffer)
    return out


def _stage_of(parts: list[int], layer: int) -> int:
    return next(s for s in range(len(parts) - 1) if parts[s] <= layer < parts[s + 1])


def _is_floating(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point


# --- live: hand the user's module back -------------------------------------------------------------


def restore_module(fit: Any, record: ModuleRecord) -> None:
    """End of fit (collective): the fit's LightningModule (``fit``: a :class:`~lightning_fleet.runtime.base.FitView`) becomes a plain module again, with the trained weights.

    AutoTP's layers are replaced by the original ones, every parameter becomes an ordinary full tensor on the CPU in its
    original dtype (fresh objects: DeepSpeed's partitioned ones stay with the engine), buffers are whole,
    DeepSpeed's hooks and attributes are gone and the user's own hooks are kept. Every rank ends with the same
    weights (pipeline stages included). The engine goes on training nothing but keeps a mirror of the tree it
    trained, so saving a checkpoint afterwards writes what it would have written before. Calling it again is a no-op.
    """
    engine = _engine_of(fit)
    if engine is None or getattr(engine, _RESTORED, False):
        return
    full = full_state_dict(fit, record)
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


def write_layout(fit: Any, directory: str | Path, record: ModuleRecord | None) -> Path | None:
    """Write ``fleet_layout.json`` (and, under pipeline parallelism, ``fleet_unstaged.pt``) into a DeepSpeed
    checkpoint directory, after the engine saved. Every rank calls it (a collective where ZeRO-0 keeps fp32 masters in
    DeepSpeed's fp16/bf16 optimizer wrapper: each model-parallel rank says which parameters its groups hold); rank 0
    writes (``fit``: a :class:`~lightning_fleet.runtime.base.FitView`). Returns the layout's path on rank 0; None
    elsewhere or when the fit has no plan (nothing trained)."""
    plan = getattr(fit, "plan", None)
    if plan is None:
        return None
    directory = Path(directory)
    module, engine = fit.module, _engine_of(fit)
    if engine is None:
        return None
    wrapper_groups = _wrapper_groups(engine)
    if int(fit.global_rank) != 0:
        return None
    restored = getattr(engine, _RESTORED, False)
    infos = record.tensors if record is not None else _live_infos(module, engine)
    layout: dict[str, Any] = {
        "format": LAYOUT_FORMAT,
        "plan": str(plan),
        "world_size": int(fit.world_size),
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
            save_atomic({k: as_export(current[k]) for k in unstaged}, directory / UNSTAGED)
    layout["restored"] = bool(restored)
    layout["wrapper_masters"] = wrapper_groups
    write_atomic(directory / EXPORT_LAYOUT, json.dumps(layout, indent=1))
    return directory / EXPORT_LAYOUT


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

