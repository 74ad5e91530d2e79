"""Training text that exists offline on every machine: the Python standard library's source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset


def stdlib_bytes(limit_bytes: int) -> bytes:
    """The first ``limit_bytes`` of the stdlib's .py files, concatenated in sorted path order (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit_bytes:
            break
    if len(out) < limit_bytes:
        raise RuntimeError(f"the standard library at {root} holds only {len(out)} bytes of .py files, {limit_bytes} asked")
    return bytes(out[:limit_bytes])


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_length + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: bytes, seq_length: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_length = seq_length

    def __len__(self) -> int:
        return (len(self.data) - 1) // (self.seq_length + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * (self.seq_length + 1)
        chunk = self.data[start : start + self.seq_length + 1]
        return chunk[:-1], chunk[1:]


class StdlibText(LightningDataModule):
    """Byte windows of stdlib source; the last ``val_fraction`` of the text is held out."""

    def __init__(self, seq_length: int = 128, batch_size: int = 8, limit_bytes: int = 1_000_000, val_fraction: float = 0.05) -> None:
        """
        Args:
            seq_length: tokens per sample (must match the model's).
            batch_size: per-process batch size of the training loader (global batch = this x world size,
                unless the strategy is given global_batch_size).
            limit_bytes: how much stdlib text to use.
            val_fraction: share of the text held out for validation.
        """
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        text = stdlib_bytes(self.hparams.limit_bytes)
        cut = int(len(text) * (1 - self.hparams.val_fraction))
        self.train_set = ByteWindows(text[:cut], self.hparams.seq_length)
        self.val_set = ByteWindows(text[cut:], self.hparams.seq_length)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
