"""Tier 2: FleetProgress's lines and summary under a plain one-process Trainer (the callback needs no FleetStrategy)."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fleet.progress import FleetProgress

pytestmark = pytest.mark.unit


class Regression(LightningModule):
    """A user's module: logs its losses with self.log, validates every few steps."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_each_line_shows_the_validation_loss_of_its_own_step(capsys):
    """Validation runs after a step's batch ends: the step's line waits for it, so the last line's val_loss is the
    summary's (it used to show the validation before, 2.979 against the summary's 2.826 in the Quickstart)."""
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, val_check_interval=3, log_every_n_steps=3, callbacks=[FleetProgress()],
                      enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
                      num_sanity_val_steps=0)
    trainer.fit(Regression(), _loader(), _loader())
    out = capsys.readouterr().out
    lines = re.findall(r"lightning_fleet: step (\d+)/6 .*?val_loss ([0-9.e+-]+)", out)
    assert [step for step, _ in lines] == ["3", "6"], out
    summary = re.search(r"loss .* at step 6, val_loss ([0-9.e+-]+)", out)
    assert summary is not None, out
    assert lines[-1][1] == summary.group(1) != lines[0][1]
