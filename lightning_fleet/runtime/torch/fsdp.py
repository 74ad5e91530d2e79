"""Shard levels 2 and 3 of the torch runtime: FSDP2 (``torch.distributed.fsdp.fully_shard``) over the user's module, and
the way back to the plain module at the end of fit.

``shard`` applies ``fully_shard`` to every layer of the module's layer stack and then to the module itself (the root
holds what no layer does: embeddings, head, norms), on a one-dimensional mesh of every rank; ``reshard_after_forward``
is False at shard level 2 (the gathered weights stay until backward: ZeRO-2's memory, one gather per step) and True at
3 (gathered again for backward: ZeRO-3). The parameters become DTensors sharded on dimension 0, gradients are
reduce-scattered (averaged over the replicas, as DDP's all-reduce), and the optimizer Lightning builds afterwards holds
only this rank's shards.

``fully_shard`` changes the module in place (its class, hooks, parameters); :func:`release` undoes all of it at the end
of fit: every parameter and optimizer state gathered whole (collective), plain ``nn.Parameter`` s registered again
(tied weights stay tied), FSDP's hooks and state removed and each module's own class restored, so the user gets back
the module they passed, holding the trained weights on every rank, and an optimizer over it.

Imports torch.distributed.fsdp (the layering rule: only runtime/torch imports it); imported by the torch backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn


class ShardedEngine(nn.Module):
    """The engine at shard levels 2-3: the user's module with FSDP2 applied, as ``module``. Calling the engine calls the
    module, so the root's FSDP hooks (gather before forward, reduce after backward) run when Lightning redirects
    ``training_step`` and ``validation_step`` through it, as through DDP."""

    def __init__(self, module: nn.Module, classes: dict[nn.Module, type]) -> None:
        super().__init__()
        self.module = module
        self.classes = classes
        """Each sharded module's own class (what :func:`release` gives back)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """A micro-batch that is not its step's last: no reduce-scatter (the unsharded gradients accumulate)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


def shard(module: nn.Module, layers: Sequence[nn.Module] | None, *, zero: int) -> ShardedEngine:
    """FSDP2 over ``module`` (in place; collective): each of ``layers``, then the module, on one mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    first = next(module.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    targets = [*(layers or ()), module]
    classes = {target: type(target) for target in targets}
    for target in targets:
        fully_shard(target, mesh=mesh, reshard_after_forward=zero >= 3)
    return ShardedEngine(module, classes)


def release(engine: ShardedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module:
    """The user's module as it was before :func:`shard`, holding the trained weights whole on every rank, and each of
    ``optimizers`` over its plain parameters with its state gathered whole (collective: every rank, same order)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import fully_shard

    module = engine.module
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
    for target, cls in engine.classes.items():
        state = fully_shard.state(target)
        for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
            handle.remove()
        target.__class__ = cls
        for key in (STATE_KEY, REGISTRY_KEY):
            target.__dict__.pop(key, None)
        _module_state_mapping.pop(target, None)
    for owner in module.modules():
        for name in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            owner.__dict__.pop(name, None)
    return module


def _gather_optimizer(optimizer: torch.optim.Optimizer, plain: dict[int, nn.Parameter]) -> None:
    """The optimizer over the plain parameters, its state tensors gathered whole (a sharded step counter stays as is)."""
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

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

