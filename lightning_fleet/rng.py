"""The process's random-number streams as one value: captured, installed, seeded, kept around a block, checkpointed.

lightning_fleet must not disturb the user's randomness where it runs code of its own (profiling a copy of the
module, reading training data under a seed of its own), and carries each rank's streams in a checkpoint so a resumed
job continues them. The streams are torch's CPU generator, CUDA's (where CUDA is in use), Python's ``random`` and
NumPy's global one. Imports torch and NumPy only.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class RngState:
    """The global random-number streams of this process at one moment."""

    torch_cpu: torch.Tensor
    """torch's default (CPU) generator."""
    python: tuple
    """``random.getstate()``."""
    numpy: tuple
    """``numpy.random.get_state()``."""
    cuda: tuple[torch.Tensor, ...] | None = None
    """Every CUDA device's generator; None where CUDA is not in use (then it is left alone)."""

    @classmethod
    def capture(cls, *, cuda: bool = True) -> RngState:
        """The streams now (CUDA's only with ``cuda`` and once CUDA is initialised: capturing must not initialise it)."""
        cuda_states = None
        if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda_states = tuple(torch.cuda.get_rng_state_all())
        return cls(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda_states)

    @classmethod
    def seeded(cls, seed: int) -> RngState:
        """The CPU, Python and NumPy streams as seeding them with ``seed`` makes them (CUDA's untouched); the process's
        own streams are left as they were."""
        with kept(cuda=False):
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that also reseeds every CUDA device
            random.seed(seed)
            np.random.seed(seed % 2**32)
            return cls.capture(cuda=False)

    def install(self) -> None:
        """Make these the process's streams."""
        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(self.cuda))

    def to_checkpoint(self) -> dict[str, Any]:
        """Plain tensors, lists and numbers (loadable with ``torch.load(weights_only=True)``)."""
        version, internal, gauss = self.python
        kind, keys, pos, has_gauss, cached = self.numpy
        state = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
            "torch": self.torch_cpu,
        }
        if self.cuda is not None:
            state["cuda"] = list(self.cuda)
        return state

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> RngState:
        """Inverse of :meth:`to_checkpoint`."""
        version, internal, gauss = state["python"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        cuda = tuple(state["cuda"]) if "cuda" in state else None
        return cls(state["torch"], (version, tuple(internal), gauss), (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached), cuda)


@contextmanager
def kept(*, cuda: bool = True) -> Iterator[None]:
    """Run the block; afterwards the streams are as they were before it."""
    outer = RngState.capture(cuda=cuda)
    try:
        yield
    finally:
        outer.install()


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the block with the CPU, Python and NumPy streams seeded by ``seed`` (or as they are, for None); afterwards
    they are as they were before it."""
    with kept(cuda=False):
        if seed is not None:
            RngState.seeded(seed).install()
        yield
