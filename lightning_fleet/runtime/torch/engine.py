"""The torch runtime's engine beyond plain DDP: DTensor tensor parallelism and FSDP2 over the user's module, and the way
back to the plain module at the end of fit.

:func:`apply` lays a plan out on a ``(dp, tp)`` device mesh of every rank (tp the inner axis, as ``Plan.coordinates``
places it):

- tp > 1: ``parallelize_module`` on the tp axis, each layer ``fleet_tensor_parallel()``'s patterns name split as its
  kind says (:func:`lightning_fleet.hooks.split_layers`): a column-split Linear keeps its output local (the next
  row-split Linear takes it), a row-split Linear all-reduces its output; an embedding split either way gives its whole
  output. The split parameters become DTensors sharded over tp;
- shard levels 2 and 3: ``fully_shard`` on the dp axis over every layer of the layer stack and then the module itself
  (the root holds what no layer does: embeddings, head, norms), ``reshard_after_forward`` False at 2 (the gathered
  weights stay until backward: ZeRO-2's memory, one gather per step) and True at 3 (gathered again for backward:
  ZeRO-3); gradients are reduce-scattered, averaged over the replicas as DDP's all-reduce. With hybrid sharding
  (``Plan.dp_shard``) the dp axis is two, ``(dp / dp_shard, dp_shard)``, consecutive dp ranks sharing a shard group, and
  ``fully_shard`` takes that 2-D mesh: HSDP, sharded within each group and replicated across the groups (each reduction
  reduce-scatters within the group, then all-reduces its shard across the groups);
- shard level 0 with dp > 1 and tp > 1: DDP cannot take DTensor parameters, so the engine reduces the gradients itself
  (:class:`_DataParallelReduction`: buckets all-reduced over dp as their gradients become ready in backward, waited for
  at its end) -- what DDP does, on the local shards.

``fully_shard`` and ``parallelize_module`` change the module in place (classes, hooks, parameters); :func:`release`
undoes all of it: every parameter and optimizer state gathered whole (collective), plain ``nn.Parameter`` s registered
again (tied weights stay tied), the hooks the engine added removed and each module's own class restored, so the user
gets back the module they passed, holding the trained weights on every rank, and optimizers over it.

Imports torch.distributed (fsdp, tensor.parallel) at call time (the layering rule: only runtime/torch imports them);
imported by the torch backend.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from lightning_fleet.planning import FleetError, Offload, Plan
from lightning_fleet.runtime.base import TensorParallelSpec
from lightning_fleet.runtime.common import local_part

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce of :class:`_DataParallelReduction` (DDP's default ``bucket_cap_mb`` is 25)."""
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
"""The per-module hook registries (torch.nn.Module): what the engine added to them is removed at the end of fit."""


class ParallelEngine(nn.Module):
    """The user's module laid out by :func:`apply`, as ``module``. Calling the engine calls the module, so FSDP's root
    hooks (gather before forward, reduce after backward) run when Lightning redirects ``training_step`` and
    ``validation_step`` through it, as through DDP."""

    def __init__(self, module: nn.Module, classes: dict[nn.Module, type], hooks: dict[nn.Module, dict[str, set[int]]],
                 reduction: "_DataParallelReduction | None", dp_group: Any) -> None:
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        """The data-parallel process group of this rank (shard level 1 partitions the optimizer states over it)."""
        self.classes = classes
        """Each module FSDP changed, with its own class (what :func:`release` gives back)."""
        self.hooks = hooks
        """Each module's hook ids before :func:`apply` (what :func:`release` keeps)."""
        self.reduction = reduction

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> Any:
        """A micro-batch that is not its step's last: no gradient reduction (the unsharded gradients accumulate)."""
        if self.classes:
            return _fsdp_no_sync(self.module)
        return self.reduction.paused() if self.reduction is not None else nullcontext()


def apply(module: nn.Module, layers: Sequence[nn.Module] | None, *, plan: Plan, tensor_parallel: TensorParallelSpec | None) -> ParallelEngine:
    """``plan``'s tensor parallelism and shard level over ``module`` (in place; collective): see the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh

    first = next(module.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    if plan.dp_shard is None:
        mesh = init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    else:  # HSDP: fully_shard replicates over a 2-D mesh's first dimension and shards over its second
        mesh = init_device_mesh(device_type, (plan.shard_replicas, plan.dp_shard, plan.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
    hooks = {m: {name: set(getattr(m, name)) for name in _HOOK_DICTS} for m in module.modules()}
    if plan.tp > 1:
        _split(module, tensor_parallel, mesh["tp"], sequence=plan.sp)
    classes: dict[nn.Module, type] = {}
    reduction = None
    if plan.zero >= 2:
        from torch.distributed.fsdp import fully_shard

        targets = [*(layers or ()), module]
        classes = {target: type(target) for target in targets}
        offload = _offload_policy(plan, device_type)
        for target in targets:
            fully_shard(target, mesh=dp_mesh, reshard_after_forward=plan.zero >= 3, offload_policy=offload)
    elif plan.dp > 1:
        reduction = _DataParallelReduction(module, dp_mesh.get_group(), plan.dp)
    return ParallelEngine(module, classes, hooks, reduction, dp_mesh.get_group() if plan.dp_shard is None else None)


def _offload_policy(plan: Plan, device_type: str) -> Any:
    """FSDP2's offload of ``plan``: under ``offload=optimizer+params`` every sharded parameter, its gradient and its
    optimizer state in host memory, the optimizer stepping there (``CPUOffloadPolicy``; pinned pages where the device
    copies from them, a CUDA device); else none."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if plan.offload is Offload.OPTIMIZER_PARAMS:
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def _split(module: nn.Module, patterns: TensorParallelSpec | None, tp_mesh: Any, *, sequence: bool = False) -> None:
    """DTensor tensor parallelism over ``tp_mesh``: each layer the patterns name, column- or row-wise; with ``sequence``
    (sp=true) the layers of the stack also run on sequence shards (:func:`_sequence_parallel`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from lightning_fleet.hooks import sequence_parallel_layout, split_layers

    assert patterns is not None, "a tp plan needs fleet_tensor_parallel() (the capabilities say so)"
    layout = None
    if sequence:
        layout, why = sequence_parallel_layout(module)
        if layout is None:  # the capabilities refuse such a plan first
            raise FleetError(f"sp=true: {type(module).__name__} {why}")
    styles: dict[str, Any] = {}
    for name, layer, kind in split_layers(module, patterns):
        embedding = isinstance(layer, nn.Embedding)
        if layout is not None and name in layout.inside and kind == "row":  # back to sequence shards: a reduce-scatter
            styles[name] = RowwiseParallel(output_layouts=Shard(1))
        elif kind == "column":  # an embedding's features split: its output gathered whole
            styles[name] = ColwiseParallel(output_layouts=Replicate()) if embedding else ColwiseParallel()
        else:  # an embedding's rows split: the token ids arrive whole, the partial outputs are summed
            styles[name] = RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel()
    if layout is not None:
        styles.update({name: SequenceParallel(use_local_output=True) for name in layout.norms})
    parallelize_module(module, tp_mesh, styles)
    if layout is not None:
        _sequence_parallel(module, layout, tp_mesh)


def _sequence_parallel(module: nn.Module, layout: Any, tp_mesh: Any) -> None:
    """Sequence parallelism's boundaries, as forward hooks the hand-back removes: each layer of the stack takes its
    hidden state (first positional argument, or ``hidden_states``) as this rank's sequence shard (a slice forward, an
    all-gather of the gradient backward) and gives it back whole (an all-gather); each region (attention, MLP) gathers
    its shard-wise input whole before its column-split layers. DTensor's redistribute runs the collectives and their
    backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def relaid(x: Any, source: Any, target: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        held = x if isinstance(x, DTensor) else DTensor.from_local(x, tp_mesh, [source], run_check=False)
        return held.redistribute(tp_mesh, [target]).to_local()

    def on_hidden(source: Any, target: Any) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args:
                return (relaid(args[0], source, target), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": relaid(kwargs["hidden_states"], source, target)}
            return args, kwargs
        return hook

    def whole(x: Any) -> Any:  # a tensor of its own: FSDP2 warns of (and an in-place op would break on) a layer's view
        out = relaid(x, Shard(1), Replicate())
        return out.clone() if isinstance(out, torch.Tensor) and out._base is not None else out

    def gathered(_: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple) and output:
            return (whole(output[0]), *output[1:])
        return whole(output)

    named = dict(module.named_modules())
    for name in layout.layers:
        named[name].register_forward_pre_hook(on_hidden(Replicate(), Shard(1)), with_kwargs=True)
        named[name].register_forward_hook(gathered)
    for name in layout.regions:
        named[name].register_forward_pre_hook(on_hidden(Shard(1), Replicate()), with_kwargs=True)


@contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


class _DataParallelReduction:
    """DDP's gradient all-reduce for a module whose parameters DDP cannot take (DTensors of tensor parallelism): each
    parameter's gradient (its local shard) joins a bucket when autograd has accumulated it; a full bucket is averaged
    over ``group`` by an asynchronous all-reduce while backward goes on; the end of backward sends the rest and waits.
    Paused (:meth:`paused`) for a step's micro-batches before its last, whose gradients accumulate locally."""

    def __init__(self, module: nn.Module, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.sync = True
        self._bucket: list[torch.Tensor] = []
        self._bucket_bytes = 0
        self._sent: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._finishing = False
        unique = {id(p): p for p in module.parameters() if p.requires_grad}
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in unique.values()]

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _ready(self, param: torch.Tensor) -> None:
        if not self.sync or param.grad is None:
            return
        if not self._finishing:
            self._finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        grad = local_part(param.grad)
        if grad.is_sparse:
            raise FleetError("a sparse gradient (nn.Embedding(sparse=True)) with tp > 1 and dp > 1 at zero=0 on the torch "
                             "runtime: build the embedding with sparse=False, or use tp=1 or runtime='deepspeed'")
        self._bucket.append(grad)
        self._bucket_bytes += grad.numel() * grad.element_size()
        if self._bucket_bytes >= BUCKET_BYTES:
            self._flush()

    def _flush(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in self._bucket:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            self._send(grads)
        self._bucket, self._bucket_bytes = [], 0

    def _send(self, grads: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.size)
        self._sent.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, grads))

    def _finish(self) -> None:
        """End of backward: send what is left, wait for every all-reduce, write the averages back."""
        self._flush()
        for work, flat, grads in self._sent:
            work.wait()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._sent, self._finishing = [], False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def release(engine: ParallelEngine, optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module:
    """The user's module as it was before :func:`apply`, holding the trained weights whole on every rank, and each of
    ``optimizers`` over its plain parameters with its state gathered whole (collective: every rank, same order)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    module = engine.module
    if engine.reduction is not None:
        engine.reduction.remove()
    plain: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) not in plain:
                plain[id(param)] = nn.Parameter(_whole(param.detach()), requires_grad=param.requires_grad)
            owner._parameters[name] = plain[id(param)]
    for optimizer in optimizers:
        _gather_optimizer(optimizer, plain)
    for owner, kept in engine.hooks.items():
        for name, ids in kept.items():
            registry = getattr(owner, name)
            for key in [k for k in registry if k not in ids]:
                del registry[key]
    for target, cls in engine.classes.items():
        target.__class__ = cls
        for key in (STATE_KEY, REGISTRY_KEY):
            target.__dict__.pop(key, None)
        _module_state_mapping.pop(target, None)
    for owner in module.modules():
        for name in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            owner.__dict__.pop(name, None)
    return module


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients laid out on different meshes (tensor-parallel shards, FSDP2
    shards, plain replicated tensors), which torch's cannot stack together: each group's norm (one mesh and placement;
    a DTensor's reduced over its mesh and gathered whole), the total as the norm of those norms (exact for every
    p-norm, the maximum for inf), then every gradient scaled by the same factor. Returns the total norm."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else grad.device
            groups.setdefault(key, []).append(grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append((_on_mesh_device(norm).full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if not norms:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    scale = min(1.0, float(max_norm) / (float(total) + 1e-6))  # torch's clip_coef, clamped at 1
    if scale < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, scale)
    return total


def _gather_optimizer(optimizer: torch.optim.Optimizer, plain: dict[int, nn.Parameter]) -> None:
    """The optimizer over the plain parameters, its state tensors gathered whole."""
    state = {}
    for group in optimizer.param_groups:
        new = []
        for param in group["params"]:
            whole = plain.get(id(param), param)
            entry = optimizer.state.get(param)
            if entry is not None:
                state[whole] = {key: _whole(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
            new.append(whole)
        group["params"] = new
    optimizer.state.clear()
    optimizer.state.update(state)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return _on_mesh_device(tensor).full_tensor() if isinstance(tensor, DTensor) else tensor


def _on_mesh_device(tensor: Any) -> Any:
    """A DTensor whose local part sits where its mesh's collectives run: an offloaded shard (host memory, under
    ``CPUOffloadPolicy``) copied to the mesh's device first (NCCL reduces no host tensors), any other as it is."""
    device_type = tensor.device_mesh.device_type
    return tensor if tensor.device.type == device_type else tensor.to(device_type)
