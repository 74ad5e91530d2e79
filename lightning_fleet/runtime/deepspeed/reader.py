"""Offline: a DeepSpeed checkpoint directory and its layout -> the full state_dict (no process group, no model code).

:func:`read` covers any plan (ZeRO 0-3, offload, AutoTP tensor parallel, DeepSpeed pipeline, and their data-parallel
products). Every file is read by the restricted unpickler (elastic/safe_load.py), memory-mapped, one after
another; only the weights are copied out (optimizer moments are never read). Trainable parameters are DeepSpeed's fp32
masters wherever it keeps them (ZeRO 1/2 and bf16-optimizer shards, ZeRO-3 partitions, the model-states file of
ZeRO-0's fp16/bf16 optimizer wrapper), so a mixed-precision run exports full precision. What DeepSpeed's files do not
say (split dims, pipeline layer keys, wrapper groups, the original keys, shapes and dtypes) comes from the layout that
:func:`lightning_fleet.runtime.deepspeed.weights.write_layout` wrote next to them.

Imports torch and elastic/safe_load.py (which admits DeepSpeed's classes by name, when present). Imported by
:mod:`lightning_fleet.export` (and its tests).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from lightning_fleet.elastic.layout import DEEPSPEED_LATEST, EXPORT_LAYOUT, TAG, UNSTAGED
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.deepspeed.weights import TensorInfo, as_export, unflat

_CLIENT_KEYS = ("pytorch-lightning_version", "epoch", "global_step", "hyper_parameters", "hparams_name")


def read(directory: Path, layout: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full weights of the DeepSpeed checkpoint in ``directory`` (``latest``, the tag directory and the layout),
    keyed and shaped like the original module's ``state_dict()`` (floating tensors fp32), and what Lightning saved next
    to them in the first model-states file (version, epoch, step, hyper-parameters). Raises FleetError (one line) for
    a missing, damaged or mismatched file."""
    reader = _Reader(directory / str(layout["tag"]), layout)
    # DeepSpeed saves its fp32 groups with requires_grad=True: a copy out of them under autograd would keep a graph node
    # holding the source tensor, and with it the whole memory-mapped file
    with torch.no_grad():
        if int(layout["pp"]) > 1:
            named = _from_pipeline(reader.pipeline_values(), layout)
        else:
            named = _from_replicas(reader, layout)
        return _assemble(named, layout, directory), reader.client_state()


def without_layout(directory: Path) -> str | None:
    """Why ``directory`` cannot be read when it holds DeepSpeed's files but no layout (one line), else None."""
    if (directory / DEEPSPEED_LATEST).is_file() or (directory / TAG).is_dir():
        return (
            f"{directory} is a DeepSpeed checkpoint without {EXPORT_LAYOUT} (saved by another strategy or an older "
            "lightning_fleet): for a data-parallel one use Lightning's convert_zero_checkpoint_to_fp32_state_dict, "
            "or save it again with strategy 'fleet'"
        )
    if any(directory.glob("*model_states.pt")):
        return f"{directory} holds DeepSpeed's files of one tag; give the checkpoint directory above it, {directory.parent}"
    return None


# --- DeepSpeed's files, one at a time -> DeepSpeed's names -> the module's keys -------------------


class _Reader:
    """Reads the DeepSpeed files of one checkpoint, knowing their names from the layout: each file memory-mapped when
    needed, what is wanted copied out, the file let go before the next one (nothing is cached)."""

    def __init__(self, files: Path, layout: Mapping[str, Any]) -> None:
        self.files, self.layout = files, layout
        self.dp, self.zero = int(layout["dp"]), int(layout["zero"])
        self._client: dict[str, Any] | None = None

    def load(self, name: str) -> Any:
        return load_file(self.files / name, mmap=True)

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
            f"a model-states file holds no fp32 master weights although its {EXPORT_LAYOUT} records them: the files do not match"
        )
    if "fp32_groups_flat" in saved:
        tensors = [unflat(flat, [shape for _, shape in group]) for flat, group in zip(saved["fp32_groups_flat"], groups)]
    else:
        tensors = [list(masters) for masters in saved["fp32_groups"]]
    if [len(t) for t in tensors] != [len(g) for g in groups]:
        raise FleetError(f"the fp32 master groups do not hold the parameters its {EXPORT_LAYOUT} records: the files do not match")
    out: dict[str, torch.Tensor] = {}
    for group, masters in zip(groups, tensors):
        for (name, shape), master in zip(group, masters):
            if tuple(master.shape) != tuple(shape):
                raise FleetError(
                    f"fp32 master of {name} has shape {tuple(master.shape)}, its {EXPORT_LAYOUT} says {tuple(shape)}"
                )
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
        raise FleetError(f"checkpoint lacks {name} of {where}; the files do not match their {EXPORT_LAYOUT}")
    return values[name]


def _assemble(named: dict[str, torch.Tensor], layout: Mapping[str, Any], directory: Path) -> dict[str, torch.Tensor]:
    """The original state_dict: every recorded key, in order, with its recorded shape; aliases share their tensor.
    Takes the tensors out of ``named`` as it goes (each source is let go once its export copy exists)."""
    pipeline = layout.get("pipeline") or {}
    unstaged = load_file(directory / UNSTAGED, mmap=True) if pipeline.get("unstaged") else {}
    out: dict[str, torch.Tensor] = {}
    for entry in layout["tensors"]:
        info = TensorInfo.from_json(entry)
        if info.alias_of is not None:
            out[info.key] = out[info.alias_of]
            continue
        value = named.pop(info.key, None)
        value = unstaged.get(info.key) if value is None else value
        if value is None:
            raise FleetError(f"checkpoint lacks {info.key}; the files do not match their {EXPORT_LAYOUT}")
        if tuple(value.shape) != info.shape:
            raise FleetError(
                f"checkpoint holds {info.key} with shape {tuple(value.shape)} but the module's is {info.shape}: "
                f"the files do not match their {EXPORT_LAYOUT}"
            )
        out[info.key] = as_export(value)
    return out
