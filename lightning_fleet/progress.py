"""FleetProgress: what a FleetStrategy job shows while it trains and when it ends (rank 0 only), and the measured
against predicted step time it logs (``fleet/measured_step_s``, ``fleet/predicted_step_s``).

Every ``Trainer(log_every_n_steps)`` optimizer steps, when the Trainer has no progress bar, one line (after the
validation that follows the step, if one does, so its ``val_loss`` is that step's):

    lightning_fleet: step 30/60  loss 2.413  val_loss 2.398  0.271 s/step (predicted 0.275, 0.99x)  eta 8 s

and at the end of training, progress bar or not, a summary: steps and samples, wall time, measured
against predicted step time, the plan, the last loss, and where the checkpoints are.

Imports Lightning's Callback and the planning core; imported by the strategy (which attaches it) and by users.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Mapping

import torch
from lightning.pytorch import Callback

from lightning_fleet.planning.cluster import GIB


def loss_of(outputs: Any, metrics: Mapping[str, Any]) -> float | None:
    """The step's loss: the training_step output's loss, else a logged metric named like a loss; None if neither."""
    value = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(value, torch.Tensor):
        value = next((v for k, v in metrics.items() if "loss" in k and "val" not in k), None)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float())
    return float(value) if isinstance(value, (int, float)) else None


def validation_loss(metrics: Mapping[str, Any]) -> float | None:
    """The last logged validation loss (a metric named val*loss*), if any."""
    value = next((v for k, v in metrics.items() if k.startswith("val") and "loss" in k), None)
    return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _every(trainer: Any) -> int:
    """The Trainer's ``log_every_n_steps`` (at least 1)."""
    return max(1, int(trainer.log_every_n_steps or 50))


class FleetProgress(Callback):
    """Progress lines and an end-of-training summary for a FleetStrategy fit (added by the strategy; rank 0 prints)."""

    def __init__(self, lines: bool = True) -> None:
        self.lines = lines
        """Print the progress lines and the summary (the step-time metrics are logged either way)."""
        self.step_seconds: list[float] = []
        """Wall time between consecutive optimizer steps of this fit (data loading included)."""
        self.last_loss: float | None = None
        """Rank 0's loss at the last step."""
        self._started = 0.0
        self._last = 0.0
        self._first_step = 0
        self._line_due = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the clock of this fit."""
        self.step_seconds, self.last_loss, self._line_due = [], None, False
        self._started = self._last = time.perf_counter()
        self._first_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Time the step and log measured vs predicted step time (and on CUDA peak memory); on rank 0 keep its loss (one
        host sync) and print a line every ``log_every_n_steps``."""
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now
        self._log_metrics(trainer, pl_module)
        if not trainer.is_global_zero or not self.lines:
            return
        self.last_loss = loss_of(outputs, trainer.callback_metrics)
        if trainer.progress_bar_callback is None and trainer.global_step % _every(trainer) == 0:
            self._line_due = True  # printed once this step's validation, if one follows it, has logged its loss

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Print the previous step's line if no validation came after it."""
        self._print_due_line(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Print the line of the step this validation ran after, with its loss (not the previous validation's)."""
        if not trainer.sanity_checking:
            self._print_due_line(trainer)

    def _print_due_line(self, trainer: Any) -> None:
        if self._line_due:
            self._line_due = False
            print(self._line(trainer), flush=True)

    def _log_metrics(self, trainer: Any, pl_module: Any) -> None:
        """``fleet/predicted_step_s`` and ``fleet/measured_step_s`` (from the third step on); on CUDA also
        ``fleet/predicted_peak_gib`` and ``fleet/measured_peak_gib``. Logged on the steps the Trainer's loggers write
        (every ``log_every_n_steps``) and at the last step, not on every step (a ``self.log`` costs about a millisecond)."""
        step = trainer.global_step
        if step % _every(trainer) and not (trainer.max_steps > 0 and step >= trainer.max_steps):
            return
        estimate, measured = getattr(trainer.strategy, "estimate", None), self._measured()
        if estimate is None or measured is None or len(self.step_seconds) < 3:
            return
        pl_module.log("fleet/predicted_step_s", estimate.time.step_s, rank_zero_only=True)
        pl_module.log("fleet/measured_step_s", measured, rank_zero_only=True)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            pl_module.log("fleet/predicted_peak_gib", estimate.memory.total_bytes / GIB, rank_zero_only=True)
            pl_module.log("fleet/measured_peak_gib", torch.cuda.max_memory_allocated(device) / GIB, rank_zero_only=True)

    def _measured(self) -> float | None:
        """Median step time, leaving out the first step (warm-up: allocation, first collectives)."""
        steady = self.step_seconds[1:] or self.step_seconds
        return statistics.median(steady[-50:]) if steady else None

    def _versus_prediction(self, trainer: Any) -> str:
        measured = self._measured()
        estimate = getattr(trainer.strategy, "estimate", None)
        if measured is None:
            return ""
        if estimate is None:
            return f"{measured:.3g} s/step"
        predicted = estimate.time.step_s
        return f"{measured:.3g} s/step (predicted {predicted:.3g}, {measured / predicted:.2f}x)"

    def _line(self, trainer: Any) -> str:
        parts = [f"lightning_fleet: step {trainer.global_step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        if self.last_loss is not None and math.isfinite(self.last_loss):
            parts.append(f"loss {self.last_loss:.4g}")
        validated = validation_loss(trainer.callback_metrics)
        if validated is not None:
            parts.append(f"val_loss {validated:.4g}")
        parts.append(self._versus_prediction(trainer))
        measured = self._measured()
        if trainer.max_steps > 0 and measured is not None:
            parts.append(f"eta {max(0, trainer.max_steps - trainer.global_step) * measured:.0f} s")
        return "  ".join(p for p in parts if p)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0: the last step's line if still due, then the summary of this fit."""
        if not trainer.is_global_zero or not self.lines:
            return
        self._print_due_line(trainer)
        steps = trainer.global_step - self._first_step
        plan = getattr(trainer.strategy, "plan", None)
        samples = f" ({steps * plan.global_batch_size} samples)" if plan is not None else ""
        lines = [f"lightning_fleet: trained {steps} steps{samples} in {time.perf_counter() - self._started:.1f} s: {self._versus_prediction(trainer)}"]
        if plan is not None:
            lines.append(f"  plan     {plan}")
        if self.last_loss is not None:
            validated = validation_loss(trainer.callback_metrics)
            lines.append(f"  loss     {self.last_loss:.4g} at step {trainer.global_step}" + (f", val_loss {validated:.4g}" if validated is not None else ""))
        resumed = getattr(trainer.strategy, "resumed_from", None)
        if resumed is not None:
            lines.append(f"  resumed  from {resumed}")
        rebalances = getattr(trainer.strategy, "rebalances", ())
        if rebalances:
            lines.append(f"  split    changed {len(rebalances)} time(s) as the ranks' speeds drifted; last: "
                         f"{rebalances[-1].removeprefix('lightning_fleet: ')}")
        for callback in trainer.callbacks:
            saved = getattr(callback, "saved", None)
            if saved:
                lines.append(f"  saved    {saved[-1]} (newest of {len(saved)} saved by this run)")
        print("\n".join(lines), flush=True)
