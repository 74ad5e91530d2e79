"""Modules for the export tests with what the example GPT lacks: tied weights and buffers that training changes; a path
among the hyper-parameters.

Imports only the example (no lightning_fleet), so a fresh process can ``TiedGPT.load_from_checkpoint`` an exported file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from examples.gpt.model import GPT


class TiedGPT(GPT):
    """The example GPT with its output head tied to the token embedding, a float buffer that tracks the mean logits
    seen in training (different on every data-parallel rank) and an int64 counter of training forwards."""

    def __init__(self, **kwargs: int | float) -> None:
        super().__init__(**kwargs)
        self.head.weight = self.tok.weight
        self.register_buffer("logit_mean", torch.zeros(self.hparams.vocab_size))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits; in training also updates the buffers."""
        logits = super().forward(idx)
        if self.training and logits.device.type != "meta":
            with torch.no_grad():
                self.logit_mean.mul_(0.9).add_(0.1 * logits.detach().mean(dim=(0, 1)))
                self.forwards += 1
        return logits


class PathGPT(GPT):
    """The example GPT with a ``pathlib.Path`` among its hyper-parameters, as LightningCLI passes a path argument."""

    def __init__(self, data_dir: Path = Path("/data/corpus"), **kwargs: int | float) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()  # adds data_dir (a PosixPath) to the GPT's own
