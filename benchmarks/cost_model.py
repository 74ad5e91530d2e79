"""Hold the cost model against reality on this machine: every executable plan, predicted and measured.

    .venv/bin/python benchmarks/cost_model.py            # writes benchmarks/RESULTS.md and benchmarks/RESULTS.png

1. ``fleet calibrate`` measures the machine for each world size (microbenchmarks only: matmul
   rates, all-reduce, operator dispatch, optimizer rate, backward/forward ratio, the framework's
   own per-step and per-micro-batch time on a probe model) and writes a cluster YAML;
2. every plan the strategy can execute for the example GPT at each size and world size is
   enumerated at one fixed global batch (ZeRO 0-3, offload, tp, pp, micro-batch, recomputation)
   and the ones predicted to fit are kept;
3. each is trained for real through ``Trainer(strategy=FleetStrategy(plan=..., cluster=<file>))``
   in processes forked from this one, twice (``--repeats``), in passes of alternating order, and
   its step time (the faster run's median step) and peak memory are measured;
4. RESULTS.md reports every plan and, overall, the median and worst relative error of step time
   and memory, Spearman's rank correlation and the regret of the planner's own choice.

Nothing here feeds the measured answers back into the model: the constants come from step 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank (2 cores), and safe to fork: set before torch loads
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))  # DeepSpeed's prebuilt CPU op

from benchmarks.cost_model_sizes import GLOBAL_BATCH, SIZES  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
GIB = 1024**3


# --- statistics (pure; tested in tests/test_cost_model_stats.py) -------------------------------------


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    return abs(predicted - measured) / measured


def round_noise(round_medians: list[list[float]]) -> float:
    """Run-to-run noise of a benchmark run in rounds: for each job that ran more than once, half the range of its round
    medians over their median (how far the same job moves between rounds on this machine); the median over the jobs,
    0.0 when none ran twice. A difference between two jobs smaller than this cannot be told from noise."""
    spreads = [(max(r) - min(r)) / 2 / statistics.median(r) for r in round_medians if len(r) > 1]
    return statistics.median(spreads) if spreads else 0.0


def lower_quartile(values: list[float]) -> float:
    """The value a quarter of the way up the sorted values (nan when there are none): a job's steps least slowed by other
    work on this shared machine, which only ever adds time."""
    ordered = sorted(v for v in values if math.isfinite(v))
    return ordered[len(ordered) // 4] if ordered else math.nan


def goal_met(ratio: float, goal: float, noise: float) -> str:
    """'yes' when a throughput ratio reaches its goal, 'tie' when it falls short by less than the measured noise, else 'no'."""
    if ratio >= goal:
        return "yes"
    return "tie" if ratio >= goal - noise else "no"


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties getting the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two equally long lists of at least two values")
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else float("nan")


def regret(chosen_measured_s: float, measured_s: list[float]) -> float:
    """Measured time of the planner's choice over the measured best."""
    return chosen_measured_s / min(measured_s)


# --- enumeration ------------------------------------------------------------------------------------


def executable_plans(world: int, *, num_layers: int, num_heads: int, global_batch: int) -> list[str]:
    """Every plan FleetStrategy runs for the example GPT on ``world`` processes at ``global_batch`` samples per step.

    The cost model's layouts (tp dividing the heads, at most one stage per layer, dp dividing the batch) and every
    value of the other axes a Plan accepts (offload needs ZeRO >= 1, parameter offload ZeRO-3), kept when DeepSpeed
    executes them (``DEEPSPEED.refusal``, runtime/deepspeed/capabilities.py) for a module with every hook, as the
    example GPT has.
    """
    from lightning_fleet.planning import Plan, PlanError
    from lightning_fleet.runtime.base import ModuleHooks
    from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

    hooks = ModuleHooks.assumed("GPT")
    plans = []
    for tp in (d for d in range(1, world + 1) if world % d == 0 and num_heads % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0 and d <= num_layers):
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for zero, offload, recompute, sp, vpp in _other_axes(num_layers // pp):
                for mbs in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
                    try:
                        plan = Plan(dp=dp, tp=tp, pp=pp, zero=zero, mbs=mbs, gas=per_replica // mbs, recompute=recompute,
                                    sp=sp, vpp=vpp, offload=offload)
                    except PlanError:  # a combination the cost model gives no meaning (e.g. offload with ZeRO-0)
                        continue
                    if DEEPSPEED.refusal(plan, hooks) is None:
                        plans.append(str(plan))
    return plans


def _other_axes(layers_per_stage: int) -> list[tuple[int, object, object, bool, int]]:
    """(zero, offload, recompute, sp, vpp) in the order the benchmark lists plans."""
    from itertools import product

    from lightning_fleet.planning import Offload, Recompute

    vpps = [v for v in range(1, layers_per_stage + 1) if layers_per_stage % v == 0] or [1]
    return list(product(range(4), Offload, Recompute, (False, True), vpps))


# --- running -----------------------------------------------------------------------------------------


_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def worker_env(cache_dir: Path = OUT / "cache") -> dict[str, str]:
    """The environment of a benchmark's worker processes: this one's without any launcher's (torchrun, Lightning)
    variables, one OpenMP thread, the repository importable, lightning_fleet's measurement cache in ``cache_dir``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith(("TORCHELASTIC_", "PL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FLEET_CACHE_DIR=str(cache_dir))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    return env


def calibrate(world: int, timeout_s: float, device: str = "cpu") -> Path:
    """Run ``fleet calibrate`` for ``world`` processes; returns the cluster file."""
    path = OUT / f"cluster-{device}-{world}.yaml"
    cmd = [sys.executable, "-m", "lightning_fleet", "calibrate", f"--nproc-per-node={world}", "--device", device, "--out", str(path)]
    subprocess.run(cmd, check=True, env=worker_env(), cwd=ROOT, timeout=timeout_s)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


TIMED_S = 0.3
"""Seconds of timed steps a plan gets per run, by its predicted step time (between ``TIMED_STEPS`` bounds)."""
TIMED_STEPS = (3, 5)
"""Fewest and most timed steps per run."""


def timed_steps(predicted_step_s: float) -> int:
    """How many steps of a plan to time in one run: ``TIMED_S`` worth by its prediction, at least 3 (a median) and at most 5."""
    lo, hi = TIMED_STEPS
    return min(hi, max(lo, math.ceil(TIMED_S / predicted_step_s)))


def combine_runs(runs: list[dict]) -> dict:
    """One plan's record from its runs: the fastest run's step time (on a shared 2-core VM a process is only ever slowed
    down, by ±15-40 % between forks of the same plan), the largest peak memory, and the runs' spread; an error if any failed."""
    failed = [r for r in runs if r["error"] or not math.isfinite(r["measured_step_s"])]
    if failed:
        return {**failed[0], "runs_step_s": [r["measured_step_s"] for r in runs]}
    steps = [r["measured_step_s"] for r in runs]
    return {**min(runs, key=lambda r: r["measured_step_s"]), "measured_peak_bytes": max(r["measured_peak_bytes"] for r in runs),
            "runs_step_s": steps}


def run_all(world: int, plans: list[Predicted], cluster: Path, *, repeats: int, warmup: int, timeout_s: float, device: str) -> list[dict]:
    """Train every plan on ``world`` processes forked from this one, ``repeats`` times in passes of alternating order (a
    slow spell of the machine then hits different plans each pass); each run is also appended to out/."""
    from benchmarks.cost_model_worker import preload, run_forked

    preload(device)
    out = OUT / f"measured-{world}.jsonl"
    out.unlink(missing_ok=True)
    runs: dict[tuple[str, str], list[dict]] = {(p.size, p.plan): [] for p in plans}
    for rep in range(repeats):
        for i, p in enumerate(plans if rep % 2 == 0 else plans[::-1], 1):
            steps = warmup + 1 + timed_steps(p.step_s)  # n + 1 step ends after the warm-up give n timed steps
            record = run_forked(p.size, p.plan, str(cluster), world=world, steps=steps, warmup=warmup, timeout_s=timeout_s, port=free_port(),
                                device=device)
            runs[(p.size, p.plan)].append(record)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[{world} proc. pass {rep + 1}/{repeats}, {i}/{len(plans)}] {p.size} {_short(p.plan)}: {record['measured_step_s']:.4f} s "
                  f"{record['error']}", flush=True)
    return [combine_runs(r) for r in runs.values()]


# --- the planner's view ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicted:
    """What the model says about one (size, world, plan) before anything runs."""

    size: str
    world: int
    plan: str
    step_s: float
    memory_bytes: float
    fits: bool


def model_spec(size: str):
    """The example GPT of this size, profiled on the meta device exactly as the strategy does."""
    import torch

    from examples.gpt.model import GPT
    from lightning_fleet.profiling import profile_module

    shape = SIZES[size]
    example = (torch.zeros(1, shape["seq_length"], dtype=torch.long), torch.zeros(1, shape["seq_length"], dtype=torch.long))
    return profile_module(GPT(**shape), example, global_batch_size=GLOBAL_BATCH, name=f"GPT {size}")


def predict_all(worlds: list[int], clusters: dict[int, Path], device: str) -> tuple[list[Predicted], dict[tuple[str, int], str]]:
    """Every executable plan's prediction, and the planner's choice per (size, world).

    The memory compared with the measurement: on CPU the whole process (device and host memory are
    the same RAM, the runtime reserve is the calibrated baseline of a process with the framework
    loaded); on a GPU what the allocator hands out (the device total without the runtime reserve).
    """
    from lightning_fleet.planning import estimate, load_cluster, parse_plan
    from lightning_fleet.planning.memory import reserve_bytes
    from lightning_fleet.planning import plan as search
    from lightning_fleet.runtime.base import ModuleHooks
    from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

    predictions, chosen = [], {}
    for size, shape in SIZES.items():
        spec = model_spec(size)
        for world in worlds:
            cluster = load_cluster(str(clusters[world]))
            for text in executable_plans(world, num_layers=shape["num_layers"], num_heads=shape["num_heads"], global_batch=GLOBAL_BATCH):
                e = estimate(spec, cluster, parse_plan(text, global_batch_size=GLOBAL_BATCH), overlaps=DEEPSPEED.overlaps)
                memory = e.memory.total_bytes + e.memory.host_bytes if device == "cpu" else e.memory.total_bytes - reserve_bytes(
                    e.memory.limit_bytes, cluster.calibration)
                predictions.append(Predicted(size, world, str(e.plan), e.time.step_s, memory, e.memory.fits))
            constraints = DEEPSPEED.constraints(ModuleHooks.assumed(f"GPT {size}"))  # the example GPT has every hook
            chosen[(size, world)] = str(search(spec, cluster, constraints=constraints).best.plan)
    return predictions, chosen


# --- report ------------------------------------------------------------------------------------------


def _fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f}"


def write_report(rows: list[dict], chosen: dict[tuple[str, int], str], clusters: dict[int, Path], command: str, seconds: float,
                 machine: str) -> str:
    """RESULTS.md text from the joined predicted/measured rows."""
    ok = [r for r in rows if not r["error"] and math.isfinite(r["measured_step_s"])]
    failed = [r for r in rows if r not in ok]
    time_err = [relative_error(r["predicted_step_s"], r["measured_step_s"]) for r in ok]
    mem_err = [relative_error(r["predicted_bytes"], r["measured_peak_bytes"]) for r in ok]
    lines = [
        "# Cost model against reality",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min, {time.strftime('%Y-%m-%d')}).",
        f"Machine: {machine}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"example GPT (vocabulary 256) at global batch {GLOBAL_BATCH}.",
        "",
        "## Overall",
        "",
        f"- plans executed: {len(ok)} (of {len(rows)} predicted to fit; {len(failed)} failed to run)",
    ]
    if ok:
        lines += [
            f"- step time: median relative error **{statistics.median(time_err):.1%}**, worst **{max(time_err):.1%}** (targets 15 % / 35 %)",
            f"- Spearman rank correlation of predicted vs measured step time, all plans: **{spearman([r['predicted_step_s'] for r in ok], [r['measured_step_s'] for r in ok]):.3f}** (target 0.9)",
            f"- peak memory ({'resident set' if 'CPU' in machine else 'max_memory_allocated'}): median relative error **{statistics.median(mem_err):.1%}**, worst **{max(mem_err):.1%}** (target 15 %)",
        ]
        spread = [max(r["runs_step_s"]) / min(r["runs_step_s"]) - 1 for r in ok if len(r.get("runs_step_s", [])) > 1]
        if spread:
            lines.append(f"- measurement noise: {len(ok[0]['runs_step_s'])} runs of each plan (fresh processes, passes in alternating order) "
                         f"differ by median **{statistics.median(spread):.1%}**, worst **{max(spread):.1%}**; the fastest run counts")
    lines += ["", "Per model size and world size:", "", "| size | world | plans | median err | worst err | Spearman | planner's choice | its measured step | best measured | regret |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (size, world), choice in chosen.items():
        group = [r for r in ok if r["size"] == size and r["world"] == world]
        if len(group) < 2:
            continue
        errs = [relative_error(r["predicted_step_s"], r["measured_step_s"]) for r in group]
        best = min(group, key=lambda r: r["measured_step_s"])
        mine = next((r for r in group if r["plan"] == choice), None)
        reg = f"{regret(mine['measured_step_s'], [r['measured_step_s'] for r in group]):.3f}" if mine else "not run"
        lines.append(
            f"| {size} | {world} | {len(group)} | {statistics.median(errs):.1%} | {max(errs):.1%} | "
            f"{spearman([r['predicted_step_s'] for r in group], [r['measured_step_s'] for r in group]):.3f} | `{_short(choice)}` | "
            f"{mine['measured_step_s']:.4f} s | `{_short(best['plan'])}` {best['measured_step_s']:.4f} s | {reg} |"
            if mine
            else f"| {size} | {world} | {len(group)} | {statistics.median(errs):.1%} | {max(errs):.1%} | - | `{_short(choice)}` | - | - | {reg} |"
        )
    speed = ROOT / "benchmarks" / "PLANNING_SPEED.md"
    if speed.is_file():
        table = [line for line in speed.read_text().splitlines() if line.startswith("|")]
        lines += ["", "## Planner scaling", "", "Planning time of the full search (from `benchmarks/PLANNING_SPEED.md`, "
                  "`.venv/bin/python benchmarks/planning_speed.py`):", "", *table]
    lines += ["", "## Calibrated constants (from `fleet calibrate`'s microbenchmarks only)", ""]
    for world, path in clusters.items():
        lines += [f"World {world} (`{path.relative_to(ROOT)}`):", "", "```yaml", path.read_text().strip(), "```", ""]
    lines += ["## Every plan", "", "| size | world | plan | predicted step | measured step | error | predicted GiB | measured GiB | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(ok, key=lambda r: (r["size"], r["world"], r["measured_step_s"])):
        lines.append(
            f"| {r['size']} | {r['world']} | `{_short(r['plan'])}` | {r['predicted_step_s']:.4f} | {r['measured_step_s']:.4f} | "
            f"{relative_error(r['predicted_step_s'], r['measured_step_s']):.1%} | {_fmt_gib(r['predicted_bytes'])} | "
            f"{_fmt_gib(r['measured_peak_bytes'])} | {relative_error(r['predicted_bytes'], r['measured_peak_bytes']):.1%} |"
        )
    if failed:
        lines += ["", "## Plans that did not run", ""] + [f"- {r['size']} world {r['world']} `{_short(r['plan'])}`: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def _short(plan: str) -> str:
    """The plan string without the fields this runtime never changes."""
    return plan.replace(",sp=false,vpp=1", "")


def plot(rows: list[dict], path: Path, machine: str) -> None:
    """Scatter of predicted vs measured step time, one colour per (size, world)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6), dpi=120)
    groups = sorted({(r["size"], r["world"]) for r in rows})
    for size, world in groups:
        group = [r for r in rows if (r["size"], r["world"]) == (size, world)]
        ax.scatter([r["measured_step_s"] for r in group], [r["predicted_step_s"] for r in group], s=14, alpha=0.7, label=f"{size}, {world} proc.")
    lo = min(min(r["measured_step_s"], r["predicted_step_s"]) for r in rows) * 0.8
    hi = max(max(r["measured_step_s"], r["predicted_step_s"]) for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15, label="±15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"lightning_fleet cost model vs reality ({machine})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2", help="world sizes (processes on this machine)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per plan, each a fresh process; the fastest counts")
    parser.add_argument("--warmup", type=int, default=1, help="steps not timed in each run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, nccl (benchmarks/gpu_check.sh)")
    parser.add_argument("--every", type=int, default=1, help="run every n-th plan only (a quick look; RESULTS.md is from --every 1)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")]
    clusters = {w: calibrate(w, timeout_s=600, device=args.device) for w in worlds}
    predictions, chosen = predict_all(worlds, clusters, args.device)
    rows = []
    for world in worlds:
        todo = [p for p in predictions if p.world == world and p.fits][:: args.every]
        measured = run_all(world, todo, clusters[world], repeats=args.repeats, warmup=args.warmup, timeout_s=180,
                           device=args.device)
        by_key = {(m["size"], m["plan"]): m for m in measured}
        for p in todo:
            m = by_key.get((p.size, p.plan), {"measured_step_s": float("nan"), "measured_peak_bytes": float("nan"), "error": "no record (worker stopped)"})
            rows.append({**m, "size": p.size, "world": world, "plan": p.plan, "predicted_step_s": p.step_s, "predicted_bytes": p.memory_bytes})
    (OUT / "rows.json").write_text(json.dumps(rows, indent=1))
    command = "bash scripts/setup-env.sh && .venv/bin/python benchmarks/cost_model.py" + (" --device cuda" if args.device == "cuda" else "")
    machine = f"{platform.machine()} CPU only (gloo)"
    if args.device == "cuda":
        import torch

        machine = f"{torch.cuda.get_device_name(0)} (nccl)"
    report = write_report(rows, chosen, clusters, command, time.perf_counter() - started, machine)
    Path(args.out).write_text(report)
    ok = [r for r in rows if not r["error"] and math.isfinite(r["measured_step_s"])]
    if ok:
        plot(ok, Path(args.out).with_suffix(".png"), machine)
    print(report.split("## Calibrated")[0])


if __name__ == "__main__":
    main()
