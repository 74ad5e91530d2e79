"""What every runtime's torch side shares: full recomputation of a layer, the stand-in for Lightning's gradient zeroing
between micro-batches, an atomic ``torch.save``, and a sharded tensor's local part.

Imports torch; imported by the runtimes' backends (runtime/deepspeed/, runtime/torch/), by :mod:`lightning_fleet.export`
and by the non-finite check (:mod:`lightning_fleet.elastic.callback`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_fleet.elastic.checkpoint import fsync_path


def checkpointed_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Full recomputation: a layer's forward under torch.utils.checkpoint (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def engine_zeroes_gradients(*args: Any, **kwargs: Any) -> None:
    """Stands in for LightningModule.optimizer_zero_grad under strategy 'fleet': Lightning calls it after a step's
    first micro-batches have accumulated their gradients; the runtime (DeepSpeed after each step) or the strategy
    (before a step's first micro-batch) zeroes them instead."""


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary file, fsync, rename into place, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2, tensor parallelism; a view that writes through), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
