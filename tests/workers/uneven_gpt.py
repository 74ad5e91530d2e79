"""Worker for tests/test_uneven_stages.py: the training worker (train_gpt.py) on the example GPT with 3 layers, so a
two-stage pipeline splits its layers unevenly.

    python tests/workers/uneven_gpt.py --plans "dp=1,pp=2,stage_layers=2/1" --out /tmp/r.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.workers import train_gpt  # noqa: E402

LAYERS = 3
"""Layers of the example GPT here: odd, so pp=2 cannot split them evenly."""

if __name__ == "__main__":
    train_gpt.SIZES["num_layers"] = LAYERS
    train_gpt.main()
