"""The user's module's hooks, in one room: its layer stack, ``fleet_tensor_parallel()`` and ``fleet_pipeline()``.

All three hooks are optional and must be pure (they are called on the module itself, possibly several times); a
malformed answer is a FleetError naming the hook and the shape it must return.

``fleet_layers()``
    The layer stack (a non-empty ``nn.ModuleList`` or ``nn.Sequential``). Without it: the largest (by parameters)
    ModuleList/Sequential anywhere in the module whose children all have one type. Profiling prices per layer;
    full recomputation and the pipeline stages work on these layers.
``fleet_tensor_parallel()``
    ``{"num_heads": int, "column": [regex, ...], "row": [regex, ...]}``: the head count and which Linear weights
    tensor parallelism splits along their output (column) or input (row) dimension.
``fleet_pipeline()``
    ``{"layers": [nn.Module, ...], "loss_fn": fn(last_output, labels)}``: the forward pass as a sequence (each layer
    takes the previous one's output) and the loss; a training batch is then ``(inputs, labels)``.

:func:`module_hooks` sums them up as a :class:`~lightning_fleet.runtime.base.ModuleHooks` value, which a runtime's
capabilities read. Imports torch, :mod:`lightning_fleet.planning` and :mod:`lightning_fleet.runtime.base` only;
imported by profiling, the runtimes, export and the strategy.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.base import ModuleHooks, TensorParallelSpec


def find_layers(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The layer stack: ``fleet_layers()`` if the module has it, else the largest (by parameters) ModuleList or
    Sequential anywhere in the module whose children all have one type (a parent before its nested stacks)."""
    hook = getattr(module, "fleet_layers", None)
    if callable(hook):
        layers = hook()
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
            raise FleetError(f"{type(module).__name__}.fleet_layers() must return a non-empty nn.ModuleList or nn.Sequential")
        return layers
    stacks = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and _repeats_one_type(m)]
    sized = [(sum(p.numel() for p in m.parameters()), m) for m in stacks]
    best = max(sized, key=lambda pair: pair[0], default=(0, None))
    return best[1] if best[0] > 0 else None


def _repeats_one_type(container: nn.Module) -> bool:
    return len(container) > 0 and len({type(child) for child in container}) == 1


def tensor_parallel_hook(module: nn.Module) -> tuple[int, TensorParallelSpec] | None:
    """``fleet_tensor_parallel()`` as (num_heads, patterns), or None when the module has no such hook."""
    hook = getattr(module, "fleet_tensor_parallel", None)
    if not callable(hook):
        return None
    spec = hook()
    try:
        heads = int(spec["num_heads"])
        patterns = TensorParallelSpec(column=tuple(spec["column"]), row=tuple(spec["row"]))
    except (KeyError, TypeError, ValueError):
        raise FleetError(
            f"{type(module).__name__}.fleet_tensor_parallel() must return {{'num_heads': int, 'column': [regex...], 'row': [regex...]}}"
        ) from None
    return heads, patterns


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


def module_hooks(module: nn.Module, sparse_params: tuple[str, ...] = ()) -> ModuleHooks:
    """What ``module`` offers a runtime (each hook called once and validated), with the parameters profiling found to
    get sparse gradients (:attr:`lightning_fleet.profiling.Profile.sparse_params`). A plain ``nn.Module`` has no
    optimization loop of its own: it counts as automatically optimized."""
    layers = find_layers(module) is not None
    return ModuleHooks(
        name=type(module).__name__,
        tensor_parallel=tensor_parallel_hook(module) is not None,
        pipeline=pipeline_hook(module) is not None and layers,
        layers=layers,
        automatic_optimization=bool(getattr(module, "automatic_optimization", True)),
        sparse_params=sparse_params,
    )
