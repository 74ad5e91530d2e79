"""The user's module's hooks, in one room: its layer stack, ``fleet_tensor_parallel()`` and ``fleet_pipeline()``.

All three hooks are optional and must be pure (they are called on the module itself, possibly several times); a
malformed answer is a FleetError naming the hook and the shape it must return.

``fleet_layers()``
    The layer stack (a non-empty ``nn.ModuleList`` or ``nn.Sequential``). Without it: the largest (by parameters)
    ModuleList/Sequential anywhere in the module whose children all have one type. Profiling prices per layer;
    full recomputation and the pipeline stages work on these layers.
``fleet_tensor_parallel()``
    ``{"num_heads": int, "column": [regex, ...], "row": [regex, ...]}``: the head count and which Linear weights
    tensor parallelism splits along their output (column) or input (row) dimension; optionally ``"num_kv_heads"``
    (grouped-query attention) and ``"head_dim"``, else read from a Hugging Face style ``config`` on the module or one
    of its submodules (``num_key_value_heads``, ``head_dim``), else ``num_heads`` and width / ``num_heads``.
    :func:`tensor_parallel_limits` says, per split layer, which degrees can split it (its heads or features; a fused
    query/key/value weight or a layer that is not an ``nn.Linear`` cannot be split). Optionally ``"sequence"``:
    regexes over the parameter names of the modules inside the layer stack that run on sequence shards under sequence
    parallelism (the norms): with them a runtime that runs it may plan sp=true (:func:`sequence_parallel_layout`).
    Optionally ``"per_rank"``: regexes over ``<module path>.<attribute>`` naming the integer attributes the module's
    forward reads as counts of what tensor parallelism splits (``layers.0.attn.n_heads`` for code that does
    ``q.view(b, t, self.n_heads, head_dim)``): while the module is split, each rank's value is the count divided by tp,
    and the original comes back with the module at the end of fit (:func:`per_rank_attributes`; code that reshapes with
    ``-1`` needs none, as torchtitan's and Hugging Face's do).
``fleet_pipeline()``
    ``{"layers": [nn.Module, ...], "loss_fn": fn(last_output, labels)}``: the forward pass as a sequence (each layer
    takes the previous one's output alone: :data:`PIPELINE_SHAPE`) and the loss; a training batch is then
    ``(inputs, labels)``. The layers of the layer stack (or adapters holding them) follow each other in it
    (:func:`stack_problem`).

:func:`module_hooks` sums them up as a :class:`~lightning_fleet.runtime.base.ModuleHooks` value, which a runtime's
capabilities read. Imports torch, :mod:`lightning_fleet.planning` and :mod:`lightning_fleet.runtime.base` only;
imported by profiling, the runtimes, export and the strategy.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.base import ModuleHooks, TensorParallelLimit, TensorParallelSpec


def find_layers(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The layer stack: ``fleet_layers()`` if the module has it, else the largest (by parameters) ModuleList or
    Sequential anywhere in the module whose children all have one type (a parent before its nested stacks)."""
    hook = getattr(module, "fleet_layers", None)
    if callable(hook):
        layers = hook()
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
            raise FleetError(f"{type(module).__name__}.fleet_layers() must return a non-empty nn.ModuleList or nn.Sequential")
        return layers
    return discovered_layers(module)


def discovered_layers(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The layer stack found without the hook: the largest (by parameters) ModuleList or Sequential anywhere in the
    module whose children all have one type (a parent before its nested stacks), or None."""
    stacks = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and _repeats_one_type(m)]
    sized = [(sum(p.numel() for p in m.parameters()), m) for m in stacks]
    best = max(sized, key=lambda pair: pair[0], default=(0, None))
    return best[1] if best[0] > 0 else None


def _repeats_one_type(container: nn.Module) -> bool:
    return len(container) > 0 and len({type(child) for child in container}) == 1


def tensor_parallel_hook(module: nn.Module) -> tuple[int, TensorParallelSpec] | None:
    """``fleet_tensor_parallel()`` as (num_heads, patterns), or None when the module has no such hook."""
    spec = _tensor_parallel_answer(module)
    return None if spec is None else (int(spec["num_heads"]), _patterns(spec))


def _patterns(spec: dict[str, Any]) -> TensorParallelSpec:
    return TensorParallelSpec(column=tuple(spec["column"]), row=tuple(spec["row"]), sequence=tuple(spec.get("sequence") or ()))


def _tensor_parallel_answer(module: nn.Module) -> dict[str, Any] | None:
    """The hook's answer checked (positive head counts, regex lists), or None without the hook."""
    hook = getattr(module, "fleet_tensor_parallel", None)
    if not callable(hook):
        return None
    spec = hook()
    shape = ("{'num_heads': int, 'column': [regex...], 'row': [regex...]} (optional 'num_kv_heads': int, 'head_dim': int, "
             "'sequence': [regex...], 'per_rank': [regex...])")
    try:
        heads = int(spec["num_heads"])
        optional = [int(spec[key]) for key in ("num_kv_heads", "head_dim") if spec.get(key) is not None]
        for pattern in (*spec["column"], *spec["row"], *(spec.get("sequence") or ()), *(spec.get("per_rank") or ())):
            re.compile(pattern)
    except (KeyError, TypeError, ValueError, AttributeError, re.error):
        raise FleetError(f"{type(module).__name__}.fleet_tensor_parallel() must return {shape}") from None
    if min([heads, *optional]) < 1 or spec.get("num_kv_heads") is not None and heads % int(spec["num_kv_heads"]):
        raise FleetError(f"{type(module).__name__}.fleet_tensor_parallel(): num_heads, num_kv_heads and head_dim must be "
                         "positive, and num_kv_heads must divide num_heads")
    return spec


# --- what tensor parallelism can split -------------------------------------------------------------


def attention_shape(module: nn.Module) -> tuple[int, int, int | None] | None:
    """(heads, key/value heads, head size or None) of a module with ``fleet_tensor_parallel()``: the hook's values,
    else a Hugging Face style ``config`` on the module or a submodule (``num_key_value_heads``, ``head_dim``), else
    key/value heads = heads; None without the hook."""
    spec = _tensor_parallel_answer(module)
    return None if spec is None else _attention_shape(module, spec)


def _attention_shape(module: nn.Module, spec: dict[str, Any]) -> tuple[int, int, int | None]:
    heads = int(spec["num_heads"])
    config = next((m.config for m in module.modules() if getattr(getattr(m, "config", None), "num_attention_heads", None) == heads), None)
    kv = int(spec.get("num_kv_heads") or _positive(getattr(config, "num_key_value_heads", None)) or heads)
    head_dim = spec.get("head_dim") or _positive(getattr(config, "head_dim", None))
    return heads, kv if heads % kv == 0 else heads, int(head_dim) if head_dim else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def tensor_parallel_limits(module: nn.Module) -> tuple[TensorParallelLimit, ...]:
    """Each layer ``fleet_tensor_parallel()``'s patterns split, with the parts a tp degree must divide (empty without
    the hook). Both tensor-parallel runtimes split ``nn.Linear`` weights as (out, in) and ``nn.Embedding`` ones, in equal
    contiguous shards: an attention projection splits by whole heads, a fused query/key/value weight or any other
    layer (a transformers ``Conv1D`` stores its weight transposed, in x out) cannot be split evenly that way."""
    spec = _tensor_parallel_answer(module)
    return () if spec is None else _limits(module, spec)


def split_layers(module: nn.Module, patterns: TensorParallelSpec) -> list[tuple[str, nn.Module, str]]:
    """(name, layer, ``column`` or ``row``) for each layer of ``module`` whose own parameters a pattern matches (column
    first): what a tensor-parallel runtime splits."""
    return [(name, sub, kind) for name, sub in module.named_modules() if (kind := _split_kind(sub, name, patterns))]


def _limits(module: nn.Module, spec: dict[str, Any]) -> tuple[TensorParallelLimit, ...]:
    heads, kv, head_dim = _attention_shape(module, spec)
    split = split_layers(module, _patterns(spec))
    head_dim = head_dim or _head_dim(split, heads)
    counts = tuple(TensorParallelLimit(layer=path, parts=value, reason=(
        f"the module reads it as a count of what tensor parallelism splits (fleet_tensor_parallel()'s 'per_rank'), and its "
        f"{value} is not divisible by tp={{tp}}; use a tp that divides {value}")) for path, _, _, value in _per_rank(module, spec))
    return tuple(_limit(name, sub, kind, heads, kv, head_dim) for name, sub, kind in split) + counts


def per_rank_attributes(module: nn.Module) -> list[tuple[str, nn.Module, str, int]]:
    """(path, owner, attribute, value) of each integer attribute ``fleet_tensor_parallel()``'s ``per_rank`` patterns
    name (empty without them): counts the module's forward reads that a tp-split module holds a tp-th of on each rank.
    A pattern that names no integer attribute is a FleetError (a misspelt name would otherwise surface as a shape
    error inside the forward)."""
    spec = _tensor_parallel_answer(module)
    return [] if spec is None else _per_rank(module, spec)


def _per_rank(module: nn.Module, spec: dict[str, Any]) -> list[tuple[str, nn.Module, str, int]]:
    patterns = tuple(spec.get("per_rank") or ())
    if not patterns:
        return []
    found = [(f"{name}.{attr}" if name else attr, sub, attr, value) for name, sub in module.named_modules()
             for attr, value in vars(sub).items() if _positive(value) and not attr.startswith("_")]
    held = [entry for entry in found if any(re.match(p, entry[0]) for p in patterns)]
    missing = [p for p in patterns if not any(re.match(p, entry[0]) for entry in held)]
    if missing:
        raise FleetError(f"{type(module).__name__}.fleet_tensor_parallel(): 'per_rank' pattern {missing[0]!r} names no positive integer "
                         "attribute of the module or its submodules (matched against '<module path>.<attribute>', e.g. "
                         "'layers.0.attn.n_heads'); fix the pattern or drop it")
    return held


def _split_kind(sub: nn.Module, name: str, patterns: TensorParallelSpec) -> str | None:
    """'column' or 'row' when one of ``sub``'s own parameters matches a pattern of that kind (column first), else None."""
    names = [f"{name}.{p}" if name else p for p, _ in sub.named_parameters(recurse=False)]
    for kind, regexes in (("column", patterns.column), ("row", patterns.row)):
        if any(re.match(r, n) for r in regexes for n in names):
            return kind
    return None


def _head_dim(split: list[tuple[str, nn.Module, str]], heads: int) -> int | None:
    """Head size when neither the hook nor a config gives it: the model width (the input of the first column-split
    Linear) over the heads."""
    width = next((sub.in_features for _, sub, kind in split if kind == "column" and isinstance(sub, nn.Linear)), None)
    return width // heads if width and width % heads == 0 else None


def _limit(name: str, sub: nn.Module, kind: str, heads: int, kv: int, head_dim: int | None) -> TensorParallelLimit:
    """What one split layer allows: its embedding features, nothing (not an nn.Linear, or fused query/key/value), its
    key/value heads, its attention heads, or its features."""
    if isinstance(sub, nn.Embedding):
        return _divides(name, sub.embedding_dim, "embedding feature")
    if not isinstance(sub, nn.Linear):
        weight = getattr(sub, "weight", None)
        held = f" (weight {tuple(weight.shape)}{', stored transposed: in x out' if type(sub).__name__ == 'Conv1D' else ''})" if weight is not None else ""
        return TensorParallelLimit(layer=name, parts=1, reason=(
            f"it is a {type(sub).__name__}{held}, and tensor parallelism splits nn.Linear (out x in) and nn.Embedding "
            "weights only; use tp=1, or a model built from nn.Linear layers"))
    width = sub.out_features if kind == "column" else sub.in_features
    if head_dim and kind == "column" and width == (heads + 2 * kv) * head_dim and _in_attention(name):
        return TensorParallelLimit(layer=name, parts=1, reason=(
            f"its {width} outputs hold the query, key and value projections side by side ({heads} + 2 x {kv} heads of "
            f"{head_dim}), and an even split gives a rank the queries of some heads and the keys of others; use tp=1, or "
            "separate query, key and value nn.Linear layers"))
    if head_dim and kind == "column" and kv != heads and width == kv * head_dim:
        return _divides(name, kv, "key/value head")
    if head_dim and width == heads * head_dim:
        return _divides(name, heads, "attention head")
    return _divides(name, width, "output feature" if kind == "column" else "input feature")


def _divides(name: str, parts: int, unit: str) -> TensorParallelLimit:
    """A layer of ``parts`` equal ``unit``s (singular: "key/value head"), split by a tp that divides them."""
    held = f"its 1 {unit} is" if parts == 1 else f"its {parts} {unit}s are"
    fix = "use tp=1" if parts == 1 else f"use a tp that divides {parts}"
    return TensorParallelLimit(layer=name, parts=parts, reason=f"{held} not divisible by tp={{tp}}; {fix}")


def _in_attention(name: str) -> bool:
    """The layer sits in an attention block or is named as a fused projection (``attn.c_attn``, ``qkv``)."""
    return bool(re.search(r"att|qkv|query_key_value", name, re.IGNORECASE))


def pipeline_hook(module: nn.Module) -> dict[str, Any] | None:
    """``fleet_pipeline()`` validated, or None when the module has no such hook."""
    hook = getattr(module, "fleet_pipeline", None)
    if not callable(hook):
        return None
    spec = hook()
    layers, loss_fn = (spec.get("layers"), spec.get("loss_fn")) if isinstance(spec, dict) else (None, None)
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers) or not callable(loss_fn):
        raise FleetError(f"{type(module).__name__}.fleet_pipeline() must return {{'layers': [nn.Module, ...], 'loss_fn': callable}}")
    return {"layers": list(layers), "loss_fn": loss_fn}


PIPELINE_SHAPE = (
    "each layer is called as layer(x) with the previous layer's output alone (the first with the batch's inputs; batches "
    "are (inputs, labels)) and returns a tensor or a tuple of tensors: wrap a layer that needs more (rotary embeddings, "
    "an attention mask, keyword arguments) or returns a model output in a small nn.Module that computes them from x "
    "(README: 'Pipelines on a Hugging Face model', class DecoderStage)"
)
"""What fleet_pipeline()'s layers must look like, as every message about them says it."""


def stack_positions(layers: list[nn.Module], layer_type: str) -> list[int]:
    """Where in fleet_pipeline()'s ``layers`` the layer stack is: the layers that are, or hold (an adapter), a module of
    class ``layer_type`` (the stack's class, which the plan's stages split)."""
    return [i for i, layer in enumerate(layers) if any(type(m).__name__ == layer_type for m in layer.modules())]


def stack_problem(layers: list[nn.Module], layer_type: str) -> str:
    """Why the stack's layers cannot be split into stages ('' when they can): none of them there, or not one run."""
    stack = stack_positions(layers, layer_type)
    if stack and stack == list(range(stack[0], stack[-1] + 1)):
        return ""
    kinds = _kinds(layers)
    if not stack:
        return (
            f"none of its {len(layers)} layers ({kinds}) is or holds a {layer_type}, the class of the layer stack "
            "(fleet_layers(), or the largest ModuleList of one type in the module) that the plan splits into stages: "
            "put the stack's layers, or adapters holding them, in order between what runs before and after them"
        )
    return (
        f"its layers that are or hold a {layer_type} (positions {', '.join(map(str, stack))} of {len(layers)}: {kinds}) "
        "must follow each other: put what runs between them inside them"
    )


def _kinds(layers: list[nn.Module]) -> str:
    """'Embedding, DecoderStage x4, LlamaRMSNorm, Linear': the classes of ``layers`` in order, runs counted."""
    runs: list[list[Any]] = []
    for layer in layers:
        name = type(layer).__name__
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)


class SequenceLayout:
    """Where sequence parallelism puts sequence shards in a module (:func:`sequence_parallel_layout`), by module name:
    each layer of the stack takes its hidden state split along the sequence and gives it back whole; inside it, each
    region (the smallest submodule holding split layers of both kinds: attention, MLP) gathers its input whole, its
    row-split layers reduce-scatter their output back to sequence shards, and the ``sequence`` modules (norms) run on
    the shards."""

    def __init__(self, layers: list[str], regions: list[str], norms: list[str], inside: set[str]) -> None:
        self.layers, self.regions, self.norms, self.inside = layers, regions, norms, inside
        """``inside``: the split layers (column and row) within the layer stack."""


def sequence_parallel_layout(module: nn.Module) -> tuple[SequenceLayout | None, str]:
    """(the layout, '') where ``module`` runs sequence parallelism, else (None, why not: 'names no ...: add ...'). It
    runs where ``fleet_tensor_parallel()`` names the ``sequence`` modules, there is a layer stack, every parameter inside
    a layer is split (column or row) or in a ``sequence`` module (whose gradient is then summed over the shards), and
    every split layer inside a layer lies in a region below the layer (its code between split layers must be
    position-wise: a norm, an activation, a residual add)."""
    spec = _tensor_parallel_answer(module)
    if spec is None or not spec.get("sequence"):
        return None, "names no 'sequence' modules (its norms) in fleet_tensor_parallel(): add them or use sp=false"
    stack = find_layers(module)
    if stack is None:
        return None, "has no layer stack for sequence parallelism to split along the sequence: add fleet_layers() or use sp=false"
    names = {id(m): n for n, m in module.named_modules()}
    patterns = _patterns(spec)
    layers, regions, norms, inside = [], [], [], set()
    for layer in stack:
        prefix = names[id(layer)]
        layers.append(prefix)
        kinds = {n: k for n, sub in layer.named_modules() if (k := _split_kind(sub, f"{prefix}.{n}" if n else prefix, patterns))}
        for name, sub in layer.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            own = [f"{full}.{p}" for p, _ in sub.named_parameters(recurse=False)]
            if any(re.match(r, n) for r in patterns.sequence for n in own):
                norms.append(full)
            elif own and name not in kinds:
                return None, (f"holds {own[0]} in its layer {prefix}, which is neither split (column/row) nor a 'sequence' "
                              "module: name it in fleet_tensor_parallel()'s 'sequence' (a norm) or use sp=false")
        for name, kind in kinds.items():
            inside.add(f"{prefix}.{name}")
            region = _region(name, kinds)
            if not region:
                return None, (f"splits {prefix}.{name} with no submodule of {prefix} around it that holds both column- and "
                              "row-split layers (an attention or MLP module): sequence parallelism gathers such a module's "
                              "input; use sp=false")
            if f"{prefix}.{region}" not in regions:
                regions.append(f"{prefix}.{region}")
    return SequenceLayout(layers, regions, norms, inside), ""


def _region(name: str, kinds: dict[str, str]) -> str:
    """The deepest proper ancestor of ``name`` (within its layer, '' is the layer itself) that holds split layers of
    both kinds, or '' when only the layer does."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        held = {k for n, k in kinds.items() if n.startswith(prefix + ".")}
        if held == {"column", "row"}:
            return prefix
    return ""


def module_hooks(module: nn.Module, *, sparse_params: tuple[str, ...] = (), pipeline_problem: str = "") -> ModuleHooks:
    """What ``module`` offers a runtime (each hook called once and validated), with the parameters profiling found to
    get sparse gradients (:attr:`lightning_fleet.profiling.Profile.sparse_params`). A plain ``nn.Module`` has no
    optimization loop of its own: it counts as automatically optimized. ``pipeline_problem`` is why its
    ``fleet_pipeline()`` cannot run as a pipeline (the profiler's dry run on the example batch); the pipeline is off
    then."""
    layers = find_layers(module) is not None
    tensor_parallel = _tensor_parallel_answer(module)
    _, sequence_problem = sequence_parallel_layout(module) if tensor_parallel is not None else (None, "")
    return ModuleHooks(
        name=type(module).__name__,
        tensor_parallel=tensor_parallel is not None,
        pipeline=pipeline_hook(module) is not None and layers and not pipeline_problem,
        layers=layers,
        automatic_optimization=bool(getattr(module, "automatic_optimization", True)),
        tp_limits=() if tensor_parallel is None else _limits(module, tensor_parallel),
        sparse_params=sparse_params,
        pipeline_problem=pipeline_problem,
        sequence_parallel=tensor_parallel is not None and not sequence_problem,
        sequence_problem=sequence_problem,
    )
