"""Issue 11, "nothing lost" and "clear errors, no crash loops" for FleetCheckpoint checkpoints.

Each test fails on the code before the change it covers: a NaN loss under ZeRO-0 committed non-finite weights and
keep-K pruning deleted the last finite checkpoint; two jobs on one directory overwrote each other; a FIFO ``latest``
blocked start-up and a higher-numbered copy won over ``latest``; ranks seeded apart read samples twice; a read-only or
full directory was found at the first save (after training) and every restart repeated it; a disk filling up during a
save was a C++ ``enforce fail`` and a restart loop. Real DeepSpeed on gloo, real torchrun, real kills, tmpfs mounts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import stat
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch

from lightning_fleet.elastic.checkpoint import (
    LATEST_MAX_BYTES,
    check_private,
    committed,
    file_table,
    newest_verified,
    read_latest,
    remove_abandoned,
    set_aside_newer,
    write_atomic,
)
from lightning_fleet.elastic.layout import (
    GUARD,
    LATEST,
    LOCK,
    MANIFEST,
    SET_ASIDE,
    DCP_DIR,
    UNIVERSAL,
    Manifest,
    derived_listed,
    state_dir,
    step_dir_name,
    verify,
)
from lightning_fleet.elastic.lock import DirLock, LockHolder, job_rendezvous, machine_id
from lightning_fleet.elastic.worker import is_deterministic
from lightning_fleet.export import export_state_dict
from lightning_fleet.planning import FleetError
from tests.multiprocess import ROOT, finish, free_port, kill_family, run, worker_env

WORKER = ROOT / "tests" / "workers" / "safety_tiny.py"


# --- helpers -------------------------------------------------------------------------------------------------------


def fake_checkpoint(directory: Path, step: int, *, named: int | None = None, payload: bytes = b"weights") -> Path:
    """A committed step dir that verifies (one file and its manifest); ``named``: the step its directory is named after."""
    path = directory / step_dir_name(step if named is None else named)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(payload)
    manifest = Manifest(step=step, world_size=1, plan=None, global_batch_size=None, model=None, data_seed=None,
                        files=file_table(path))
    (path / MANIFEST).write_text(manifest.to_json())
    return path


def torchrun(tmp: Path, *args: str, restarts: int = 0, log: str = "job.log") -> psutil.Popen:
    """Start the worker under plain torchrun (2 processes) in its own session; output to tmp/<log>."""
    env = worker_env(tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={env['MASTER_PORT']}", f"--max-restarts={restarts}", str(WORKER), "--dir", str(tmp), *args]
    out = open(tmp / log, "a")
    return psutil.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=out, start_new_session=True)


def single(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The worker as one process (Lightning, one device)."""
    return run([sys.executable, str(WORKER), "--dir", str(tmp), "--plan", "dp=1,zero=0", *args], worker_env(tmp), timeout)


def _remove_abandoned_holding_the_lock(directory: Path) -> None:
    """remove_abandoned as rank 0 calls it: under the directory's lock, released afterwards."""
    held = DirLock(directory)
    held.acquire()
    try:
        remove_abandoned(directory, held)
    finally:
        held.release()


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("lightning_fleet: error:")]


def attempts(log: str) -> int:
    """Attempts that reached the plan (rank 0 prints the plan once per attempt)."""
    return log.count("lightning_fleet plan for Tiny")


def finite_checkpoint(step_dir: Path) -> bool:
    """Whether a ZeRO-0 checkpoint's module weights are finite (our own test files: full unpickling is fine)."""
    states = next((step_dir / "state" / "checkpoint").glob("*model_states.pt"))
    module = torch.load(states, weights_only=False)["module"]
    return all(bool(torch.isfinite(t).all()) for t in module.values())


@contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# --- `latest`, manifest step = name, set-aside, abandoned saves (pure) -----------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "binary", "not-a-step"])
def test_a_latest_that_is_not_a_small_text_file_is_ignored_with_a_line(tmp_path, kind):
    """Before: a FIFO `latest` blocked start-up for good, /dev/zero ate memory, binary content stopped the job."""
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    hint = tmp_path / LATEST
    if kind == "fifo":
        os.mkfifo(hint)
    elif kind == "dev-zero":
        hint.symlink_to("/dev/zero")
    elif kind == "huge":
        hint.write_bytes(b"step-000000002" + b" " * (10 * 1024 * 1024))
    elif kind == "binary":
        hint.write_bytes(b"\xff\xfe\x00step")
    else:
        hint.write_text("../elsewhere")
    logged: list[str] = []
    chosen: list = []
    reader = threading.Thread(target=lambda: chosen.append(newest_verified(tmp_path, log=logged.append)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading `latest` blocked"
    assert chosen[0].path.name == "step-000000004"  # the newest that verifies
    assert len([line for line in logged if "ignoring" in line and str(hint) in line]) == 1, logged
    assert all("\n" not in line and len(line) < 400 for line in logged)


@pytest.mark.pure
def test_latest_wins_over_a_higher_numbered_copy_and_the_next_commit_sets_the_copy_aside(tmp_path):
    """Before: the newest step dir was chosen by name, so an operator's copy (or a planted dir) numbered higher won over
    `latest` forever (pruning kept it too)."""
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 90, payload=b"someone else's")
    (tmp_path / LATEST).write_text("step-000000004")
    logged: list[str] = []
    assert newest_verified(tmp_path, log=logged.append).path.name == "step-000000004"
    assert any("not the higher-numbered step-000000090" in line for line in logged), logged
    moved = set_aside_newer(tmp_path, 6, log=logged.append)  # FleetCheckpoint commits step 6 next
    assert [p.name for p in moved] == ["step-000000090"] and (tmp_path / SET_ASIDE / "step-000000090" / "weights.bin").exists()
    assert [p.name for p in committed(tmp_path)] == ["step-000000004", "step-000000002"]


@pytest.mark.pure
def test_a_step_dir_whose_manifest_names_another_step_is_skipped_with_a_line(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 2, named=7)  # a copy renamed to a higher step
    logged: list[str] = []
    assert newest_verified(tmp_path, log=logged.append).path.name == "step-000000002"
    assert any("step-000000007" in line and "records step 2" in line for line in logged), logged


@pytest.mark.pure
def test_latest_is_read_only_up_to_its_bound(tmp_path):
    (tmp_path / LATEST).write_text("step-000000003" + " " * (LATEST_MAX_BYTES - 20))
    assert read_latest(tmp_path, log=pytest.fail) == "step-000000003"
    assert read_latest(tmp_path / "missing", log=pytest.fail) is None


@pytest.mark.pure
def test_abandoned_saves_are_removed_only_under_the_directory_lock(tmp_path):
    """Before: remove_abandoned deleted any .tmp-step-* dir, another live job's save in progress included."""
    (tmp_path / ".tmp-step-000000005").mkdir()
    with pytest.raises(FleetError, match="needs its lock"):
        remove_abandoned(tmp_path, DirLock(tmp_path))
    _remove_abandoned_holding_the_lock(tmp_path)
    assert not (tmp_path / ".tmp-step-000000005").exists() and not (tmp_path / LOCK).exists()


# --- the directory lock (real processes) ----------------------------------------------------------------------------

HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
import lightning_fleet.elastic.lock as L
if {elsewhere!r}:
    L.machine_id = lambda: "another-machine"
lock = L.DirLock(__import__("pathlib").Path({path!r}), job={job!r}, rendezvous={rendezvous!r}, heartbeat_s=0.2)
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


@contextmanager
def holder_process(path: Path, *, elsewhere: bool = False, job: str = "", rendezvous: str = ""):
    """A process holding the lock of ``path`` (posing as another machine when ``elsewhere``), killed afterwards."""
    code = HOLDER.format(root=str(ROOT), path=str(path), elsewhere=elsewhere, job=job, rendezvous=rendezvous)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_a_live_holder_is_named_and_a_dead_one_is_taken_over_with_a_line(tmp_path):
    with holder_process(tmp_path) as proc:
        with pytest.raises(FleetError) as err:
            DirLock(tmp_path).acquire()
        message = str(err.value)
        assert "\n" not in message and f"pid {proc.pid}" in message and "in use by another job" in message
        assert "another checkpoint_dir" in message
        proc.kill()
        proc.wait()
        logged: list[str] = []
        taker = DirLock(tmp_path, log=logged.append)
        taker.acquire()
        taker.release()
    assert len(logged) == 1 and "its process is gone" in logged[0] and f"pid {proc.pid}" in logged[0]


@pytest.mark.unit
def test_a_holder_on_another_machine_is_refused_once_its_heartbeat_moves(tmp_path):
    with holder_process(tmp_path, elsewhere=True):
        started = time.monotonic()
        with pytest.raises(FleetError, match="in use by another job"):
            DirLock(tmp_path, heartbeat_s=0.2).acquire()
        assert time.monotonic() - started < 5


@pytest.mark.unit
def test_the_same_jobs_restart_takes_over_at_once(tmp_path):
    with holder_process(tmp_path, elsewhere=True, job="run-7", rendezvous="node1:29400"):
        logged: list[str] = []
        taker = DirLock(tmp_path, job="run-7", rendezvous="node1:29400", log=logged.append)
        taker.acquire()
        taker.release()
    assert "an earlier attempt of this job" in logged[0] and "run id run-7" in logged[0]


class FakeTime:
    """A monotonic clock that only a sleep advances; ``on_sleep`` runs at each sleep (a holder's heartbeat)."""

    def __init__(self, on_sleep=None) -> None:
        self.now, self.on_sleep = 1000.0, on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep()


def remote_holder(path: Path, heartbeat: float, **fields) -> LockHolder:
    """Write a lock naming a holder on another machine with this heartbeat time; return it."""
    holder = LockHolder(**{"host": "far", "machine": "another-machine", "pid": 1, "job": "", "token": "t", **fields,
                           "heartbeat": heartbeat})
    (path / LOCK).write_bytes(holder.encode())
    return holder


def beating(path: Path, holder: LockHolder):
    """A heartbeat of ``holder`` that keeps its (skewed, or not a time) heartbeat value and moves its counter."""
    state = {"holder": holder}

    def beat() -> None:
        state["holder"] = replace(state["holder"], beat=state["holder"].beat + 1)
        (path / LOCK).write_bytes(state["holder"].encode())

    return beat


@pytest.mark.pure
@pytest.mark.parametrize("skew_s", [-60.0, -3600.0, 0.0])
def test_a_live_holder_on_another_machine_is_refused_whatever_its_clock(tmp_path, skew_s):
    """Before: a live holder whose clock was 60 s behind (its heartbeat looked 60 s old) was taken over at once."""
    holder = remote_holder(tmp_path, time.time() + skew_s)
    fake = FakeTime(on_sleep=beating(tmp_path, holder))
    logged: list[str] = []
    with pytest.raises(FleetError, match="in use by another job \\(host far, pid 1"):
        DirLock(tmp_path, log=logged.append, clock=fake.clock, sleep=fake.sleep, heartbeat_s=5).acquire()
    assert fake.now - 1000.0 <= 5 and "taking it over unless its heartbeat moves within 30 s" in logged[0]
    assert LockHolder.decode((tmp_path / LOCK).read_bytes()).token == "t"  # not taken


@pytest.mark.pure
@pytest.mark.parametrize("heartbeat", [time.time() - 3600, time.time() + 3600, float("nan"), float("inf")],
                         ids=["old", "ahead", "nan", "inf"])
def test_a_dead_holder_on_another_machine_is_taken_over_once_its_heartbeat_did_not_move(tmp_path, heartbeat):
    """Judged by whether the file changes over STALE_AFTER_S of this process's clock, never by the time it holds.
    Before: a heartbeat in the future or NaN refused every launch (until the lock was deleted by hand)."""
    remote_holder(tmp_path, heartbeat)
    fake = FakeTime()
    logged: list[str] = []
    lock = DirLock(tmp_path, log=logged.append, clock=fake.clock, sleep=fake.sleep, heartbeat_s=5)
    lock.acquire()
    try:
        assert 30 <= fake.now - 1000.0 <= 32
        assert "its heartbeat did not move for 30 s" in logged[-1] and "host far, pid 1" in logged[-1]
        assert LockHolder.decode((tmp_path / LOCK).read_bytes()).token == lock.token
    finally:
        lock.release()


@pytest.mark.pure
def test_two_jobs_with_one_run_id_on_two_hosts_do_not_take_each_others_lock(tmp_path, monkeypatch):
    """The same --rdzv-id on two single-host jobs (both at 127.0.0.1:29400): not the same job, so the live one is
    refused (before: taken over at once as "an earlier attempt of this job"); an earlier attempt of the same job (same
    run id and rendezvous) is still taken over at once."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "127.0.0.1:29400")
    here = job_rendezvous()
    assert here.startswith("127.0.0.1:29400@" + machine_id())
    other = remote_holder(tmp_path, time.time(), job="job1", rendezvous="127.0.0.1:29400@another-machine/agent 7/1")
    fake = FakeTime(on_sleep=beating(tmp_path, other))
    with pytest.raises(FleetError, match="in use by another job .*run id job1"):
        DirLock(tmp_path, log=lambda line: None, clock=fake.clock, sleep=fake.sleep).acquire()
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "node1:29400")  # a multi-host job: every agent names the same endpoint
    remote_holder(tmp_path, time.time(), job="job1", rendezvous=job_rendezvous())
    logged: list[str] = []
    taker = DirLock(tmp_path, log=logged.append, clock=FakeTime().clock, sleep=pytest.fail)
    taker.acquire()
    taker.release()
    assert "an earlier attempt of this job" in logged[-1]


@pytest.mark.pure
def test_a_stale_or_unreadable_lock_is_taken_over_and_a_holder_that_lost_it_stops(tmp_path):
    old = LockHolder(host="gone", machine="another-machine", pid=1, job="", token="t", heartbeat=time.time() - 3600)
    (tmp_path / LOCK).write_bytes(old.encode())
    logged: list[str] = []
    fake = FakeTime()
    first = DirLock(tmp_path, log=logged.append, clock=fake.clock, sleep=fake.sleep)
    first.acquire()
    assert "its heartbeat did not move for 30 s" in logged[-1]
    fresh = LockHolder(host="h2", machine="another-machine", pid=2, job="", token="u", heartbeat=time.time())
    (tmp_path / LOCK).write_bytes(fresh.encode())  # another job took it while this one was stopped
    with pytest.raises(FleetError, match="lost checkpoint directory .* to another job \\(host h2, pid 2"):
        first.verify()
    first.release()
    assert (tmp_path / LOCK).exists()  # not ours: left alone
    (tmp_path / LOCK).unlink()
    os.mkfifo(tmp_path / LOCK)
    DirLock(tmp_path, log=logged.append).acquire()
    assert "name no holder" in logged[-1] and LockHolder.decode((tmp_path / LOCK).read_bytes()).machine == machine_id()


# --- non-finite loss and weights --------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_nan_loss_on_one_rank_stops_the_zero0_job_in_one_line_and_keeps_the_finite_checkpoints(tmp_path):
    """Before: ZeRO-0 stepped into NaN weights, committed them at steps 6 and 8, and keep=2 pruned the finite step 4."""
    proc = torchrun(tmp_path, "--nan-at", "5", "--nan-ranks", "1", "--plan", "dp=2,zero=0", "--keep", "2", restarts=1)
    code = finish(proc, timeout=150)
    log = (tmp_path / "job.log").read_text()
    assert code != 0
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert "the loss is NaN on rank 1 at step 5 (it was not applied)" in lines[0]
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'step-000000004'} (step 4)" in lines[0]
    assert "non_finite='skip'" in lines[0]
    assert attempts(log) == 1  # deterministic: torchrun's restart is not spent on it
    kept = committed(tmp_path / "ckpt")
    assert [p.name for p in kept] == ["step-000000004", "step-000000002"] and all(map(finite_checkpoint, kept))


@pytest.mark.multiprocess
@pytest.mark.parametrize("runtime", ["deepspeed", "torch"])
def test_skip_leaves_the_zero0_step_unapplied_on_every_rank(tmp_path, runtime):
    """non_finite='skip': the NaN step (on rank 0 only) changes neither weights nor optimizer state; reported. On the
    torch runtime no collective checks a healthy step: rank 0's NaN reaches rank 1 through DDP's gradient all-reduce."""
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", str(WORKER), "--dir", str(tmp_path), "--nan-at", "5", "--nan-ranks", "0",
                "--plan", f"dp=2,zero=0,runtime={runtime}", "--non-finite", "skip", "--every", "1", "--keep", "9"],
               worker_env(tmp_path), 150)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "lightning_fleet: step 5: the loss is NaN on rank 0; the step was skipped" in done.stdout
    assert "1 step(s) skipped for a non-finite loss or gradient (non_finite='skip'): 5" in done.stdout
    weights = {step: export_state_dict(tmp_path / "ckpt" / step_dir_name(step)) for step in (4, 5, 6)}
    for name, tensor in weights[4].items():
        assert torch.equal(tensor, weights[5][name]) and not torch.equal(tensor, weights[6][name])
    before, after = (_optimizer_state(tmp_path / "ckpt" / step_dir_name(step), runtime) for step in (4, 5))
    assert sorted(before) == sorted(after) and len(before) >= 3
    assert all(torch.equal(before[key], after[key]) for key in before)
    result = torch.load(tmp_path / "final.pt", weights_only=False)
    assert result["global_step"] == 8 and result["skipped"] == [5]
    assert all(bool(torch.isfinite(t).all()) for t in result["state"].values())


def _optimizer_state(step: Path, runtime: str) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors (Adam's step, exp_avg, exp_avg_sq) of a checkpoint step, flat by name."""
    if runtime == "deepspeed":
        state = torch.load(next((state_dir(step) / "checkpoint").glob("*model_states.pt")), weights_only=False)["optimizer"]["state"]
        return {f"{i}.{key}": state[i][key] for i in state for key in ("step", "exp_avg", "exp_avg_sq")}
    from lightning_fleet.runtime.torch.dcp import read_full

    state = read_full(state_dir(step) / DCP_DIR)["optimizer"]["state"]
    return {f"{name}.{key}": value for name, entry in state.items() for key, value in entry.items() if isinstance(value, torch.Tensor)}


def _fit_in_process(tmp_path, *, steps: int, callbacks=(), keep: int = 1, plan: str = "dp=1,zero=0,runtime=deepspeed", **strategy):
    import lightning.pytorch as pl
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_fleet
    from tests.multiprocess import QUIET_TRAINER

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.detached_nan_at: int | None = None
            self.gradient_nan_at: int | None = None
            self.per_step_schedule = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            if self.trainer.global_step + 1 == self.gradient_nan_at:
                out.register_hook(lambda grad: grad * float("nan"))  # a finite loss whose gradient is NaN
            loss = torch.nn.functional.mse_loss(out, y)
            if self.trainer.global_step + 1 == self.detached_nan_at:
                loss = loss + torch.tensor(float("nan"))  # NaN with finite gradients: DeepSpeed would apply the step
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
            if not self.per_step_schedule:
                return optimizer
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    checkpoint = lightning_fleet.FleetCheckpoint(tmp_path / "ckpt", every_n_steps=1, keep=keep)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=lightning_fleet.FleetStrategy(plan=plan, **strategy),
                      max_steps=steps, limit_val_batches=0, callbacks=[*callbacks, checkpoint], **QUIET_TRAINER)
    module = Module()
    return trainer, module, DataLoader(data, batch_size=4)


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_skip_holds_under_zero2_even_where_the_gradients_are_finite(tmp_path):
    """A NaN loss whose gradients are finite: DeepSpeed's overflow check alone would apply the step; skip does not."""
    trainer, module, data = _fit_in_process(tmp_path, steps=6, keep=9, plan="dp=1,zero=2,runtime=deepspeed", non_finite="skip")
    module.detached_nan_at = 4
    trainer.fit(module, data)
    weights = {}
    for step in (3, 4, 5):
        files = (tmp_path / "ckpt" / step_dir_name(step) / "state" / "checkpoint").glob("*optim_states.pt")
        weights[step] = torch.load(next(files), weights_only=False)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert torch.equal(weights[3], weights[4]) and not torch.equal(weights[4], weights[5])
    guard = next(c for c in trainer.callbacks if type(c).__name__ == "NonFiniteGuard")
    assert guard.skipped == [4]


def _guard(trainer):
    return next(c for c in trainer.callbacks if type(c).__name__ == "NonFiniteGuard")


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("cause", ["loss", "gradient"])
def test_a_skipped_step_does_not_advance_a_per_step_lr_schedule(tmp_path, zero, cause):
    """Before: Lightning stepped the schedule after the skipped step as after any other, so a run with a skipped step
    went on with the learning rate of one step later. ZeRO-2's case is a finite loss whose gradient DeepSpeed's own
    overflow check skipped (also caught now: see the next test)."""
    trainer, module, data = _fit_in_process(tmp_path, steps=6, keep=9, plan=f"dp=1,zero={zero}", non_finite="skip")
    module.per_step_schedule = True
    setattr(module, "detached_nan_at" if cause == "loss" else "gradient_nan_at", 4)
    trainer.fit(module, data)
    assert _guard(trainer).skipped == [4]
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert schedule.last_epoch == 5  # 6 optimizer steps, 5 applied
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 6)
    assert type(trainer.fit_loop.epoch_loop).update_lr_schedulers.__name__ == "update_lr_schedulers"
    assert "update_lr_schedulers" not in vars(trainer.fit_loop.epoch_loop)  # given back at teardown


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("zero", [0, 2])
def test_a_nan_gradient_with_a_finite_loss_stops_the_job_in_one_line(tmp_path, zero):
    """Before: at ZeRO-0 the NaN gradient was applied (NaN weights, found only at the next save); at ZeRO-2 only
    DeepSpeed's overflow message said anything and the job ran on."""
    trainer, module, data = _fit_in_process(tmp_path, steps=6, keep=9, plan=f"dp=1,zero={zero}")
    module.gradient_nan_at = 3
    with pytest.raises(FleetError) as err:
        trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message and is_deterministic(err.value)
    assert message.startswith("the gradient is ") and "(the loss is finite on every rank" in message
    assert "at step 3 (it was not applied)" in message and "non_finite='skip'" in message
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'step-000000002'} (step 2)" in message
    assert all(map(finite_checkpoint, committed(tmp_path / "ckpt")))


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("runtime", ["deepspeed", "torch"])
def test_skip_drops_a_nan_gradient_at_zero0(tmp_path, runtime):
    """non_finite='skip' with a finite loss and a NaN gradient at ZeRO-0 (the torch optimizer stepped directly), on
    either runtime: the step changes nothing. Before: applied, the weights became NaN."""
    trainer, module, data = _fit_in_process(tmp_path, steps=5, keep=9, non_finite="skip", plan=f"dp=1,zero=0,runtime={runtime}")
    module.gradient_nan_at = 3
    trainer.fit(module, data)
    assert _guard(trainer).skipped == [3] and trainer.strategy.decision.runtime == runtime
    states = {step: export_state_dict(tmp_path / "ckpt" / step_dir_name(step)) for step in (2, 3, 4)}
    assert all(torch.equal(states[2][k], states[3][k]) and not torch.equal(states[3][k], states[4][k]) for k in states[2])
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_non_finite_weights_are_never_committed_nor_counted_toward_keep(tmp_path):
    """Weights that became non-finite (here: set so by a callback after step 3) are refused at the next commit; keep=1
    still holds the last finite checkpoint. Before: committed, and the finite one pruned."""
    from lightning.pytorch import Callback

    class Corrupt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                with torch.no_grad():
                    pl_module.net.weight[0, 0] = float("inf")

    trainer, module, data = _fit_in_process(tmp_path, steps=6, callbacks=[Corrupt()])
    with pytest.raises(FleetError) as err:
        trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message and "not finite at step 3 (rank 0's shard)" in message
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'step-000000002'} (step 2)" in message
    assert is_deterministic(err.value)
    assert [p.name for p in committed(tmp_path / "ckpt")] == ["step-000000002"]
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))


@pytest.mark.pure
def test_a_bad_non_finite_policy_is_one_line():
    import lightning_fleet

    with pytest.raises(FleetError, match="non_finite='ignore'"):
        lightning_fleet.FleetStrategy(non_finite="ignore")


# --- the directory probed at setup; disk full ---------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_a_read_only_checkpoint_dir_is_one_deterministic_line_before_training(tmp_path):
    """Before: found at the first save, after training, and again at every restart."""
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mount:
        trained: list[int] = []
        from lightning.pytorch import Callback

        class Count(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                trained.append(trainer.global_step)

        trainer, module, data = _fit_in_process(mount, steps=2, callbacks=[Count()])
        with pytest.raises(FleetError) as err:
            trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message and str(mount / "ckpt") in message and "Read-only file system" in message
    assert "make it writable or point checkpoint_dir elsewhere" in message
    assert is_deterministic(err.value) and trained == []


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_a_checkpoint_dir_without_room_for_one_more_checkpoint_is_refused_at_setup_and_at_a_save(tmp_path):
    """Setup: free space below what keep + 1 checkpoints of the newest one's size need. A save: below the previous
    save's size (the file system filled meanwhile), refused before anything is written; the previous checkpoint is named,
    intact."""
    with tmpfs(tmp_path / "small", "400k") as mount:
        trainer, module, data = _fit_in_process(mount, steps=2, keep=2)
        trainer.fit(module, data)
        size = sum(f.stat().st_size for f in committed(mount / "ckpt")[0].rglob("*") if f.is_file())
        (mount / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(mount).free - size // 2))
        trainer, module, data = _fit_in_process(mount, steps=4, keep=2)
        with pytest.raises(FleetError) as err:
            trainer.fit(module, data)
        assert "keep=2 needs room for 1 more checkpoint(s) (2 there now)" in str(err.value)
        assert "the size of step-000000002" in str(err.value) and is_deterministic(err.value)
        (mount / "filler").unlink()
        # Issue 22, 14: keep=4 with 2 there needs 3 more; room for one and a half. Before: passed setup, then stopped
        # the job for good at the second save ("the file system is full").
        (mount / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(mount).free - size * 3 // 2))
        trainer, module, data = _fit_in_process(mount, steps=6, keep=4)
        with pytest.raises(FleetError) as err:
            trainer.fit(module, data)
        message = str(err.value)
        assert "\n" not in message and "keep=4 needs room for 3 more checkpoint(s) (2 there now) of about" in message
        assert "(the size of step-000000002)" in message and "lower keep" in message and is_deterministic(err.value)
        assert [p.name for p in committed(mount / "ckpt")] == ["step-000000002", "step-000000001"]  # nothing trained
        (mount / "filler").unlink()

        from lightning.pytorch import Callback

        class Filler(Callback):
            """Fills the file system after step 3's save, leaving half the previous checkpoint's size."""

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 3 and not (mount / "filler").exists():
                    (mount / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(mount).free - size // 2))

        trainer, module, data = _fit_in_process(mount, steps=6, keep=9, callbacks=[])
        trainer.callbacks.append(Filler())  # after FleetCheckpoint: runs once step 3 is saved
        with pytest.raises(FleetError) as err:
            trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message
    assert f"saving the checkpoint of step 4 to {mount / 'ckpt' / 'step-000000004'} failed: the file system is full (" in message
    assert f"the last good checkpoint is {mount / 'ckpt' / 'step-000000003'} (step 3), intact" in message
    assert is_deterministic(err.value)


@pytest.mark.elastic
@pytest.mark.parametrize("runtime", ["deepspeed", "torch"])
def test_disk_full_during_a_save_is_one_line_leaves_nothing_behind_and_does_not_loop(tmp_path, runtime):
    """The file system fills up after the save of step 4 started (the worker's test switch): before, an `enforce fail
    at inline_container.cc` or ENOSPC traceback, a partial .tmp-step dir, and every restart failing the same way; on the
    torch runtime, DCP's own line, the partial dir left and a restart."""
    with tmpfs(tmp_path / "fs", "2m") as mount:
        proc = torchrun(tmp_path, "--ckpt", str(mount / "ckpt"), "--plan", f"dp=2,zero=2,runtime={runtime}", "--fill-at", "4",
                        restarts=2)
        code = finish(proc, timeout=150)
        log = (tmp_path / "job.log").read_text()
        left = sorted(p.name for p in (mount / "ckpt").iterdir() if not p.name.startswith(".fleet-lock"))
    assert code != 0
    lines = error_lines(log)
    assert len(lines) == 1, log[-4000:]
    assert f"saving the checkpoint of step 4 to {mount / 'ckpt' / 'step-000000004'} failed" in lines[0]
    assert f"the last good checkpoint is {mount / 'ckpt' / 'step-000000002'} (step 2), intact" in lines[0]
    assert "the file system is full (" in lines[0] and "enforce fail" not in lines[0]
    assert left == ["latest", "step-000000002"], left  # no partial .tmp-step-000000004
    assert attempts(log) == 1, log[-4000:]  # deterministic: no restart loop


# --- two jobs, one directory ----------------------------------------------------------------------------------------------


@pytest.mark.elastic
def test_a_second_job_on_a_live_jobs_directory_is_refused_and_takes_over_once_that_job_is_killed(tmp_path):
    """Before: the second job resumed the first's live checkpoint and both committed the same steps over each other."""
    shared = tmp_path / "ckpt"
    first = tmp_path / "first"
    first.mkdir()
    proc = torchrun(first, "--ckpt", str(shared), "--steps", "400", "--every", "2", "--sleep", "0.2")
    try:
        deadline = time.monotonic() + 120
        while not committed(shared):
            assert time.monotonic() < deadline and proc.poll() is None, (first / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        second = tmp_path / "second"
        second.mkdir()
        refused = single(second, "--ckpt", str(shared), "--steps", "4")
        assert refused.returncode == 2, refused.stdout[-3000:]
        lines = error_lines(refused.stdout)
        assert len(lines) == 1 and "is in use by another job" in lines[0] and "pid " in lines[0], refused.stdout[-3000:]
        assert not (second / "final.pt").exists()
        assert proc.poll() is None  # the first job trains on, undisturbed
    finally:
        kill_family(proc)  # SIGKILL: its lock stays behind, held by a dead process
        finish(proc, timeout=30)
    newest = committed(shared)[0]
    taker = torchrun(second, "--ckpt", str(shared), "--steps", str(int(newest.name[-9:]) + 2), log="take.log")
    assert finish(taker, timeout=120) == 0, (second / "take.log").read_text()[-3000:]
    log = (second / "take.log").read_text()
    assert "took over the lock of checkpoint directory" in log and "its process is gone" in log
    result = torch.load(second / "final.pt", weights_only=False)
    assert result["resumed_from"] == str(newest)  # it continued the first job's newest checkpoint
    assert not (shared / LOCK).exists()  # released at the end of fit


# --- data-order seed ------------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_ranks_seeded_apart_read_every_sample_once_and_the_manifest_records_the_seed_used(tmp_path):
    """seed_everything(seed + rank), a common pattern: before, each rank drew the global order from its own seed (64 reads
    of 45 distinct samples in one epoch) while the manifest recorded, and a resume compared, rank 0's seed only."""
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", str(WORKER), "--dir", str(tmp_path), "--seed", "3", "--rank-seeds",
                "--steps", "8", "--every", "8"], worker_env(tmp_path), 150)
    assert done.returncode == 0, done.stdout[-3000:]
    seen = [i for rank in (0, 1) for line in (tmp_path / f"consumed-rank{rank}.jsonl").read_text().splitlines()
            for i in json.loads(line)["indices"]]
    assert len(seen) == 64 and sorted(seen) == list(range(64))
    manifest = Manifest.from_json((committed(tmp_path / "ckpt")[0] / MANIFEST).read_bytes())
    assert manifest.data_seed == 3


# --- local attackers, umask, our own temporary files (issue 22, items 12-14) -------------------------------------------

NOBODY = 65534
"""uid and gid of the user ``nobody``: a real other local user."""


def as_nobody(action: Callable[[], None]) -> None:
    """Run ``action`` in a forked child as the user nobody; fail when it raised (its traceback on stderr)."""
    if os.geteuid() != 0:
        pytest.skip("acting as another local user needs root")
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch, only file operations
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child acting as nobody failed (see stderr)"


@pytest.fixture
def shared_tmp():
    """A directory every local user can reach (pytest's tmp_path is root's alone): 0755, root's, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="fleet-shared-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def writable_by_others(root: Path) -> list[str]:
    """Entries below ``root`` (and root) that a user other than their owner can write."""
    found = [root, *root.rglob("*")]
    return sorted(f"{p.relative_to(root)} {stat.S_IMODE(p.lstat().st_mode):o}" for p in found if p.lstat().st_mode & 0o022)


@pytest.mark.pure
def test_a_checkpoint_dir_in_a_parent_others_can_write_without_the_sticky_bit_is_refused(tmp_path):
    """Issue 22, 12(a): who can write the parent can move the checkpoint directory away and put their own in its place.
    Before: only the directory itself was checked."""
    for mode, who in ((0o777, "everyone"), (0o2775, "its group")):
        project = tmp_path / f"project-{mode:o}"
        project.mkdir()
        project.chmod(mode)
        for ckpt in (project / "ckpt", project / "ckpt" / "deeper"):  # a missing directory too: its parent exists
            with pytest.raises(FleetError) as err:
                check_private(ckpt)
            message = str(err.value)
            assert "\n" not in message and f"lies in {project}, which {who} can write (mode {mode:o}, no sticky bit)" in message
            assert f"chmod +t {project}" in message
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot rename what is not theirs
    (sticky / "ckpt").mkdir(mode=0o755)
    check_private(sticky / "ckpt")


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_nobody_cannot_swap_the_checkpoint_dir_and_make_the_root_job_write_through_a_link(shared_tmp):
    """Issue 22, 12(a), the audit's attack with a real other user: the checkpoint directory's parent is writable by
    everyone (a shared project directory); after the save of step 2, nobody moves the directory away, puts one of their
    own in its place (with a copy of the lock) and plants a link to a root-only file at rank 0's temporary `latest` name.
    Before: the root job overwrote that file through the link, finished and printed nothing. Now refused at setup."""
    project = shared_tmp / "project"
    project.mkdir()
    project.chmod(0o777)
    victim = shared_tmp / "root-only"
    victim.write_bytes(b"secret")
    victim.chmod(0o600)
    ckpt, job, attacked = project / "ckpt", os.getpid(), []

    def swap() -> None:
        ckpt.rename(project / "moved")
        os.mkdir(ckpt, 0o755)
        for name in (LOCK, GUARD):
            shutil.copyfile(project / "moved" / name, ckpt / name)
        for name in (f".{LATEST}.tmp{job}", f".tmp-{LATEST}.{job}"):
            os.symlink(victim, ckpt / name)

    from lightning.pytorch import Callback

    class Attack(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and not attacked:
                as_nobody(swap)
                attacked.append(True)

    trainer, module, data = _fit_in_process(project, steps=4, keep=2)
    trainer.callbacks.append(Attack())  # after FleetCheckpoint: once step 2 is saved
    with pytest.raises(FleetError) as err:
        trainer.fit(module, data)
    assert victim.read_bytes() == b"secret"
    message = str(err.value)
    assert "\n" not in message and f"lies in {project}, which everyone can write (mode 777, no sticky bit)" in message
    assert is_deterministic(err.value) and not attacked


@pytest.mark.unit
def test_an_atomic_write_never_follows_a_link_planted_at_a_temporary_name(shared_tmp):
    """Issue 22, 12(a): where the directory is another user's anyway (moved in after the checks), their links at the
    temporary names (the pid is visible in `ps`) are never written through. Before: `.latest.tmp<pid>` was opened with
    open(..., "w"), following the link."""
    place = shared_tmp / "theirs"
    place.mkdir()
    os.chown(place, NOBODY, NOBODY)
    victim = shared_tmp / "root-only"
    victim.write_bytes(b"secret")
    victim.chmod(0o600)
    job = os.getpid()
    as_nobody(lambda: [os.symlink(victim, place / name) for name in (f".{LATEST}.tmp{job}", f".tmp-{LATEST}.{job}")])
    write_atomic(place / LATEST, "step-000000004")
    assert victim.read_bytes() == b"secret"
    assert not (place / LATEST).is_symlink() and (place / LATEST).read_text() == "step-000000004"
    assert stat.S_IMODE((place / LATEST).stat().st_mode) == 0o644


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_under_a_permissive_umask_no_entry_is_writable_by_others_and_a_replacement_is_refused(shared_tmp, umask):
    """Issue 22, 12(b). Before: under umask 000 (002 alike) every step dir and file below the 0755 checkpoint directory
    was created writable by others (40 of 42 entries), and nobody's replacement of the weights and the manifest (its
    hashes recomputed) verified and was resumed. Now: explicit modes, and `verify` refuses foreign or writable entries."""
    old = os.umask(umask)
    try:
        trainer, module, data = _fit_in_process(shared_tmp, steps=2, keep=2)
        trainer.fit(module, data)
    finally:
        os.umask(old)
    ckpt = shared_tmp / "ckpt"
    assert writable_by_others(ckpt) == []
    newest, older = committed(ckpt)
    assert verify(newest).ok
    # What the old code left under this umask, and what nobody could then do: replace a shard and the manifest.
    for path in [newest, *newest.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    rank_file, forged = newest / "rank-00000.pt", (older / "rank-00000.pt").read_bytes()
    table = {**file_table(newest), "rank-00000.pt": file_table(older)["rank-00000.pt"]}
    manifest = Manifest.from_json((newest / MANIFEST).read_bytes())
    text = Manifest(step=manifest.step, world_size=1, plan=manifest.plan, global_batch_size=manifest.global_batch_size,
                    model=manifest.model, data_seed=manifest.data_seed, files=table).to_json()

    def replace() -> None:
        for path, content in ((rank_file, forged), (newest / MANIFEST, text.encode())):
            path.unlink()
            path.write_bytes(content)

    as_nobody(replace)
    verdict = verify(newest)
    assert not verdict.ok and "another user could have replaced it" in verdict.reason, verdict.reason
    assert newest_verified(ckpt, log=lambda line: None).path == older


KILLED_WHILE_LISTING = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from lightning_fleet.elastic.checkpoint import list_derived
from lightning_fleet.elastic.layout import Manifest, MANIFEST
step = Path({step!r})
os.replace = lambda *args: os.kill(os.getpid(), 9)  # killed between the temporary manifest's write and its rename
list_derived(step, Manifest.from_json((step / MANIFEST).read_bytes()), {name!r})
"""


@pytest.mark.unit
def test_a_kill_while_the_universal_form_is_listed_leaves_a_checkpoint_that_verifies_and_is_chosen(tmp_path):
    """Issue 22, 13: a real SIGKILL between the temporary manifest's write and its rename. Before: the writer's own
    `.manifest.json.tmp<pid>` stayed in the step dir and the good checkpoint failed verification for good ("not listed
    in the manifest"): a later resize resharded from the older step."""
    fake_checkpoint(tmp_path, 2)
    step = fake_checkpoint(tmp_path, 4)
    (tmp_path / LATEST).write_text(step.name)
    (step / UNIVERSAL / "checkpoint").mkdir(parents=True)
    (step / UNIVERSAL / "checkpoint" / "fp32.pt").write_bytes(b"x" * 100)
    code = KILLED_WHILE_LISTING.format(root=str(ROOT), step=str(step), name=UNIVERSAL)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr[-2000:]
    (step / ".manifest.json.tmp4242").write_text("{}")  # what earlier versions left there
    chosen = newest_verified(tmp_path, log=pytest.fail)
    assert chosen.path == step and not derived_listed(chosen.manifest, UNIVERSAL)  # converted again, from this step
    strays = [p.name for p in tmp_path.glob(".tmp-*")]
    assert len(strays) == 1 and strays[0].startswith(f".tmp-{MANIFEST}."), strays
    _remove_abandoned_holding_the_lock(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_a_checkpoint_dir_deleted_between_saves_is_made_again_and_the_job_finishes(tmp_path, capfd):
    """Issue 22, 14 (a regression): one `rm -rf` of the checkpoint directory after the save of step 2. Before: the save
    of step 3 stopped the job (exit 2), blaming a full disk and calling the deleted step 2 "intact"."""
    from lightning.pytorch import Callback

    ckpt, removed = tmp_path / "ckpt", []

    class Remove(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and not removed:
                shutil.rmtree(ckpt)
                removed.append(True)

    trainer, module, data = _fit_in_process(tmp_path, steps=4, keep=2)
    trainer.callbacks.append(Remove())
    trainer.fit(module, data)
    assert removed and [p.name for p in committed(ckpt)] == ["step-000000004", "step-000000003"]
    assert all(verify(p).ok for p in committed(ckpt)) and not (ckpt / LOCK).exists()
    lines = [line for line in capfd.readouterr().out.splitlines() if "was deleted since the last save" in line]
    assert len(lines) == 1 and "made it again, with its lock" in lines[0]


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
@pytest.mark.parametrize("moment", ["after DeepSpeed wrote", "while Lightning builds the checkpoint"])
def test_a_checkpoint_dir_deleted_during_a_save_is_named_as_the_cause_not_a_full_disk(tmp_path, moment):
    """Issue 22, 14: the directory removed during the save of step 3, once DeepSpeed wrote its part (the rank file then
    has nowhere to go), or before (DeepSpeed makes the path again, without the lock). Before: "the file system is full
    (0 bytes free ...)" and the deleted step 2 called "intact"; or the save went on into the new path and the next one
    blamed "another job"."""
    from lightning.pytorch import Callback

    ckpt = tmp_path / "ckpt"

    class RemoveDuringSave(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if trainer.global_step == 3 and moment.startswith("while"):
                shutil.rmtree(ckpt)

    trainer, module, data = _fit_in_process(tmp_path, steps=4, keep=2, callbacks=[RemoveDuringSave()])
    save = trainer.save_checkpoint

    def save_then_remove(*args, **kwargs):
        save(*args, **kwargs)
        if trainer.global_step == 3 and moment.startswith("after"):
            shutil.rmtree(ckpt)

    trainer.save_checkpoint = save_then_remove
    with pytest.raises(FleetError) as err:
        trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message and f"saving the checkpoint of step 3 to {ckpt / 'step-000000003'} failed" in message
    assert "deleted" in message and "full" not in message and "intact" not in message, message
    assert f"this job's last checkpoint {ckpt / 'step-000000002'} (step 2)" in message
    assert not is_deterministic(err.value)  # a restart makes the directory again


@pytest.mark.unit
@pytest.mark.usefixtures("restore_environment")
def test_a_checkpoint_dir_replaced_between_saves_gets_nothing_written_into_it(tmp_path):
    """Issue 22, 12(a): the directory's identity (device, inode) is checked at every save and commit. Before: a
    directory put in its place (with a copy of the lock) received the job's next checkpoints."""
    from lightning.pytorch import Callback

    ckpt, swapped = tmp_path / "ckpt", []

    class Swap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and not swapped:
                ckpt.rename(tmp_path / "moved")
                ckpt.mkdir(mode=0o755)
                for name in (LOCK, GUARD):
                    shutil.copyfile(tmp_path / "moved" / name, ckpt / name)
                swapped.append(True)

    trainer, module, data = _fit_in_process(tmp_path, steps=4, keep=2)
    trainer.callbacks.append(Swap())
    with pytest.raises(FleetError) as err:
        trainer.fit(module, data)
    message = str(err.value)
    assert "\n" not in message and f"{ckpt} is not the one this job set up" in message, message
    assert "intact" not in message
    assert {p.name for p in ckpt.iterdir()} <= {LOCK, GUARD}  # nothing written into it
    assert [p.name for p in committed(tmp_path / "moved")] == ["step-000000002", "step-000000001"]


@pytest.mark.pure
@pytest.mark.parametrize(("check", "healthy", "poisoned"), [("replicated", 0, 1), ("sharded", 1, 2), ("engine", 1, 1)])
def test_the_guard_runs_no_collective_on_a_healthy_step_where_every_rank_holds_the_reduced_gradient(monkeypatch, check, healthy, poisoned):
    """The non-finite check's all-reduces per step, as a 2-rank job sees them (the collective counted, not run):
    replicated gradients (DDP) none on a healthy step, sharded ones (FSDP) one, DeepSpeed's path one before backward.
    A NaN loss turns the gradient NaN through the loss hook (what the reduction carries to the other ranks), and the
    step is skipped with its gradients dropped. Before: two all-reduces every step on every runtime."""
    from types import SimpleNamespace

    import lightning_fleet.elastic.callback as callback

    calls = []
    monkeypatch.setattr(callback.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(callback.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(callback.dist, "all_reduce", lambda tensor, op=None: calls.append(tensor.clone()))
    module = torch.nn.Linear(3, 2)
    strategy = SimpleNamespace(gradient_check=check, root_device=torch.device("cpu"), engine=module)
    trainer = SimpleNamespace(strategy=strategy, world_size=2, global_rank=0, global_step=4, callbacks=[],
                              is_global_zero=True, lightning_module=module)
    guard = callback.NonFiniteGuard("skip")
    for value, expected in ((1.0, healthy), (float("nan"), poisoned)):
        calls.clear()
        module.zero_grad()
        guard.on_train_batch_start(trainer, module, None, 0)
        loss = module(torch.ones(1, 3)).sum() * value
        guard.on_before_backward(trainer, module, loss)
        loss.backward()
        if check != "engine":
            assert all(bool(torch.isfinite(p.grad).all()) == (value == 1.0) for p in module.parameters())
        guard.on_before_optimizer_step(trainer, module, None)
        assert len(calls) == expected, (check, value, calls)
        assert (guard._pending is None) == (value == 1.0)
        if value != 1.0:
            assert guard._pending == "the loss is NaN on rank 0" and all(p.grad is None for p in module.parameters())
