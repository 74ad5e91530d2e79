"""DeepSpeed's loads of a checkpoint, each file checked against its manifest and unpickled without running code.

DeepSpeed reads a checkpoint's files through the engine's pluggable checkpoint engine (``engine.checkpoint_engine``;
its ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``, DeepSpeed 0.19.8
runtime/checkpoint_engine/torch_checkpoint_engine.py). :func:`checked_loads` puts a :class:`CheckedCheckpointEngine`
in its place for one ``load_checkpoint``: every file is read once, checked against the manifest of the verified
checkpoint it belongs to (a file outside it, or one the manifest does not list, is refused), and those bytes are
unpickled by the restricted unpickler. The loads DeepSpeed makes without its checkpoint engine (the universal form's
per-parameter files, DeepSpeed 0.19.8 checkpoint/universal_checkpoint.py) run inside
:func:`lightning_fleet.elastic.safe_load.restricted` too.

Imports deepspeed's checkpoint engine (at call time) and elastic/safe_load.py; imported by runtime/deepspeed/backend.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint
from lightning_fleet.elastic.safe_load import load_file, restricted
from lightning_fleet.planning import FleetError


def checked_engine(checkpoint: VerifiedCheckpoint | None) -> Any:
    """A DeepSpeed checkpoint engine whose loads are restricted, and checked against ``checkpoint``'s manifest when given
    (a plain ``trainer.save_checkpoint`` dir has none: its files are only restricted)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class CheckedCheckpointEngine(TorchCheckpointEngine):
        """TorchCheckpointEngine whose ``load`` reads through :func:`lightning_fleet.elastic.safe_load.load_file`."""

        def load(self, path: str, map_location: Any = None) -> Any:
            return load_file(Path(path), _entry(checkpoint, Path(path)), map_location=map_location)

    return CheckedCheckpointEngine()


def _entry(checkpoint: VerifiedCheckpoint | None, path: Path) -> Any:
    """The manifest entry of a file DeepSpeed asks for (None without a manifest); FleetError for one outside it."""
    if checkpoint is None:
        return None
    root = checkpoint.path.resolve()
    try:
        name = path.resolve().relative_to(root).as_posix()
    except ValueError:
        raise FleetError(f"DeepSpeed asked for {path}, which is outside the verified checkpoint {checkpoint.path}; refusing to read it") from None
    entry = checkpoint.manifest.files.get(name)
    if entry is None:
        raise FleetError(f"DeepSpeed asked for {name}, which the manifest of {checkpoint.path} does not list; refusing to read it")
    return entry


@contextmanager
def checked_loads(engine: Any, checkpoint: VerifiedCheckpoint | None) -> Iterator[None]:
    """For the block, the engine reads checkpoints through :func:`checked_engine` and every other ``torch.load`` is
    restricted; the engine's own checkpoint engine is put back afterwards."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = checked_engine(checkpoint)
    try:
        with restricted():
            yield
    finally:
        engine.checkpoint_engine = own
