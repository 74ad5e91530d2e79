"""A DLRM-style recommender (``nn.EmbeddingBag(sparse=True)`` tables and a dense MLP, plain SGD) for the sparse-gradient
tests, and a worker that trains it on 2 processes under strategy "fleet" (or "ddp") and reports.

    python tests/workers/sparse_dlrm.py --plan auto --cluster c.yaml --steps 4 --out /tmp/r.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

TABLES, ROWS, DIM, BAG, DENSE = 4, 20_000, 16, 3, 8
"""Embedding tables, rows per table, row width, ids per bag (per sample and table), dense features."""
SAMPLES, BATCH = 64, 8


class DLRM(LightningModule):
    """Sparse embedding tables (sum of each bag's rows) beside a bottom MLP on dense features, a top MLP on both."""

    def __init__(self, rows: int = ROWS, tables: int = TABLES, dim: int = DIM, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, dim))
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        dense, ids, label = batch
        return nn.functional.binary_cross_entropy_with_logits(self(dense, ids), label)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # SGD takes sparse gradients (Adam does not)


def dlrm_data(rows: int = ROWS, samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    """(dense features, ids [tables x bag], click) triples; the click follows the dense features."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(samples, DENSE, generator=g)
    ids = torch.randint(0, rows, (samples, TABLES, BAG), generator=g)
    label = (dense[:, 0] > 0).float()
    return TensorDataset(dense, ids, label)


class StepTimer(Callback):
    """Wall time of each optimizer step after the first (the first builds and warms up)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def reference_state(steps: int, gbs: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` plain SGD steps of one process taking ``gbs`` samples a step in dataset order."""
    seed_everything(0)
    model = DLRM(rows=rows)
    optimizer = model.configure_optimizers()
    data = dlrm_data(rows)
    for step in range(steps):
        start = step * gbs % SAMPLES
        batch = data[start:start + gbs]
        model.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default="auto", help="'auto', a (partial) plan string, or 'ddp' (Lightning's own)")
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seed_everything(0)
    model = DLRM(rows=args.rows)
    loader = DataLoader(dlrm_data(args.rows), batch_size=BATCH, shuffle=False)
    if args.plan == "ddp":
        strategy = "ddp"
    else:
        import lightning_fleet

        strategy = lightning_fleet.FleetStrategy(plan=None if args.plan == "auto" else args.plan, cluster=args.cluster,
                                                 progress=False)
    timer = StepTimer()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, callbacks=[timer],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=args.plan != "ddp")
    trainer.fit(model, train_dataloaders=loader)
    if trainer.global_rank == 0:
        plan = getattr(trainer.strategy, "plan", None)
        decision = getattr(trainer.strategy, "decision", None)
        torch.save({
            "plan": str(plan) if plan is not None else "ddp",
            "global_step": trainer.global_step,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "step_times": timer.times,
            "predicted_step_s": decision.estimate.time.step_s if decision is not None else None,
        }, args.out)


if __name__ == "__main__":
    main()
