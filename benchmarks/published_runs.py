"""Predicted vs published: lightning_fleet's cost model priced at the layouts of published training runs.

    .venv/bin/python benchmarks/published_runs.py          # writes benchmarks/PUBLISHED_RUNS.md

Every run of ``benchmarks/published_runs.yaml`` (its header is the schema; every number there says where it comes
from: a quoted source, arithmetic on published numbers, or our assumption with the reason) is estimated at its
published layout on its published hardware, with the cost model's one default set of constants (no per-source
fitting, no calibration): the same ``estimate`` that ``fleet estimate`` and the planner run.

The reference step time of a run is its published iteration time where the source publishes one, else the step time
that its published throughput implies under the source's own FLOPs convention (the yaml's ``derived: step_s`` entry
says how; ``tests/test_attention_flops.py`` recomputes one run of each convention with
:mod:`lightning_fleet.planning.flops`). The predicted
throughput in the source's convention is then the published throughput times reference / predicted step time:
the convention's FLOPs per step are the same on both sides. Memory is compared where the source publishes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_fleet.planning import (
    Calibration, ClusterSpec, Estimate, FleetError, Overlaps, Plan, TransformerSpec, estimate, load_cluster, transformer_model,
)

HERE = Path(__file__).parent
RUNS = HERE / "published_runs.yaml"
GIB = 2**30

# goals of issue 13 ("How to prove it")
GOAL_MEDIAN = 0.10
GOAL_WORST = 0.25


def knob(entry: Any) -> Any:
    """The value lightning_fleet takes from one knob of the yaml: its ``spec`` when the published value is outside
    lightning_fleet's vocabulary, else whichever of value / derived / assumed it holds."""
    if not isinstance(entry, dict):
        return entry
    if "spec" in entry:
        return entry["spec"]
    for key in ("value", "derived", "assumed"):
        if key in entry:
            return entry[key]
    raise ValueError(f"knob {entry!r} has none of value / derived / assumed")


def provenance(entry: Any) -> str:
    """Where a knob comes from: published, derived or assumed."""
    if isinstance(entry, dict):
        if "assumed" in entry:
            return "assumed"
        if "derived" in entry:
            return "derived"
    return "published"


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One published run, read from the yaml: what is priced and what it is compared with."""

    id: str
    source: str
    spec: TransformerSpec
    layout: dict[str, Any]
    cluster: ClusterSpec
    gpus: int
    reference_step_s: float
    reference_how: str
    """'published' or the derivation the yaml states."""
    throughput: tuple[str, float, str] | None
    """(metric, value, convention) of the source's throughput figure, when it publishes one."""
    memory_gib: float | None
    """Published memory per GPU in GiB (converted from GB where the source says GB)."""
    memory_note: str
    overlaps: Overlaps
    """What the run's stack hides behind compute: its published overlaps, else the cost model's default."""
    assumed: tuple[str, ...]
    """The knobs the source does not publish."""
    substituted: tuple[str, ...]
    """Knobs priced as a value other than the published one (outside lightning_fleet's vocabulary): 'key: published -> priced'."""


def read_runs(path: Path = RUNS) -> tuple[dict[str, Any], list[Run]]:
    """The yaml's sources and its runs."""
    data = yaml.safe_load(path.read_text())
    return data, [_run(r) for r in data["runs"]]


def _run(r: dict[str, Any]) -> Run:
    model = {k: knob(v) for k, v in r["model"].items()}
    spec = TransformerSpec(name=r["id"], **model)
    layout = {k: knob(v) for k, v in r["layout"].items()}
    where = r["cluster"]
    cluster = load_cluster(where.get("preset") or where["new"]).with_nodes(int(where["nodes"]))
    published = {p["metric"]: p for p in r["published"]}
    derived = {d["metric"]: d for d in r.get("derived", [])}
    if "step_s" in published:
        reference, how = float(published["step_s"]["value"]), "published"
    elif "step_s" in derived:
        reference, how = float(derived["step_s"]["value"]), derived["step_s"]["how"]
    else:
        reference, how = float("nan"), "none: the source's numbers do not give a step time"
    throughput = None
    for metric in ("tflops_per_gpu", "tokens_per_s_per_gpu"):
        if metric in published:
            p = published[metric]
            throughput = (metric, float(p["value"]), p["convention"])
            break
    memory, note = None, ""
    if "memory_per_gpu" in published:
        p = published["memory_per_gpu"]
        unit = p.get("unit", "")
        memory = float(p["value"]) * (1e9 / GIB if unit.startswith("GB") else 1.0)
        note = unit
    assumed = tuple(
        f"{part}.{k}" for part in ("model", "layout") for k, v in r[part].items() if provenance(v) == "assumed"
    )
    substituted = tuple(
        f"{part}.{k}: {v.get('value', v.get('derived', v.get('assumed')))} -> {v['spec']}"
        for part in ("model", "layout") for k, v in r[part].items() if isinstance(v, dict) and "spec" in v
    )
    gpus = int(knob(r["hardware"]["gpus"]))
    overlap = r["runtime"].get("overlap")
    overlaps = Overlaps.of(knob(overlap)) if overlap is not None else Overlaps.DEFAULT
    return Run(
        id=r["id"], source=r["source"], spec=spec, layout=layout, cluster=cluster, gpus=gpus,
        reference_step_s=reference, reference_how=how, throughput=throughput, memory_gib=memory, memory_note=note,
        overlaps=overlaps, assumed=assumed, substituted=substituted,
    )


# layout keys the cost model's Plan does not have, and what pricing does about them
_NOT_A_PLAN_KEY = {"cp"}


def plan_of(run: Run) -> Plan:
    """The run's published layout as a Plan; FleetError naming what the cost model cannot express."""
    layout = dict(run.layout)
    cp = int(layout.pop("cp", 1))
    if cp != 1:
        raise FleetError(f"context parallelism (cp={cp}) is not in the cost model's plan vocabulary")
    fields = {f.name for f in dataclasses.fields(Plan)}
    stage_layers = layout.pop("stage_layers", None)
    if stage_layers is not None and "stage_layers" in fields:
        layout["stage_layers"] = tuple(int(n) for n in stage_layers)
    unknown = set(layout) - fields - _NOT_A_PLAN_KEY
    if unknown:
        raise FleetError(f"layout keys {sorted(unknown)} are not plan keys")
    return Plan(**layout)


@dataclass(frozen=True, slots=True, kw_only=True)
class Priced:
    """A run and what the cost model says of it (estimate None: not priced, ``reason`` says why)."""

    run: Run
    estimate: Estimate | None
    reason: str = ""

    @property
    def error(self) -> float:
        """Predicted / reference step time - 1 (positive: predicted slower than published)."""
        assert self.estimate is not None
        return self.estimate.time.step_s / self.run.reference_step_s - 1.0

    @property
    def predicted_memory_gib(self) -> float:
        assert self.estimate is not None
        return self.estimate.memory.total_bytes / GIB


def price(run: Run) -> Priced:
    """Estimate one run at its published layout."""
    try:
        if run.reference_step_s != run.reference_step_s:
            raise FleetError(run.reference_how)
        plan = plan_of(run)
        model = transformer_model(run.spec)
        if plan.world_size != run.gpus:
            raise FleetError(f"the layout uses {plan.world_size} GPUs, the run {run.gpus}")
        return Priced(run=run, estimate=estimate(model, run.cluster, plan, overlaps=run.overlaps))
    except FleetError as err:
        return Priced(run=run, estimate=None, reason=str(err))


def _largest_other_term(e: Estimate) -> str:
    terms = {k: v for k, v in e.time.terms().items() if k != "compute"}
    name = max(terms, key=terms.__getitem__)
    return f"{name} {terms[name] / e.time.step_s:.0%}"


def _layout_text(layout: dict[str, Any]) -> str:
    keys = ("dp", "tp", "pp", "cp", "zero", "mbs", "gas", "recompute", "sp", "vpp")
    shown = [k for k in keys if k in ("dp", "zero") or layout.get(k, 1) not in (1, False, "none")]
    text = " ".join(f"{k}{layout[k]}" for k in shown)
    if layout.get("stage_layers"):
        text += " stages " + "/".join(str(n) for n in layout["stage_layers"])
    return text


def _layout_substituted(run: Run) -> bool:
    """The run's layout is priced with a knob other than the published one (outside the plan vocabulary)."""
    return any(s.startswith("layout.") for s in run.substituted)


def _exactness_line(summary: dict[str, Any], substituted: list[str]) -> str:
    """The summary's line on runs whose layout is priced with a substituted knob (the figures without them, if any)."""
    if not substituted:
        return "- Every priced run's layout is priced exactly as published (no layout knob substituted)."
    return (
        f"- The same over the {summary['exact_runs']} runs whose layout is priced exactly as published (leaving out "
        f"{', '.join(substituted)}, priced with a layout knob outside the plan vocabulary: the yaml's spec_why says what "
        f"it over- or under-counts): median {summary['exact_median']:.1%}, worst {summary['exact_worst']:.1%}."
    )


def report(data: dict[str, Any], priced: list[Priced]) -> tuple[str, dict[str, Any]]:
    """The markdown report and its summary figures."""
    ok = [p for p in priced if p.estimate is not None]
    errors = [abs(p.error) for p in ok]
    misfits = [p for p in ok if not p.estimate.fits and not p.estimate.memory.tight]
    tight = [p for p in ok if p.estimate.memory.tight]
    published_memory = [p for p in ok if p.run.memory_gib is not None]
    # a layout priced as another one (torchtitan's op-level recomputation as full) holds other activations
    memory = [p for p in published_memory if not _layout_substituted(p.run)]
    memory_errors = [abs(p.predicted_memory_gib / p.run.memory_gib - 1) for p in memory]
    exact = [abs(p.error) for p in ok if not _layout_substituted(p.run)]
    summary = {
        "runs": len(priced),
        "priced": len(ok),
        "sources": len({p.run.source for p in ok}),
        "median": statistics.median(errors) if errors else float("nan"),
        "worst": max(errors) if errors else float("nan"),
        "misfits": [p.run.id for p in misfits],
        "tight": [p.run.id for p in tight],
        "exact_runs": len(exact),
        "exact_median": statistics.median(exact) if exact else float("nan"),
        "exact_worst": max(exact) if exact else float("nan"),
        "memory_median": statistics.median(memory_errors) if memory_errors else float("nan"),
    }
    lines = [
        "# Predicted vs published: training runs at their published layouts",
        "",
        "Command: `.venv/bin/python benchmarks/published_runs.py` (pure arithmetic, about a second; "
        f"written {datetime.date.today().isoformat()}).",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        "## Summary",
        "",
        f"- Runs: {summary['runs']} from {len(data['sources'])} sources; priced: {summary['priced']} "
        f"(from {summary['sources']} sources).",
        f"- Step time |error|: median **{summary['median']:.1%}** (goal <= {GOAL_MEDIAN:.0%}: "
        f"{'met' if summary['median'] <= GOAL_MEDIAN else 'missed'}), worst **{summary['worst']:.1%}** "
        f"(goal <= {GOAL_WORST:.0%}: {'met' if summary['worst'] <= GOAL_WORST else 'missed'}).",
        _exactness_line(summary, [p.run.id for p in ok if _layout_substituted(p.run)]),
        f"- Published layouts that trained but are predicted not to fit: **{len(misfits)}**"
        + (f" ({', '.join(summary['misfits'])})" if misfits else "") + " (goal 0)"
        + (f"; predicted tight (every byte held only inside the {Calibration().memory_reserve_fraction:.0%} "
           f"fragmentation allowance, which the planner never spends): **{len(tight)}** ({', '.join(summary['tight'])})"
           if tight else "") + ".",
        f"- Memory where published and the layout is priced as published ({len(memory)} of {len(published_memory)} runs): "
        f"median |error| {summary['memory_median']:.1%}"
        + ("" if len(memory) == len(published_memory) else
           f" (not compared: {', '.join(p.run.id for p in published_memory if p not in memory)}, whose layout is "
           "priced with a substituted knob)") + ".",
        "",
        "## By source",
        "",
        "| source | runs priced | median abs. error | worst | mean signed error |",
        "|---|---|---|---|---|",
    ]
    for source in data["sources"]:
        mine = [p for p in ok if p.run.source == source]
        if mine:
            errs = [p.error for p in mine]
            lines.append(
                f"| {source} | {len(mine)} | {statistics.median(abs(e) for e in errs):.1%} | "
                f"{max(abs(e) for e in errs):.1%} | {statistics.mean(errs):+.1%} |"
            )
    lines += [
        "",
        "## Runs",
        "",
        "Reference: the published step time, or (`*`) the one implied by the published throughput under the source's "
        "convention. Throughput columns are in the source's own unit and convention. Memory: GiB per GPU.",
        "",
        "| run | GPUs | layout | reference step s | predicted step s | error | published throughput | predicted | "
        "memory published | memory predicted | fits | largest term after compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in priced:
        r = p.run
        ref = f"{r.reference_step_s:.3f}" + ("" if r.reference_how == "published" else "*")
        if p.estimate is None:
            lines.append(f"| {r.id} | {r.gpus} | {_layout_text(r.layout)} | {ref} | not priced: {p.reason} | | | | | | | |")
            continue
        e = p.estimate
        thr_pub = thr_pred = ""
        if r.throughput is not None:
            metric, value, _ = r.throughput
            unit = "TFLOP/s" if metric == "tflops_per_gpu" else "tok/s"
            thr_pub = f"{value:g} {unit}"
            thr_pred = f"{value * r.reference_step_s / e.time.step_s:.1f} {unit}"
        mem_pub = f"{r.memory_gib:.1f}" if r.memory_gib is not None else ""
        lines.append(
            f"| {r.id} | {r.gpus} | {_layout_text(r.layout)} | {ref} | {e.time.step_s:.3f} | {p.error:+.1%} | {thr_pub} | "
            f"{thr_pred} | {mem_pub} | {p.predicted_memory_gib:.1f} | {'yes' if e.fits else 'tight' if e.memory.tight else '**no**'} | {_largest_other_term(e)} |"
        )
    lines += [
        "", "## What each run assumes", "",
        "Knobs the source does not publish (the yaml says why each value was chosen), and published values outside "
        "lightning_fleet's vocabulary priced as the nearest one (the yaml's `spec_why` says what that over- or "
        "under-counts):", "",
    ]
    for p in priced:
        text = f"- {p.run.id}: assumed {', '.join(p.run.assumed) if p.run.assumed else 'nothing'}"
        if p.run.substituted:
            text += f"; priced as {'; '.join(p.run.substituted)}"
        lines.append(text)
    lines.append("")
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "PUBLISHED_RUNS.md")
    args = parser.parse_args(argv)
    data, runs = read_runs()
    priced = [price(r) for r in runs]
    text, summary = report(data, priced)
    args.out.write_text(text)
    for p in priced:
        if p.estimate is None:
            print(f"{p.run.id:36s} not priced: {p.reason}")
        else:
            print(f"{p.run.id:36s} ref {p.run.reference_step_s:9.3f}  pred {p.estimate.time.step_s:9.3f}  {p.error:+7.1%}  fits {p.estimate.fits}")
    print(f"median {summary['median']:.1%}  worst {summary['worst']:.1%}  misfits {summary['misfits']}  tight {summary['tight']}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
