"""FleetStrategy against the same layout run by each bare runtime, one table per runtime, side by side in one run.

    .venv/bin/python benchmarks/strategy_vs_deepspeed.py     # writes benchmarks/STRATEGY_VS_DEEPSPEED.md

Every job runs under torchrun on 2 CPU processes (gloo) and trains the example GPT (4 layers, hidden 128, seq 128) on
the same stdlib text in the same global-batch order. DeepSpeed: FleetStrategy with a ZeRO-2 plan fixed on the DeepSpeed
runtime against the same config written by hand in a bare DeepSpeed loop. torch: FleetStrategy with a zero=0 plan fixed
on the torch runtime against a bare DistributedDataParallel loop and against ``Trainer(strategy="ddp")`` (the preset a
Lightning user picks for that layout); torch-fsdp: FleetStrategy with a zero=2 plan fixed on the torch runtime (FSDP2)
against FSDP2's fully_shard applied by hand in a plain loop and against Lightning's own way to run FSDP2,
``ModelParallelStrategy`` with fully_shard in the module's ``configure_model`` (its fleet row, beside DeepSpeed's, is the
same layout on either runtime). Each times every optimizer step; the report compares the median (and the lower quartile) of
the steps after a warm-up over rounds in alternating order (``--rounds``, default 6), each rank pinned to its own core, and gives FleetStrategy's start-up overhead (profiling, cluster, planning)
separately.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cost_model import goal_met, lower_quartile, round_noise  # noqa: E402  (stdlib only at import)

STEPS, WARMUP, GBS = 60, 10, 32
PLANS = {  # every key fixed: nothing left to plan
    "deepspeed": "dp=2,tp=1,pp=1,zero=2,mbs=16,gas=1,recompute=none,sp=false,vpp=1,offload=none,runtime=deepspeed",
    "torch": "dp=2,tp=1,pp=1,zero=0,mbs=16,gas=1,recompute=none,sp=false,vpp=1,offload=none,runtime=torch",
    "torch-fsdp": "dp=2,tp=1,pp=1,zero=2,mbs=16,gas=1,recompute=none,sp=false,vpp=1,offload=none,runtime=torch",
}
MODEL = dict(num_layers=4, hidden_size=128, num_heads=4, seq_length=128)
DATA = dict(seq_length=128, batch_size=16, limit_bytes=2_000_000)


def fleet_job(out: Path, table: str) -> None:
    """Rank code: Trainer(strategy=FleetStrategy(plan=PLANS[table])), step times from a callback."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    import lightning_fleet
    from examples.gpt.data import StdlibText
    from examples.gpt.model import GPT

    times: list[float] = []

    class StepClock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            times.append(time.perf_counter())

    seed_everything(0)
    started = time.perf_counter()
    strategy = lightning_fleet.FleetStrategy(plan=PLANS[table], global_batch_size=GBS)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS + 1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[StepClock()])
    trainer.fit(GPT(**MODEL), StdlibText(**DATA))
    total = time.perf_counter() - started
    if dist.get_rank() == 0:
        steps = [b - a for a, b in zip(times, times[1:])][WARMUP:]
        out.write_text(json.dumps({"step_s": steps, "startup": strategy.startup_s, "plan": str(strategy.plan), "total_s": total,
                                   "predicted_step_s": strategy.estimate.time.step_s}))


def ddp_job(out: Path) -> None:
    """Rank code: Trainer(strategy="ddp") on the same module and data (the DataLoader's batch 16 per process)."""
    from examples.gpt.model import GPT

    _lightning_job(out, "ddp", GPT(**MODEL))


def model_parallel_job(out: Path) -> None:
    """Rank code: the torch zero=2 plan as a Lightning user writes it for FSDP2: ``ModelParallelStrategy`` and
    ``fully_shard`` on every block and the root (reshard_after_forward False) in the module's ``configure_model``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from examples.gpt.model import GPT

    class ShardedGPT(GPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=False)
            fully_shard(self, mesh=mesh, reshard_after_forward=False)

    _lightning_job(out, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ShardedGPT(**MODEL))


def _lightning_job(out: Path, strategy: object, module: object) -> None:
    """Trainer(strategy=strategy) over ``module`` and the data (the DataLoader's batch 16 per process), each step timed."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.gpt.data import StdlibText

    times: list[float] = []

    class StepClock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            times.append(time.perf_counter())

    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS + 1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[StepClock()])
    trainer.fit(module, StdlibText(**DATA))
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"step_s": [b - a for a, b in zip(times, times[1:])][WARMUP:]}))


def torch_job(out: Path) -> None:
    """Rank code: the zero=0 plan by hand: DistributedDataParallel over the module, its own optimizer, a plain loop."""
    from torch.nn.parallel import DistributedDataParallel

    _torch_loop(out, DistributedDataParallel)


def fsdp_job(out: Path) -> None:
    """Rank code: the torch zero=2 plan by hand: FSDP2's fully_shard on every block and the root (reshard_after_forward
    False: ZeRO-2), the optimizer over the shards, a plain loop."""
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)
        return fully_shard(model, reshard_after_forward=False)

    _torch_loop(out, shard)


def _torch_loop(out: Path, layout) -> None:
    """The example GPT laid out by ``layout(model)`` (returns what to call), its own optimizer built after, a plain loop."""
    import torch
    import torch.distributed as dist

    from examples.gpt.model import GPT, next_byte_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(**MODEL)
    engine = layout(model)
    optimizer = model.configure_optimizers()

    def step(xs, ys):
        loss = next_byte_loss(engine(xs), ys)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    _timed_loop(step, out, rank, world)


def deepspeed_job(out: Path) -> None:
    """Rank code: the same plan as a hand-written DeepSpeed config and a plain training loop."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from examples.gpt.model import GPT, next_byte_loss

    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(**MODEL)
    config = {  # dp=2, ZeRO-2, micro-batch 16, no accumulation: what PLAN means, by hand
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000, "overlap_comm": False, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=model.configure_optimizers(), config=config, args=None)

    def step(xs, ys):
        loss = next_byte_loss(engine(xs), ys)  # forward through the engine, as DeepSpeed users write it
        engine.backward(loss)
        engine.step()

    _timed_loop(step, out, rank, world)


def _timed_loop(step, out: Path, rank: int, world: int) -> None:
    """A plain loop over this rank's share of each global batch (the order FleetStrategy reads), ``step(xs, ys)`` per
    optimizer step, each step timed; rank 0 writes the times after the warm-up."""
    import torch

    from examples.gpt.data import StdlibText
    from lightning_fleet.elastic.sampler import GlobalBatchSampler

    dm = StdlibText(**DATA)
    dm.setup("fit")
    sampler = GlobalBatchSampler(len(dm.train_set), global_batch_size=GBS, dp_size=world, dp_rank=rank, shuffle=True, seed=0)
    times = []
    for index, indices in enumerate(sampler):
        if index > STEPS:
            break
        times.append(time.perf_counter())
        xs, ys = zip(*(dm.train_set[i] for i in indices))
        step(torch.stack(xs), torch.stack(ys))
    if rank == 0:
        out.write_text(json.dumps({"step_s": [b - a for a, b in zip(times, times[1:])][WARMUP:]}))


def _spread(each_round: list[list[float]]) -> tuple[float, float, list[float]]:
    """(median of every step, its lower quartile, each round's median)."""
    every = sorted(s for steps in each_round for s in steps)
    return statistics.median(every), lower_quartile(every), [statistics.median(steps) for steps in each_round]


def _pin() -> None:
    """This rank on its own core (LOCAL_RANK), as every job of the benchmark alike: no migrations between the two."""
    if hasattr(os, "sched_setaffinity") and "LOCAL_RANK" in os.environ:
        os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)})


def launch(role: str, out: Path) -> dict:
    """One job of ``role`` (fleet-<table>, deepspeed, torch, fsdp, ddp) under torchrun; its JSON record."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}", __file__, role, str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{role} job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


TABLES = {  # table (a key of PLANS) -> (the bare jobs it is held against, first the one the goal is stated for)
    "deepspeed": (("deepspeed", "bare DeepSpeed loop (config by hand)"),),
    "torch": (("torch", "bare DistributedDataParallel loop (by hand)"), ("ddp", 'Trainer(strategy="ddp")')),
    "torch-fsdp": (("fsdp", "bare FSDP2 loop (fully_shard by hand)"),
                   ("mp-fsdp", "Trainer(strategy=ModelParallelStrategy()), fully_shard in configure_model")),
}
def round_jobs(round_index: int) -> list[str]:
    """The jobs of one round: every table's bare jobs, then its fleet job, in TABLES' order in even rounds and reversed
    in odd ones (no job always runs first, or always right after the same other job)."""
    jobs = [role for table, bare in TABLES.items() for role in (*(r for r, _ in bare), f"fleet-{table}")]
    return jobs if round_index % 2 == 0 else jobs[::-1]


def verdict_line(label: str, bare_rounds: list[list[float]], fleet_rounds: list[list[float]], noise: float, goal: float = 0.98) -> str:
    """The report's sentence for one table: FleetStrategy's throughput over the bare job's by the medians of every step
    and by the lower quartiles, per round, and the goal met, tied within the noise, or missed."""
    bare_med, bare_low, bare_each = _spread(bare_rounds)
    fleet_med, fleet_low, fleet_each = _spread(fleet_rounds)
    ratio = bare_med / fleet_med
    said = {"yes": "goal met", "tie": "a tie within the measured noise", "no": "**goal missed**"}[goal_met(ratio, goal, noise)]
    paired = ", ".join(f"{b / f:.3f}" for b, f in zip(bare_each, fleet_each))
    return (f"**Throughput ratio FleetStrategy / {label}: {ratio:.3f}** by the medians, {bare_low / fleet_low:.3f} by the lower "
            f"quartiles, per round {paired}; run-to-run noise {noise * 100:.1f} % -- {said} (goal >= {goal:.2f}).")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds; every job runs once per round, the order reversed every other round")
    args = parser.parse_args()
    work = ROOT / "out" / "bench"
    work.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[list[float]]] = {}  # role -> each round's step times
    fleet: dict[str, list[dict]] = {}
    for i in range(args.rounds):  # every job once per round, so that drift on this shared box hits all of them
        for role in round_jobs(i):
            record = launch(role, work / f"{role}{i}.json")
            rounds.setdefault(role, []).append(record["step_s"])
            if role.startswith("fleet-"):
                fleet.setdefault(role.removeprefix("fleet-"), []).append(record)
    noise = round_noise([[statistics.median(steps) for steps in each] for each in rounds.values()])
    command = ".venv/bin/python benchmarks/strategy_vs_deepspeed.py" + (f" --rounds {args.rounds}" if args.rounds != 6 else "")
    text = f"""# FleetStrategy vs the same layout on each bare runtime

Command: `{command}`
Machine: {platform.machine()}, {os.cpu_count()} cores, 2 processes under torchrun (gloo), OMP_NUM_THREADS=1, {time.strftime('%Y-%m-%d')}.
Workload: example GPT (4 layers, hidden 128, seq 128, 0.88 M params), global batch {GBS}, {STEPS} steps, the first
{WARMUP} dropped, {args.rounds} rounds in which every job below runs once (the order of the tables below, reversed every
other round); each rank pinned to its own core. This box is shared: a job's steps drift by up to 1.5x within a run as
other work comes and goes, so each row gives the median of every step, its lower quartile (the quieter steps) and each
round's median; the run-to-run noise is the median over all jobs of half the range of a job's round medians over their
median ({noise * 100:.1f} % in this run): a ratio within it of the goal is a tie.
"""
    for table, bare in TABLES.items():
        runs = fleet[table]
        startup = {k: statistics.median(r["startup"][k] for r in runs) for k in runs[-1]["startup"]}
        rows = [(label, *_spread(rounds[role])) for role, label in (*bare, (f"fleet-{table}", "Trainer(strategy=FleetStrategy(plan=...))"))]
        (_, _, fleet_low, _), fleet_med = rows[-1], rows[-1][1]
        text += f"""
## {table}

Plan `{runs[-1]['plan']}`.

| job | median step s | lower quartile s | round medians s | samples/s (median) |
|---|---|---|---|---|
""" + "".join(f"| {name} | {m:.4f} | {q:.4f} | {', '.join(f'{r:.3f}' for r in each)} | {GBS / m:.1f} |\n" for name, m, q, each in rows) + f"""
{verdict_line(bare[0][1], rounds[bare[0][0]], rounds[f"fleet-{table}"], noise)}""" + "".join(
            f" FleetStrategy / {name}: {m / fleet_med:.3f} ({q / fleet_low:.3f})." for name, m, q, _ in rows[1:-1]) + f"""

FleetStrategy start-up overhead (median of the rounds, rank 0): profiling on the meta device
{startup['profile_s']:.3f} s, cluster (cached measurement) {startup['cluster_s']:.3f} s, planning and broadcast
{startup['plan_s']:.3f} s; total {sum(startup.values()):.3f} s of a {runs[-1]['total_s']:.1f} s job.
The cost model predicted {runs[-1]['predicted_step_s']:.4f} s per step for this plan.
"""
    (ROOT / "benchmarks" / "STRATEGY_VS_DEEPSPEED.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):
        jobs = {"deepspeed": deepspeed_job, "torch": torch_job, "fsdp": fsdp_job, "ddp": ddp_job, "mp-fsdp": model_parallel_job,
                **{f"fleet-{table}": (lambda out, table=table: fleet_job(out, table)) for table in PLANS}}
        _pin()
        jobs[sys.argv[1]](Path(sys.argv[2]))
    else:
        main()
