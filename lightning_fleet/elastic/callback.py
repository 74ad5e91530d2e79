"""FleetCheckpoint: periodic, preemption-safe, atomic checkpoints of a FleetStrategy job.

Saves every ``every_n_steps`` optimizer steps and/or every ``every_n_seconds`` (rank 0's clock),
on SIGTERM, and at the end of training. One small all-reduce per step makes every rank agree on
whether to save or stop at this step, so a SIGTERM delivered to a single rank (a preempted node)
stops all ranks at the same step with one consistent checkpoint, and the job exits cleanly.

Imports torch and Lightning; imported by the strategy (which attaches it for ``checkpoint_dir``) and by users. What
it writes where is described in :mod:`lightning_fleet.elastic.layout`.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_fleet.elastic.checkpoint import file_table, fsync_path, fsync_tree, prune, remove_abandoned, write_atomic
from lightning_fleet.elastic.layout import LATEST, MANIFEST, Manifest, rank_file, state_dir, step_dir_name, tmp_name
from lightning_fleet.planning import FleetError
from lightning_fleet.rng import RngState


class FleetCheckpoint(Callback):
    """Atomic checkpoints every N steps / T seconds, on SIGTERM and at the end; keeps the newest ``keep``.

    Args:
        dirpath: where checkpoints live (shared by all nodes of a multi-node job).
        every_n_steps: save after every N optimizer steps (None: not by steps).
        every_n_seconds: save when rank 0 has not saved for T seconds (None: not by time).
        keep: committed checkpoints to keep; the previous good one is removed only after the new one is committed.
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None, every_n_seconds: float | None = None, keep: int = 3) -> None:
        if keep < 1:
            raise FleetError(f"FleetCheckpoint(keep={keep}): keep at least one checkpoint")
        for name, value in (("every_n_steps", every_n_steps), ("every_n_seconds", every_n_seconds)):
            if value is not None and value <= 0:
                raise FleetError(f"FleetCheckpoint({name}={value}): must be positive or None")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.keep = keep
        self.preempted = False
        """True once a SIGTERM stopped training (after the checkpoint was committed)."""
        self.saved: list[Path] = []
        """Checkpoints this process committed, in order."""
        self.save_seconds: list[float] = []
        """Wall time of each of those saves (from the first barrier to the commit)."""
        self._sigterm = False
        self._previous_handler: Any = None
        self._last_save_time = time.monotonic()
        self._last_saved_step = -1

    # --- signals ----------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over SIGTERM (after Lightning registered its own handler, which would abort the step)."""
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._last_save_time = time.monotonic()
        self._last_saved_step = trainer.global_step

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Give SIGTERM back to the handler it had before training."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # --- when to save -----------------------------------------------------------------------

    def _agree(self, trainer: Any) -> tuple[bool, bool]:
        """(any rank got SIGTERM, rank 0's clock says save) agreed by all ranks with one all-reduce."""
        due = self.every_n_seconds is not None and trainer.is_global_zero and time.monotonic() - self._last_save_time >= self.every_n_seconds
        flags = torch.tensor([float(self._sigterm), float(due)], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Save when any rank got SIGTERM, the time is due or the step count says so; stop after a SIGTERM."""
        sigterm, time_due = self._agree(trainer)
        step = trainer.global_step
        if sigterm or time_due or (self.every_n_steps is not None and step % self.every_n_steps == 0):
            self.save(trainer)
        if sigterm:
            self.preempted = True
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The final checkpoint."""
        self.save(trainer)

    # --- the save ---------------------------------------------------------------------------

    def save(self, trainer: Any) -> Path | None:
        """Commit a checkpoint of the current step (every rank calls this together); None if it exists already."""
        step = trainer.global_step
        if step == self._last_saved_step:
            return None
        started = time.perf_counter()
        final = self.dirpath / step_dir_name(step)
        tmp = self.dirpath / tmp_name(final.name)
        strategy = trainer.strategy
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            remove_abandoned(self.dirpath)
            tmp.mkdir()
        strategy.barrier("fleet-checkpoint-start")
        trainer.save_checkpoint(state_dir(tmp), weights_only=False)  # a full, resumable checkpoint
        torch.save(RngState.capture().to_checkpoint(), rank_file(tmp, trainer.global_rank))
        fsync_tree(tmp)
        strategy.barrier("fleet-checkpoint-written")
        if trainer.is_global_zero:
            self._commit(trainer, tmp, final)
        strategy.barrier("fleet-checkpoint-committed")
        self._last_save_time = time.monotonic()
        self._last_saved_step = step
        self.saved.append(final)
        self.save_seconds.append(time.perf_counter() - started)
        return final

    def _commit(self, trainer: Any, tmp: Path, final: Path) -> None:
        """Rank 0: manifest last, rename into place, then move ``latest`` and prune."""
        write_atomic(tmp / MANIFEST, self._manifest(trainer, tmp).to_json())
        if final.exists():  # left by a save that renamed but died before moving `latest`: same step, replace it
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_path(final.parent)
        write_atomic(self.dirpath / LATEST, final.name)
        prune(self.dirpath, self.keep, protect=[final])

    @staticmethod
    def _manifest(trainer: Any, tmp: Path) -> Manifest:
        """The manifest of the save in ``tmp``: its step, world and plan, what a resume must keep (model structure and
        data-order seed, from the strategy's ``checkpoint_facts()``: elastic/compatibility.py) and every file's hash."""
        plan = getattr(trainer.strategy, "plan", None)
        facts = getattr(trainer.strategy, "checkpoint_facts", None)
        job = facts() if callable(facts) else None
        return Manifest(
            step=trainer.global_step,
            world_size=trainer.world_size,
            plan=str(plan) if plan is not None else None,
            global_batch_size=plan.global_batch_size if plan is not None else None,
            model=job.model if job is not None else None,
            data_seed=job.data_seed if job is not None else None,
            files=file_table(tmp),
        )
