"""Train the example GPT with LightningCLI; ``import lightning_fleet`` makes ``strategy: fleet`` available.

    python examples/gpt/train.py fit --config examples/gpt/config.yaml
    torchrun --nproc-per-node=2 examples/gpt/train.py fit --config examples/gpt/config.yaml
    python examples/gpt/train.py fit --config examples/gpt/config.yaml --trainer.strategy fleet_zero3

A lightning_fleet error (bad plan, nothing fits, cluster file that contradicts the job) ends the
run with one line on rank 0's stderr and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_fleet  # noqa: E402,F401  (registers the "fleet" strategy names)
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402


def main() -> None:
    """Run the LightningCLI. A lightning_fleet error ends the job with one line on rank 0's stderr and exit code 2 (the
    strategy's error hook; under torchrun a deterministic one also stops the agent instead of burning restarts)."""
    LightningCLI(GPT, StdlibText, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
