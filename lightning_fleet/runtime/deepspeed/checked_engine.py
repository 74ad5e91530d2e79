"""DeepSpeed's loads of a checkpoint, each file checked against its manifest and unpickled without running code.

DeepSpeed reads a checkpoint's files through the engine's pluggable checkpoint engine (``engine.checkpoint_engine``;
its ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``, DeepSpeed 0.19.8
runtime/checkpoint_engine/torch_checkpoint_engine.py). :func:`checked_loads` puts a :class:`CheckedCheckpointEngine`
in its place for one ``load_checkpoint``: every file is read once, checked against the manifest of the verified
checkpoint it belongs to (a file outside it, or one the manifest does not list, is refused), and those bytes are
unpickled by the restricted unpickler as the kind the manifest records.

The universal form is read without the checkpoint engine: ``torch.load`` called directly by the optimizer's
``load_hp_checkpoint_state_from_checkpoint_dir`` (runtime/base_optimizer.py; ZeRO-3:
``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` and ``load_hp_checkpoint_state``, runtime/zero/stage3.py) and
by each parameter's ``load_hp_checkpoint_state`` (checkpoint/universal_checkpoint.py, bound to the parameter). For the
block, exactly those methods of this engine's optimizer and parameters are replaced by copies whose ``torch`` is
:class:`_TorchForDeepSpeed`, whose ``load`` is the checked engine's: the same DeepSpeed code, its loads ours. Nothing
process-wide changes (no module attribute, no torch setting), so another engine, another thread or the user's own
``torch.load`` is untouched.

Imports deepspeed's checkpoint engine (at call time) and elastic/safe_load.py; imported by runtime/deepspeed/backend.py.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint
from lightning_fleet.elastic.layout import kind_of
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError

DIRECT_LOADERS = (
    "load_hp_checkpoint_state_from_checkpoint_dir",
    "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
    "load_hp_checkpoint_state",
)
"""The methods of DeepSpeed 0.19.8's optimizers and parameters that call ``torch.load`` themselves (universal form)."""


def checked_engine(checkpoint: VerifiedCheckpoint | None) -> Any:
    """A DeepSpeed checkpoint engine whose loads are restricted, and checked against ``checkpoint``'s manifest when given
    (a plain ``trainer.save_checkpoint`` dir has none: its files are only restricted, as the kind their names say)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class CheckedCheckpointEngine(TorchCheckpointEngine):
        """TorchCheckpointEngine whose ``load`` reads through :func:`lightning_fleet.elastic.safe_load.load_file`."""

        def load(self, path: str, map_location: Any = None) -> Any:
            entry, kind = _entry(checkpoint, Path(path))
            return load_file(Path(path), entry, kind=kind, map_location=map_location)

    return CheckedCheckpointEngine()


def _entry(checkpoint: VerifiedCheckpoint | None, path: Path) -> tuple[Any, str]:
    """The manifest entry and recorded kind of a file DeepSpeed asks for (no entry and the name's kind without a
    manifest); FleetError for one outside the checkpoint or unlisted."""
    if checkpoint is None:
        return None, kind_of(path.as_posix())
    root = checkpoint.path.resolve()
    try:
        name = path.resolve().relative_to(root).as_posix()
    except ValueError:
        raise FleetError(f"DeepSpeed asked for {path}, which is outside the verified checkpoint {checkpoint.path}; refusing to read it") from None
    entry = checkpoint.manifest.files.get(name)
    if entry is None:
        raise FleetError(f"DeepSpeed asked for {name}, which the manifest of {checkpoint.path} does not list; refusing to read it")
    return entry, checkpoint.manifest.kinds[name]


class _TorchForDeepSpeed:
    """Stands for the ``torch`` module inside the copies of :data:`DIRECT_LOADERS`: everything is torch's but ``load``,
    which reads through the checked engine."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def load(self, f: Any, map_location: Any = None, **_: Any) -> Any:
        """DeepSpeed's ``torch.load(path, weights_only=False)``, through the checked engine."""
        return self._engine.load(str(f), map_location=map_location)


def _rebound(func: types.FunctionType, stand_in: _TorchForDeepSpeed) -> types.FunctionType:
    """``func`` with ``torch`` in its globals replaced by ``stand_in`` (a copy: DeepSpeed's module is not changed)."""
    copy = types.FunctionType(func.__code__, {**func.__globals__, "torch": stand_in}, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    return copy


def _route_direct_loads(engine: Any, checked: Any) -> list[tuple[Any, str, Any]]:
    """Give this engine's optimizer and parameters copies of :data:`DIRECT_LOADERS` that load through ``checked``;
    returns what to restore (object, name, the instance attribute it had or None)."""
    stand_in, replaced = _TorchForDeepSpeed(checked), []
    optimizer = getattr(engine, "optimizer", None)
    owners = [optimizer] if optimizer is not None else []
    module = getattr(engine, "module", None)
    owners += list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    for owner in owners:
        for name in DIRECT_LOADERS:
            own = vars(owner).get(name)
            method = own if own is not None else getattr(type(owner), name, None)
            func = getattr(method, "__func__", method)
            if isinstance(func, types.FunctionType) and "torch" in func.__code__.co_names:
                setattr(owner, name, types.MethodType(_rebound(func, stand_in), owner))
                replaced.append((owner, name, own))
    return replaced


@contextmanager
def checked_loads(engine: Any, checkpoint: VerifiedCheckpoint | None) -> Iterator[None]:
    """For the block, the engine reads checkpoints through :func:`checked_engine` (its own loads and, through
    :data:`DIRECT_LOADERS`, the universal form's); the engine's own checkpoint engine and methods are put back after."""
    own = engine.checkpoint_engine
    checked = checked_engine(checkpoint)
    engine.checkpoint_engine = checked
    replaced = _route_direct_loads(engine, checked)
    try:
        yield
    finally:
        engine.checkpoint_engine = own
        for owner, name, previous in replaced:
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
