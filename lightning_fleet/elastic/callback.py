"""FleetCheckpoint: periodic, preemption-safe, atomic checkpoints of a FleetStrategy job.

Saves every ``every_n_steps`` optimizer steps and/or every ``every_n_seconds`` (rank 0's clock),
on SIGTERM or SIGHUP, and at the end of training. One small all-reduce per step makes every rank agree on
whether to save or stop at this step, so a SIGTERM delivered to a single rank (a preempted node)
stops all ranks at the same step with one consistent checkpoint, and the job exits cleanly.

Nothing is lost and no failure repeats itself. Before anything reads or writes the directory (:meth:`FleetCheckpoint.claim`,
at setup) rank 0 takes its lock (elastic/lock.py: one job at a time), removes saves that never committed and probes
it: a directory that cannot be written, or has no room for one more checkpoint, is one line before training, marked
deterministic (torchrun does not retry it). Every save first agrees on the weights being finite (each rank its own
shard) and on rank 0 still holding the lock and having room; a save that fails anyway (a disk filling up meanwhile)
is one line naming the step, the path and the intact previous checkpoint, and leaves nothing behind. A step whose loss
is not finite is stopped or skipped before the optimizer applies it (:class:`NonFiniteGuard`, ``FleetStrategy(
non_finite=...)``), so non-finite weights are never committed nor counted toward ``keep``.

Imports torch and Lightning; imported by the strategy (which attaches FleetCheckpoint for ``checkpoint_dir`` and
NonFiniteGuard for every fit) and by users. What it writes where is described in :mod:`lightning_fleet.elastic.layout`.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_fleet.elastic.checkpoint import (
    committed,
    directory_bytes,
    file_table,
    fsync_path,
    fsync_tree,
    identity,
    make_dir,
    make_private_dir,
    probe_writable,
    prune,
    remove_abandoned,
    seal_tree,
    set_aside,
    set_aside_newer,
    still_there,
    write_atomic,
)
from lightning_fleet.elastic.layout import LATEST, MANIFEST, Manifest, rank_file, state_dir, step_dir_name, step_of, tmp_name
from lightning_fleet.elastic.lock import DirLock
from lightning_fleet.elastic.worker import collectives, deterministic, note_stop_signal
from lightning_fleet.planning import FleetError
from lightning_fleet.rng import RngState
from lightning_fleet.runtime.base import ENGINE_CHECK, SHARDED_CHECK
from lightning_fleet.runtime.common import local_part

CHECKPOINT_BYTES_PER_PARAMETER = 16
"""Free space a first checkpoint needs per parameter of the module, where the directory holds none to measure:
DeepSpeed's checkpoint of a ZeRO 1-3 job holds the module's fp32 weights (4 bytes) beside the optimizer's fp32 copy and
Adam's two moments (12 bytes, the "K = 12" of Rajbhandari et al. 2020, ZeRO, section 3.1); ZeRO-0 holds 12 of them."""


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
        self._previous_handlers: dict[int, Any] = {}  # per signal of STOP_SIGNALS, while training
        self._last_save_time = time.monotonic()
        self._last_saved_step = -1
        self._lock: DirLock | None = None  # rank 0's hold on dirpath, from claim() to the end of fit
        self._claimed = False
        self._needed_bytes = 0  # free space one more checkpoint needs (the newest one's size, or the estimate)
        self._identity: tuple[int, ...] | None = None  # rank 0: dirpath as claimed (_directory_identity)
        self._resumed: Path | None = None  # the checkpoint this fit continued, the last good one before its own saves

    # --- the directory ------------------------------------------------------------------------

    def claim(self, trainer: Any) -> None:
        """Before anything reads or writes ``dirpath``: rank 0 takes its lock, removes saves that never committed and
        probes that the checkpoints ``keep`` asks for can be written (the directory writable, in a tree no other user
        can rearrange; free space for ``keep`` + 1 checkpoints, the most there are during a save before pruning, less
        those already there, each of the newest checkpoint's size, or :data:`CHECKPOINT_BYTES_PER_PARAMETER` per
        parameter when there is none). Every rank raises the same deterministic FleetError when not. Collective; once
        per fit (FleetStrategy calls it at setup, before choosing the checkpoint to continue; with another strategy it
        runs at train start)."""
        if self._claimed:
            return
        verdict = self._claim_here(trainer) if trainer.is_global_zero else None
        with _collectives(trainer, "FleetCheckpoint's claim of its directory"):
            problem, needed = trainer.strategy.broadcast(verdict) if trainer.world_size > 1 else (verdict or (None, 0))
        if problem is not None:
            raise deterministic(FleetError(problem))
        self._claimed, self._needed_bytes = True, needed

    def _claim_here(self, trainer: Any) -> tuple[str | None, int]:
        """Rank 0's part of :meth:`claim`: (what is wrong or None, bytes one more checkpoint needs)."""
        try:
            self._take_directory()
            needed, basis = self._space_needed(trainer)
            problem = probe_writable(self.dirpath)
        except FleetError as err:
            return str(err), 0
        except OSError as err:
            problem, needed, basis = f"it cannot be used ({err.strerror or err})", 0, ""
        except Exception as err:  # a bug or an unexpected state: the other ranks must not wait for the broadcast
            return f"checkpoint directory {self.dirpath} could not be claimed: {_error_text(err)}", 0
        if problem:
            return (f"checkpoint directory {self.dirpath}: {problem}; every save would fail (after training, and again at "
                    "every restart): make it writable or point checkpoint_dir elsewhere"), 0
        free, present = shutil.disk_usage(self.dirpath).free, len(committed(self.dirpath))
        count = max(self.keep - present, 0) + 1  # a save holds keep + 1 until it prunes
        if free < count * needed:
            return (f"checkpoint directory {self.dirpath} has {_size(free)} free, and keep={self.keep} needs room for "
                    f"{count} more checkpoint(s) ({present} there now) of about {_size(needed)} each ({basis}), "
                    f"{_size(count * needed)} in all: free space there, lower keep, or point checkpoint_dir elsewhere"), 0
        return None, needed

    def _take_directory(self) -> None:
        """Rank 0: create ``dirpath`` privately (or check it is private), take its lock, remove saves that never
        committed and note which directory it is (:meth:`_check_directory` compares at every save)."""
        make_private_dir(self.dirpath)
        self._lock = self._lock or DirLock(self.dirpath, log=lambda line: print(line, flush=True))
        self._lock.acquire()
        self._identity = self._directory_identity()
        remove_abandoned(self.dirpath, self._lock)

    def _directory_identity(self) -> tuple[int, ...] | None:
        """Which directory is at ``dirpath`` (None: nothing is): its (device, inode) and its lock file's inode. A
        directory deleted and made again (by DeepSpeed's own ``makedirs`` during a save) holds no lock file, even where
        the file system gives it the deleted one's inode number (measured: tmpfs and ext4 reuse it at once)."""
        found = identity(self.dirpath)
        if found is None:
            return None
        lock = identity(self._lock.path) if self._lock is not None else None
        return (*found, *(lock or (-1, -1)))

    def _check_directory(self) -> None:
        """Rank 0, before a save writes: ``dirpath`` is still the directory claimed. Deleted since (``rm -rf``): made
        again, with its lock, and the job goes on (a line says so). Another directory in its place: FleetError (this job
        writes nothing into a directory it did not set up)."""
        found = self._directory_identity()
        if found is None:
            print(f"lightning_fleet: checkpoint directory {self.dirpath} was deleted since the last save (with the "
                  "checkpoints it held); made it again, with its lock", flush=True)
            assert self._lock is not None, "claim() took the lock on rank 0"
            self._lock.release()  # its heartbeat stopped with the lock file gone
            self._take_directory()
        elif found != self._identity:
            raise FleetError(f"checkpoint directory {self.dirpath} is not the one this job set up")  # _failed says more

    def _space_needed(self, trainer: Any) -> tuple[int, str]:
        """(bytes, how they were found) one more checkpoint needs: the newest one's size, else an estimate."""
        newest = committed(self.dirpath)
        if newest:
            return directory_bytes(newest[0]), f"the size of {newest[0].name}"
        params = sum(p.numel() for p in trainer.lightning_module.parameters())
        return CHECKPOINT_BYTES_PER_PARAMETER * params, (
            f"estimated at {CHECKPOINT_BYTES_PER_PARAMETER} bytes for each of the module's {params} parameters; none saved "
            "there yet")

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self._claimed = False

    # --- signals ----------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over SIGTERM and SIGHUP (:data:`STOP_SIGNALS`; after Lightning registered its own SIGTERM handler, which
        would abort the step); claim the directory if the strategy did not."""
        self.claim(trainer)
        for sig in STOP_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, self._on_sigterm)
        self._last_save_time = time.monotonic()
        self._last_saved_step = trainer.global_step
        resumed = getattr(trainer.strategy, "resumed_from", None)
        self._resumed = Path(resumed) if resumed is not None else None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        note_stop_signal()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Give SIGTERM and SIGHUP back to the handlers they had before training; release the directory."""
        while self._previous_handlers:
            sig, handler = self._previous_handlers.popitem()
            signal.signal(sig, handler)
        self._release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A fit that failed releases the directory too (a restart of the same job would take it over anyway)."""
        self._release()

    # --- when to save -----------------------------------------------------------------------

    def _agree(self, trainer: Any) -> tuple[bool, bool]:
        """(any rank got SIGTERM, rank 0's clock says save) agreed by all ranks with one all-reduce."""
        due = self.every_n_seconds is not None and trainer.is_global_zero and time.monotonic() - self._last_save_time >= self.every_n_seconds
        flags = torch.tensor([float(self._sigterm), float(due)], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            with _collectives(trainer, "FleetCheckpoint's per-step agreement on saving"):
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
        """Commit a checkpoint of the current step (every rank calls this together); None if it exists already.
        FleetError on every rank, with nothing of the step kept, when the weights are not finite, the directory was lost
        to another job or has no room, or the write fails."""
        step = trainer.global_step
        if step == self._last_saved_step:
            return None
        self.claim(trainer)
        started = time.perf_counter()
        final = self.dirpath / step_dir_name(step)
        tmp = self.dirpath / tmp_name(final.name)
        self._agree_to_save(trainer, tmp, final)
        self._write(trainer, tmp, final)
        outcome = self._try_commit(trainer, tmp, final) if trainer.is_global_zero else None
        with _collectives(trainer, f"FleetCheckpoint's commit of step {step}"):
            problem, size = trainer.strategy.broadcast(outcome) if trainer.world_size > 1 else outcome
        if problem is not None:
            raise self._failed(final, problem)
        self._needed_bytes = max(self._needed_bytes, size)
        self._last_save_time = time.monotonic()
        self._last_saved_step = step
        self.saved.append(final)
        self.save_seconds.append(time.perf_counter() - started)
        return final

    def _agree_to_save(self, trainer: Any, tmp: Path, final: Path) -> None:
        """One all-reduce before anything is written: every rank's weights (its own shard) finite, and rank 0 still
        holding the directory, with room for one more checkpoint, and its temporary directory made. FleetError on every
        rank otherwise (rank 0's says what it found)."""
        refusal = self._refusal_here(tmp) if trainer.is_global_zero else ""
        flags = torch.zeros(trainer.world_size + 1, device=trainer.strategy.root_device)
        flags[0] = float(bool(refusal))
        flags[1 + trainer.global_rank] = float(not _weights_finite(trainer))
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            with _collectives(trainer, f"FleetCheckpoint's agreement to save step {trainer.global_step}"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        found = flags.tolist()
        ranks = [rank for rank, flag in enumerate(found[1:]) if flag > 0]
        if not ranks and not found[0]:
            return
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        if ranks:
            raise deterministic(FleetError(
                f"the weights or optimizer state are not finite at step {trainer.global_step} ({_ranks(ranks)}'s shard): "
                f"the checkpoint {final} was not written and the job stops; {self._last_good()} (a restart would train into "
                "the same values again: lower the learning rate, clip gradients, or check the data of the steps since)"
            ))
        raise self._failed(final, refusal or "rank 0 could not start the save (see its line)")

    def _refusal_here(self, tmp: Path) -> str:
        """Rank 0: why it cannot start the save of ``tmp`` ('' when it can), having made ``tmp`` when it can."""
        try:
            assert self._lock is not None, "claim() took the lock on rank 0"
            self._check_directory()
            self._lock.verify()
            remove_abandoned(self.dirpath, self._lock)
            free = shutil.disk_usage(self.dirpath).free
            if free < self._needed_bytes:
                return "no room for it"  # _failed says how much
            make_dir(tmp, 0o700)  # nobody else enters it while DeepSpeed and torch write with the umask's modes
        except FleetError as err:
            return str(err)
        except OSError as err:
            return f"{err.strerror or err} ({err.filename or self.dirpath})"
        return ""

    def _write(self, trainer: Any, tmp: Path, final: Path) -> None:
        """Every rank writes its part into ``tmp`` and fsyncs it. A failure inside the runtime's save is raised at once
        (the ranks may have failed at different collectives: none waits for another); one after it is agreed."""
        try:
            trainer.save_checkpoint(state_dir(tmp), weights_only=False)  # a full, resumable checkpoint
        except (OSError, RuntimeError, FleetError) as err:  # FleetError: a runtime's own line (DCP's failed save)
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(final, str(err) if isinstance(err, FleetError) else _error_text(err)) from None
        failure: BaseException | None = None
        try:
            torch.save(RngState.capture().to_checkpoint(), rank_file(tmp, trainer.global_rank))
            fsync_tree(tmp)
        except (OSError, RuntimeError) as err:
            failure = err
        flag = torch.tensor([float(failure is not None)], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            with _collectives(trainer, f"FleetCheckpoint's agreement that step {trainer.global_step} was written"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # also the barrier before rank 0 commits
        if flag.item():
            if trainer.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(final, _error_text(failure) if failure is not None else "another rank could not write its part")

    def _try_commit(self, trainer: Any, tmp: Path, final: Path) -> tuple[str | None, int]:
        """Rank 0: :meth:`_commit`, as (what went wrong or None, the checkpoint's bytes); a commit that failed before the
        rename leaves nothing behind."""
        try:
            size = self._commit(trainer, tmp, final)
        except (OSError, RuntimeError, FleetError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            return _error_text(err), 0
        return None, size or 0

    def _commit(self, trainer: Any, tmp: Path, final: Path) -> int:
        """Rank 0: manifest last; ``latest`` names the step, then the directory is renamed into place (a crash between
        the two leaves ``latest`` naming a missing directory: the newest verified one is resumed); what was already
        there under that name, or numbered above it, is set aside (never deleted); then prune. Returns its bytes."""
        seal_tree(tmp)  # 0755 directories, files 0644 or tighter, whatever the umask: then hashed
        manifest = self._manifest(trainer, tmp)
        write_atomic(tmp / MANIFEST, manifest.to_json())
        self._check_directory_kept()
        if os.path.lexists(final):  # not the checkpoint this job resumed (it did not verify, or `latest` named another)
            print(f"lightning_fleet: {final} was already there; moved to {set_aside(self.dirpath, final)}", flush=True)
        write_atomic(self.dirpath / LATEST, final.name)
        tmp.rename(final)
        fsync_path(final.parent)
        set_aside_newer(self.dirpath, manifest.step, log=lambda line: print(line, flush=True))
        prune(self.dirpath, self.keep, protect=[final])
        return sum(entry.bytes for entry in manifest.files.values())

    def _check_directory_kept(self) -> None:
        """Rank 0, right before the commit's rename: ``dirpath`` is still the directory claimed (FleetError if not)."""
        if self._directory_identity() != self._identity:
            raise FleetError(f"checkpoint directory {self.dirpath} is not the one this job set up")  # _failed says more

    def _last_good(self) -> str:
        """The newest checkpoint known good, in words (this fit's last save, else the one it resumed), checked to be
        still there (size, not hash) before it is named as good."""
        good = self.saved[-1] if self.saved else self._resumed
        if good is None:
            return f"no checkpoint of this job in {self.dirpath} yet"
        moved = self._directory_identity() not in (None, self._identity) and self._identity is not None
        gone = f"was in the directory this job set up, which is no longer at {self.dirpath}" if moved else still_there(good)
        if gone:
            return f"this job's last checkpoint {good} (step {step_of(good.name)}) {gone}"
        return f"the last good checkpoint is {good} (step {step_of(good.name)}), intact"

    def _failed(self, final: Path, what: str) -> FleetError:
        """The one line of a save that failed, naming its cause as found on disk (the directory deleted or replaced, the
        file system full) before the runtime's words; deterministic when the next attempt's setup would fail the same
        way (the directory unwritable, or without room for one more checkpoint)."""
        found = self._directory_identity()
        full, cause = False, what
        if found is None:
            cause = f"the checkpoint directory {self.dirpath} was deleted during the save ({what})"
        elif self._identity is not None and found != self._identity:
            cause = (f"the checkpoint directory {self.dirpath} is not the one this job set up (deleted and made again, or "
                     "moved away and replaced: its device, inode or lock file changed), and this job writes nothing into a directory "
                     "it did not set up")
        else:
            free = shutil.disk_usage(self.dirpath).free
            full = free < self._needed_bytes
            if full:  # whatever the runtime said (torch's "enforce fail at inline_container.cc", ENOSPC): the cause is this
                cause = f"the file system is full ({_size(free)} free, a checkpoint needs about {_size(self._needed_bytes)})"
        error = FleetError(
            f"saving the checkpoint of step {step_of(final.name)} to {final} failed: {cause}; nothing of it was kept and "
            f"{self._last_good()}: {'free space there' if full else 'fix the cause'} and restart (it resumes from the newest "
            "checkpoint that verifies), or point checkpoint_dir elsewhere"
        )
        parent = self.dirpath.parent
        unwritable = bool(probe_writable(self.dirpath)) if found is not None else not os.access(parent, os.W_OK | os.X_OK)
        return deterministic(error, full or unwritable)

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


NON_FINITE_POLICIES = ("stop", "skip")
"""What a step whose loss is not finite does (``FleetStrategy(non_finite=...)``): ``stop``: the job stops before the
optimizer applies it, in one line naming the step and the last good checkpoint; ``skip``: the step is not applied
(weights and optimizer state unchanged), counted and reported."""


class NonFiniteGuard(Callback):
    """Stops or skips a step whose loss is NaN or infinite on any rank, before the optimizer applies it.

    The loss of every step is checked on every rank right before its (last) backward and agreed with one small
    all-reduce. ``stop`` raises there, a deterministic FleetError (a restart would train into the same value). ``skip``
    makes the step's gradient NaN, which DeepSpeed's optimizer wrappers (ZeRO 1-3, fp16, bf16) discard as an overflow,
    and, where the torch optimizer is stepped directly (ZeRO-0 in fp32, which would step into NaN weights), drops the
    gradients before the step, so that no parameter is updated (torch optimizers skip parameters without a gradient).
    Where the step runs inside the engine (a pipeline schedule) or the user steps (manual optimization), the loss is
    checked after the step: ``skip`` then holds only where DeepSpeed skipped it itself, else the job stops.

    Where the gradients end up in ``param.grad`` (``FleetStrategy.gradient_check``: the torch runtime), the loss is not
    agreed before backward: a rank whose loss is not finite makes its gradient NaN (a hook on the loss, on the device),
    which the runtime's reduction carries to the others, and one fused check of the gradients before the optimizer step
    gives the verdict: local where every rank holds the same whole gradient (DDP, no collective on a healthy step), agreed
    by one small all-reduce where each holds its shard (FSDP). Only on a non-finite gradient do the ranks agree (one
    more all-reduce) on whose loss it was.

    A finite loss whose gradient is NaN or infinite (a backward through ``sqrt(0)``, a custom autograd function) is
    caught too: where the torch optimizer is stepped directly, the gradients (averaged alike on every rank) are checked
    before the step; where DeepSpeed's wrapper checks them (ZeRO 1-3, bf16), a step it did not apply with a finite loss
    and no fp16 loss scaler (whose skips on overflow are its normal work) is that case. ``stop`` stops the job there,
    ``skip`` skips the step. A step that was not applied (skipped here, or by DeepSpeed's overflow check) does not
    advance a per-step learning-rate schedule (Lightning steps it after every optimizer step; DeepSpeed's own engine
    does not on a skipped step): a run with skipped steps follows the schedule of the steps it applied.

    Args:
        policy: one of :data:`NON_FINITE_POLICIES`.
    """

    def __init__(self, policy: str = "stop") -> None:
        if policy not in NON_FINITE_POLICIES:
            raise FleetError(f"non_finite={policy!r}: must be one of {', '.join(map(repr, NON_FINITE_POLICIES))}")
        self.policy = policy
        self.skipped: list[int] = []
        """The steps skipped in this fit (``skip``)."""
        self._pending: str | None = None  # the step being skipped: what was non-finite where, in words
        self._checked = False  # the step's loss was checked before its backward
        self._loss: torch.Tensor | None = None  # the step's loss, checked with its gradient (FleetStrategy.gradient_check)
        self._agree = False  # that check is agreed by an all-reduce (each rank holds a shard of the gradient)
        self._held = False  # the step was not applied: its per-step LR schedule step is held back
        self._loop: Any = None  # the epoch loop whose update_lr_schedulers is wrapped, while training

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Hold a per-step LR schedule back on a step that was not applied (:meth:`_update_lr_schedulers`)."""
        loop = trainer.fit_loop.epoch_loop
        original = loop.update_lr_schedulers

        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            if interval == "step" and self._not_applied(trainer):
                return
            original(interval, update_plateau_schedulers)

        loop.update_lr_schedulers, self._loop = update_lr_schedulers, loop

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Give the epoch loop its own update_lr_schedulers back."""
        if self._loop is not None:
            vars(self._loop).pop("update_lr_schedulers", None)
            self._loop = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A new step: nothing checked yet."""
        self._pending, self._checked, self._held, self._loss, self._agree = None, False, False, None, False

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """The step's loss (its micro-batches' mean) before its last backward: agreed by every rank; stop or skip."""
        if not getattr(pl_module, "automatic_optimization", True) or self._checked:
            return
        self._checked = True
        check = getattr(trainer.strategy, "gradient_check", ENGINE_CHECK)
        if check != ENGINE_CHECK:  # checked with the gradient before the optimizer step, no collective here
            self._loss, self._agree = loss.detach(), check == SHARDED_CHECK
            loss.register_hook(_poisoned_unless_finite(self._loss))
            return
        bad = _non_finite_ranks(trainer, loss)
        if not bad:
            return
        step = trainer.global_step + 1
        if self.policy == "stop":
            raise self._stop(trainer, step, f"the loss is {bad}", "it was not applied")
        loss.register_hook(_poisoned)
        self._pending = f"the loss is {bad}"

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Where the torch optimizer is stepped directly (no overflow check of DeepSpeed's): a finite loss's gradient is
        checked (stop, or skip); skipping drops the gradients."""
        engine = _engine(trainer)
        if hasattr(getattr(engine, "optimizer", None), "overflow"):
            return
        if self._pending is None and self._checked:
            module = _module_of(engine)
            bad = _non_finite_gradient(module, agree_on=trainer.strategy.root_device if self._agree else None)
            if bad and self._loss is not None:  # every rank has the same verdict: all are here together
                lost = _non_finite_ranks(trainer, self._loss)
                what = f"the loss is {lost}" if lost else f"the gradient is {bad} (the loss is finite on every rank)"
            elif bad:
                what = f"the gradient is {bad} (the loss is finite on every rank)"
            if bad:
                if self.policy == "stop":
                    raise self._stop(trainer, trainer.global_step + 1, what, "it was not applied")
                self._pending = what
        if self._pending is not None:
            for parameter in _module_of(engine).parameters():
                parameter.grad = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Report a skipped step (checking that DeepSpeed did skip it); check the loss of a step not checked before it."""
        step, engine = trainer.global_step, _engine(trainer)
        if self._pending is not None:
            if hasattr(getattr(engine, "optimizer", None), "overflow") and _step_applied(engine):
                raise self._stop(trainer, step, self._pending, "DeepSpeed applied it although its gradient was made NaN")
            self._skip(trainer, step, self._pending)
        elif not self._checked:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            bad = _non_finite_ranks(trainer, loss if isinstance(loss, torch.Tensor) else None)
            if bad and (self.policy == "stop" or _step_applied(engine)):
                done = "applied" if _step_applied(engine) else "skipped"
                raise self._stop(trainer, step, f"the loss is {bad}", f"it ran inside the engine, which {done} it")
            if bad:
                self._skip(trainer, step, f"the loss is {bad}")
        elif getattr(pl_module, "automatic_optimization", True) and _gradient_overflowed(engine):
            what = "the gradient is non-finite (the loss is finite on every rank; DeepSpeed's overflow check skipped it)"
            if self.policy == "stop":
                raise self._stop(trainer, step, what, "it was not applied")
            self._skip(trainer, step, what)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The skipped steps, once, at the end of fit."""
        if self.skipped and trainer.is_global_zero:
            steps = ", ".join(map(str, self.skipped[:20])) + (", ..." if len(self.skipped) > 20 else "")
            count = len(self.skipped)
            print(f"lightning_fleet: {count} step(s) skipped for a non-finite loss or gradient (non_finite='skip'): "
                  f"{steps}", flush=True)

    def _not_applied(self, trainer: Any) -> bool:
        """Whether this step's optimizer step was not applied: skipped here (``skip``), or by DeepSpeed's overflow check
        (also an fp16 loss scaler's). Asked when Lightning steps the LR schedule, after the optimizer step."""
        engine = _engine(trainer)
        self._held = self._held or self._pending is not None or (
            getattr(trainer.lightning_module, "automatic_optimization", True)
            and hasattr(getattr(engine, "optimizer", None), "overflow") and not _step_applied(engine))
        return self._held

    def _skip(self, trainer: Any, step: int, what: str) -> None:
        self.skipped.append(step)
        self._pending = None
        self._held = True
        if trainer.is_global_zero:
            print(f"lightning_fleet: step {step}: {what}; the step was skipped (weights, optimizer state and learning-rate "
                  f"schedule unchanged; {len(self.skipped)} skipped in this fit)", flush=True)

    def _stop(self, trainer: Any, step: int, what: str, applied: str) -> FleetError:
        checkpoints = [c for c in trainer.callbacks if isinstance(c, FleetCheckpoint)]
        good = checkpoints[0]._last_good() if checkpoints else "no FleetCheckpoint saves this fit"
        skip = ", or pass FleetStrategy(non_finite='skip') to skip such steps" if self.policy == "stop" else ""
        return deterministic(FleetError(
            f"{what} at step {step} ({applied}); the job stops: {good}. Lower the learning rate, clip "
            f"gradients or check the data of that step{skip}"
        ))


# --- small helpers --------------------------------------------------------------------------------------------


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals FleetCheckpoint answers by saving the step every rank agrees on and stopping: a scheduler's SIGTERM, and
the SIGHUP of a closed terminal or session (torchrun's agent forwards to its workers the signal it got)."""


def _collectives(trainer: Any, during: str) -> Any:
    """The block of a collective of FleetCheckpoint's: a peer hung past the strategy's timeout, or gone, is one line
    naming ``during`` (:func:`lightning_fleet.elastic.worker.collectives`)."""
    return collectives(during, getattr(trainer.strategy, "_timeout", None))



def _engine(trainer: Any) -> Any:
    """The engine training the module (FleetStrategy's runtime engine), else the trainer's model."""
    return getattr(trainer.strategy, "engine", None) or trainer.model


def _module_of(engine: Any) -> torch.nn.Module:
    module = getattr(engine, "module", engine)
    return module if isinstance(module, torch.nn.Module) else engine


def _step_applied(engine: Any) -> bool:
    """Whether the engine applied its last optimizer step (DeepSpeed skips one whose gradient overflowed)."""
    applied = getattr(engine, "was_step_applied", None)
    return bool(applied()) if callable(applied) else True


def _non_finite_gradient(module: torch.nn.Module, *, agree_on: torch.device | None = None) -> str:
    """'' when every gradient of ``module`` (this rank's part of a sharded one) is finite, else ``NaN`` or ``infinite``:
    one fused check per device, the kind looked at only when it fails; ``agree_on`` (this rank's device): the worst
    over every rank (one all-reduce, every rank calls it; a rank without a gradient shard takes part too)."""
    grads = _local_gradients(module)
    worst = 0.0 if _gradients_finite(grads) else _worst(grads)
    if agree_on is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([worst], device=agree_on)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        worst = float(flag)
    return {0.0: "", 1.0: "infinite"}.get(worst, "NaN")


def _local_gradients(module: torch.nn.Module) -> dict[torch.device, list[torch.Tensor]]:
    """The floating gradients of ``module`` by device: a sparse one's values, a DTensor's local shard."""
    found: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in module.parameters():
        grad = parameter.grad
        if grad is not None and grad.is_floating_point() and grad.numel():
            grad = local_part(grad)
            dense = grad.coalesce().values() if grad.is_sparse else grad
            if dense.numel():
                found.setdefault(dense.device, []).append(dense)
    return found


def _gradients_finite(grads: dict[torch.device, list[torch.Tensor]]) -> bool:
    """Whether every tensor is finite: one fused check per device (torch's GradScaler primitive, which with a scale of 1
    leaves the tensors as they are) and one read."""
    flags = []
    with torch.no_grad():
        for device, tensors in grads.items():
            flag = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.ones(1, device=device))
            flags.append(flag)
    return not any(bool(flag) for flag in flags)


def _worst(grads: dict[torch.device, list[torch.Tensor]]) -> float:
    """2.0 when a tensor holds a NaN, else 1.0 when one is infinite, else 0.0 (one read per device)."""
    with torch.no_grad():
        return max((float(torch.stack([torch.where(torch.isnan(t).any(), 2.0, torch.where(torch.isfinite(t).all(), 0.0, 1.0))
                                       for t in tensors]).max()) for tensors in grads.values()), default=0.0)


def _poisoned_unless_finite(loss: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A loss hook: its gradient unchanged while ``loss`` is finite, else NaN (on the device, no host read)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isfinite(loss).all(), grad, torch.full_like(grad, float("nan")))

    return hook


def _gradient_overflowed(engine: Any) -> bool:
    """Whether DeepSpeed's optimizer wrapper skipped the last step for a non-finite gradient where no fp16 loss scaler
    runs (a loss scaler's skip on overflow lowers its scale: its normal work, not a failure)."""
    if not hasattr(getattr(engine, "optimizer", None), "overflow") or _step_applied(engine):
        return False
    fp16 = getattr(engine, "fp16_enabled", None)
    return not (callable(fp16) and fp16())


def _poisoned(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of a step being skipped: NaN, which DeepSpeed's optimizer wrappers discard as an overflow."""
    return torch.full_like(grad, float("nan"))


def _non_finite_ranks(trainer: Any, loss: torch.Tensor | None) -> str:
    """'' when the loss is finite on every rank, else e.g. ``NaN on rank 1``; one all-reduce (every rank calls it)."""
    flags = torch.zeros(trainer.world_size, device=trainer.strategy.root_device)
    if loss is not None:  # 2: NaN, 1: infinite, 0: finite; computed on the device, read once after the all-reduce
        value = loss.detach().float().to(flags.device)
        flags[trainer.global_rank] = torch.where(torch.isnan(value).any(), 2.0, torch.where(torch.isfinite(value).all(), 0.0, 1.0))
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    found = flags.tolist()
    bad = [rank for rank, flag in enumerate(found) if flag > 0]
    if not bad:
        return ""
    kind = "NaN" if max(found) == 2 else "infinite"
    return f"{kind} on {_ranks(bad)}"


def _weights_tensors(trainer: Any) -> Iterator[torch.Tensor]:
    """This rank's share of the weights and optimizer state: the module's parameters (their ZeRO-3 partitions), the
    optimizer's parameters (DeepSpeed's fp32 partitions) and its state tensors."""
    engine = _engine(trainer)
    for parameter in _module_of(engine).parameters():
        yield getattr(parameter, "ds_tensor", parameter)
    optimizer = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return
    for group in optimizer.param_groups:
        yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
    for state in getattr(optimizer, "state", {}).values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _weights_finite(trainer: Any) -> bool:
    """Whether this rank's share of the weights and optimizer state is finite."""
    checks: dict[torch.device, list[torch.Tensor]] = {}
    with torch.no_grad():
        for tensor in _weights_tensors(trainer):
            tensor = local_part(tensor)
            if tensor.is_floating_point() and tensor.numel():
                checks.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
        return all(bool(torch.stack(found).all()) for found in checks.values())  # one read per device


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def _size(count: float) -> str:
    """Bytes for people: ``512 bytes``, ``86.3 KiB``, ``1.2 GiB``."""
    if count < 1024:
        return f"{count:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


def _error_text(err: BaseException) -> str:
    """An exception in one bounded line (torch's C++ errors carry a stack)."""
    text = " ".join(str(err).split("\n")[0].split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}"
