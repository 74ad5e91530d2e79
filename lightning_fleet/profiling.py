"""nn.Module -> ModelSpec, measured on the meta device: no real memory, no real FLOPs.

The module's parameters are swapped for meta tensors and its ``training_step`` runs once on a meta
copy of an example batch. torch's FlopCounterMode counts the forward FLOPs and autograd's
saved-tensor hooks see every tensor kept for backward; both are attributed to the block running at
that moment: ``pre`` (everything before the first layer), each layer, ``post`` (everything after the
last layer, the loss included), and so are the output elements of the operators that do no matmul
(the memory-bound rest: norms, activations, softmax, residual adds, copies). The forward suffices:
the cost model takes backward as 2x forward (Narayanan 2021), so no backward pass is run.

Layers are the module's ``fleet_layers()`` (optional hook) or, without it, its largest
``nn.ModuleList``/``nn.Sequential`` child. ``fleet_tensor_parallel()`` (optional hook) gives the
head count and the AutoTP patterns, from which each layer's tensor-parallel all-reduces are counted.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from lightning_fleet.planning import BlockSpec, FleetError, ModelSpec, Precision, Role
from lightning_fleet.runtime.deepspeed_config import TensorParallelSpec


def find_layers(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The layer stack: ``fleet_layers()`` if the module has it, else its largest ModuleList/Sequential child."""
    hook = getattr(module, "fleet_layers", None)
    if callable(hook):
        layers = hook()
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
            raise FleetError(f"{type(module).__name__}.fleet_layers() must return a non-empty nn.ModuleList or nn.Sequential")
        return layers
    stacks = [c for c in module.children() if isinstance(c, (nn.ModuleList, nn.Sequential)) and len(c) > 0]
    return max(stacks, key=lambda c: sum(p.numel() for p in c.parameters()), default=None)


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


@dataclass
class _Phase:
    """What one phase of the forward pass (pre, a layer, post) used."""

    modules: set[str] = field(default_factory=set)
    flops: float = 0.0
    saved: list[tuple[int, float]] = field(default_factory=list)  # (last dimension, bytes) per saved tensor
    output_bytes: float = 0.0
    elementwise: float = 0.0  # output elements of the operators that do no matmul

    def split_bytes(self, hidden: int) -> tuple[float, float]:
        """(replicated, sharded) saved bytes: width-``hidden`` tensors stay whole under tp, wider ones are split."""
        replicated = sum(b for dim, b in self.saved if dim in (hidden, 0))
        return replicated, sum(b for _, b in self.saved) - replicated


class _Recorder:
    """Forward hooks and saved-tensor hooks that attribute FLOPs, saved bytes and modules to phases."""

    def __init__(self, layers: list[nn.Module], names: dict[int, str], counter: FlopCounterMode, param_storages: set[int], scale: float) -> None:
        self.layers = {id(layer): i for i, layer in enumerate(layers)}
        self.names = names
        self.counter = counter
        self.param_storages = param_storages
        self.scale = scale  # float bytes scale for mixed precision (profiled in fp32)
        self.phases: dict[str, _Phase] = {"pre": _Phase(), "post": _Phase()}
        self.current = "pre"
        self.mark = 0.0
        self.seen_storages: set[int] = set()
        self.hidden = 0
        self.seq = 1

    def _phase(self) -> _Phase:
        return self.phases.setdefault(self.current, _Phase())

    def _switch(self, name: str) -> None:
        total = float(self.counter.get_total_flops())
        self._phase().flops += total - self.mark
        self.mark, self.current = total, name

    def layer_pre(self, module: nn.Module, args: Any) -> None:
        self._switch(f"layer{self.layers[id(module)]}")

    def layer_post(self, module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor):
            self._phase().output_bytes = out.numel() * out.element_size() * (self.scale if out.is_floating_point() else 1)
            if out.dim() >= 2 and not self.hidden:
                self.hidden, self.seq = out.shape[-1], (out.shape[1] if out.dim() >= 3 else 1)
        self._switch("post")

    def add_elementwise(self, elements: int) -> None:
        self._phase().elementwise += elements

    def module_pre(self, module: nn.Module, args: Any) -> None:
        self._phase().modules.add(self.names[id(module)])

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()._cdata
        if storage not in self.param_storages and storage not in self.seen_storages:
            self.seen_storages.add(storage)
            nbytes = t.untyped_storage().nbytes() * (self.scale if t.is_floating_point() else 1)
            self._phase().saved.append((t.shape[-1] if t.dim() else 0, nbytes))
        return t

    def finish(self) -> None:
        self._switch(self.current)


_NO_DATA_MOVED = (torch.ops.aten._unsafe_view, torch.ops.aten.alias, torch.ops.aten.lift_fresh)
"""Operators that return their input's storage (aliases not marked as views)."""


class _OpCounter(TorchDispatchMode):
    """Counts the operators a forward pass dispatches (each costs host time, whatever its size), and hands the
    output elements of every operator that does no matmul to ``on_elementwise`` (memory-bound work: norms,
    activations, softmax, adds, copies; views move no data and are not counted)."""

    def __init__(self, on_elementwise: Callable[[int], None]) -> None:
        super().__init__()
        self.ops = 0
        self.on_elementwise = on_elementwise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in flop_registry and not func.is_view and func.overloadpacket not in _NO_DATA_MOVED:
            elements = sum(t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
            if elements and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs))):
                self.on_elementwise(elements)
        return out


def _meta_like(batch: Any) -> Any:
    """The example batch on the meta device (same shapes and dtypes)."""
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device="meta")
    if isinstance(batch, (list, tuple)):
        return type(batch)(_meta_like(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _meta_like(v) for k, v in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for item in items:
        size = batch_size_of(item)
        if size:
            return size
    return 0


@contextmanager
def _quiet_logging(module: nn.Module) -> Iterator[None]:
    """LightningModule.log/log_dict become no-ops while profiling (there is no loop to log into)."""
    saved = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


def _run_step(module: nn.Module, batch: Any) -> None:
    step = getattr(module, "training_step", None)
    if callable(step):
        with _quiet_logging(module):
            step(batch, 0)
    else:
        module(batch)


def _params_of(phase: _Phase, module: nn.Module) -> set[nn.Parameter]:
    """The parameters owned directly by the modules that ran in a phase (real objects, for dedupe)."""
    owners = dict(module.named_modules())
    return {p for name in phase.modules for p in owners[name].parameters(recurse=False)}


def _block(name: str, role: Role, phase: _Phase, params: int, hidden: int, samples: int, tp_counts: tuple[int, int] = (0, 0), output_bytes: float | None = None) -> BlockSpec:
    replicated, sharded = phase.split_bytes(hidden)
    return BlockSpec(
        name=name,
        role=role,
        params=params,
        flops=phase.flops / samples,
        elementwise=phase.elementwise / samples,
        act_replicated_bytes=replicated / samples,
        act_sharded_bytes=sharded / samples,
        output_bytes=(phase.output_bytes if output_bytes is None else output_bytes) / samples,
        tp_allreduces_fwd=tp_counts[0],
        tp_allreduces_bwd=tp_counts[1],
    )


def _tp_counts(layer: nn.Module, prefix: str, patterns: TensorParallelSpec | None) -> tuple[int, int]:
    """AutoTP all-reduces of one layer: one per row-split Linear forward, one per column-split Linear backward."""
    if patterns is None:
        return 0, 0
    names = [f"{prefix}.{n}" for n, _ in layer.named_parameters()]
    row = sum(any(re.match(p, n) for p in patterns.row) for n in names)
    column = sum(any(re.match(p, n) for p in patterns.column) for n in names)
    return row, column


def _merge_repeats(blocks: list[BlockSpec]) -> list[BlockSpec]:
    """Consecutive identical layers become one entry with a count."""
    out: list[BlockSpec] = []
    for block in blocks:
        if out and out[-1].role is Role.LAYER and block.role is Role.LAYER and _same_costs(out[-1], block):
            prev = out[-1]
            out[-1] = BlockSpec(**{**_fields(prev), "count": prev.count + 1, "name": prev.name.split("..")[0] + f"..{block.name}"})
        else:
            out.append(block)
    return out


def _fields(block: BlockSpec) -> dict[str, Any]:
    return {f: getattr(block, f) for f in BlockSpec.__dataclass_fields__}


def _same_costs(a: BlockSpec, b: BlockSpec) -> bool:
    return {k: v for k, v in _fields(a).items() if k not in ("name", "count")} == {
        k: v for k, v in _fields(b).items() if k not in ("name", "count")
    }


def profile_module(
    module: nn.Module,
    example_batch: Any,
    *,
    global_batch_size: int,
    precision: Precision = Precision.FP32,
    name: str | None = None,
) -> ModelSpec:
    """Measure ``module`` on a meta copy of ``example_batch`` and return its per-block, per-sample ModelSpec.

    ``precision`` scales floating-point activation bytes: the profile runs in fp32 and mixed
    precision keeps 16-bit activations.
    """
    samples = batch_size_of(example_batch)
    if samples < 1:
        raise FleetError("cannot profile: the example batch holds no tensor with a batch dimension")
    layers_container = find_layers(module)
    layers = list(layers_container) if layers_container is not None else []
    tp = tensor_parallel_hook(module)
    names = {id(m): n for n, m in module.named_modules()}
    meta = {n: torch.empty_like(p, device="meta", requires_grad=p.requires_grad) for n, p in module.named_parameters()}
    meta.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
    with ExitStack() as stack:
        counter = stack.enter_context(FlopCounterMode(display=False))
        storages = {t.untyped_storage()._cdata for t in meta.values()}
        recorder = _Recorder(layers, names, counter, storages, precision.element_bytes / 4)
        ops = stack.enter_context(_OpCounter(recorder.add_elementwise))
        handles = [m.register_forward_pre_hook(recorder.module_pre) for m in module.modules()]
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(recorder.layer_pre))
            handles.append(layer.register_forward_hook(recorder.layer_post))
        try:
            stack.enter_context(_reparametrize_module(module, meta))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t))
            _run_step(module, _meta_like(example_batch))
            recorder.finish()
        finally:
            for handle in handles:
                handle.remove()
    spec = _to_model_spec(module, layers, recorder, tp, samples, global_batch_size, precision, name)
    return dataclasses.replace(spec, forward_ops=ops.ops, param_tensors=sum(1 for p in module.parameters() if p.requires_grad))


def _to_model_spec(module, layers, recorder, tp, samples, global_batch_size, precision, name) -> ModelSpec:
    phases, hidden = recorder.phases, recorder.hidden
    pre, post = phases.pop("pre"), phases.pop("post")
    if not layers:  # no layer stack: the whole model is one layer (no pipeline, no recomputation)
        whole = _Phase(modules=pre.modules | post.modules, flops=pre.flops + post.flops, saved=pre.saved + post.saved,
                       elementwise=pre.elementwise + post.elementwise)
        body = [_block(type(module).__name__, Role.LAYER, whole, sum(p.numel() for p in module.parameters()), hidden, samples)]
        pre, post = _Phase(), _Phase()
    else:
        body = []
        for i, layer in enumerate(layers):
            prefix = recorder.names[id(layer)]
            body.append(
                _block(prefix, Role.LAYER, phases.get(f"layer{i}", _Phase()), sum(p.numel() for p in layer.parameters()), hidden, samples, _tp_counts(layer, prefix, tp[1] if tp else None))
            )
    pre_params, post_params = _params_of(pre, module), _params_of(post, module)
    return ModelSpec(
        name=name or type(module).__name__,
        blocks=(
            _block("pre", Role.PRE, pre, sum(p.numel() for p in pre_params), hidden, samples, output_bytes=body[0].output_bytes * samples),
            *_merge_repeats(body),
            _block("post", Role.POST, post, sum(p.numel() for p in post_params), hidden, samples),
        ),
        hidden_size=max(1, hidden),
        num_heads=tp[0] if tp else 1,
        seq_length=max(1, recorder.seq),
        precision=precision,
        global_batch_size=global_batch_size,
        tied_params=sum(p.numel() for p in pre_params & post_params),
    )
