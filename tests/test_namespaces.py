"""Any import order and both Lightning namespaces: ``lightning.pytorch`` and ``pytorch_lightning`` (each in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multiprocess import ROOT, worker_env

TRAIN_ONE_STEP = """
import torch
from torch.utils.data import DataLoader, TensorDataset

class Net({base}):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
trainer = Trainer(accelerator="cpu", devices=1, strategy={strategy}, max_steps=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[FleetCheckpoint(r"{ckpt}", every_n_steps=1)])
trainer.fit(Net(), data)
assert type(trainer.strategy).__module__ == "{module}", type(trainer.strategy).__module__
assert trainer.global_step == 2 and any(getattr(c, "saved", None) for c in trainer.callbacks)
print("TRAINED", next(k for k in type(trainer.strategy).__mro__ if k.__name__ == "DDPStrategy").__module__)
"""


def run_code(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=worker_env(tmp_path), capture_output=True, text=True, timeout=300)


@pytest.mark.unit
@pytest.mark.parametrize(
    "imports,base,strategy,module",
    [
        # the README's own line first, Lightning afterwards (was a circular ImportError)
        ("from lightning_fleet import FleetCheckpoint, FleetStrategy\nfrom lightning.pytorch import Trainer, LightningModule",
         "LightningModule", '"fleet"', "lightning_fleet.strategy"),
        ("from lightning.pytorch import Trainer, LightningModule\nimport lightning_fleet\nfrom lightning_fleet import FleetCheckpoint",
         "LightningModule", "lightning_fleet.FleetStrategy()", "lightning_fleet.strategy"),
        ("import lightning_fleet\nfrom pytorch_lightning import Trainer, LightningModule\nfrom lightning_fleet.pl import FleetCheckpoint",
         "LightningModule", '"fleet"', "lightning_fleet.pl.strategy"),
        ("from pytorch_lightning import Trainer, LightningModule\nfrom lightning_fleet.pl import FleetCheckpoint, FleetStrategy",
         "LightningModule", 'FleetStrategy(zero_stages=(1,))', "lightning_fleet.pl.strategy"),
    ],
    ids=["fleet-first", "lightning-first", "pytorch_lightning-by-name", "pytorch_lightning-class"],
)
def test_trains_in_any_import_order_and_namespace(tmp_path, imports, base, strategy, module):
    code = imports + TRAIN_ONE_STEP.format(base=base, strategy=strategy, ckpt=tmp_path / "ckpt", module=module)
    done = run_code(code, tmp_path)
    assert done.returncode == 0 and "TRAINED" in done.stdout, (done.stdout + done.stderr)[-3000:]
    expected = "pytorch_lightning" if "pytorch_lightning" in imports else "lightning.pytorch"
    assert f"TRAINED {expected}.strategies.ddp" in done.stdout


@pytest.mark.pure
def test_pytorch_lightning_copy_is_served_from_the_same_sources():
    """The pytorch_lightning classes are the same source files with the Lightning imports renamed, nothing else."""
    from lightning_fleet import pl

    mirrored = pl.mirrored()
    assert {"lightning_fleet.strategy", "lightning_fleet.elastic.callback"} <= set(mirrored)
    assert "lightning_fleet.planning.search" not in mirrored  # the pure core is shared, not copied
    source = mirrored["lightning_fleet.strategy"].read_text()
    rewritten = pl.rewrite(source)
    assert "lightning.pytorch" not in rewritten and "from pytorch_lightning.strategies import" in rewritten
    assert "from lightning_fleet.pl.elastic.callback import FleetCheckpoint, NonFiniteGuard" in rewritten
    assert "from lightning_fleet.pl.fit import FitCore" in rewritten  # the fit core profiles LightningModules: copied too
    assert "from lightning_fleet.planning import" in rewritten
