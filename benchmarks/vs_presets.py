"""strategy="fleet" against the strategies a Lightning user picks by hand, measured on this machine, and fleet's
predicted ranking of the same layouts next to the measured one.

    .venv/bin/python benchmarks/vs_presets.py            # writes benchmarks/VS_PRESETS.md (+ benchmarks/out/vs_presets/)
    .venv/bin/python benchmarks/vs_presets.py --quick    # one model, one size: a smoke check
    .venv/bin/python benchmarks/vs_presets.py --cells llama:S --strategies ddp --rounds 4 --steps 12 --out /tmp/ab.md  # an A/B

For the example GPT (examples/gpt/model.py) and a Llama-style module (benchmarks/vs_presets_worker.py: RMSNorm, GQA,
SwiGLU, RoPE, untied head, no biases, fused SDPA), each at two sizes and one global batch (the DataLoader's per-process
batch x 2 processes, the same data and seed for every strategy), each strategy trains on 2 CPU processes under torchrun
(gloo, OMP_NUM_THREADS=1, 127.0.0.1, a free port, a timeout):

1. probes: ``Trainer(strategy=NAME)`` exactly as a user writes it, once per preset; a preset Lightning refuses on a CPU
   is then run as Lightning's own registered preset with the CPU seams opened (vs_presets_worker.VARIANTS), and the
   refusal is kept for the report;
2. the main pass: every (model, size, strategy), each rank in its own memory cgroup without a limit, in ``--rounds``
   rounds in which every strategy runs once, the order reversed every other round (this machine is shared: alternating
   spreads the drift of other work over all strategies): per round the median step time of the steps after the
   warm-up; per strategy the median of its round medians, samples/s, per-rank peak resident set (``ru_maxrss``) and
   cgroup peak (``memory.max_usage_in_bytes``, what a limit acts on); then fleet's throughput against the fastest
   preset's, with the run-to-run noise measured in the same cell (:func:`verdict`);
3. the limit pass (the larger size of each model): every strategy again with each rank's cgroup limited to a memory
   between the smallest and the largest cgroup peak the presets had in step 2, and fleet told that memory (its cluster
   file's device memory set to it): which of them fit at all;
4. the prediction: each layout priced with lightning_fleet's cost model on this machine's calibrated cluster file
   (``fleet calibrate``, benchmarks/out/cluster-cpu-2.yaml, as benchmarks/cost_model.py makes it), the module profiled
   as the strategy profiles it; predicted step time and peak memory next to the measured ones, both rankings and
   Spearman's rank correlation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cost_model import free_port, goal_met, lower_quartile, ranks, round_noise, spearman, worker_env  # noqa: E402  (stdlib only at import; the same statistics and worker setup as RESULTS.md)

OUT = ROOT / "benchmarks" / "out" / "vs_presets"
REPORT = ROOT / "benchmarks" / "VS_PRESETS.md"
CLUSTER = ROOT / "benchmarks" / "out" / "cluster-cpu-2.yaml"
WORKER = ROOT / "benchmarks" / "vs_presets_worker.py"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB, MIB = 1024**3, 1024**2

STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload", "fleet")
"""What is compared: Lightning's registered names as a user types them, and lightning_fleet's."""

LAYOUTS = {
    "ddp": "zero=0,offload=none",
    "fsdp": "zero=3,offload=none",  # FULL_SHARD, Lightning's default sharding strategy: parameters, gradients and optimizer split
    "deepspeed_stage_2": "zero=2,offload=none",
    "deepspeed_stage_3": "zero=3,offload=none",
    "deepspeed_stage_3_offload": "zero=3,offload=optimizer+params",
}
"""Each hand-picked preset as the cost model's layout (fleet's is the plan it chose)."""

MODELS = {
    "gpt": {
        "global_batch": 16,
        "sizes": {
            "S": dict(num_layers=6, hidden_size=256, num_heads=4, seq_length=128),
            "L": dict(num_layers=8, hidden_size=448, num_heads=7, seq_length=128),
        },
    },
    "llama": {
        "global_batch": 16,
        "sizes": {
            "S": dict(num_layers=6, hidden_size=256, num_heads=8, num_kv_heads=2, ffn_size=704, seq_length=128),
            "L": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, ffn_size=1408, seq_length=128),
        },
    },
}
"""model -> its global batch (the user's own: DataLoader batch_size x 2 processes) and two sizes' constructor arguments."""

DATA_BYTES = 400_000
"""Bytes of the example's stdlib text (examples/gpt/data.py) every run trains on."""


# --- pure: records, rankings, the report (tested in tests/test_vs_presets.py) --------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One (model, size, strategy) run as the report shows it."""

    model: str
    size: str
    strategy: str
    ran_as: str
    """How it ran: ``Trainer(strategy=...)`` as named, or the CPU-seamed preset (vs_presets_worker.VARIANTS)."""
    step_s: float
    """Median measured step time (nan when it did not run)."""
    peak_rss_bytes: float
    """Largest rank's resident-set high-water mark."""
    cgroup_peak_bytes: float
    """Largest rank's memory-cgroup peak (nan when cgroups were not available)."""
    error: str
    """Why it did not run or did not fit ('' when it ran)."""
    plan: str = ""
    """The layout priced: the preset's, or the plan fleet chose."""
    predicted_step_s: float = math.nan
    predicted_bytes: float = math.nan
    round_step_s: tuple[float, ...] = ()
    """Each round's median step time, in round order (one value when it ran once)."""
    quiet_step_s: float = math.nan
    """The lower quartile of every timed step of every round (:func:`benchmarks.cost_model.lower_quartile`): the steps least slowed by other
    work on this shared machine, which only ever adds time."""

    @property
    def ran(self) -> bool:
        """It trained to the end."""
        return not self.error and math.isfinite(self.step_s)


def merge_ranks(records: list[dict]) -> dict:
    """One run's record from its ranks' files: the slowest rank's median step, the largest peaks, the first error."""
    if not records:
        return {"error": "no rank wrote a result", "median_step_s": math.nan, "peak_rss_bytes": math.nan}
    errors = [r["error"] for r in records if r.get("error")]
    steps = [r["median_step_s"] for r in records]
    merged = dict(records[0])
    merged["error"] = errors[0] if errors else ""
    merged["median_step_s"] = max(steps) if not errors and all(math.isfinite(s) for s in steps) else math.nan
    merged["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in records)
    merged["step_times_s"] = [max(times) for times in zip(*(r.get("step_times_s") or [] for r in records))]  # the slowest rank's, step by step
    return merged


def combine_rounds(rounds: list[dict]) -> dict:
    """One strategy's record over the rounds (each a :func:`merge_ranks` record): the median of the round medians, each
    round's median, the largest peaks; a strategy that failed in any round failed, with that round's error."""
    if not rounds:
        raise ValueError("combine_rounds needs at least one round")
    errors = [r["error"] for r in rounds if r.get("error")]
    steps = [r["median_step_s"] for r in rounds]
    combined = dict(rounds[0])
    combined["error"] = errors[0] if errors else ""
    combined["round_step_s"] = steps
    combined["median_step_s"] = statistics.median(steps) if not errors and all(math.isfinite(s) for s in steps) else math.nan
    combined["step_times_s"] = [t for r in rounds for t in r.get("step_times_s") or []]  # every round's timed steps
    for key in ("peak_rss_bytes", "cgroup_peak_bytes"):
        values = [r.get(key, math.nan) for r in rounds]
        combined[key] = max(values) if all(math.isfinite(v) for v in values) else math.nan
    return combined


def round_order(strategies: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The order strategies run in a round: as listed in even rounds, reversed in odd ones (first and last swap places, so
    no strategy always runs right after start-up or always last)."""
    return strategies if round_index % 2 == 0 else tuple(reversed(strategies))


@dataclass(frozen=True)
class Verdict:
    """fleet's throughput against the fastest preset that ran in one (model, size), and whether it meets the goal."""

    fastest: str
    """The preset with the smallest median step time."""
    ratio: float
    """fleet's throughput / the fastest preset's (their medians of round medians)."""
    quiet_ratio: float
    """The same by the lower quartiles of all their timed steps (:attr:`Outcome.quiet_step_s`)."""
    round_ratios: tuple[float, ...]
    """The same ratio within each round (the two ran minutes apart in the same round)."""
    noise: float
    """Run-to-run noise of this cell (:func:`benchmarks.cost_model.round_noise` over every strategy that ran): how far
    the same job's round median moves between rounds here."""

    @property
    def met(self) -> str:
        """'yes' when fleet is at least as fast, 'tie' when it is slower by less than the noise, else 'no'."""
        return goal_met(self.ratio, 1.0, self.noise)

    def line(self) -> str:
        """The report's sentence under the cell's table."""
        rounds = ", ".join(f"{r:.3f}" for r in self.round_ratios)
        said = {"yes": "goal met", "tie": "a tie within the measured noise", "no": "**goal missed**"}[self.met]
        return (f"**fleet / fastest preset ({self.fastest}): {self.ratio:.3f}x** throughput by the medians of the rounds (per round: "
                f"{rounds}), {self.quiet_ratio:.3f}x by the lower quartiles of all timed steps; run-to-run noise in this cell "
                f"{self.noise * 100:.1f} % -- {said} (goal >= 1.00, ties within the noise).")


def verdict(outcomes: list["Outcome"]) -> Verdict | None:
    """fleet against the fastest preset that ran (None when fleet or every preset did not run)."""
    fleet = next((o for o in outcomes if o.strategy == "fleet" and o.ran), None)
    presets = [o for o in outcomes if o.strategy != "fleet" and o.ran]
    if fleet is None or not presets:
        return None
    fastest = min(presets, key=lambda o: o.step_s)
    paired = [p / f for p, f in zip(fastest.round_step_s, fleet.round_step_s)]
    return Verdict(fastest=fastest.strategy, ratio=fastest.step_s / fleet.step_s, quiet_ratio=fastest.quiet_step_s / fleet.quiet_step_s,
                   round_ratios=tuple(paired),
                   noise=round_noise([list(o.round_step_s) for o in outcomes if o.ran]))


def chosen_plan(log: str) -> str:
    """The plan strategy="fleet" printed in its start-up report (``  chosen   dp=...``), '' when it printed none."""
    for line in log.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "chosen" and fields[1].startswith("dp="):
            return fields[1]
    return ""


def limit_between(peaks: list[float], *, step: int = 16 * MIB) -> int:
    """A per-rank memory limit halfway between the smallest and the largest peak, rounded down to ``step``."""
    finite = [p for p in peaks if math.isfinite(p)]
    if len(finite) < 2:
        raise ValueError("need at least two measured peaks to place a limit between them")
    return int((min(finite) + max(finite)) / 2) // step * step


def ranking(outcomes: list[Outcome]) -> tuple[list[tuple[Outcome, float, float]], float]:
    """The runs that trained, each with its predicted and measured rank (1 = fastest, ties averaged), and Spearman's
    rank correlation of predicted against measured step time (nan with fewer than two runs)."""
    ran = [o for o in outcomes if o.ran and math.isfinite(o.predicted_step_s)]
    if len(ran) < 2:
        return [(o, 1.0, 1.0) for o in ran], math.nan
    predicted, measured = [o.predicted_step_s for o in ran], [o.step_s for o in ran]
    rows = sorted(zip(ran, ranks(predicted), ranks(measured)), key=lambda row: row[2])
    return rows, spearman(predicted, measured)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f}" if math.isfinite(nbytes) else "-"


def _short(plan: str) -> str:
    return plan.replace(",tp=1,pp=1", "").replace(",recompute=none", "").replace(",sp=false,vpp=1", "")


def group_section(model: str, size: str, params: float, global_batch: int, outcomes: list[Outcome]) -> list[str]:
    """The report's table for one (model, size): measured and predicted per strategy, then the two rankings."""
    lines = [f"### {model} {size} ({params / 1e6:.1f} M parameters, global batch {global_batch})", "",
             "| strategy | ran as | median step s | round medians s | samples/s | peak RSS GiB/rank | cgroup peak GiB/rank | layout priced | "
             "predicted step s | predicted GiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rounds = ", ".join(f"{s:.3f}" for s in o.round_step_s) or "-"
        measured = (f"{o.step_s:.4f} | {rounds} | {global_batch / o.step_s:.1f}" if o.ran else f"did not run: {o.error} | - | -")
        lines.append(f"| {o.strategy} | {o.ran_as} | {measured} | {_gib(o.peak_rss_bytes)} | {_gib(o.cgroup_peak_bytes)} | "
                     f"`{_short(o.plan)}` | {o.predicted_step_s:.4f} | {_gib(o.predicted_bytes)} |")
    said = verdict(outcomes)
    if said is not None:
        lines += ["", said.line()]
    rows, rho = ranking(outcomes)
    lines += ["", f"Ranking by step time (1 = fastest), Spearman {rho:.3f}:", "",
              "| measured rank | strategy | predicted rank |", "|---|---|---|"]
    lines += [f"| {m:g} | {o.strategy} | {p:g} |" for o, p, m in rows]
    return lines + [""]


def verdict_section(verdicts: dict[str, Verdict | None]) -> list[str]:
    """The report's summary: per (model, size), fleet's throughput against the fastest preset and whether the goal is met."""
    lines = ["| model size | fastest preset | fleet / fastest (throughput, medians) | per round | by lower quartiles | noise | goal >= 1.00 |",
             "|---|---|---|---|---|---|---|"]
    for cell, said in verdicts.items():
        if said is None:
            lines.append(f"| {cell} | - | fleet or every preset did not run | - | - | - | no |")
            continue
        rounds = ", ".join(f"{r:.3f}" for r in said.round_ratios)
        lines.append(f"| {cell} | {said.fastest} | {said.ratio:.3f}x | {rounds} | {said.quiet_ratio:.3f}x | {said.noise * 100:.1f} % | "
                     f"{ {'yes': 'met', 'tie': 'tie (within noise)', 'no': '**missed**'}[said.met]} |")
    return lines + [""]


def limit_section(model: str, size: str, limit: int, outcomes: list[Outcome], predicted_fits: dict[str, bool]) -> list[str]:
    """The report's table of the limit pass: which strategies fit in ``limit`` bytes per rank, predicted and measured."""
    lines = [f"### {model} {size} at {limit / GIB:.3f} GiB per rank", "",
             "| strategy | layout | predicted to fit | fit (trained to the end) | cgroup peak GiB/rank | median step s |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        fit = "yes" if o.ran else f"**no**: {o.error}"
        step = f"{o.step_s:.4f}" if o.ran else "-"
        lines.append(f"| {o.strategy} | `{_short(o.plan)}` | {'yes' if predicted_fits.get(o.strategy) else 'no'} | {fit} | "
                     f"{_gib(o.cgroup_peak_bytes)} | {step} |")
    return lines + [""]


# --- running ---------------------------------------------------------------------------------------------------------


class Cgroups:
    """One cgroup-v1 memory group per local rank for one run (created here, removed by :meth:`remove`)."""

    def __init__(self, tag: str, limit_bytes: int | None) -> None:
        self.paths = [CGROUP_ROOT / f"lightning-fleet-vs-presets-{os.getpid()}-{tag}-r{r}" for r in range(2)]
        for path in self.paths:
            path.mkdir()
            if limit_bytes is not None:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                memsw = path / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(str(limit_bytes))

    @staticmethod
    def available() -> bool:
        """cgroup v1's memory controller is mounted and writable here."""
        return CGROUP_ROOT.is_dir() and os.access(CGROUP_ROOT, os.W_OK)

    def peak_bytes(self) -> float:
        """The largest group's ``memory.max_usage_in_bytes``."""
        return float(max(int((p / "memory.max_usage_in_bytes").read_text()) for p in self.paths))

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit, summed over the groups (``oom_kill`` of memory.oom_control)."""
        total = 0
        for path in self.paths:
            for line in (path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    total += int(line.split()[1])
        return total

    def remove(self) -> None:
        """Remove the groups (their processes have exited; a leftover one is moved to the root group first)."""
        for path in self.paths:
            for pid in filter(None, (path / "cgroup.procs").read_text().split()):
                (CGROUP_ROOT / "cgroup.procs").write_text(pid)
            path.rmdir()


def launch(job: dict, *, limit_bytes: int | None, timeout_s: float, use_cgroups: bool) -> dict:
    """Run one job under torchrun (2 processes, in its own session, killed as a group on timeout); its merged record."""
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    groups = Cgroups(out.name, limit_bytes) if use_cgroups else None
    job = {**job, "cgroups": [str(p) for p in groups.paths] if groups else []}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(WORKER), json.dumps(job)]
    started = time.perf_counter()
    timed_out = False
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, env=worker_env(OUT / "cache"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        merged = merge_ranks(records)
        merged["wall_s"] = time.perf_counter() - started
        merged["cgroup_peak_bytes"] = groups.peak_bytes() if groups else math.nan
        kills = groups.oom_kills() if groups else 0
    finally:
        if groups:
            groups.remove()
    if kills:
        merged["error"] = f"killed by the kernel at the {limit_bytes / GIB:.3f} GiB limit (out of memory, {kills} process(es))"
    elif timed_out:
        merged["error"] = f"did not finish within {timeout_s:.0f} s"
    elif len(records) < 2 and not merged.get("error"):
        merged["error"] = f"a rank died without a result (torchrun exit {proc.returncode}; see {out.relative_to(ROOT)}/log.txt)"
    if job["strategy"] == "fleet" and not merged.get("plan"):  # killed before it wrote its record: the plan it printed
        merged["plan"] = chosen_plan((out / "log.txt").read_text())
    merged["limit_bytes"] = limit_bytes
    (out / "record.json").write_text(json.dumps(merged, indent=1))
    return merged


def job_for(model: str, size: str, strategy: str, variant: str, tag: str, *, warmup: int, steps: int, cluster: Path) -> dict:
    """The worker's job description."""
    return {"model": model, "shape": MODELS[model]["sizes"][size], "strategy": strategy, "variant": variant,
            "global_batch": MODELS[model]["global_batch"], "data_bytes": DATA_BYTES, "warmup": warmup, "steps": steps,
            "out": str(OUT / tag), "cluster": str(cluster)}


def probe_variants(cluster: Path, use_cgroups: bool, timeout_s: float, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, tuple[str, list[str]]]:
    """For each preset, the first way it trains on this CPU (named, then Lightning's preset with the CPU seams, then that
    with the module's own optimizer kept under offload) on the smallest GPT for one step, and the errors of the ways
    before it."""
    from benchmarks.vs_presets_worker import VARIANTS

    chosen: dict[str, tuple[str, list[str]]] = {}
    for strategy in strategies:
        refusals: list[str] = []
        if strategy in ("ddp", "fleet"):  # run as named on a CPU (the main pass shows it)
            chosen[strategy] = ("named", refusals)
            continue
        for variant in VARIANTS:
            tag = f"probe-{strategy}-{variant}"
            record = launch(job_for("gpt", "S", strategy, variant, tag, warmup=0, steps=1, cluster=cluster), limit_bytes=None,
                            timeout_s=timeout_s, use_cgroups=use_cgroups)
            print(f"probe {strategy} ({variant}): {record['error'] or 'trains'}", flush=True)
            if not record["error"]:
                break
            refusals.append(f"{_variant_text(strategy, variant)}: {record['error']}")
        chosen[strategy] = (variant, refusals)
    return chosen


def _variant_text(strategy: str, variant: str) -> str:
    if strategy == "fleet":
        return "FleetStrategy(cluster=<calibrated file>)"
    return {"named": f'strategy="{strategy}"', "cpu": f"Lightning's {strategy} preset, CPU seams open",
            "cpu+client-optimizer": f"Lightning's {strategy} preset, CPU seams open, zero_force_ds_cpu_optimizer: false"}[variant]


# --- the prediction --------------------------------------------------------------------------------------------------


def profile_spec(model: str, size: str):  # type: ignore[no-untyped-def]
    """The module profiled as ``strategy="fleet"`` profiles it at fit (its loader batch, fp32, default attention kernel)."""
    import torch

    from benchmarks.vs_presets_worker import build_model
    from lightning_fleet.profiling import profile

    shape, gbs = MODELS[model]["sizes"][size], MODELS[model]["global_batch"]
    module = build_model(model, shape)
    example = (torch.zeros(gbs // 2, shape["seq_length"], dtype=torch.long), torch.zeros(gbs // 2, shape["seq_length"], dtype=torch.long))
    params = sum(p.numel() for p in module.parameters())
    return profile(module, example, global_batch_size=gbs, name=type(module).__name__).spec, params


def price(spec, cluster, layout: str, global_batch: int) -> tuple[str, float, float]:  # type: ignore[no-untyped-def]
    """(plan, predicted step s, predicted whole-process bytes per rank) of a data-parallel layout on 2 ranks.

    On CPU device and host memory are the same RAM, so the process holds both (benchmarks/cost_model.py's rule)."""
    from lightning_fleet.planning import estimate, parse_plan

    plan = layout if layout.startswith("dp=") else f"dp=2,tp=1,pp=1,mbs={global_batch // 2},gas=1,recompute=none,sp=false,vpp=1,{layout}"
    e = estimate(spec, cluster, parse_plan(plan, global_batch_size=global_batch))
    return str(e.plan), e.time.step_s, e.memory.total_bytes + e.memory.host_bytes


def limited_cluster(limit_bytes: int, path: Path) -> Path:
    """The calibrated cluster file with each device's memory set to ``limit_bytes`` and no host memory section (a CPU
    rank's host and device memory are the same limited RAM, so nothing can be offloaded to somewhere else)."""
    import yaml

    data = yaml.safe_load(CLUSTER.read_text())
    data["device"]["memory_gib"] = round(limit_bytes / GIB, 4)
    data.pop("host", None)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- the whole benchmark ---------------------------------------------------------------------------------------------


def measure_group(model: str, size: str, variants: dict, cluster: Path, *, pass_name: str, limit: int | None, warmup: int, steps: int,
                  use_cgroups: bool, timeout_s: float, rounds: int = 1, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, dict]:
    """Every strategy on one (model, size), ``rounds`` times in alternating order (:func:`round_order`); per strategy its
    rounds combined (:func:`combine_rounds`), in the order given."""
    runs: dict[str, list[dict]] = {strategy: [] for strategy in strategies}
    for index in range(rounds):
        for strategy in round_order(strategies, index):
            variant = variants[strategy][0]
            tag = f"{pass_name}-{model}-{size}-{strategy}-r{index}"
            record = launch(job_for(model, size, strategy, variant, tag, warmup=warmup, steps=steps, cluster=cluster), limit_bytes=limit,
                            timeout_s=timeout_s, use_cgroups=use_cgroups)
            runs[strategy].append(record)
            print(f"{pass_name} {model} {size} {strategy} round {index + 1}/{rounds}: {record['median_step_s']:.4f} s/step, peak RSS "
                  f"{_gib(record['peak_rss_bytes'])} GiB, cgroup {_gib(record['cgroup_peak_bytes'])} GiB {record['error']}", flush=True)
    return {strategy: combine_rounds(records) for strategy, records in runs.items()}


def outcomes_of(model: str, size: str, records: dict[str, dict], variants: dict, spec, cluster) -> list[Outcome]:  # type: ignore[no-untyped-def]
    """Records joined with the cost model's prices of their layouts."""
    gbs = MODELS[model]["global_batch"]
    out = []
    for strategy, r in records.items():
        layout = r.get("plan") if strategy == "fleet" else LAYOUTS[strategy]
        plan, step, nbytes = price(spec, cluster, layout, gbs) if layout else ("(fleet did not plan)", math.nan, math.nan)
        out.append(Outcome(model=model, size=size, strategy=strategy, ran_as=_variant_text(strategy, variants[strategy][0]),
                           step_s=r["median_step_s"], peak_rss_bytes=r["peak_rss_bytes"], cgroup_peak_bytes=r["cgroup_peak_bytes"],
                           error=r["error"], plan=plan, predicted_step_s=step, predicted_bytes=nbytes,
                           round_step_s=tuple(r.get("round_step_s", ())), quiet_step_s=lower_quartile(r.get("step_times_s") or [])))
    return out


def ensure_cluster() -> Path:
    """This machine's calibrated cluster file for 2 processes (made by ``fleet calibrate`` when missing)."""
    if not CLUSTER.is_file():
        from benchmarks.cost_model import calibrate

        calibrate(2, timeout_s=600)
    return CLUSTER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the GPT at its small size only (a smoke check)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (the median counts)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the main pass (every strategy once per round, alternating order)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--cells", default="", help="only these model:size cells, comma-separated (e.g. llama:S); no limit pass")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="only these strategies, comma-separated (fleet always)")
    parser.add_argument("--out", default=str(REPORT))
    args = parser.parse_args()
    started = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    use_cgroups = Cgroups.available()
    load_before = os.getloadavg()
    from lightning_fleet.planning import load_cluster

    cluster_path = ensure_cluster()
    cluster = load_cluster(str(cluster_path))
    strategies = tuple(s for s in STRATEGIES if s in {*args.strategies.split(","), "fleet"})
    variants = probe_variants(cluster_path, use_cgroups, args.timeout, strategies)
    groups = [("gpt", "S")] if args.quick else [(m, s) for m in MODELS for s in MODELS[m]["sizes"]]
    if args.cells:
        groups = [tuple(cell.split(":")) for cell in args.cells.split(",")]
    sections, limits, raw, verdicts = [], [], {}, {}
    for model, size in groups:
        spec, params = profile_spec(model, size)
        records = measure_group(model, size, variants, cluster_path, pass_name="main", limit=None, warmup=args.warmup, steps=args.steps,
                                use_cgroups=use_cgroups, timeout_s=args.timeout, rounds=args.rounds, strategies=strategies)
        outcomes = outcomes_of(model, size, records, variants, spec, cluster)
        verdicts[f"{model} {size}"] = verdict(outcomes)
        raw[f"{model}-{size}"] = [asdict(o) for o in outcomes]
        sections += group_section(model, size, params, MODELS[model]["global_batch"], outcomes)
        last_size = list(MODELS[model]["sizes"])[-1]
        if use_cgroups and not args.cells and strategies == STRATEGIES and (args.quick or size == last_size):
            peaks = [o.cgroup_peak_bytes for o in outcomes if o.ran and o.strategy != "fleet"]
            limit = limit_between(peaks)
            small = limited_cluster(limit, OUT / f"cluster-limited-{model}-{size}.yaml")
            limited = measure_group(model, size, variants, small, pass_name="limit", limit=limit, warmup=1, steps=2, use_cgroups=True,
                                    timeout_s=args.timeout)
            limited_outcomes = outcomes_of(model, size, limited, variants, spec, cluster)
            predicted_fits = {o.strategy: o.predicted_bytes <= limit for o in limited_outcomes}
            raw[f"{model}-{size}-limit"] = [asdict(o) for o in limited_outcomes]
            limits += limit_section(model, size, limit, limited_outcomes, predicted_fits)
    (OUT / "outcomes.json").write_text(json.dumps(raw, indent=1))
    report = render(args, variants, verdict_section(verdicts) + sections, limits, use_cgroups, time.perf_counter() - started, load_before,
                    os.getloadavg())
    Path(args.out).write_text(report)
    print(report)


PRESET_CONFIG_NOTE = " Each preset is priced as its layout (dp, ZeRO stage, offload) under fleet's own DeepSpeed / ZeRO settings, not the preset's: Lightning's DeepSpeed presets use 2e8-element reduce and all-gather buckets, a ZeRO-3 sub_group_size of 1e12 and DeepSpeed's default stage3_param_persistence_threshold (lightning/pytorch/strategies/deepspeed.py), fleet 5e7-element buckets and no persistent parameters (lightning_fleet/runtime/deepspeed/config.py), and Lightning's FSDP wraps the whole model as one unit; their measured memory can exceed what the cost model prices for the layout."
"""Why a preset's measured memory can exceed its layout's prediction (printed under the report's Prediction line)."""


def render(args, variants, sections, limits, use_cgroups, seconds, load_before, load_after) -> str:  # type: ignore[no-untyped-def]
    """VS_PRESETS.md."""
    refusals = [f"- `{s}`: {line}" for s, (_, lines) in variants.items() for line in lines]
    flags = [("--quick", args.quick), (f"--rounds {args.rounds}", args.rounds != 3), (f"--steps {args.steps}", args.steps != 5),
             (f"--cells {args.cells}", bool(args.cells)), (f"--strategies {args.strategies}", args.strategies != ",".join(STRATEGIES))]
    command = " ".join([".venv/bin/python benchmarks/vs_presets.py", *(flag for flag, given in flags if given)])
    lines = [
        "# strategy=\"fleet\" against the presets a Lightning user picks by hand",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min, {time.strftime('%Y-%m-%d')}); raw records under `benchmarks/out/vs_presets/`.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, CPU only; every run 2 processes under torchrun (gloo, OMP_NUM_THREADS=1), "
        f"{args.warmup} warm-up steps then the median of {args.steps} timed steps (slowest rank); the main pass in {args.rounds} rounds, every "
        "strategy once per round, the order reversed every other round, each strategy's step time the median of its round medians. "
        "Load average before/after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f} (other work on this shared machine ran concurrently when it is above ~2).",
        f"Prediction: lightning_fleet's cost model on `{CLUSTER.relative_to(ROOT)}` (`fleet calibrate` on this machine), the module profiled as "
        "strategy=\"fleet\" profiles it; predicted memory is the whole process (device + host bytes: one RAM on a CPU), measured is the "
        "resident-set high-water mark." + PRESET_CONFIG_NOTE,
        "",
        "## What runs on a CPU at all",
        "",
        "Each preset as a user types it, `Trainer(accelerator=\"cpu\", devices=2, strategy=NAME)`, and what it said; the tables below then run "
        "the first way that trains (Lightning's own registered preset, so Lightning's own DeepSpeed/FSDP configuration, with only the CPU "
        "seams opened: `benchmarks/vs_presets_worker.py`).",
        "",
        *(refusals or ["- every preset trains as named"]),
        "",
        "## Throughput, memory and the predicted ranking",
        "",
        *sections,
    ]
    if limits:
        lines += ["## Which fit at all: a per-rank memory limit", "",
                  "Each rank in its own cgroup-v1 memory group limited to halfway between the smallest and the largest cgroup peak the "
                  "presets reached above (no swap on this machine); fleet is told that memory (its cluster file's device memory, no host "
                  "section: on a CPU there is nowhere else to offload to) and plans again. Predicted to fit: the priced layout's "
                  "whole-process bytes within the limit. 1 warm-up and 2 timed steps. A cgroup is charged the process' anonymous memory "
                  "and the file pages it brings in first; shared-library pages another process already cached are not charged, which is why "
                  "the cgroup peak sits ~0.1 GiB below the resident set, and the predicted bytes (calibrated to the resident set) are "
                  "compared with the limit as they are.", "", *limits]
    elif not use_cgroups:
        lines += ["## Which fit at all", "", f"No writable cgroup-v1 memory controller at {CGROUP_ROOT}: only peak memory is reported.", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
