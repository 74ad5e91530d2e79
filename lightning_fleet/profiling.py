"""nn.Module -> ModelSpec, measured without touching the user's module.

Everything runs on an isolated copy of the module (its parameters become meta tensors, or share the
original's storage for a real run); the module, its attributes, buffers, metrics, hooks, the
trainer's logged values and the RNG streams are exactly as before afterwards.

Three methods, tried in order (:class:`Method`):

``meta``
    ``training_step`` runs once on a meta copy of the example batch: no real memory, no real
    FLOPs. torch's FlopCounterMode counts the forward FLOPs and autograd's saved-tensor hooks see
    every tensor kept for backward; both are attributed to the block running at that moment: ``pre``
    (everything before the first layer), each layer, ``post`` (everything after the last layer, the
    loss included), and so are the output elements of the operators that do no matmul (the
    memory-bound rest: norms, activations, softmax, residual adds, copies). The forward suffices: the
    cost model takes backward as 2x forward (Narayanan 2021), so no backward pass is run. What meta
    tensors cannot do is stood in for and counted: ``.item()``/``bool()`` return a stand-in, boolean
    masks, ``nonzero`` and ``unique`` select everything (an upper bound), real tensors meeting meta
    ones become meta, tensors created without a device land on meta. ``scaled_dot_product_attention``
    (however it is reached: ``F.``/``torch.nn.functional.``, a name imported from there,
    ``nn.MultiheadAttention``/``nn.Transformer*`` with ``need_weights=False``) runs as the fused kernel
    a GPU runs for it (FlashAttention-2 or memory-efficient attention): it keeps q, k, v, the output
    and an fp32 logsumexp per head and query for backward, never the s x s probabilities the meta
    device's math path keeps (``attention_kernel="math"`` prices the math path; see
    :class:`AttentionKernel`). Its FLOPs are marked as a fused kernel's (``BlockSpec.attention_flops``), and of them
    half as executed when the call passes ``is_causal=True`` and no ``attn_mask`` (the kernel skips the blocks above
    the diagonal; ``attention_kernel_flops``). Attention written by hand (matmul, softmax) is measured as written.
``real``
    The same measurement on a real slice of the example batch (2 samples), on a copy whose
    parameters share the original's storage (no weight copy, no backward, no optimizer step, no
    in-place write to a parameter), scaled per sample.
``parameters``
    Exact parameter counts; FLOPs and activations from stated rules of thumb (see ``notes``).

Layers are the module's ``fleet_layers()`` (optional hook) or, without it, the largest
``nn.ModuleList``/``nn.Sequential`` anywhere in the module whose children are all of one type.
``fleet_tensor_parallel()`` (optional hook) gives the head count and the AutoTP patterns, from which
each layer's tensor-parallel all-reduces are counted; the key/value heads (the hook's, or a Hugging Face config's)
go into the spec's ``num_kv_heads``. Both hooks must be pure: they are called on
the module itself, and a malformed answer is a FleetError (both are read in :mod:`lightning_fleet.hooks`).

Imports torch, the planning core and the module's hooks (lightning_fleet/hooks.py); imported by the strategy and the
calibration probe.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import re
import threading
import types
from collections import Counter
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

from lightning_fleet import rng
from lightning_fleet.hooks import (
    PIPELINE_SHAPE,
    attention_shape,
    discovered_layers,
    find_layers,
    pipeline_hook,
    stack_problem,
    tensor_parallel_hook,
)
from lightning_fleet.planning import BlockSpec, FleetError, ModelSpec, Precision, Role
from lightning_fleet.planning.model import (
    CAUSAL_ATTENTION_SHARE,
    AttentionKernel,
    layer_act_replicated_bytes,
    layer_act_sharded_bytes,
    layer_elementwise,
)
from lightning_fleet.runtime.base import TensorParallelSpec

aten = torch.ops.aten

REAL_SAMPLES = 2
"""Samples of the example batch the ``real`` method runs (BatchNorm in training needs 2)."""
REAL_RUN_FLOPS = 1e12
"""Most forward FLOPs the ``real`` method may spend, estimated before it runs as 2 per parameter per token (Kaplan et
al. 2020) for its samples: about 25 s on one CPU core at ~40 GFLOP/s (docs/MEASURED.md), seconds on a GPU."""
BATCH_CHECK_FLOPS = 2e10
"""Most forward FLOPs the micro-batch check may spend: about 0.5 s on one CPU core at the ~40 GFLOP/s a core of
the development machine reaches on layer GEMMs (docs/MEASURED.md), far less on a GPU."""
BATCH_CHECK_RTOL = 1e-4
"""Relative difference between the loss of a batch and the mean loss of its halves above which the loss depends on
the micro-batch; 16-bit losses use 8 ulps instead when larger. fp32 reductions over 2 vs 4 samples differ by ~1e-7."""
_PLACEHOLDER_STEPS = 1000
"""``trainer.estimated_stepping_batches`` as the copy sees it before the trainer has loaded its data (a scheduler
built for profiling only needs a positive length)."""
_REASON_CHARS = 200


class Method(StrEnum):
    """How a profile was measured, best first."""

    META = "meta"
    """Exact: training_step ran on meta tensors (no real compute)."""
    REAL = "real"
    """training_step ran on a small real slice of the example batch; per-sample values scaled from it."""
    PARAMETERS = "parameters"
    """Parameter counts only; FLOPs and activations from rules of thumb."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """What profiling a module found and how far to trust it."""

    spec: ModelSpec
    """The per-block, per-sample costs the planner prices."""
    method: Method
    """How ``spec`` was measured."""
    fallback_reason: str = ""
    """'' when meta worked; else why the better method(s) failed, one line."""
    notes: tuple[str, ...] = ()
    """One line each: what the method and its approximations mean for the plan."""
    batch_dependent: bool | None = None
    """Whether the loss depends on how the batch is split into micro-batches; None when not checked (see notes)."""
    sparse_params: tuple[str, ...] = ()
    """Names of the trainable parameters whose gradients are sparse (looked up with ``sparse=True``): a runtime must run
    them (:attr:`~lightning_fleet.runtime.base.ModuleHooks.sparse_params`)."""
    pipeline_problem: str = ""
    """Why ``fleet_pipeline()``'s layers cannot run as a pipeline (:func:`pipeline_problem`); '' when they can or the
    module has no such hook. The report says it too."""

    def report_lines(self) -> list[str]:
        """The lines a start-up report prints: the method (and why a better one failed), then the notes."""
        head = f"profiling: {self.method.value} ({_METHOD_WORDS[self.method]})"
        if self.fallback_reason:
            head += f"; {self.fallback_reason}"
        return [head, *(f"  {note}" for note in self.notes)]


_METHOD_WORDS = {
    Method.META: "exact, training_step on meta tensors",
    Method.REAL: f"training_step on {REAL_SAMPLES} real samples",
    Method.PARAMETERS: "parameter counts only",
}


# --- batches ----------------------------------------------------------------------------------------


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


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with every tensor replaced by ``fn(tensor)``: lists, tuples, named tuples, mappings and dataclasses."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        out = copy.copy(batch)
        out.update({k: _map_tensors(v, fn) for k, v in batch.items()})
        return out
    if isinstance(batch, Mapping):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: _map_tensors(getattr(batch, f.name), fn) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **fields)
    return batch


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch, in order."""
    found: list[torch.Tensor] = []
    _map_tensors(batch, found.append)
    return found


def _meta_like(batch: Any) -> Any:
    """The example batch on the meta device (same shapes and dtypes)."""
    return _map_tensors(batch, lambda t: torch.empty_like(t, device="meta"))


def _slice(batch: Any, start: int, stop: int, samples: int, device: torch.device) -> Any:
    """Samples ``start:stop`` of a batch of ``samples``, as fresh tensors on ``device`` (tensors whose first dimension is
    not the batch stay whole)."""

    def take(t: torch.Tensor) -> torch.Tensor:
        part = t[start:stop] if t.dim() and t.shape[0] == samples else t
        return part.to(device=device, copy=True)

    return _map_tensors(batch, take)


# --- isolation: a copy to run, answers to Lightning's calls, global state kept -----------------------


class _Absorb:
    """A stand-in that accepts any attribute access and call (a logger the copy may write to)."""

    def __getattr__(self, name: str) -> "_Absorb":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_Absorb":
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(())


class _TrainerView:
    """The trainer as the copy sees it: reads go to the real trainer, writes stay here, loggers absorb everything, and
    ``estimated_stepping_batches`` never makes the trainer load its data early."""

    def __init__(self, trainer: Any) -> None:
        self.__dict__["_real"] = trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)

    @property
    def estimated_stepping_batches(self) -> float:
        """The real value when the trainer can give it without loading data, else a placeholder."""
        real = self.__dict__["_real"]
        if getattr(real, "max_steps", -1) and real.max_steps > 0:
            return real.max_steps
        if getattr(real, "train_dataloader", None) is not None:
            return real.estimated_stepping_batches
        return _PLACEHOLDER_STEPS

    @property
    def logger(self) -> Any:
        return _Absorb() if self.__dict__["_real"].logger is not None else None

    @property
    def loggers(self) -> list[Any]:
        return [_Absorb() for _ in self.__dict__["_real"].loggers]


class _NullOptimizer:
    """An optimizer whose step and zero_grad do nothing (a closure passed to step still runs: it is the forward)."""

    def __init__(self, inner: Any) -> None:
        self.optimizer = inner

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    @contextmanager
    def toggle_model(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class _NullScheduler:
    """A learning-rate scheduler whose step does nothing."""

    def __init__(self, inner: Any) -> None:
        self.scheduler = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def _optimizer_config(conf: Any) -> tuple[list[Any], list[Any]]:
    """(optimizers, schedulers) of a ``configure_optimizers`` answer, parsed as Lightning parses it."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    if conf is None:
        return [], []
    optimizers, schedulers, _ = _configure_optimizers(conf)
    return list(optimizers), [_scheduler_of(s) for s in schedulers]


def _scheduler_of(entry: Any) -> Any:
    return entry["scheduler"] if isinstance(entry, Mapping) else entry


class _Stubs:
    """Answers, on the copy, the Lightning calls a training step may make without a training loop around it."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.last_loss: torch.Tensor | None = None
        self._optimizers: list[_NullOptimizer] | None = None
        self._schedulers: list[_NullScheduler] = []

    def _configure(self) -> None:
        if self._optimizers is not None:
            return
        configure = getattr(self.root, "configure_optimizers", None)
        try:
            with _disable_current_modes(), torch.no_grad():
                optimizers, schedulers = _optimizer_config(configure() if callable(configure) else None)
        except Exception:  # the count of optimizers is all the copy needs; one will do
            optimizers, schedulers = [], []
        self._optimizers = [_NullOptimizer(o) for o in optimizers] or [_NullOptimizer(None)]
        self._schedulers = [_NullScheduler(s) for s in schedulers]

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        self._configure()
        assert self._optimizers is not None
        return self._optimizers[0] if len(self._optimizers) == 1 else list(self._optimizers)

    def lr_schedulers(self) -> Any:
        self._configure()
        if not self._schedulers:
            return None
        return self._schedulers[0] if len(self._schedulers) == 1 else list(self._schedulers)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.last_loss = loss

    def install(self, module: nn.Module) -> None:
        """Put the answers on one (Lightning) module of the copy as instance attributes."""
        for name in ("log", "log_dict", "print", "clip_gradients", "toggle_optimizer", "untoggle_optimizer"):
            module.__dict__[name] = _ignore
        module.__dict__["optimizers"] = self.optimizers
        module.__dict__["lr_schedulers"] = self.lr_schedulers
        module.__dict__["manual_backward"] = self.manual_backward


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _is_lightning_module(module: nn.Module) -> bool:
    return callable(getattr(module, "training_step", None)) and callable(getattr(module, "log", None))


def _new_parameter(p: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A parameter of the copy: a meta tensor, or a detached one sharing the original's storage (no weight copy)."""
    data = torch.empty_like(p, device="meta") if on_meta else p.detach()
    if isinstance(p, nn.Parameter):
        return nn.Parameter(data, requires_grad=p.requires_grad)
    return data.requires_grad_(p.requires_grad)


def _new_tensor(t: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A buffer or tensor attribute of the copy: a meta tensor, or a detached clone."""
    out = torch.empty_like(t, device="meta") if on_meta else t.detach().clone()
    return out.requires_grad_(t.requires_grad) if t.is_leaf and (t.is_floating_point() or t.is_complex()) else out


def _held_in(value: Any, wanted: Callable[[Any], bool], depth: int = 2) -> Iterator[Any]:
    """The objects ``wanted`` accepts among an attribute value and the containers it holds, ``depth`` containers deep."""
    if wanted(value):
        yield value
    elif depth and isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _held_in(item, wanted, depth - 1)
    elif depth and isinstance(value, Mapping):
        for item in value.values():
            yield from _held_in(item, wanted, depth - 1)


def _tensors_in(value: Any) -> Iterator[Any]:
    """Tensors and torch Generators held by an attribute value, two containers deep."""
    return _held_in(value, lambda v: isinstance(v, (torch.Tensor, torch.Generator)))


SHARED_ARRAY_BYTES = 1 << 20
"""numpy arrays at least this large are shared with the copy, not copied (see :func:`_shared_in`)."""


def _shared_in(value: Any) -> Iterator[Any]:
    """Objects an attribute holds that the copy shares with the module instead of copying: data sources (Dataset,
    DataLoader, Sampler: a LightningModule often keeps its data set from ``setup()``, and a copy would hold the data
    twice per profiling run, on every rank) and numpy arrays of SHARED_ARRAY_BYTES or more. A training_step reads them;
    one that changed them in place would change the module's."""
    return _held_in(value, _is_shared)


def _is_shared(value: Any) -> bool:
    large_array = hasattr(value, "__array_interface__") and getattr(value, "nbytes", 0) >= SHARED_ARRAY_BYTES
    return isinstance(value, (Dataset, DataLoader, Sampler)) or large_array


def _clone_generator(g: torch.Generator) -> torch.Generator:
    clone = torch.Generator(device=g.device)
    clone.set_state(g.get_state())
    return clone


def _replacements(module: nn.Module, on_meta: bool) -> dict[int, Any]:
    """id(original) -> what the copy holds instead: parameters, buffers, tensor attributes, generators; the trainer,
    fabric and data sources (:func:`_shared_in`) map to themselves (never copied)."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = _new_parameter(p, on_meta)
        for b in m._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = _new_tensor(b, on_meta)
        for key, value in m.__dict__.items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            if key in ("_trainer", "_fabric") and value is not None:
                memo[id(value)] = value
                continue
            for t in _tensors_in(value):
                if id(t) not in memo:
                    memo[id(t)] = _clone_generator(t) if isinstance(t, torch.Generator) else _new_tensor(t, on_meta)
            for shared in _shared_in(value):
                memo[id(shared)] = shared
    return memo


def _structural_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A copy built module by module when deepcopy fails (an unpicklable attribute): new parameter, buffer and module
    dicts, containers one level deep, tensors replaced; other attribute objects are shared with the original."""

    def copy_value(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, nn.Module):
            return copy_module(value)
        if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
            return types.MethodType(value.__func__, copy_module(value.__self__))
        if isinstance(value, (list, set)) or type(value) is tuple:
            return type(value)(memo.get(id(v), v) for v in value)
        if isinstance(value, dict):
            out = copy.copy(value)
            out.update({k: memo.get(id(v), v) for k, v in value.items()})
            return out
        return value

    def copy_module(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new = m.__class__.__new__(m.__class__)
        memo[id(m)] = new
        state = {}
        for key, value in m.__dict__.items():
            if key == "_modules":
                state[key] = {k: None if c is None else copy_module(c) for k, c in value.items()}
            elif key in ("_parameters", "_buffers"):
                state[key] = {k: None if t is None else memo[id(t)] for k, t in value.items()}
            else:
                state[key] = copy_value(value)
        new.__dict__.update(state)
        return new

    return copy_module(module)


def _isolated_copy(module: nn.Module, on_meta: bool) -> tuple[nn.Module, _Stubs]:
    """A copy of ``module`` to run: parameters on meta (or sharing storage), buffers and tensor attributes replaced,
    Lightning's calls answered by stubs, the trainer seen through a view, torchmetrics' value checks off."""
    memo = _replacements(module, on_meta)
    try:
        clone = copy.deepcopy(module, dict(memo))
    except Exception:
        clone = _structural_copy(module, dict(memo))
    stubs = _Stubs(clone)
    trainer = getattr(module, "_trainer", None)
    for m in clone.modules():
        if "_trainer" in m.__dict__ and trainer is not None:
            m.__dict__["_trainer"] = _TrainerView(trainer)
        if on_meta and "_device" in m.__dict__:
            m.__dict__["_device"] = torch.device("meta")
        if isinstance(m.__dict__.get("validate_args"), bool):  # torchmetrics reads tensor values to validate inputs
            m.__dict__["validate_args"] = False
        if _is_lightning_module(m):
            stubs.install(m)
    return clone, stubs


def _dismantle(clone: nn.Module) -> None:
    """Empty every module of a copy, so that what it kept (losses, graphs, activations) is freed now, not by the cycle
    collector later."""
    for m in list(clone.modules()):
        m.__dict__.clear()


@contextmanager
def _global_state_kept() -> Iterator[None]:
    """The RNG streams (lightning_fleet.rng) and the grad mode, as they were on entry, on exit."""
    grad = torch.is_grad_enabled()
    try:
        with rng.kept():
            yield
    finally:
        torch.set_grad_enabled(grad)


def _reason(method: Method, err: BaseException) -> str:
    """One line: which method failed and why."""
    text = " ".join(str(err).split())
    line = f"{method.value} failed: {type(err).__name__}" + (f": {text}" if text else "")
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."


# --- dispatch modes ---------------------------------------------------------------------------------


def _storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by its views); the tensor's own identity when it has none (sparse)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _ParameterWrite(RuntimeError):
    """The step writes into a parameter in place (the real method shares the user's weights)."""


def _check_no_parameter_write(func: Any, args: tuple, kwargs: dict, guarded: set[int]) -> None:
    """Raise before an operator writes in place into one of the ``guarded`` storages."""
    if not guarded or not func._schema.is_mutable:
        return
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if any(_storage_id(t) in guarded for t in _tensors(value)):
            raise _ParameterWrite(f"training_step writes into a parameter in place ({func})")


_LINEAR_GEMMS = {aten.mm: 0, aten.addmm: 1}
"""The 2-d matmuls a Linear layer dispatches, and where their [M x K] @ [K x N] operands start in the arguments."""
_NO_DATA_MOVED = (aten._unsafe_view, aten.alias, aten.lift_fresh)
"""Operators that return their input's storage (aliases not marked as views)."""


_SPARSE_LOOKUPS = (aten.embedding, aten._embedding_bag, aten._embedding_bag_forward_only)
"""Operators whose weight gets a sparse gradient when their ``sparse`` argument is true (``nn.Embedding``/
``nn.EmbeddingBag(sparse=True)``, ``F.embedding``/``F.embedding_bag(..., sparse=True)``): one row per index looked up."""


class _OpCounter(TorchDispatchMode):
    """Counts the operators a forward pass dispatches (each costs host time, whatever its size), hands the output
    elements of every operator that does no matmul to the recorder (memory-bound work: norms, activations, softmax,
    adds, copies; views move no data and are not counted), tells it which parameter storages each operator reads, and
    refuses in-place writes into ``guarded`` storages."""

    def __init__(self, recorder: "_Recorder", guarded: set[int]) -> None:
        super().__init__()
        self.ops = 0
        self.recorder = recorder
        self.guarded = guarded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        _check_no_parameter_write(func, args, kwargs, self.guarded)
        self.ops += 1
        inputs = _tensors((args, kwargs))
        self.recorder.use_storages(inputs)
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _SPARSE_LOOKUPS and _arg(func, args, kwargs, "sparse"):
            self.recorder.sparse_lookup(_arg(func, args, kwargs, "weight"), _arg(func, args, kwargs, "indices"))
        if packet in _LINEAR_GEMMS:
            a, b = args[_LINEAR_GEMMS[packet] : _LINEAR_GEMMS[packet] + 2]
            self.recorder.add_gemm(a.shape[0], a.shape[1], b.shape[1])
        if packet not in flop_registry and packet is not _CPU_ATTENTION and not func.is_view and packet not in _NO_DATA_MOVED:
            elements = sum(t.numel() for t in _tensors(out) if t.is_floating_point())
            if elements and inputs:
                self.recorder.add_elementwise(elements)
        return out


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _long(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.long, device="meta")


def _scalar_stand_in(t: torch.Tensor) -> bool | int | float:
    """What ``.item()`` of a meta tensor returns: False for booleans (the unremarkable case of a check), 1 for integers
    (a usable count or divisor), 1.0 for floats."""
    if t.dtype is torch.bool:
        return False
    return 1.0 if t.is_floating_point() or t.is_complex() else 1


def _bool_indices_as_long(indices: list[Any]) -> list[Any]:
    """Boolean index masks as the long indices ``nonzero`` would give if every element were selected."""
    out: list[Any] = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            out += [_long(index.numel()) for _ in range(index.dim())]
        else:
            out.append(index)
    return out


def _unique_upper_bound(x: torch.Tensor, inverse: bool, counts: bool, dim: int | None = None) -> tuple[torch.Tensor, ...]:
    values = torch.empty_like(x) if dim is not None else torch.empty(x.numel(), dtype=x.dtype, device="meta")
    n = x.shape[dim] if dim is not None else x.numel()
    inverse_shape = (n,) if dim is not None else tuple(x.shape)
    return values, _long(*inverse_shape) if inverse else _long(0), _long(n) if counts else _long(0)


def _upper_bound(func: Any, args: tuple, kwargs: dict) -> Any:
    """The output of a data-dependent-shape operator on meta tensors if everything were selected; None if unknown."""
    packet = func.overloadpacket
    if packet is aten.nonzero:
        return _long(args[0].numel(), args[0].dim())
    if packet is aten.masked_select:
        shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
        return torch.empty(math.prod(shape), dtype=args[0].dtype, device="meta")
    if packet in (aten.index, aten._unsafe_index) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    ):
        return func(args[0], _bool_indices_as_long(list(args[1])), *args[2:], **kwargs)
    if packet is aten._unique2:
        return _unique_upper_bound(args[0], *[_arg(func, args, kwargs, n) for n in ("return_inverse", "return_counts")])
    if packet is aten._unique:
        return _unique_upper_bound(args[0], _arg(func, args, kwargs, "return_inverse"), False)[:2]
    if packet in (aten.unique_dim, aten.unique_consecutive):
        flags = [_arg(func, args, kwargs, n) for n in ("return_inverse", "return_counts")]
        return _unique_upper_bound(args[0], *flags, dim=_arg(func, args, kwargs, "dim"))
    if packet is aten.bincount and (_arg(func, args, kwargs, "minlength") or 0) > 0:  # values assumed below minlength
        weights = _arg(func, args, kwargs, "weights")
        dtype = torch.long if weights is None else weights.dtype
        return torch.empty(_arg(func, args, kwargs, "minlength"), dtype=dtype, device="meta")
    return None


def _arg(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """An operator argument by schema name, positional, keyword or default."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, arg.default_value)
    raise KeyError(name)


_SCALAR_OPS = {aten._local_scalar_dense: None, aten.equal: True, aten.allclose: True, aten.is_nonzero: False}
"""Operators that return a Python value read from tensor data: the stand-in (None: by dtype)."""


class _MetaFixups(TorchDispatchMode):
    """What meta tensors cannot do, stood in for and counted: real tensors meeting meta ones become meta; values read
    from data get a stand-in; data-dependent shapes get their upper bound (everything selected); copies off the meta
    device stay on it."""

    def __init__(self) -> None:
        super().__init__()
        self.assumed: Counter[str] = Counter()
        self.bounded: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        tensors = _tensors((args, kwargs))
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            args, kwargs = pytree.tree_map_only(torch.Tensor, _meta, (args, kwargs))
        if tensors and all(t.is_meta for t in _tensors((args, kwargs))):
            packet = func.overloadpacket
            if packet in _SCALAR_OPS:
                self.assumed[packet.__name__] += 1
                stand_in = _SCALAR_OPS[packet]
                return _scalar_stand_in(args[0]) if stand_in is None else stand_in
            if torch.Tag.dynamic_output_shape in func.tags or packet in (aten.index, aten._unsafe_index):
                bound = _upper_bound(func, args, kwargs)
                if bound is not None:
                    self.bounded[packet.__name__] += 1
                    return bound
            if packet is aten._to_copy and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta":
                kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **kwargs)


class _Deterministic(TorchDispatchMode):
    """For the micro-batch check: dropout keeps everything (no RNG, the same in every run), other random operators are
    noted (they make runs incomparable), in-place writes into ``guarded`` storages refused."""

    def __init__(self, guarded: set[int]) -> None:
        super().__init__()
        self.guarded = guarded
        self.random_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        _check_no_parameter_write(func, args, kwargs, self.guarded)
        packet = func.overloadpacket
        if packet is aten.native_dropout:
            x = args[0]
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        if packet in (aten.bernoulli, aten.bernoulli_):
            target = args[0] if packet is aten.bernoulli_ else torch.empty_like(args[0])
            return target.fill_(1)
        if torch.Tag.nondeterministic_seeded in func.tags:
            if any(arg.name == "dropout_p" for arg in func._schema.arguments):  # fused attention: its dropout off
                args, kwargs = _with_arg(func, args, kwargs, "dropout_p", 0.0)
            else:
                self.random_ops.add(packet.__name__)
        return func(*args, **kwargs)


def _with_arg(func: Any, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the schema argument ``name`` set to ``value``."""
    position = next(i for i, arg in enumerate(func._schema.arguments) if arg.name == name)
    if position < len(args):
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return args, {**kwargs, name: value}


# --- attention: scaled_dot_product_attention as the fused kernel a GPU runs ---------------------------


_SDPA = torch._C._nn.scaled_dot_product_attention
"""The builtin behind ``torch.nn.functional.scaled_dot_product_attention`` (the same object)."""
FLASH_MAX_HEAD_DIM = 256
"""Largest head dimension PyTorch's FlashAttention-2 takes (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
``check_head_dim_size_flash``: "less than or equal to 256")."""
BIAS_ALIGNMENT = 16
"""Memory-efficient attention pads an attention bias whose key length is not a multiple of 16 (a copy; attention.cpp
``preprocess_mask``, ``mem_eff_alignment = 16``)."""
_PER_HEAD = -1
"""The 'last dimension' under which a fused attention kernel's saved tensors are recorded: split by tp (per head)."""
_CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu
"""PyTorch's fused CPU attention: what scaled_dot_product_attention runs on CPU tensors unless dropout is on (the real
method). torch's flop counter has no formula for it; it gets its CUDA siblings' (``sdpa_flop``)."""


def _cpu_attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    """Forward FLOPs of the fused CPU attention: QK^T and PV (torch.utils.flop_counter ``sdpa_flop_count``)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_arguments(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, *,
    scale: float | None = None, enable_gqa: bool = False,
) -> tuple[Any, Any, Any, Any, float, bool, float | None]:
    """A call's arguments by name, as ``scaled_dot_product_attention`` takes them (enable_gqa is validated by the
    call itself: the fused kernels take fewer key/value heads natively)."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale


def _fused_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, is_causal: bool, sixteen_bit: bool
) -> tuple[str, str]:
    """(kernel, '') for the fused kernel a CUDA GPU (sm80 or newer) runs for this call, or ('', why it runs the math
    path too). PyTorch tries flash, then memory-efficient, then math (sdp_utils.cpp ``select_sdp_backend``): flash takes
    no mask, 16-bit inputs only, equal head dims up to 256 and causal masks on square scores only; memory-efficient takes
    fp32 too and a mask, with head dims a multiple of 8 (16-bit) or 4 (fp32) (``check_head_dim_size_mem_efficient``,
    ``minimum_gemm_alignment``); both take grouped key/value heads (``supports_gqa``)."""
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if any(type(t) not in (torch.Tensor, nn.Parameter) or t.is_nested or t.layout is not torch.strided for t in tensors):
        return "", "tensor subclass or nested/sparse inputs"
    if q.dim() not in (3, 4):
        return "", f"{q.dim()}-d inputs"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "", f"{q.dtype} inputs (no fused kernel)"
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    square = q.shape[-2] == k.shape[-2]
    if mask is None and sixteen_bit and d_q == d_k == d_v <= FLASH_MAX_HEAD_DIM and (square or not is_causal):
        return "flash", ""
    alignment = 8 if sixteen_bit else 4
    if d_q != d_k or d_q % alignment or d_v % alignment:
        return "", f"head dims {d_q}/{d_k}/{d_v} are not equal multiples of {alignment}"
    return "efficient", ""


def _attention_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The bias memory-efficient attention receives (attention.cpp ``convert_boolean_attn_mask``, ``preprocess_mask``):
    a boolean mask as an additive one in the query's dtype, expanded to (batch, heads, queries, keys), padded to a
    multiple of BIAS_ALIGNMENT keys when it is not one."""
    if mask is None:
        return None
    if mask.dtype is torch.bool:
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if k.shape[2] % BIAS_ALIGNMENT:
        bias = nn.functional.pad(bias, (0, BIAS_ALIGNMENT - k.shape[2] % BIAS_ALIGNMENT))[..., : k.shape[2]]
    return bias


def _run_fused(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """The output of the fused aten operator on meta tensors: its meta kernel gives the shapes, its derivative formula
    (tools/autograd/derivatives.yaml) what autograd keeps, the flop counter its FLOPs (torch.utils.flop_counter
    ``sdpa_flop``). 3-d inputs are one batch of heads."""
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if kernel == "flash":
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    else:
        grad = q.requires_grad or k.requires_grad or v.requires_grad  # the logsumexp is computed for backward only
        bias = _attention_bias(mask, q, k)
        out = aten._scaled_dot_product_efficient_attention(q, k, v, bias, grad, dropout_p, is_causal, scale=scale)[0]
    return out.squeeze(0) if unbatched else out


class _FusedAttention(TorchFunctionMode):
    """Runs each ``scaled_dot_product_attention`` call of a meta step as the fused kernel a GPU runs for it, so that
    what it keeps for backward is what that kernel keeps (no s x s probabilities); other calls pass through unchanged.

    A function mode sees the builtin however the user reached it (``F.``, an imported name); inside torch's own
    Python ``multi_head_attention_forward``, which a mode sees as one call, the function is reached through
    ``torch.nn.functional``'s module global, routed here for that one call on this thread and restored after it."""

    def __init__(self, recorder: "_Recorder", precision: Precision, kernel: AttentionKernel) -> None:
        super().__init__()
        self.recorder = recorder
        self.kernel = kernel
        self.sixteen_bit = precision is not Precision.FP32
        self.fused: Counter[str] = Counter()  # calls priced as a fused kernel, by kernel
        self.math: Counter[str] = Counter()  # calls left to the math path, by reason
        self.device: Counter[str] = Counter()  # calls on real tensors (the real method), by device type

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(*args, **kwargs)
        if func is nn.functional.multi_head_attention_forward:
            with self._routed():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, *args: Any, **kwargs: Any) -> Any:
        """One call: the fused kernel when the inputs are meta tensors and a GPU runs one for them, else the call as it
        was made."""
        try:
            q, k, v, mask, dropout_p, is_causal, scale = _attention_arguments(*args, **kwargs)
        except TypeError:
            return _SDPA(*args, **kwargs)  # PyTorch's own error
        if self.kernel is AttentionKernel.MATH:
            self.math["attention_kernel='math'"] += 1
            return _SDPA(*args, **kwargs)
        tensors = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
        if tensors and not any(t.is_meta for t in tensors):  # the real method: the profiling device's own kernel runs
            self.device[tensors[0].device.type] += 1
            if _device_runs_fused(*args, **kwargs):
                self.recorder.add_attention(*_fused_attention_flops(q, k, v, mask, is_causal))
            else:
                self.recorder.add_elementwise(_softmax_elements(q, k))
            return _SDPA(*args, **kwargs)
        if not all(t.is_meta for t in tensors):  # real tensors meeting meta ones become meta (as in _MetaFixups)
            args, kwargs = pytree.tree_map_only(torch.Tensor, _meta, (args, kwargs))
            q, k, v, mask, dropout_p, is_causal, scale = _attention_arguments(*args, **kwargs)
        kernel, reason = _fused_kernel(q, k, v, mask, is_causal, self.sixteen_bit or q.dtype is not torch.float32)
        if kernel:
            with _disable_current_modes(), torch.no_grad():
                expected = _SDPA(*args, **kwargs)  # PyTorch's own checks, and the output to match; free on meta
            with torch.autograd.graph.saved_tensors_hooks(self.recorder.pack_attention, _unpacked):
                out = _run_fused(kernel, q, k, v, mask, dropout_p, is_causal, scale)
            if out.shape != expected.shape or out.dtype != expected.dtype:  # its costs are recorded: no quiet fallback
                got, want = f"{out.dtype}{list(out.shape)}", f"{expected.dtype}{list(expected.shape)}"
                raise RuntimeError(f"the {kernel} attention kernel gave {got}, scaled_dot_product_attention {want}")
            self.fused[kernel] += 1
            self.recorder.add_attention(*_fused_attention_flops(q, k, v, mask, is_causal))
            return out
        self.math[reason] += 1
        return _SDPA(*args, **kwargs)

    @contextmanager
    def _routed(self) -> Iterator[None]:
        functional, thread = nn.functional, threading.get_ident()
        original = functional.scaled_dot_product_attention
        if original is not _SDPA:  # someone else replaced it: leave theirs alone
            yield
            return

        def routed(*args: Any, **kwargs: Any) -> Any:
            return self.attention(*args, **kwargs) if threading.get_ident() == thread else _SDPA(*args, **kwargs)

        functional.scaled_dot_product_attention = routed
        try:
            yield
        finally:
            functional.scaled_dot_product_attention = original


def _fused_attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, is_causal: bool) -> tuple[float, float]:
    """(FLOPs the flop counter records for one fused call, FLOPs the kernel executes): QK^T and scores x V over every
    score (torch.utils.flop_counter ``sdpa_flop_count``, what ``flops`` holds), and of them CAUSAL_ATTENTION_SHARE under
    ``is_causal`` with no explicit mask (the kernel skips the blocks above the diagonal, FlashAttention-2 Sec. 3.1; an
    ``attn_mask``, even a causal one, is applied to every block)."""
    shapes = [tuple(t.shape) if t.dim() == 4 else (1, *t.shape) for t in (q, k, v)]
    full = float(sdpa_flop_count(*shapes))
    return full, full * CAUSAL_ATTENTION_SHARE if is_causal and mask is None else full


def _device_runs_fused(*args: Any, **kwargs: Any) -> bool:
    """Whether PyTorch runs a fused kernel (not the math path) for this call on its real tensors' device: its own choice
    (``torch._fused_sdp_choice``, what ``scaled_dot_product_attention`` dispatches on; e.g. the CPU's flash kernel unless
    dropout is on); asked with the profiler's modes off, so that the question is not counted as an operator."""
    with _disable_current_modes():
        return torch._fused_sdp_choice(*args, **kwargs) != int(SDPBackend.MATH)


def _softmax_elements(q: torch.Tensor, k: torch.Tensor) -> int:
    """The mask add and softmax of a scaled_dot_product_attention the device runs unfused, as memory-bound elements: two
    per score. A fused kernel's softmax is not counted here: it runs inside the kernel (FlashAttention-2, Dao 2023,
    Sec. 3.1), whose whole time the cost model prices at the kernel's own measured rate (``attention_efficiency``)."""
    return 2 * q.shape[:-1].numel() * k.shape[-2]


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


# --- attributing costs to blocks ----------------------------------------------------------------------


@dataclass
class _Phase:
    """What one phase of the forward pass (pre, a layer, post) used."""

    storages: set[int] = field(default_factory=set)  # parameter storages its operators read
    flops: float = 0.0
    saved: list[tuple[int, float]] = field(default_factory=list)  # (last dimension or _PER_HEAD, bytes) per saved tensor
    output_bytes: float = 0.0
    elementwise: float = 0.0  # output elements of the operators that do no matmul
    attention_flops: float = 0.0  # the part of flops fused attention kernels run (every score counted)
    attention_kernel_flops: float = 0.0  # what those kernels execute (half under a causal mask)

    def split_bytes(self, hidden: int) -> tuple[float, float]:
        """(replicated, sharded) saved bytes: width-``hidden`` tensors stay whole under tp, wider ones and a fused
        attention kernel's per-head tensors are split."""
        replicated = sum(b for dim, b in self.saved if dim in (hidden, 0))
        return replicated, sum(b for _, b in self.saved) - replicated


class _Recorder:
    """Layer hooks and saved-tensor hooks that attribute FLOPs, saved bytes and parameter reads to phases."""

    def __init__(
        self, layers: list[nn.Module], counter: FlopCounterMode, param_storages: set[int], buffer_storages: set[int], scale: float
    ) -> None:
        self.positions: dict[int, list[int]] = {}  # id(layer object) -> its positions in the stack (one object may repeat)
        for i, layer in enumerate(layers):
            self.positions.setdefault(id(layer), []).append(i)
        self.calls: Counter[int] = Counter()  # entries into each layer object so far
        self.active: list[tuple[int, str]] = []  # (layer object, phase) of the layer entries running now, innermost last
        self.ran: set[int] = set()  # positions that ran something
        self.entered: set[int] = set()  # layer objects whose own forward ran
        self.counter = counter
        self.param_storages = param_storages
        self.state_storages = param_storages | buffer_storages  # module state: saving a reference to it costs nothing
        self.scale = scale  # fp32 bytes scale for mixed precision (profiled in fp32)
        self.phases: dict[str, _Phase] = {"pre": _Phase(), "post": _Phase()}
        self.current = "pre"
        self.mark = 0.0
        self.seen_storages: set[int] = set()
        self.kept: list[torch.Tensor] = []  # saved tensors stay alive until the end, so no storage id is reused
        self.hidden = 0
        self.tokens = 0  # first layer output's elements over its last dimension (samples x tokens per sample)
        self.gemms: Counter[tuple[int, int, int]] = Counter()  # volume of the 2-d matmuls run, by (m, k, n)
        self.batchnorm = False
        self.sparse: dict[int, tuple[int, int]] = {}  # parameter storage -> (rows looked up, elements of a row)

    def _phase(self) -> _Phase:
        return self.phases.setdefault(self.current, _Phase())

    def _scale(self, t: torch.Tensor) -> float:
        """fp32 tensors of the profile are 16-bit in mixed-precision training; others keep their size."""
        return self.scale if t.dtype is torch.float32 else 1.0

    def _switch(self, name: str) -> None:
        total = float(self.counter.get_total_flops())
        self._phase().flops += total - self.mark
        self.mark, self.current = total, name

    def layer_pre(self, owner: int, module: nn.Module, args: Any) -> None:
        """A module of layer object ``owner`` (the object itself or a module only it holds) starts: inside a running entry
        of the same object nothing changes, else the object's next position (in turn, when it repeats) becomes the
        phase."""
        if id(module) == owner:
            self.entered.add(owner)
        if self.active and self.active[-1][0] == owner:
            self.active.append(self.active[-1])
            return
        positions = self.positions[owner]
        position = positions[self.calls[owner] % len(positions)]
        self.calls[owner] += 1
        self.ran.add(position)
        self.active.append((owner, f"layer{position}"))
        self._switch(f"layer{position}")

    def layer_post(self, owner: int, module: nn.Module, args: Any, output: Any) -> None:
        """That module ends: leaving the layer's outermost entry records its output and returns to the enclosing layer
        (a layer object run inside another), else to ``post``."""
        entry = self.active.pop()
        if self.active and self.active[-1] == entry:
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor):
            self._phase().output_bytes = out.numel() * out.element_size() * self._scale(out)
            if out.dim() >= 2 and not self.hidden:
                self.hidden, self.tokens = out.shape[-1], out.numel() // max(1, out.shape[-1])
        self._switch(self.active[-1][1] if self.active else "post")

    def batchnorm_pre(self, module: nn.Module, args: Any) -> None:
        self.batchnorm = self.batchnorm or _normalises_over_the_batch(module)

    def add_elementwise(self, elements: int) -> None:
        self._phase().elementwise += elements

    def add_gemm(self, m: int, k: int, n: int) -> None:
        """A [m x k] @ [k x n] matmul ran (its volume counted under its shape)."""
        self.gemms[(m, k, n)] += m * k * n

    def width_and_tokens(self) -> tuple[int, int]:
        """(width of the residual stream, samples x tokens): the first layer output's last dimension and the elements
        over it; when no layer ran, the matmul that ran the most volume, [tokens x h] @ [h x h] with h^2 = k * n (the
        GEMM the cost model's efficiency curve is sized by, time.gemm_dim), so that a module without a layer stack is
        priced at the GEMM sizes it runs, not at 1 x 1; (0, 0) when neither ran."""
        if self.hidden or not self.gemms:
            return self.hidden, self.tokens
        (m, k, n), _ = max(self.gemms.items(), key=lambda item: item[1])
        return max(1, round(math.sqrt(k * n))), m

    def add_attention(self, flops: float, kernel_flops: float) -> None:
        """A fused attention call: ``flops`` of the phase's counted FLOPs are its, ``kernel_flops`` what it executes."""
        phase = self._phase()
        phase.attention_flops += flops
        phase.attention_kernel_flops += kernel_flops

    def sparse_lookup(self, weight: torch.Tensor, indices: torch.Tensor) -> None:
        """A lookup of ``indices.numel()`` rows in ``weight`` whose gradient is sparse (counted for a parameter only)."""
        storage = _storage_id(weight)
        if storage in self.param_storages and weight.dim() >= 1:
            rows, width = self.sparse.get(storage, (0, math.prod(weight.shape[1:])))
            self.sparse[storage] = (rows + indices.numel(), width)

    def use_storages(self, tensors: list[torch.Tensor]) -> None:
        used = {_storage_id(t) for t in tensors} & self.param_storages
        if used:
            self._phase().storages |= used

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Autograd keeps ``t`` for backward: its storage counts once, under its last dimension."""
        return self._keep(t, t.shape[-1] if t.dim() else 0, self._scale(t))

    def pack_attention(self, t: torch.Tensor) -> torch.Tensor:
        """A fused attention kernel keeps ``t``: per head (split by tp); q, k, v, the output and a bias are in the
        compute dtype, the logsumexp (fp32) and the RNG state keep theirs."""
        return self._keep(t, _PER_HEAD, self._scale(t) if t.dim() == 4 else 1.0)

    def _keep(self, t: torch.Tensor, dim: int, scale: float) -> torch.Tensor:
        storage = _storage_id(t)
        if storage not in self.state_storages and storage not in self.seen_storages:
            self.seen_storages.add(storage)
            self.kept.append(t)
            self._phase().saved.append((dim, t.untyped_storage().nbytes() * scale))
        return t

    def finish(self) -> None:
        self._switch(self.current)
        self.kept.clear()


# --- running the step ---------------------------------------------------------------------------------


def _run_step(module: nn.Module, batch: Any) -> Any:
    """``training_step(batch, 0)`` (or ``training_step(batch)``), or ``module(batch)`` for a plain nn.Module."""
    step = getattr(module, "training_step", None)
    if not callable(step):
        return module(batch)
    try:
        inspect.signature(step).bind(batch, 0)
    except TypeError:
        return step(batch)
    except ValueError:  # no signature to read (a builtin): pass the index
        pass
    return step(batch, 0)


def _loss_of(module: nn.Module, stubs: _Stubs, batch: Any) -> tuple[float, torch.dtype]:
    """The scalar loss of one step and its dtype: returned (a tensor, or a mapping's "loss"), or given to
    manual_backward."""
    stubs.last_loss = None
    out = _run_step(module, batch)
    loss = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, Mapping) else None
    loss = stubs.last_loss if loss is None else loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError("training_step gave no scalar loss (returned, as a mapping's 'loss', or to manual_backward)")
    return float(loss.detach().double()), loss.dtype


class _TooCostly(RuntimeError):
    """The real method would take too long for a start-up measurement."""


@dataclass(frozen=True)
class _Measured:
    """A measured spec and what the run stood in for."""

    spec: ModelSpec
    samples: int
    assumed: Counter[str]
    bounded: Counter[str]
    batchnorm: bool
    fused_attention: Counter[str]  # scaled_dot_product_attention calls priced as a fused kernel, by kernel
    math_attention: Counter[str]  # calls that ran the math path, by reason
    device_attention: Counter[str]  # calls on real tensors, by device type
    sparse_params: tuple[str, ...] = ()  # parameters whose gradients are sparse
    layer_note: str = ""  # what the report says about the layer stack ('' when its layer objects ran as given)


def _measure(
    module: nn.Module,
    batch: Any,
    method: Method,
    global_batch_size: int,
    precision: Precision,
    name: str,
    attention_kernel: AttentionKernel,
) -> _Measured:
    """Run the training step once on an isolated copy (meta, or a real slice) and turn what it used into a spec."""
    total = batch_size_of(batch)
    if total < 1:
        raise ValueError("the example batch holds no tensor with a batch dimension")
    on_meta = method is Method.META
    if not on_meta:
        _check_real_budget(module, batch, total)
    clone, _ = _isolated_copy(module, on_meta)
    try:
        params = list(clone.parameters())
        if on_meta:
            samples, run_batch = total, _meta_like(batch)
        else:
            samples = min(REAL_SAMPLES, total)
            run_batch = _slice(batch, 0, samples, total, params[0].device if params else torch.device("cpu"))
        layers, recorded, note = _stack_that_runs(clone, run_batch, on_meta, precision, attention_kernel)
        recorder, ops, fixups, attention = recorded
        spec = _to_model_spec(clone, layers, recorder, tensor_parallel_hook(clone), samples, global_batch_size, precision, name)
        spec = dataclasses.replace(spec, forward_ops=ops, param_tensors=sum(1 for p in params if p.requires_grad))
        return _Measured(
            spec, samples, fixups.assumed, fixups.bounded, recorder.batchnorm, attention.fused, attention.math, attention.device,
            _sparse_names(clone, recorder.sparse),
            note,
        )
    finally:
        _dismantle(clone)


def _stack_that_runs(
    clone: nn.Module, batch: Any, on_meta: bool, precision: Precision, attention_kernel: AttentionKernel
) -> tuple[list[nn.Module], tuple[_Recorder, int, _MetaFixups, _FusedAttention], str]:
    """The layer stack priced, the step's recording with it, and the report's line about it ('' when the layer objects
    ran as given). Every position of the stack must run something of its own during the step (the layer object, or a
    module only it holds: :func:`_layer_entries`); otherwise its per-layer costs would be wrong (a position priced at 0
    and its work counted in a neighbour or the ends), so the step is priced with the stack found without the hook
    (:func:`~lightning_fleet.hooks.discovered_layers`) when every position of that one runs, else as one layer (the
    measured total: no recomputation, no pipeline stages)."""
    container = find_layers(clone)
    stack = list(container) if container is not None else []
    recorded = _record(clone, stack, batch, on_meta, precision, attention_kernel)
    idle = sorted(set(range(len(stack))) - recorded[0].ran)
    if not idle:
        return stack, recorded, _wrapped_note(clone, stack, recorded[0])
    found = discovered_layers(clone)
    found_stack = list(found) if found is not None and found is not container else []
    if found_stack:
        retried = _record(clone, found_stack, batch, on_meta, precision, attention_kernel)
        if retried[0].ran == set(range(len(found_stack))):
            return found_stack, retried, _idle_note(clone, stack, idle, f"priced with {_stack_words(clone, found_stack)} instead")
    whole = _record(clone, [], batch, on_meta, precision, attention_kernel)
    return [], whole, _idle_note(clone, stack, idle, "priced as one layer (the step's measured total)")


def _stack_words(root: nn.Module, stack: list[nn.Module]) -> str:
    """'blocks (6 x Block)': where a stack is in the module and what it holds."""
    names = {id(m): n for n, m in root.named_modules()}
    types = Counter(type(layer).__name__ for layer in stack)
    held = ", ".join(f"{n} x {t}" for t, n in types.items())
    place = names.get(id(stack[0]), "").rpartition(".")[0] if stack else ""
    return f"{place or 'the stack found without the hook'} ({held})"


def _idle_note(root: nn.Module, stack: list[nn.Module], idle: list[int], priced: str) -> str:
    """The report's line when positions of the stack ran nothing of their own during the step."""
    source = f"{type(root).__name__}.fleet_layers()" if callable(getattr(root, "fleet_layers", None)) else "the layer stack"
    kinds = ", ".join(sorted({type(stack[i]).__name__ for i in idle}))
    shown = ", ".join(map(str, idle[:8])) + (", ..." if len(idle) > 8 else "")
    return (
        f"layer stack: {len(idle)} of the {len(stack)} layer objects {source} returns ({kinds}; position(s) {shown}) ran "
        "nothing of their own during training_step (neither they nor a module only they hold), so their per-layer costs "
        f"cannot be measured: {priced}; return the modules the forward calls (e.g. self.blocks), or wrappers that "
        "the forward calls, from fleet_layers()"
    )


def _wrapped_note(root: nn.Module, stack: list[nn.Module], recorder: _Recorder) -> str:
    """The report's line when layer objects never ran themselves and were priced by the modules they hold that ran."""
    objects = list({id(layer): layer for layer in stack}.values())
    passed = [layer for layer in objects if id(layer) not in recorder.entered]
    if not passed:
        return ""
    kinds = ", ".join(sorted({type(layer).__name__ for layer in passed}))
    return (
        f"layer stack: {len(passed)} of the {len(objects)} layer objects fleet_layers() returns ({kinds}) never run "
        "themselves during training_step: each is "
        "priced by what runs of the modules only it holds; full recomputation and pipeline stages act on the objects "
        "fleet_layers() returns, so return the modules the forward calls (e.g. self.blocks) to use them"
    )


def _check_real_budget(module: nn.Module, batch: Any, total: int) -> None:
    estimate = 2.0 * sum(p.numel() for p in module.parameters()) * _tokens_per_sample(batch) * min(REAL_SAMPLES, total)
    if estimate > REAL_RUN_FLOPS:
        raise _TooCostly(f"~{estimate:.2g} FLOPs estimated (2 per parameter per token), over the {REAL_RUN_FLOPS:.2g} budget")


def _record(
    clone: nn.Module, layers: list[nn.Module], batch: Any, on_meta: bool, precision: Precision, attention_kernel: AttentionKernel
) -> tuple[_Recorder, int, _MetaFixups, _FusedAttention]:
    """Run the step on ``batch`` with every counter attached: (recorder, operators dispatched, meta stand-ins, the
    attention calls by how they were priced)."""
    params = {_storage_id(p) for p in clone.parameters()}
    buffers = {_storage_id(b) for b in clone.buffers()}
    fixups = _MetaFixups()
    with ExitStack() as stack:
        counter = stack.enter_context(FlopCounterMode(display=False, custom_mapping={_CPU_ATTENTION: _cpu_attention_flops}))
        recorder = _Recorder(layers, counter, params, buffers, precision.element_bytes / 4)
        if on_meta:
            stack.enter_context(fixups)
        ops = stack.enter_context(_OpCounter(recorder, set() if on_meta else params))  # real: never write the user's weights
        if on_meta:
            stack.enter_context(torch.device("meta"))
        attention = stack.enter_context(_FusedAttention(recorder, precision, attention_kernel))
        for module, owner in _layer_entries(clone, layers):
            stack.callback(module.register_forward_pre_hook(functools.partial(recorder.layer_pre, owner)).remove)
            stack.callback(module.register_forward_hook(functools.partial(recorder.layer_post, owner), always_call=True).remove)
        for m in clone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                stack.callback(m.register_forward_pre_hook(recorder.batchnorm_pre).remove)
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t))
        _run_step(clone, batch)
        recorder.finish()
    return recorder, ops.ops, fixups, attention


def _layer_entries(root: nn.Module, layers: list[nn.Module]) -> list[tuple[nn.Module, int]]:
    """(module, id of its layer object) for every module whose run is a layer's: each layer object, and each module that
    only one layer object holds (not the root): so a layer object that never runs itself (a wrapper the forward passes
    by, built on the fly or holding its block next to other things) is priced by what runs of what it holds, and a
    module several layer objects hold (a shared rotary table, the head, the whole model) by where it runs."""
    objects = list({id(layer): layer for layer in layers}.values())
    holders: dict[int, set[int]] = {}
    modules: dict[int, nn.Module] = {}
    for layer in objects:
        for m in layer.modules():
            holders.setdefault(id(m), set()).add(id(layer))
            modules[id(m)] = m
    entries = [(layer, id(layer)) for layer in objects]
    is_layer = {id(layer) for layer in objects}
    for key, owners in holders.items():
        if len(owners) == 1 and key not in is_layer and modules[key] is not root:
            entries.append((modules[key], next(iter(owners))))
    return entries


# --- building the spec ---------------------------------------------------------------------------------


def _counts(params: Iterable[torch.Tensor]) -> tuple[int, int | None]:
    """(parameters, trainable parameters or None when all of them train)."""
    params = list(params)
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    return total, None if trainable == total else trainable


def _block(
    name: str,
    role: Role,
    phase: _Phase,
    params: Iterable[torch.Tensor],
    hidden: int,
    samples: int,
    tp_counts: tuple[int, int] = (0, 0),
    output_bytes: float | None = None,
    sparse: Mapping[int, tuple[int, int]] | None = None,
) -> BlockSpec:
    params = list(params)
    replicated, sharded = phase.split_bytes(hidden)
    total, trainable = _counts(params)
    return BlockSpec(
        **_sparse_fields(params, sparse or {}, samples),
        name=name,
        role=role,
        params=total,
        trainable_params=trainable,
        flops=phase.flops / samples,
        elementwise=phase.elementwise / samples,
        attention_flops=phase.attention_flops / samples,
        attention_kernel_flops=phase.attention_kernel_flops / samples,
        act_replicated_bytes=replicated / samples,
        act_sharded_bytes=sharded / samples,
        output_bytes=(phase.output_bytes if output_bytes is None else output_bytes) / samples,
        tp_allreduces_fwd=tp_counts[0],
        tp_allreduces_bwd=tp_counts[1],
    )


def _sparse_fields(params: list[torch.Tensor], sparse: Mapping[int, tuple[int, int]], samples: int) -> dict[str, Any]:
    """The BlockSpec sparse fields of a block holding ``params``: those that train and were looked up sparsely
    (``sparse``: storage -> rows looked up in the run, elements per row), their lookups per sample."""
    looked_up = [(p, sparse[_storage_id(p)]) for p in params if p.requires_grad and _storage_id(p) in sparse]
    if not looked_up:
        return {}
    return {
        "sparse_params": sum(p.numel() for p, _ in looked_up),
        "sparse_tensors": len(looked_up),
        "sparse_rows_per_sample": sum(rows for _, (rows, _) in looked_up) / samples,
        "sparse_elements_per_sample": sum(rows * width for _, (rows, width) in looked_up) / samples,
    }


def _sparse_names(module: nn.Module, sparse: Mapping[int, tuple[int, int]]) -> tuple[str, ...]:
    """Names of the module's trainable parameters whose gradients are sparse (looked up with ``sparse=True``)."""
    return tuple(name for name, p in module.named_parameters() if p.requires_grad and _storage_id(p) in sparse)


def _tp_counts(layer: nn.Module, prefix: str, patterns: TensorParallelSpec | None) -> tuple[int, int]:
    """AutoTP all-reduces of one layer: one per row-split Linear forward, one per column-split Linear backward."""
    if patterns is None:
        return 0, 0
    names = [f"{prefix}.{n}" for n, _ in layer.named_parameters()]
    row = sum(any(re.match(p, n) for p in patterns.row) for n in names)
    column = sum(any(re.match(p, n) for p in patterns.column) for n in names)
    return row, column


def _kv_heads(module: nn.Module) -> int | None:
    """Key/value heads when they differ from the heads (grouped-query attention; the hook's or a config's), else None."""
    shape = attention_shape(module)
    return shape[1] if shape is not None and shape[1] != shape[0] else None


def _untied(sparse: Mapping[int, tuple[int, int]], tied_ids: set[int], params: list[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """``sparse`` without the tied parameters among ``params`` (the pre block counts their lookups once)."""
    tied = {_storage_id(p) for p in params if id(p) in tied_ids}
    return {k: v for k, v in sparse.items() if k not in tied}


def _merge_repeats(blocks: list[BlockSpec]) -> list[BlockSpec]:
    """Consecutive identical layers become one entry with a count."""
    out: list[BlockSpec] = []
    for block in blocks:
        if out and out[-1].role is Role.LAYER and block.role is Role.LAYER and _same_costs(out[-1], block):
            prev = out[-1]
            out[-1] = dataclasses.replace(prev, count=prev.count + 1, name=prev.name.split("..")[0] + f"..{block.name}")
        else:
            out.append(block)
    return out


def _same_costs(a: BlockSpec, b: BlockSpec) -> bool:
    return dataclasses.replace(a, name="", count=1) == dataclasses.replace(b, name="", count=1)


def _split_ends(rest: list[torch.Tensor], pre: _Phase, post: _Phase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters outside the layers go where the forward read them: post if read after the layers, pre if read before
    or never read (a module that did not run); tied parameters read in both go to both."""
    first, last = [], []
    for p in rest:
        storage = _storage_id(p)
        if storage in post.storages:
            last.append(p)
        if storage in pre.storages or storage not in post.storages:
            first.append(p)
    return first, last


def _layer_params(layers: list[nn.Module], phases: Mapping[str, _Phase] | None = None) -> list[list[torch.Tensor]]:
    """Each layer's parameters, a parameter several layers hold counted once: in the first layer whose run read it
    (``phases``, measured), else in none when only the parts outside the stack read it (a head a wrapper holds next to
    its block: it goes to the ends, :func:`_split_ends`), else (never read, or not measured) in the first holding it."""
    read = {i: phases[f"layer{i}"].storages for i in range(len(layers)) if f"layer{i}" in phases} if phases else {}
    outside = (phases["pre"].storages | phases["post"].storages) if phases else set()
    holders: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            holders.setdefault(id(p), []).append(i)
    out: list[list[torch.Tensor]] = [[] for _ in layers]
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            storage = _storage_id(p)
            readers = [j for j in holders[id(p)] if storage in read.get(j, ())]
            if readers:
                out[readers[0]].append(p)
            elif storage not in outside:
                out[i].append(p)
    return out


def _layer_name(layer: nn.Module, names: Mapping[int, str], position: int) -> str:
    """A layer's name in the module: its own, else (a wrapper the module does not hold) that of the first module it
    holds that the module does, else its position."""
    return next((names[id(m)] for m in layer.modules() if names.get(id(m))), f"layer{position}")


def _to_model_spec(
    module: nn.Module,
    layers: list[nn.Module],
    recorder: _Recorder,
    tp: tuple[int, TensorParallelSpec] | None,
    samples: int,
    global_batch_size: int,
    precision: Precision,
    name: str,
) -> ModelSpec:
    phases, hidden = recorder.phases, recorder.hidden
    width, tokens = recorder.width_and_tokens()
    pre, post = phases.pop("pre"), phases.pop("post")
    names = {id(m): n for n, m in module.named_modules()}
    if not layers:  # no layer stack: the whole model is one layer (no pipeline, no recomputation)
        whole = _Phase(
            flops=pre.flops + post.flops, saved=pre.saved + post.saved, elementwise=pre.elementwise + post.elementwise,
            attention_flops=pre.attention_flops + post.attention_flops,
            attention_kernel_flops=pre.attention_kernel_flops + post.attention_kernel_flops,
        )
        body = [_block(type(module).__name__, Role.LAYER, whole, module.parameters(), hidden, samples, sparse=recorder.sparse)]
        first: list[torch.Tensor] = []
        last: list[torch.Tensor] = []
        pre, post = _Phase(), _Phase()
    else:
        body = []
        per_layer = _layer_params(layers, {**phases, "pre": pre, "post": post})
        for i, (layer, own) in enumerate(zip(layers, per_layer)):
            prefix = names.get(id(layer), f"layer{i}")
            phase = phases.get(f"layer{i}", _Phase())
            tp_counts = _tp_counts(layer, prefix, tp[1] if tp else None)
            body.append(_block(_layer_name(layer, names, i), Role.LAYER, phase, own, hidden, samples, tp_counts,
                               sparse=recorder.sparse))
        in_layers = {id(p) for own in per_layer for p in own}
        first, last = _split_ends([p for p in module.parameters() if id(p) not in in_layers], pre, post)
    tied_ids = {id(p) for p in first} & {id(p) for p in last}
    tied, tied_trainable = _counts(p for p in first if id(p) in tied_ids)
    return ModelSpec(
        name=name,
        blocks=(
            _block("pre", Role.PRE, pre, first, hidden, samples, output_bytes=body[0].output_bytes * samples,
                   sparse=recorder.sparse),
            *_merge_repeats(body),
            _block("post", Role.POST, post, last, hidden, samples, sparse=_untied(recorder.sparse, tied_ids, last)),
        ),
        hidden_size=max(1, width),
        num_heads=tp[0] if tp else 1,
        num_kv_heads=_kv_heads(module),
        seq_length=max(1, tokens // samples),
        precision=precision,
        global_batch_size=global_batch_size,
        tied_params=tied,
        tied_trainable_params=tied_trainable,
    )


# --- the parameters method ----------------------------------------------------------------------------


def _tokens_per_sample(batch: Any) -> int:
    """The second dimension of the first integer tensor with two or more dimensions (token ids), else 1."""
    for t in _batch_tensors(batch):
        if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
            return int(t.shape[1])
    return 1


def _rule_of_thumb_block(name: str, role: Role, params: list[torch.Tensor], tokens: int, e: int) -> BlockSpec:
    """One block by rules of thumb: forward FLOPs 2 per parameter per token (Kaplan et al. 2020, C_forward = 2N); a
    width h with 12h^2 parameters (a transformer layer, Kaplan et al. 2020 eq. 2.1); a layer's saved activations and
    memory-bound elements as that transformer layer's (Korthikanti et al. 2022, without attention scores)."""
    n, trainable = _counts(params)
    h = max(1, round(math.sqrt(n / 12)))
    is_layer = role is Role.LAYER
    return BlockSpec(
        name=name,
        role=role,
        params=n,
        trainable_params=trainable,
        flops=2.0 * n * tokens,
        elementwise=layer_elementwise(tokens, h, 4 * h, 0) if is_layer else float(tokens * h),  # a=0: no attention scores
        act_replicated_bytes=layer_act_replicated_bytes(tokens, h, e) if is_layer else float(e * tokens * h),
        act_sharded_bytes=layer_act_sharded_bytes(tokens, h, 4 * h, e) if is_layer else 0.0,
        output_bytes=float(e * tokens * h),
    )


def _ends_by_registration(
    module: nn.Module, per_layer: list[list[torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters outside the layers: ``pre`` if registered before the layer stack's, else ``post``."""
    in_layers = {id(p) for own in per_layer for p in own}
    first: list[torch.Tensor] = []
    last: list[torch.Tensor] = []
    passed = False
    for p in module.parameters():
        passed = passed or id(p) in in_layers
        if id(p) not in in_layers:
            (last if passed else first).append(p)
    return first, last


def _parameters_spec(
    module: nn.Module, batch: Any, global_batch_size: int, precision: Precision, name: str
) -> tuple[ModelSpec, tuple[str, ...]]:
    """A spec from exact parameter counts and stated rules of thumb."""
    container = find_layers(module)
    tp = tensor_parallel_hook(module)
    tokens, e = _tokens_per_sample(batch), precision.element_bytes
    layers = list(container) if container is not None else [module]
    per_layer = _layer_params(layers)
    first, last = _ends_by_registration(module, per_layer) if container is not None else ([], [])
    names = {id(m): n for n, m in module.named_modules()}
    body = [
        _rule_of_thumb_block(names.get(id(layer)) or type(module).__name__, Role.LAYER, own, tokens, e)
        for layer, own in zip(layers, per_layer)
    ]
    pre, post = _rule_of_thumb_block("pre", Role.PRE, first, tokens, e), _rule_of_thumb_block("post", Role.POST, last, tokens, e)
    spec = ModelSpec(
        name=name,
        blocks=(pre, *_merge_repeats(body), post),
        hidden_size=max(1, round(math.sqrt(body[0].params / 12))),
        num_heads=tp[0] if tp else 1,
        num_kv_heads=_kv_heads(module),
        seq_length=tokens,
        precision=precision,
        global_batch_size=global_batch_size,
        param_tensors=sum(1 for p in module.parameters() if p.requires_grad),
    )
    notes = (
        f"parameter counts are exact; FLOPs assume 2 per parameter per token (Kaplan et al. 2020) at {tokens} token(s) per "
        "sample from the example batch's shape (1 unless it holds integer token ids), which under-counts weights reused "
        "across positions (convolutions)",
        "activations assume each layer is a transformer layer of width sqrt(params/12) (Korthikanti et al. 2022, "
        "attention scores left out): activation memory may be under-estimated, and a chosen plan may run out of memory",
        "operator dispatch overhead is not priced (unknown operator count)",
    )
    return spec, notes


# --- does the loss depend on the micro-batch? ----------------------------------------------------------


def _normalises_over_the_batch(m: nn.Module) -> bool:
    """A BatchNorm that normalises with the batch's statistics (training, or no running statistics)."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)


def _has_batchnorm_in_training(module: nn.Module) -> bool:
    return any(_normalises_over_the_batch(m) for m in module.modules())


def _batch_dependence(module: nn.Module, batch: Any, flops_per_sample: float, batchnorm: bool) -> tuple[bool | None, str]:
    """Whether the loss depends on the micro-batch, and the note saying how that was found."""
    if batchnorm:
        return True, (
            "the loss depends on the micro-batch: BatchNorm normalises over it in training, so the micro-batch size "
            "changes the optimisation; pin it"
        )
    total = batch_size_of(batch)
    if total < 2:
        return None, "micro-batch dependence not checked: the example batch has fewer than 2 samples"
    size = 4 if total >= 4 else 2
    cost = 2 * size * flops_per_sample
    if cost > BATCH_CHECK_FLOPS:
        return None, (
            f"micro-batch dependence not checked: it would cost {cost:.2g} forward FLOPs (budget {BATCH_CHECK_FLOPS:.2g})"
        )
    try:
        difference, tolerance = _loss_difference(module, batch, size, total)
    except Exception as err:
        return None, f"micro-batch dependence not checked: {_reason(Method.REAL, err).removeprefix('real failed: ')}"
    if difference > tolerance:
        return True, (
            f"the loss depends on the micro-batch: the loss of {size} samples differs from the mean loss of its halves by "
            f"{difference:.2g} (relative; in-batch terms, batch statistics or a sum over samples), so the micro-batch size "
            "changes the optimisation; pin it"
        )
    return False, (
        f"the loss does not depend on the micro-batch: {size} samples vs the mean of its halves differ "
        f"by {difference:.2g} (relative)"
    )


def _loss_difference(module: nn.Module, batch: Any, size: int, total: int) -> tuple[float, float]:
    """Relative difference between the loss of ``size`` samples and the mean loss of its two halves, and the tolerance
    for the loss's dtype; on a copy sharing the weights, without gradients, with dropout keeping everything."""
    clone, stubs = _isolated_copy(module, on_meta=False)
    try:
        params = list(clone.parameters())
        device = params[0].device if params else torch.device("cpu")
        half = size // 2
        with _Deterministic({_storage_id(p) for p in params}) as mode, torch.no_grad():
            whole, dtype = _loss_of(clone, stubs, _slice(batch, 0, size, total, device))
            halves = [_loss_of(clone, stubs, _slice(batch, i, i + half, total, device))[0] for i in (0, half)]
    finally:
        _dismantle(clone)
    if mode.random_ops:
        raise ValueError(f"the step draws random numbers ({', '.join(sorted(mode.random_ops))}), so runs differ")
    mean = (halves[0] + halves[1]) / 2
    if not (math.isfinite(whole) and math.isfinite(mean)):
        raise ValueError("the loss is not finite")
    difference = abs(whole - mean) / max(abs(whole), abs(mean), 1e-12)
    return difference, max(BATCH_CHECK_RTOL, 8 * torch.finfo(dtype).eps)


# --- can fleet_pipeline()'s layers run as a pipeline? ---------------------------------------------------


def _shape_words(value: Any) -> str:
    """'float32[4,32,64]', 'a tuple of 2 (float32[4,32,64], NoneType)', 'a BaseModelOutput': a value as messages say it."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{','.join(map(str, value.shape))}]"
    if isinstance(value, tuple) and type(value) is tuple:
        return f"a tuple of {len(value)} ({', '.join(_shape_words(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def _is_activation(value: Any) -> bool:
    """What DeepSpeed's pipeline engine passes between layers and stages: a tensor or a plain tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return True
    return type(value) is tuple and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def pipeline_problem(module: nn.Module, batch: Any) -> str:
    """Why ``fleet_pipeline()``'s layers cannot run as a pipeline on ``batch`` ('' when they can, or the module has no
    such hook): the batch is not (inputs, labels), a layer fails when called as ``layer(x)`` with the previous one's
    output alone or returns something other than a tensor or a tuple of tensors, the loss fails, or the layer stack's
    layers are not there in one run (:func:`~lightning_fleet.hooks.stack_problem`). One line, naming the layer and
    saying what shape is needed (:data:`~lightning_fleet.hooks.PIPELINE_SHAPE`). Runs the layers once in sequence on a
    meta copy of the module (no memory, no compute; the module is not changed), as DeepSpeed's engine calls them."""
    if not callable(getattr(module, "fleet_pipeline", None)):
        return ""
    with _global_state_kept():
        found = _pipeline_run_problem(module, batch)
    return f"{found}; {PIPELINE_SHAPE}" if found else ""


def _pipeline_run_problem(module: nn.Module, batch: Any) -> str:
    """:func:`pipeline_problem`'s finding, without the shape it needs."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        return f"the training batches are {_shape_words(batch)}, not (inputs, labels)"
    clone, _ = _isolated_copy(module, on_meta=True)
    try:
        spec = pipeline_hook(clone)
        assert spec is not None
        layers, container = spec["layers"], find_layers(clone)
        if container is not None:
            problem = stack_problem(layers, type(container[0]).__name__)
            if problem:
                return problem
        inputs, labels = _meta_like(batch[0]), _meta_like(batch[1])
        with _MetaFixups(), torch.device("meta"), torch.no_grad():
            x, given = inputs, f"the batch's inputs {_shape_words(inputs)}"
            for i, layer in enumerate(layers):
                try:
                    x = layer(x)
                except Exception as err:
                    return f"layer {i} ({type(layer).__name__}) fails when called as layer(x) with {given}: {_reason_text(err)}"
                if not _is_activation(x):
                    return f"layer {i} ({type(layer).__name__}) returns {_shape_words(x)}, not a tensor or a tuple of tensors"
                given = f"layer {i}'s output {_shape_words(x)}"
            try:
                spec["loss_fn"](x, labels)
            except Exception as err:
                return f"loss_fn(output of layer {len(layers) - 1}, labels) fails with {given}: {_reason_text(err)}"
    finally:
        _dismantle(clone)
    return ""


def _reason_text(err: BaseException) -> str:
    """'TypeError: cannot unpack ...': an exception in one bounded line."""
    text = " ".join(str(err).split())
    line = type(err).__name__ + (f": {text}" if text else "")
    return line if len(line) <= _REASON_CHARS else line[: _REASON_CHARS - 3] + "..."


# --- entry points --------------------------------------------------------------------------------------


_IDIOMS = {
    "_local_scalar_dense": ".item()/bool()/int()",
    "equal": "torch.equal",
    "allclose": "torch.allclose",
    "is_nonzero": "bool()",
    "index": "boolean mask",
    "_unsafe_index": "boolean mask",
    "nonzero": "nonzero",
    "masked_select": "masked_select",
    "_unique2": "unique",
    "_unique": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique_consecutive",
    "bincount": "bincount",
}
"""How users write the operators the meta method stands in for."""


def _idioms(counts: Counter[str]) -> str:
    return ", ".join(sorted({_IDIOMS.get(name, name) for name in counts}))


def _measured_notes(measured: _Measured, method: Method) -> tuple[str, ...]:
    notes = []
    if method is Method.META:
        notes.append("FLOPs and saved activations measured exactly on meta tensors (forward; backward priced as 2x forward)")
    else:
        notes.append(
            f"FLOPs and saved activations measured on {measured.samples} real sample(s) of the example batch and scaled "
            "per sample: data-dependent work follows those samples"
        )
    if measured.assumed:
        notes.append(
            f"{sum(measured.assumed.values())} data-dependent value(s) ({_idioms(measured.assumed)}) were assumed during "
            "profiling: work that depends on them may be mis-counted"
        )
    if measured.bounded:
        notes.append(
            f"{sum(measured.bounded.values())} data-dependent shape(s) ({_idioms(measured.bounded)}) were taken at their "
            "upper bound, everything selected: FLOPs and activation memory are upper bounds"
        )
    return (*notes, *_attention_notes(measured.fused_attention, measured.math_attention, measured.device_attention))


def _attention_notes(fused: Counter[str], math_path: Counter[str], device: Counter[str]) -> list[str]:
    """What the report says about scaled_dot_product_attention: calls priced as a fused kernel, calls left to math,
    calls the real method ran as its device runs them."""
    notes = []
    if fused:
        kernels = ", ".join(f"{kernel} x{n}" for kernel, n in sorted(fused.items()))
        notes.append(
            f"attention: {sum(fused.values())} scaled_dot_product_attention call(s) priced as the fused kernel a GPU runs "
            f"({kernels}): q, k, v, the output and an fp32 logsumexp per head and query kept for backward, no s x s scores; "
            "model FLOPs 4*s^2*d per head (the published convention), of which the kernel executes half under is_causal "
            "without a mask, at its own rate (calibration.attention_efficiency; attention_kernel='math' prices the math path)"
        )
    if math_path:
        reasons = "; ".join(f"{reason} x{n}" for reason, n in sorted(math_path.items()))
        notes.append(
            f"attention: {sum(math_path.values())} scaled_dot_product_attention call(s) priced as the math path, s x s "
            f"probabilities kept for backward ({reasons})"
        )
    for kind, n in sorted(device.items()):
        notes.append(
            f"attention: {n} scaled_dot_product_attention call(s) ran on {kind} as that device runs them (a CPU: a fused "
            "kernel keeping q, k, v, the output and a logsumexp, the math path when dropout is on; a GPU: its own choice)"
        )
    return notes


def profile(
    module: nn.Module,
    example_batch: Any,
    *,
    global_batch_size: int,
    precision: Precision = Precision.FP32,
    name: str | None = None,
    attention_kernel: AttentionKernel | str = AttentionKernel.FLASH,
) -> Profile:
    """Profile ``module`` on ``example_batch``: meta tensors, else a real slice of the batch, else parameter counts.

    Never changes the module, the trainer's logged values or the RNG streams, and never raises for what the
    module's code does (a malformed ``fleet_layers()``/``fleet_tensor_parallel()`` answer is a FleetError).
    ``precision`` scales floating-point activation bytes: the profile runs in the module's dtype (fp32) and mixed
    precision keeps 16-bit activations. ``attention_kernel`` prices ``scaled_dot_product_attention`` as the fused
    kernel a GPU runs (``"flash"``, the default) or as the math path (``"math"``: a target without a fused kernel).
    """
    name = name or type(module).__name__
    kernel = _attention_kernel(attention_kernel)
    find_layers(module)  # a malformed hook answer is the user's to fix: say so now, not as a fallback
    tensor_parallel_hook(module)
    with _global_state_kept():
        failures = []
        measured = None
        for method in (Method.META, Method.REAL):
            try:
                measured = _measure(module, example_batch, method, global_batch_size, precision, name, kernel)
                break
            except Exception as err:
                failures.append(_reason(method, err))
        if measured is not None:
            spec = measured.spec
            notes = (*((measured.layer_note,) if measured.layer_note else ()), *_measured_notes(measured, method),
                     *_sparse_notes(measured.sparse_params, spec))
            batchnorm, sparse = measured.batchnorm, measured.sparse_params
        else:
            method = Method.PARAMETERS
            spec, notes = _parameters_spec(module, example_batch, global_batch_size, precision, name)
            batchnorm, sparse = _has_batchnorm_in_training(module), _sparse_modules(module)
            notes = (*notes, *_sparse_notes(sparse, None))
        dependent, note = _batch_dependence(module, example_batch, spec.flops_per_sample, batchnorm)
    pipeline = pipeline_problem(module, example_batch)
    notes = (*notes, note, *((f"no pipeline parallelism: fleet_pipeline(): {pipeline}",) if pipeline else ()))
    return Profile(
        spec=spec, method=method, fallback_reason="; ".join(failures), notes=notes, batch_dependent=dependent,
        sparse_params=sparse, pipeline_problem=pipeline,
    )


def _sparse_modules(module: nn.Module) -> tuple[str, ...]:
    """Without a run: the trainable weights of ``nn.Embedding``/``nn.EmbeddingBag`` modules built with ``sparse=True``."""
    names = {id(p): n for n, p in module.named_parameters()}
    found = [names[id(m.weight)] for m in module.modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad and id(m.weight) in names]
    return tuple(dict.fromkeys(found))


def _sparse_notes(names: tuple[str, ...], spec: ModelSpec | None) -> tuple[str, ...]:
    """The report line on parameters with sparse gradients: which, and how they are priced (``spec`` None: not
    measured, priced dense)."""
    if not names:
        return ()
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if spec is None:
        return (f"sparse gradients: {shown} (sparse=True); their lookups were not measured, so they are priced dense",)
    rows = sum(b.sparse_rows_per_sample * b.count for b in spec.blocks)
    return (
        f"sparse gradients: {shown} ({spec.sparse_params / 1e6:.3g} M params, sparse=True): priced by the rows a step looks "
        f"up, {rows:g} per sample, each counted as a distinct row (an upper bound: repeated ids touch fewer)",
    )


def profile_module(
    module: nn.Module,
    example_batch: Any,
    *,
    global_batch_size: int,
    precision: Precision = Precision.FP32,
    name: str | None = None,
    attention_kernel: AttentionKernel | str = AttentionKernel.FLASH,
) -> ModelSpec:
    """:func:`profile`'s ModelSpec (per block, per sample)."""
    kwargs = {"precision": precision, "name": name, "attention_kernel": attention_kernel}
    return profile(module, example_batch, global_batch_size=global_batch_size, **kwargs).spec


def _attention_kernel(value: AttentionKernel | str) -> AttentionKernel:
    try:
        return AttentionKernel(value)
    except ValueError:
        choices = ", ".join(repr(k.value) for k in AttentionKernel)
        raise FleetError(
            f"attention_kernel {value!r} is not one of {choices}: pass 'flash' when the GPUs run FlashAttention or "
            "memory-efficient attention, 'math' when they run neither"
        ) from None


__all__ = [
    "AttentionKernel",
    "BATCH_CHECK_FLOPS",
    "BATCH_CHECK_RTOL",
    "BIAS_ALIGNMENT",
    "FLASH_MAX_HEAD_DIM",
    "REAL_RUN_FLOPS",
    "REAL_SAMPLES",
    "Method",
    "Profile",
    "batch_size_of",
    "pipeline_problem",
    "profile",
    "profile_module",
]
