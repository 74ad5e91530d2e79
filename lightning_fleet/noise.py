"""Known dependency noise, filtered by exact message so that nothing else is hidden.

Measured on a 6-step ZeRO-3 run of the example on 2 CPU processes (torch 2.13, lightning 2.6.6,
deepspeed 0.19.8): 227 lines of output, of which 196 were torch's FutureWarnings about
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (two per step per rank, raised inside
DeepSpeed's ZeRO), one accelerator-detection warning and one comm-op banner per rank from DeepSpeed,
Lightning's "initializing deepspeed distributed" per rank, and a pytree deprecation per rank; at every resume
Lightning warns that the dataloader is not resumable, which is false here. None of them is actionable for a user
of strategy "fleet". Every other warning and log record passes.

Imports the standard library only (it must run before DeepSpeed is first imported); imported by the strategy and the
CLI.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from typing import Iterator

WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    (Warning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # false under strategy "fleet": the training data position is keyed by the global step (elastic/sampler.py)
    (Warning, r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"),
)
"""(category, message regex) of the warnings dropped."""

LOG_RECORDS = {
    "DeepSpeed": re.compile(
        r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.$"
        # the user's own optimizer (configure_optimizers) under ZeRO: strategy "fleet" allows it on purpose
        r"|^\*\*\*\* You are using ZeRO with an untested optimizer, proceed with caution \*\*\*\*\*$"
    ),
    "lightning.pytorch.strategies.deepspeed": re.compile(r"^initializing deepspeed distributed: GLOBAL_RANK"),
    "pytorch_lightning.strategies.deepspeed": re.compile(r"^initializing deepspeed distributed: GLOBAL_RANK"),
}
"""Logger name -> the message of its records that are dropped."""

BANNER = re.compile(r"^DeepSpeed \S+ built successfully$")
"""What DeepSpeed prints (a bare print) after loading its CPU comm op at every process-group start."""

_installed = False


class _DropMessage(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def install() -> None:
    """Install the warning and log-record filters (idempotent; process-wide, but each matches one known message)."""
    global _installed
    if _installed:
        return
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in LOG_RECORDS.items():
        logging.getLogger(name).addFilter(_DropMessage(pattern))  # loggers persist: DeepSpeed's is created later
    _installed = True


@contextlib.contextmanager
def without_banner() -> Iterator[None]:
    """Run a block that may print DeepSpeed's comm-op banner; its other stdout lines are passed through."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not BANNER.match(line.strip())]
        print("".join(kept), end="", flush=True)
