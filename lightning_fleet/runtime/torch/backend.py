"""TorchBackend: a Decision applied with torch's own stack -- engine, micro-steps, save, load, hand-back.

Shard level 0 is :class:`torch.nn.parallel.DistributedDataParallel` over the user's module (the module itself is never
changed: DDP wraps it, and the end of fit unwraps it), shard level 1 the same with the optimizer states partitioned over
the replicas (:mod:`lightning_fleet.runtime.torch.zero`); tensor parallelism is DTensor's, shard levels 2 and 3 are FSDP2
over its layers and itself (:mod:`lightning_fleet.runtime.torch.engine`: in place, undone at the end of fit). Checkpoints go through torch.distributed.checkpoint
(:mod:`lightning_fleet.runtime.torch.dcp`: every file read back by the restricted unpickler, checked against the
manifest), with Lightning's client state (loops, callbacks, hyper-parameters) in one file rank 0 writes beside them and
the layout file ``fleet export`` reads (:func:`read`).

Imports torch (torch.distributed at call time); imported by the runtime table on use
(:data:`lightning_fleet.runtime.RUNTIMES`) -- the strategy reaches it through the table, never by name.
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, write_atomic, write_derived
from lightning_fleet.elastic.layout import CLIENT as CLIENT_FILE
from lightning_fleet.elastic.layout import DCP_DIR, EXPORT_LAYOUT, IMPORTED, derived_listed, imported_dir, state_dir
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError, Plan, Precision
from lightning_fleet.runtime import runtime_named
from lightning_fleet.runtime.base import REPLICATED_CHECK, SHARDED_CHECK, Capabilities, FitView, FullState, TensorParallelSpec
from lightning_fleet.runtime.common import checkpointed_forward, engine_zeroes_gradients, save_atomic
from lightning_fleet.runtime.torch.capabilities import TORCH

LAYOUT_FORMAT = runtime_named(TORCH.name).layout_format
"""What the layout file of a torch checkpoint records as its ``format`` (the runtime table's fact)."""
_SKIPPED = ("state_dict", "optimizer_states")
"""What Lightning's checkpoint dict holds that the engine saves itself (through DCP)."""


class TorchBackend:
    """Applies a plan with torch's DistributedDataParallel, DTensor tensor parallelism and FSDP2; checkpoints through
    torch.distributed.checkpoint."""

    capabilities: Capabilities = TORCH
    """What torch executes here (the planner and the CLI read the same value)."""
    averages_micro_batches: bool = False
    """Autograd sums the micro-batches' gradients: the strategy weights each loss by 1/gas."""
    zeroes_gradients: bool = False
    """The engine does not zero gradients itself: the step's first micro-batch starts from the user's zero_grad."""

    def gradient_check(self, plan: Plan) -> str:
        """In ``param.grad``: whole on every rank under DDP (shard level 0, tp=1), else this rank's shard (FSDP's
        reduce-scatter, tensor parallelism's split)."""
        return REPLICATED_CHECK if plan.zero == 0 and plan.tp == 1 else SHARDED_CHECK

    def __init__(self) -> None:
        self._optimizers: list[Any] = []  # the optimizers of the engine being trained (saved and loaded with it)
        self._sharded: list[Any] = []  # at shard level 1: each optimizer's ShardedStep (runtime/torch/zero.py)
        self._keys: list[str] = []  # the module's state_dict keys in order, before the engine changed it

    def config(
        self, plan: Plan, *, gradient_clipping: float, device_type: str, tensor_parallel: TensorParallelSpec | None, universal: bool
    ) -> dict[str, Any]:
        """The engine's settings: the shard level and the layers tensor parallelism splits (gradient clipping is
        Lightning's own, through its precision plugin)."""
        return {"zero": plan.zero, "tensor_parallel": tensor_parallel}

    def preload(self) -> None:
        """Import torch.distributed, as a training process has it loaded."""
        import torch.distributed  # noqa: F401

    def precision_refusal(self, precision: str, device_type: str) -> str | None:
        """One line when torch's autocast cannot train the Lightning ``precision`` here, else None: fp16 autocast on a
        CPU (Lightning's own DDP turns it into bf16-mixed with a warning; the job would not train what it asked for)."""
        dtype = Precision.from_lightning(precision).compute_dtype
        if device_type == "cpu" and dtype == "fp16" and precision.endswith("-mixed"):
            return (f"precision={precision!r} on a CPU: torch's autocast runs bf16 there (Lightning's DDP switches to "
                    "'bf16-mixed'); use precision='bf16-mixed' or '32-true' for the torch runtime")
        return None

    def process_globals(self) -> Iterable[tuple[Any, str]]:
        """Nothing process-wide changes."""
        return []

    def module_patches(self, module: nn.Module, plan: Plan, layers: Iterable[nn.Module] | None, precision: Any) -> list[tuple[Any, str, Any]]:
        """(object, attribute, value) changes for one fit, undone at its end: full recomputation of each layer, under
        automatic optimization no gradient zeroing by Lightning between a step's micro-batches (the step's first
        micro-batch starts from the user's own ``optimizer_zero_grad``, strategy.py), and where tensor parallelism or
        FSDP2 lays the gradients out on meshes Lightning's norm clipping through ``torch.nn.utils.clip_grad_norm_``
        cannot mix, the precision plugin's ``clip_grad_by_norm`` through :func:`lightning_fleet.runtime.torch.engine.clip_grad_norm_`."""
        patches: list[tuple[Any, str, Any]] = []
        if plan.tp > 1 or plan.zero >= 2:
            from lightning_fleet.runtime.torch.engine import clip_grad_norm_

            def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
                clip_grad_norm_(precision.main_params(optimizer), clip_val)

            patches.append((precision, "clip_grad_by_norm", clip_grad_by_norm))
        if plan.recompute.value == "full" and layers is not None:
            patches += [(layer, "forward", checkpointed_forward(layer.forward)) for layer in layers]
        if getattr(module, "automatic_optimization", True):
            patches.append((module, "optimizer_zero_grad", engine_zeroes_gradients))
        return patches

    def build(self, module: nn.Module, optimizer: Any, scheduler: Any, *, plan: Plan, config: dict[str, Any], device_rank: int,
              layers: Sequence[nn.Module] | None) -> tuple[Any, Any]:
        """(engine, ``optimizer``) on the live default process group: DistributedDataParallel over ``module`` at shard
        level 0 without tensor parallelism, else DTensor tensor parallelism and FSDP2 over its layers and itself
        (:mod:`lightning_fleet.runtime.torch.engine`)."""
        self._optimizers, self._sharded = [], []  # this fit's (optimizer() adds them)
        zero = int(config["zero"])
        if zero not in TORCH.zero_stages:
            raise FleetError(f"plan {plan}: the torch runtime runs zero {', '.join(map(str, TORCH.zero_stages))}; use runtime='deepspeed' for zero={zero}")
        if zero >= 2 or plan.tp > 1:  # (shard level 1 with tp: the engine's own dp reduction, then the sharded step)
            from lightning_fleet.runtime.torch.engine import apply

            return apply(module, layers, plan=plan, tensor_parallel=config["tensor_parallel"]), optimizer
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device_rank] if next(module.parameters(), torch.empty(0)).device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids), optimizer

    def optimizer(self, engine: Any, optimizer: Any, *, plan: Plan) -> Any:
        """The optimizer the engine trains with: the user's own, remembered for saving and loading; at shard level 1
        with dp > 1 its ``step`` steps only the parameters this replica owns and broadcasts them (for the fit)."""
        self._optimizers.append(optimizer)
        if plan.zero == 1 and plan.dp > 1:
            from lightning_fleet.runtime.torch.zero import ShardedStep

            sharded = ShardedStep(optimizer, getattr(engine, "dp_group", None))
            sharded.install()
            self._sharded.append(sharded)
        return optimizer

    def no_sync(self, engine: Any) -> ContextManager[Any]:
        """A micro-batch that is not its step's last: DDP reduces nothing (its gradients accumulate locally)."""
        return engine.no_sync() if hasattr(engine, "no_sync") else nullcontext()

    def accumulate(self, engine: Any, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any]) -> None:
        """Backward of one micro-batch that is not the step's last, through Lightning's backward (its precision plugin
        and the module's backward hooks)."""
        backward(loss)

    def save(self, engine: Any, directory: str | Path, client_state: dict[str, Any]) -> None:
        """The engine's model and optimizer state through DCP under ``directory`` (every rank), and Lightning's client
        state beside it (rank 0)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from lightning_fleet.runtime.torch.dcp import save_state

        directory = Path(directory)
        with self._states_held():
            model_state, optimizer_state = get_state_dict(_inner(engine), self._optimizers)
        save_state(directory / DCP_DIR, {"model": model_state, "optimizer": optimizer_state})
        if _rank() == 0:
            kept = {k: v for k, v in client_state.items() if k not in _SKIPPED}
            save_atomic(kept, directory / CLIENT_FILE)

    def load(self, engine: Any, directory: str | Path, *, optimizer_states: bool, strict: bool,
             checkpoint: VerifiedCheckpoint | None) -> dict[str, Any]:
        """Load a checkpoint a torch engine wrote, at any world size (DCP reshards as it loads), and return the client
        state; every file is read by the restricted unpickler, checked against ``checkpoint``'s manifest when given."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
            set_state_dict,
        )

        from lightning_fleet.runtime.torch.dcp import load_state

        directory = Path(directory)
        if not (directory / DCP_DIR).is_dir() or not (directory / CLIENT_FILE).is_file():
            raise FleetError(f"{directory} holds no checkpoint of the torch runtime (no {DCP_DIR}/ and {CLIENT_FILE}): point ckpt_path at a FleetCheckpoint step or a trainer.save_checkpoint dir of it")
        module = _inner(engine)
        with self._states_held():
            model_state, optimizer_state = get_state_dict(module, self._optimizers)
        state = {"model": model_state, "optimizer": optimizer_state} if optimizer_states else {"model": model_state}
        load_state(directory / DCP_DIR, state, checkpoint=checkpoint)
        options = StateDictOptions(strict=strict)
        if self._sharded:  # shard level 1: each rank loads the states of the parameters it owns, the others it does not hold
            set_model_state_dict(module, state["model"], options=options)
            if optimizer_states:
                set_optimizer_state_dict(module, self._optimizers, state["optimizer"], options=StateDictOptions(strict=False))
        else:
            set_state_dict(module, self._optimizers, model_state_dict=state["model"],
                           optim_state_dict=state.get("optimizer", optimizer_state), options=options)
        for sharded in self._sharded:
            sharded.owned_only()
        return load_file(directory / CLIENT_FILE, _entry(checkpoint, directory / CLIENT_FILE))

    @contextmanager
    def _states_held(self) -> Iterator[None]:
        """Where DCP's get_state_dict may create missing optimizer state (its ``_init_optim_state``: a step with zero
        gradients at lr 0), at shard level 1 each rank creates only the states it owns, with no broadcast (a rank that owns
        none would otherwise wait alone): each rank saves, and loads, the states it holds."""
        for sharded in self._sharded:
            sharded.quiet = True
        try:
            yield
        finally:
            for sharded in self._sharded:
                sharded.quiet = False

    def reshard(self, checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """Nothing to convert: DCP reshards as each rank loads."""
        return checkpoint

    def export_state(self, checkpoint: VerifiedCheckpoint) -> FullState:
        """Rank 0, one process: the whole DCP save of a torch checkpoint (every file checked against the manifest and
        read by the restricted unpickler) and its client state."""
        from lightning_fleet.runtime.torch.dcp import read_full

        directory = state_dir(checkpoint.path)
        state = read_full(directory / DCP_DIR, checkpoint=checkpoint)
        client = load_file(directory / CLIENT_FILE, _entry(checkpoint, directory / CLIENT_FILE))
        return FullState(model=state.get("model") or {}, optimizer=state.get("optimizer") or {}, client=client)

    def import_state(self, checkpoint: VerifiedCheckpoint, state: FullState) -> VerifiedCheckpoint:
        """Rank 0, one process: another runtime's checkpoint written once beside it as a torch one (a DCP save of its
        whole tensors, which every layout of this runtime loads, and its client state), then listed in its manifest;
        a kill midway leaves an unlisted temporary directory that is never loaded."""
        from lightning_fleet.runtime.torch.dcp import save_state

        def written(directory: Path) -> None:
            save_state(directory / DCP_DIR, {"model": dict(state.model), "optimizer": dict(state.optimizer)}, alone=True)
            save_atomic(dict(state.client), directory / CLIENT_FILE)

        return write_derived(checkpoint, IMPORTED, written)

    def derived_of(self, checkpoint: VerifiedCheckpoint) -> Path:
        """A resharded torch checkpoint loads from where it was saved (DCP reshards as it loads); another runtime's,
        from its imported form."""
        if derived_listed(checkpoint.manifest, IMPORTED):
            return imported_dir(checkpoint.path)
        return state_dir(checkpoint.path)

    def record(self, module: nn.Module) -> nn.Module:
        """The module itself (DDP wraps it; what FSDP and tensor parallelism change, the hand-back undoes), and its
        state_dict keys in order, for the layout file."""
        self._keys = list(module.state_dict().keys())
        return module

    def hand_back_bytes(self, record: nn.Module) -> int:
        """Under DDP nothing to gather (the module holds the whole trained weights on every rank); under FSDP or tensor
        parallelism every parameter and optimizer state tensor whole, at its dtype (their DTensors' global shapes)."""
        if self._sharded:  # shard level 1: the states of the parameters other replicas own, at this rank's bytes per element
            return sum(sharded.unowned_bytes() for sharded in self._sharded)
        if not self._optimizers or not any(_is_dtensor(p) for p in record.parameters()):
            return 0
        tensors = {id(p): p for p in record.parameters()}
        for optimizer in self._optimizers:
            tensors.update((id(t), t) for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
        return sum(t.element_size() * t.numel() for t in tensors.values())

    def hand_back(self, fit: FitView, record: nn.Module) -> None:
        """End of fit (collective under FSDP): the fit holds the plain module again, with the trained weights
        whole on every rank (FSDP, tensor parallelism: gathered, their hooks and classes removed, the optimizers over the
        plain parameters, :func:`lightning_fleet.runtime.torch.engine.release`), and the engine is let go while the process group lives: a
        DDP wrapper alive at interpreter exit keeps its reducer's gloo group until the teardown, whose destruction there
        aborts the process ("terminate called without an active exception", seen on rank 1 after a finished fit;
        pytorch/pytorch#65231). Later saves need only the module and its optimizers."""
        from lightning_fleet.runtime.torch.engine import ParallelEngine, release

        engine = fit.engine
        for sharded in self._sharded:  # every replica holds every state again, the optimizer its own step
            sharded.gather_states()
            sharded.remove()
        self._sharded = []
        if isinstance(engine, ParallelEngine):
            release(engine, self._optimizers)
        fit.engine = record

    def write_layout(self, fit: FitView, directory: str | Path, record: Any) -> None:
        """Rank 0: the layout file ``fleet export`` reads (the plan, the world, the format, the module's keys in order)."""
        if fit.global_rank != 0:
            return
        layout = {"format": LAYOUT_FORMAT, "plan": str(fit.plan), "world_size": fit.world_size, "dcp": DCP_DIR,
                  "client": CLIENT_FILE, "keys": self._keys}
        write_atomic(Path(directory) / EXPORT_LAYOUT, json.dumps(layout, indent=1))

    def state_of(self, step: Path) -> Path:
        """Where a FleetCheckpoint step keeps this runtime's checkpoint."""
        return state_dir(step)


def read(directory: Path, layout: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``fleet export``'s reader: the full weights of a torch checkpoint in ``directory``, keyed and shaped like the
    module's ``state_dict()`` (floating tensors fp32), and Lightning's client state; offline, one process."""
    from lightning_fleet.runtime.torch.dcp import read_full

    state = read_full(directory / str(layout.get("dcp", DCP_DIR)))
    weights = state.get("model")
    if not isinstance(weights, Mapping):
        raise FleetError(f"{directory / DCP_DIR} holds no model state: it is not a checkpoint of the torch runtime")
    full = {key: value.float() if value.is_floating_point() else value for key, value in weights.items() if isinstance(value, torch.Tensor)}
    keys = layout.get("keys")
    order = [key for key in keys if isinstance(key, str) and key in full] if isinstance(keys, list) else []  # the module's
    ordered = set(order)
    full = {key: full[key] for key in [*order, *(key for key in full if key not in ordered)]}
    return full, load_file(directory / str(layout.get("client", CLIENT_FILE)))


def _inner(engine: Any) -> nn.Module:
    """The module an engine trains (DDP's ``module``)."""
    return getattr(engine, "module", engine)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _entry(checkpoint: VerifiedCheckpoint | None, path: Path) -> Any:
    """The manifest entry of ``path`` in ``checkpoint`` (None without one); FleetError when the manifest does not list it."""
    if checkpoint is None:
        return None
    name = path.relative_to(checkpoint.path).as_posix()
    entry = checkpoint.manifest.files.get(name)
    if entry is None:
        raise FleetError(f"checkpoint {checkpoint.path}: {name} is not listed in its manifest; use another checkpoint")
    return entry
