"""Shard level 1 on the torch runtime: the optimizer states partitioned over the data-parallel replicas (ZeRO-1).

DistributedDataParallel all-reduces the gradients as at shard level 0; then each replica steps only the parameters it
owns, so its optimizer creates and keeps state for those only, and each owner broadcasts its updated parameters to the
others. That is what ``torch.distributed.optim.ZeroRedundancyOptimizer`` does (its ``_partition_parameters``: each
parameter group's parameters, largest first, to the rank holding the fewest elements so far; a local optimizer over
the rank's share; ``_broadcast_params_from_rank`` after its step), done with the user's own optimizer object rather
than a new one: Lightning's learning-rate schedulers, the module's optimizer hooks and ``optimizer.state_dict()`` keep
the object they were given. A parameter a rank does not own has its gradient hidden during the step (torch's
optimizers skip a parameter whose ``grad`` is None: no update, no state) and restored after it.

Checkpoints go through torch.distributed.checkpoint as at the other levels: each rank saves the states it holds, keyed
by parameter name, and a loading rank reads the states of the parameters it owns under its own partition (any world
size, any shard level: :meth:`ShardedStep.owned_only` drops the others after a load). At the end of fit every rank
receives the states it does not own (:meth:`ShardedStep.gather_states`), so the user's optimizer holds them all, as after plain DDP.

Imports torch.distributed at call time; imported by the torch backend.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_fleet.runtime.common import local_part


def partition(optimizer: torch.optim.Optimizer, world: int) -> dict[int, int]:
    """id(parameter) -> the rank that owns its optimizer state: each parameter group's parameters, largest first, to
    the rank holding the fewest elements so far (ties to the lowest rank), as ZeroRedundancyOptimizer partitions."""
    sizes = [0] * world
    owner: dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            if id(param) in owner:
                continue
            rank = min(range(world), key=lambda r: (sizes[r], r))
            owner[id(param)] = rank
            sizes[rank] += param.numel()
    return owner


class ShardedStep:
    """The step of one optimizer at shard level 1 over the data-parallel process ``group`` (None: the whole world):
    installed as the optimizer's ``step`` for the fit (:meth:`install`, :meth:`remove`). Under tensor parallelism each
    parameter is a DTensor: its local shard is what the owner steps and broadcasts within its dp group."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
        import torch.distributed as dist

        self.optimizer, self.group = optimizer, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.owner = partition(optimizer, self.world)
        self.params = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
        self._step: Callable[..., Any] | None = None
        self._own_step = False  # the optimizer object had a step of its own (an instance attribute) before install()
        self.quiet = False
        """Set while DCP's get_state_dict may step to create missing state: no broadcast (see TorchBackend.save)."""

    def install(self) -> None:
        """Route ``optimizer.step`` through :meth:`step` (an attribute of the instance; its class keeps its own)."""
        if self._step is None:
            self._own_step = "step" in vars(self.optimizer)
            self._step = self.optimizer.step
            self.optimizer.step = self.step  # type: ignore[method-assign]

    def remove(self) -> None:
        """The optimizer's own step again."""
        if self._step is not None:
            if self._own_step:
                self.optimizer.step = self._step  # type: ignore[method-assign]
            else:
                del self.optimizer.step
            self._step = None

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure`` (Lightning's training step and backward), step the parameters this rank owns, broadcast every
        owner's updated parameters (collective)."""
        assert self._step is not None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = [(p, p.grad) for p in self.params if self.owner[id(p)] != self.rank and p.grad is not None]
        for param, _ in hidden:
            param.grad = None
        try:
            self._step(**kwargs)
        finally:
            for param, grad in hidden:
                param.grad = grad
        if not self.quiet:
            self.broadcast()
        return loss

    def broadcast(self) -> None:
        """Each owner's parameters to every rank: one flat broadcast per owner (their dtype alike, else one per dtype)."""
        import torch.distributed as dist

        for src in range(self.world):
            owned = [p for p in self.params if self.owner[id(p)] == src]
            for dtype in dict.fromkeys(p.dtype for p in owned):
                same = [p for p in owned if p.dtype is dtype]
                local = [local_part(p.detach()) for p in same]
                flat = torch.cat([t.reshape(-1) for t in local])
                dist.broadcast(flat, src=self._global(src), group=self.group)
                if src != self.rank:
                    offset = 0
                    with torch.no_grad():
                        for tensor in local:
                            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                            offset += tensor.numel()

    def unowned_bytes(self) -> int:
        """Bytes the states of the parameters other replicas own take, at this rank's own states' bytes per element
        (what :meth:`gather_states` brings)."""
        held = [(p, s) for p, s in self.optimizer.state.items() if self.owner.get(id(p)) == self.rank]
        per_element = sum(t.element_size() * t.numel() for _, s in held for t in s.values() if isinstance(t, torch.Tensor))
        elements = sum(p.numel() for p, _ in held)
        unowned = sum(p.numel() for p in self.params if self.owner[id(p)] != self.rank)
        return per_element * unowned // elements if elements else 0

    def owned_only(self) -> None:
        """Drop the optimizer state of the parameters this rank does not own (after a load that filled them all)."""
        for param in self.params:
            if self.owner[id(param)] != self.rank:
                self.optimizer.state.pop(param, None)

    def gather_states(self) -> None:
        """Every rank receives the states it does not own from their owners (collective): the user's optimizer holds the
        whole state, as after DistributedDataParallel."""
        import torch.distributed as dist

        for src in range(self.world):
            owned = None
            if src == self.rank:
                owned = {index: {k: local_part(v) if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()}
                         for index, p in enumerate(self.params) if self.owner[id(p)] == src and p in self.optimizer.state}
            box = [owned]
            dist.broadcast_object_list(box, src=self._global(src), group=self.group)
            if src != self.rank:
                for index, state in (box[0] or {}).items():
                    param = self.params[index]
                    self.optimizer.state[param] = {k: _like(v, param) for k, v in state.items()}

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` of the group."""
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def _like(value: Any, param: torch.Tensor) -> Any:
    """A received state value on ``param``'s device; a local shard of a parameter's shape laid out as the parameter (a
    DTensor of its mesh and placements), a scalar such as Adam's ``step`` as it came."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.shape == param.to_local().shape and value.dim() > 0:
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False)
    return value.to(param.device)
