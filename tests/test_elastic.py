"""Tier 4: fault tolerance under real torchrun on 127.0.0.1, with real kills by PID.

Reference: the single-process run of the same global batch (tests/reference.py). "Nothing lost" =
final weights equal to the reference within 2e-5 (same plan and world: only summation order
differs from one process), the final step count as asked, and every step's samples in the
committed history exactly those the global order assigns to that step (so no sample of the epoch
is skipped or repeated).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

from lightning_fleet.elastic.checkpoint import file_table, newest_verified
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.elastic.layout import LATEST, MANIFEST, Manifest, verify
from lightning_fleet.planning import FleetError
from tests.multiprocess import ROOT, finish, free_port, worker_env
from tests.reference import reference_run

pytestmark = pytest.mark.elastic

WORKER = ROOT / "tests" / "workers" / "elastic_gpt.py"
FLEET = [sys.executable, "-m", "lightning_fleet", "launch"]
GBS = 8


def launch(tmp: Path, *worker_args: str, restarts: int = 1, nproc: int = 2, nnodes: str = "1", port: int | None = None, log_name: str = "launch.log") -> psutil.Popen:
    """Start `fleet launch` (torchrun) in its own process group; output goes to tmp/<log_name>."""
    log = open(tmp / log_name, "a")
    cmd = [*FLEET, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           f"--rdzv-endpoint=127.0.0.1:{port or free_port()}", "--rdzv-backend=c10d", str(WORKER), "--dir", str(tmp), *worker_args]
    return psutil.Popen(cmd, env=worker_env(tmp), cwd=ROOT, stdout=log, stderr=log, start_new_session=True)


def steps_done(tmp: Path, rank: int = 0) -> int:
    path = tmp / f"consumed-rank{rank}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_steps(tmp: Path, count: int, timeout: float = 180, log_name: str = "launch.log") -> None:
    deadline = time.monotonic() + timeout
    while steps_done(tmp) < count:
        assert time.monotonic() < deadline, f"no {count} steps within {timeout} s:\n{(tmp / log_name).read_text()[-3000:]}"
        time.sleep(0.2)


def worker_pid(proc: psutil.Popen, local_rank: int) -> int:
    """PID of the training process with this LOCAL_RANK among the launcher's children."""
    for child in proc.children(recursive=True):
        try:
            if "elastic_gpt.py" in " ".join(child.cmdline()) and child.environ().get("LOCAL_RANK") == str(local_rank):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank}")


def records(tmp: Path, rank: int) -> list[dict]:
    """What one rank recorded, one dict per optimizer step it completed (every attempt)."""
    path = tmp / f"consumed-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def committed_history(tmp: Path, world: int) -> dict[int, list[int]]:
    """Step -> indices read by the attempt that committed it: the newest one, whose world may differ from earlier ones.

    A lone process reads all GBS samples of a step, so when the newest record of a step holds GBS samples one
    process committed it and only that record counts (after a scale-down the dead rank's aborted attempt must not be
    added); otherwise each rank's last record of the step.
    """
    per_rank = [records(tmp, rank) for rank in range(world)]
    history: dict[int, list[int]] = {}
    for step in sorted({r["step"] for rs in per_rank for r in rs}):
        last = [max((r for r in rs if r["step"] == step), key=lambda r: r["time"], default=None) for rs in per_rank]
        newest = max((r for r in last if r), key=lambda r: r["time"])
        history[step] = newest["indices"] if len(newest["indices"]) == GBS else [i for r in last if r for i in r["indices"]]
    return history


def assert_nothing_lost(tmp: Path, steps: int, world: int = 2) -> dict:
    """Final weights equal the reference; every step read exactly the samples the global order gives it."""
    result = torch.load(tmp / "final.pt", weights_only=False)  # our own file, written by our worker
    ref_loss, ref_state = reference_run(steps, GBS)
    assert result["global_step"] == steps
    assert result["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, tensor in result["state"].items():
        torch.testing.assert_close(tensor, ref_state[name], atol=2e-5, rtol=0, msg=name)
    from examples.gpt.data import StdlibText
    from lightning_fleet.elastic.sampler import GlobalBatchSampler
    from tests.workers.train_gpt import DATA

    dm = StdlibText(**DATA)
    dm.setup("fit")
    sampler = GlobalBatchSampler(len(dm.train_set), global_batch_size=GBS, dp_size=1, dp_rank=0, seed=0)
    history = committed_history(tmp, world)
    assert sorted(history) == list(range(1, steps + 1))
    seen: list[int] = []
    for step in range(1, steps + 1):
        sampler.first_step = lambda s=step - 1: s
        expected = next(iter(sampler))
        assert sorted(history[step]) == sorted(expected), f"step {step} read other samples"
        seen += history[step]
    assert len(seen) == len(set(seen)), "a sample was read twice within the epoch"
    return result


def test_kill_one_worker_restarts_and_loses_nothing(tmp_path):
    """Scenario 1: SIGKILL one of two workers mid-run with --max-restarts=1: torchrun restarts, the job resumes, nothing lost."""
    proc = launch(tmp_path, "--steps", "12", "--every", "2", "--sleep", "0.4", "--plan", "dp=2,zero=2")
    wait_for_steps(tmp_path, 5)
    os.kill(worker_pid(proc, 1), signal.SIGKILL)
    assert finish(proc) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    result = assert_nothing_lost(tmp_path, 12)
    assert "step-00000000" in result["resumed_from"]
    assert "lightning_fleet: resumed from" in (tmp_path / "launch.log").read_text()


def test_kill_without_restarts_fails_fast_and_names_the_rank(tmp_path):
    """Scenario 2: with --max-restarts=0 a killed worker ends the job non-zero within seconds, naming it; no orphans."""
    proc = launch(tmp_path, "--steps", "40", "--every", "5", "--sleep", "0.4", "--plan", "dp=2,zero=1", restarts=0)
    wait_for_steps(tmp_path, 2)
    victim = worker_pid(proc, 1)
    members = [p.pid for p in proc.children(recursive=True)]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = finish(proc, timeout=120)
    elapsed = time.monotonic() - started
    log = (tmp_path / "launch.log").read_text()
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    assert "local_rank: 1" in log or "local_rank 1" in log, log[-3000:]
    assert not [pid for pid in members if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_kill_during_save_resumes_from_the_previous_checkpoint(tmp_path):
    """Scenario 3: rank 0 dies after the shards of step 6 are written and before the manifest: step 4 is used, nothing lost."""
    proc = launch(tmp_path, "--steps", "10", "--every", "2", "--die-in-save", "6", "--plan", "dp=2,zero=3")
    assert finish(proc) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    log = (tmp_path / "launch.log").read_text()
    assert "resumed from" in log and "step-000000004 (step 4;" in log
    assert_nothing_lost(tmp_path, 10)


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_to_one_rank_stops_all_at_one_step_and_resumes(tmp_path, rank):
    """Scenario 6: SIGTERM to one rank: every rank stops at the same step with one checkpoint, exit 0; the next launch resumes."""
    proc = launch(tmp_path, "--steps", "10", "--every", "100", "--sleep", "0.4", "--plan", "dp=2,zero=2", restarts=0)
    wait_for_steps(tmp_path, 3)
    os.kill(worker_pid(proc, rank), signal.SIGTERM)
    assert finish(proc) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    stopped = torch.load(tmp_path / "final.pt", weights_only=False)
    assert stopped["preempted"] and stopped["global_step"] < 10
    assert steps_done(tmp_path, 0) == steps_done(tmp_path, 1) == stopped["global_step"]
    newest = newest_verified(tmp_path / "ckpt")
    assert newest is not None and newest.manifest.step == stopped["global_step"]
    again = launch(tmp_path, "--steps", "10", "--every", "100", "--plan", "dp=2,zero=2", restarts=0)
    assert finish(again) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert_nothing_lost(tmp_path, 10)


# --- damaged checkpoints (scenarios 4, 5, 10) on real checkpoints of one short job ------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A finished 6-step job with committed checkpoints at steps 2, 4 and 6, written by DeepSpeed (the tests using it
    plant files in DeepSpeed's layout; "auto" may choose either runtime for zero=2)."""
    tmp = tmp_path_factory.mktemp("ckpts")
    proc = launch(tmp, "--steps", "6", "--every", "2", "--plan", "dp=2,zero=2,runtime=deepspeed", restarts=0)
    assert finish(proc) == 0, (tmp / "launch.log").read_text()[-3000:]
    return tmp


def copy_of(checkpoints: Path, tmp: Path) -> Path:
    shutil.copytree(checkpoints / "ckpt", tmp / "ckpt")
    return tmp / "ckpt"


def largest_shard(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*.pt")), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "missing"])
def test_damaged_newest_checkpoint_is_named_and_skipped(checkpoints, tmp_path, damage):
    """Scenario 4: a truncated, bit-flipped or missing shard in the newest checkpoint: detected, named, previous one used."""
    ckpt = copy_of(checkpoints, tmp_path)
    shard = largest_shard(ckpt / "step-000000006")
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "bitflip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    verdict = verify(ckpt / "step-000000006")
    expected = {"truncate": "truncated", "bitflip": "does not match its sha256", "missing": "is missing"}[damage]
    assert not verdict.ok and expected in verdict.reason and shard.name in verdict.reason
    logged: list[str] = []
    chosen = newest_verified(ckpt, log=logged.append)
    assert chosen is not None and chosen.path.name == "step-000000004"
    assert any("skipping checkpoint" in line and "step-000000006" in line for line in logged)


def test_resume_after_bitflip_uses_the_previous_checkpoint(checkpoints, tmp_path):
    """Scenario 4 end to end: the next launch resumes from step 4, not the corrupted step 6, and loses nothing."""
    ckpt = copy_of(checkpoints, tmp_path)
    shard = largest_shard(ckpt / "step-000000006")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = launch(tmp_path, "--steps", "8", "--every", "100", "--plan", "dp=2,zero=2", restarts=0)
    assert finish(proc) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    log = (tmp_path / "launch.log").read_text()
    assert "skipping checkpoint" in log and "step-000000006" in log and "resumed from" in log and "(step 4;" in log


@pytest.mark.parametrize("pointer", ["missing", "dangling"])
def test_missing_or_dangling_latest_pointer(checkpoints, tmp_path, pointer):
    """Scenario 5: no `latest`, or `latest` naming a directory that is gone: detected, newest verified checkpoint used."""
    ckpt = copy_of(checkpoints, tmp_path)
    if pointer == "missing":
        (ckpt / LATEST).unlink()
    else:
        (ckpt / LATEST).write_text("step-000000999")
    logged: list[str] = []
    chosen = newest_verified(ckpt, log=logged.append)
    assert chosen is not None and chosen.path.name == "step-000000006"
    assert any(("missing" if pointer == "missing" else "does not exist") in line for line in logged)


def test_torn_save_directory_is_never_resumed(checkpoints, tmp_path):
    """A save killed before its manifest leaves only a .tmp- directory: never a candidate."""
    ckpt = copy_of(checkpoints, tmp_path)
    torn = ckpt / ".tmp-step-000000008"
    shutil.copytree(ckpt / "step-000000006", torn)
    (torn / MANIFEST).unlink()
    assert newest_verified(ckpt, log=lambda line: None).path.name == "step-000000006"


class Payload:
    """Runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(checkpoints, tmp_path):
    """Scenario 10: a shard replaced by a pickle with __reduce__ (and a manifest rewritten to match): refused, payload not run."""
    ckpt = copy_of(checkpoints, tmp_path)
    step = ckpt / "step-000000006"
    marker = tmp_path / "payload-ran"
    shard = largest_shard(step)
    torch.save({"state": Payload(marker)}, shard)
    manifest = Manifest.from_json((step / MANIFEST).read_text())
    (step / MANIFEST).write_text(replace(manifest, files=file_table(step)).to_json())
    assert verify(step).ok  # the attacker kept the manifest consistent
    with pytest.raises(FleetError) as err:
        load_file(shard, verify(step).manifest.files[shard.relative_to(step).as_posix()])
    assert "os.system" in str(err.value) or "posix.system" in str(err.value)
    assert "restricted unpickler refuses" in str(err.value)
    assert not marker.exists()


def _relist(step: Path) -> None:
    """Rewrite a step's manifest to match its files, as an attacker with write access would."""
    manifest = Manifest.from_json((step / MANIFEST).read_text())
    (step / MANIFEST).write_text(replace(manifest, files=file_table(step)).to_json())


def test_a_payload_the_old_screen_missed_is_refused_on_resume_and_never_runs(checkpoints, tmp_path):
    """A DeepSpeed shard replaced by a raw pickle with a zip appended (the old opcode screen read the zip; torch.load,
    as DeepSpeed calls it, reads the pickle), manifest rewritten to match: the resuming job ends with one line, no
    restart, and the payload never runs."""
    from tests.test_safe_load import pickle_with_zip_appended

    ckpt = copy_of(checkpoints, tmp_path)
    step = ckpt / "step-000000006"
    marker = tmp_path / "payload-ran"
    shard = next((step / "state" / "checkpoint").glob("*optim_states.pt"))
    shard.write_bytes(pickle_with_zip_appended(marker))
    _relist(step)
    proc = launch(tmp_path, "--steps", "8", "--every", "2", "--plan", "dp=2,zero=2", restarts=1)
    assert finish(proc, timeout=180) == 2
    log = (tmp_path / "launch.log").read_text()
    assert "which the restricted unpickler refuses (it could run code; nothing of it ran)" in log, log[-3000:]
    assert not marker.exists()


def test_deepspeeds_latest_pointing_outside_the_checkpoint_is_never_read(checkpoints, tmp_path):
    """state/latest rewritten to an absolute path holding a payload checkpoint (manifest rewritten to match): the
    tag is passed explicitly, so DeepSpeed loads the verified files and the job finishes; the payload never runs."""
    from tests.test_safe_load import zip_torch_file

    ckpt = copy_of(checkpoints, tmp_path)
    step = ckpt / "step-000000006"
    marker, elsewhere = tmp_path / "payload-ran", tmp_path / "elsewhere"
    shutil.copytree(step / "state" / "checkpoint", elsewhere / "tag")
    for file in (elsewhere / "tag").glob("*.pt"):
        file.write_bytes(zip_torch_file(marker))
    (step / "state" / "latest").write_text(str(elsewhere / "tag"))
    _relist(step)
    proc = launch(tmp_path, "--steps", "8", "--every", "2", "--plan", "dp=2,zero=2", restarts=0)
    assert finish(proc, timeout=180) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "launch.log").read_text() and not marker.exists()


def test_a_checkpoint_dir_others_can_write_is_refused_without_restarts(checkpoints, tmp_path):
    """The audit's planted-checkpoint case needs a directory another user can write: refused in one line, exit 2,
    no restart spent (every attempt would refuse it again)."""
    ckpt = copy_of(checkpoints, tmp_path)
    ckpt.chmod(0o777)
    proc = launch(tmp_path, "--steps", "8", "--every", "2", "--plan", "dp=2,zero=2", restarts=2)
    assert finish(proc, timeout=180) == 2
    log = (tmp_path / "launch.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("lightning_fleet: error:")]
    assert len(errors) == 1 and "is writable by everyone (mode 777)" in errors[0] and "chmod go-w" in errors[0], log[-3000:]
    assert "will restart worker group" not in log


def test_the_torch_runtime_reshards_across_worlds_and_shard_levels_through_dcp_and_loses_nothing(tmp_path):
    """Tensor parallel (tp=2) on 2 processes -> FSDP2 at shard level 3 on 1 -> DistributedDataParallel over dp=2 -> FSDP2
    at level 2 on 1: each relaunch loads the newest checkpoint as torch.distributed.checkpoint wrote it (no conversion:
    tp shards and FSDP2's DTensor shards into whole tensors and back), re-plans the split, and the final weights equal
    the one-process reference within 2e-5."""
    for steps, nproc, plan in ((3, 2, "tp=2,zero=0"), (5, 1, "zero=3"), (7, 2, "dp=2,zero=0"), (10, 1, "zero=2")):
        job = launch(tmp_path, "--steps", str(steps), "--every", "2", "--plan", f"{plan},runtime=torch", "--max-tp", "2",
                     restarts=0, nproc=nproc)
        assert finish(job) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    log = (tmp_path / "launch.log").read_text()
    assert "resharded from 2 to 1 processes, dp=1,tp=2,pp=1,zero=0," in log
    assert "resharded from 1 to 2 processes, dp=1,tp=1,pp=1,zero=3," in log
    assert "resharded from 2 to 1 processes, dp=2,tp=1,pp=1,zero=0," in log
    result = torch.load(tmp_path / "final.pt", weights_only=False)
    assert result["plan"].startswith("dp=1,tp=1,pp=1,zero=2,") and result["plan"].endswith(",runtime=torch")
    ref_loss, ref_state = reference_run(10, GBS)
    assert result["global_step"] == 10 and result["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, tensor in result["state"].items():
        torch.testing.assert_close(tensor, ref_state[name], atol=2e-5, rtol=0, msg=name)


def test_scale_down_when_an_agent_dies(tmp_path):
    """Scenario 7: two agents under --nnodes=1:2 (one process each); SIGKILL the agent that does not host the
    rendezvous, with its worker: the survivor re-plans for one process, reshards, keeps the global batch and
    finishes with the reference's weights."""
    port = free_port()
    args = ("--steps", "16", "--every", "2", "--sleep", "0.4", "--zero-stages", "3")
    agents = [launch(tmp_path, *args, restarts=3, nproc=1, nnodes="1:2", port=port, log_name=f"agent{i}.log") for i in range(2)]
    wait_for_steps(tmp_path, 5)
    assert json.loads((tmp_path / "consumed-rank1.jsonl").read_text().splitlines()[0])  # both processes trained together
    host = next(c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
    victim = next(a for a in agents if host not in (a.pid, *[c.pid for c in a.children(recursive=True)]))
    survivor = next(a for a in agents if a is not victim)
    for proc in [*victim.children(recursive=True), victim]:
        proc.kill()
    assert finish(survivor) == 0, (tmp_path / "agent0.log").read_text()[-2000:] + (tmp_path / "agent1.log").read_text()[-2000:]
    log = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent1.log").read_text()
    assert "resharded from 2 to 1 processes" in log
    result = torch.load(tmp_path / "final.pt", weights_only=False)
    assert result["plan"].startswith("dp=1,")
    ref_loss, ref_state = reference_run(16, GBS)
    assert result["global_step"] == 16 and result["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, tensor in result["state"].items():
        torch.testing.assert_close(tensor, ref_state[name], atol=2e-5, rtol=0, msg=name)


def test_scale_up_when_an_agent_joins(tmp_path):
    """Scenario 8: one agent runs alone under --nnodes=1:2; a second agent joins: torchrun stops the worker (SIGTERM:
    FleetCheckpoint saves at a step boundary), both re-rendezvous at world 2, re-plan, reshard 1 -> 2, keep the global
    batch and finish with the reference's weights; every step read exactly its samples."""
    port = free_port()
    args = ("--steps", "30", "--every", "4", "--sleep", "1.0", "--sleep-only-alone", "--zero-stages", "0,2")
    first = launch(tmp_path, *args, restarts=3, nproc=1, nnodes="1:2", port=port, log_name="agent0.log")
    wait_for_steps(tmp_path, 4, log_name="agent0.log")
    assert not (tmp_path / "consumed-rank1.jsonl").exists()  # trained alone so far
    second = launch(tmp_path, *args, restarts=3, nproc=1, nnodes="1:2", port=port, log_name="agent1.log")
    logs = lambda: (tmp_path / "agent0.log").read_text()[-2000:] + (tmp_path / "agent1.log").read_text()[-2000:]
    assert finish(first) == 0, logs()
    assert finish(second) == 0, logs()
    log = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent1.log").read_text()
    assert "resharded from 1 to 2 processes" in log, logs()
    result = assert_nothing_lost(tmp_path, 30)
    assert result["plan"].startswith("dp=2,")
    joined = [json.loads(line)["step"] for line in (tmp_path / "consumed-rank1.jsonl").read_text().splitlines()]
    assert min(joined) < 30 - 5, "the second agent joined too late to train with the first"


def test_resize_across_plan_kinds_and_runtimes_replans_reshards_and_loses_nothing(tmp_path):
    """Scenario 9 (and the resharding of 7/8), across runtimes: DeepSpeed ZeRO-0 on 2 processes -> DeepSpeed ZeRO-3 on 1
    (the universal form written from ZeRO-0's files) -> torch DDP on 2 (the ZeRO-3 checkpoint's whole state, exported
    through DeepSpeed's converter, imported as a DCP save) -> DeepSpeed ZeRO-1 with optimizer offload on 2 (the same world:
    the plan fixes the other runtime; torch's DCP save imported as a universal form). Each relaunch re-plans (the
    micro-batch and accumulation change, the global batch stays), converts the newest checkpoint once, listed in its
    manifest, and continues; the final weights equal the one-process reference within 2e-5."""
    for steps, nproc, plan, options in ((3, 2, "dp=2,zero=0,runtime=deepspeed", ()), (5, 1, "runtime=deepspeed", ("--zero-stages", "3")),
                                        (7, 2, "dp=2,zero=0,runtime=torch", ()),
                                        (10, 2, "dp=2,zero=1,mbs=4,gas=1,offload=optimizer,runtime=deepspeed", ())):
        job = launch(tmp_path, "--steps", str(steps), "--every", "2", "--plan", plan, *options, restarts=0, nproc=nproc)
        assert finish(job) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    log = (tmp_path / "launch.log").read_text()
    assert "resharded from 2 to 1 processes, dp=2,tp=1,pp=1,zero=0," in log and ",runtime=deepspeed -> dp=1,tp=1,pp=1,zero=3," in log
    assert "resharded from 1 to 2 processes, dp=1,tp=1,pp=1,zero=3," in log and ",runtime=deepspeed -> dp=2,tp=1,pp=1,zero=0," in log
    assert "resharded from 2 to 2 processes, dp=2,tp=1,pp=1,zero=0," in log
    result = torch.load(tmp_path / "final.pt", weights_only=False)
    assert result["plan"].startswith("dp=2,") and ",zero=1," in result["plan"] and ",offload=optimizer," in result["plan"]
    assert result["plan"].endswith(",runtime=deepspeed")
    ref_loss, ref_state = reference_run(10, GBS)
    assert result["global_step"] == 10 and result["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    for name, tensor in result["state"].items():
        torch.testing.assert_close(tensor, ref_state[name], atol=2e-5, rtol=0, msg=name)
