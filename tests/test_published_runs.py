"""The published-runs benchmark (benchmarks/published_runs.py over benchmarks/published_runs.yaml): what it reads and
prices, checked against the yaml's schema and by hand. Its figures (errors, fits) are the benchmark's report,
benchmarks/PUBLISHED_RUNS.md, not asserted here."""

import math

import pytest
import yaml

from benchmarks import published_runs as pr
from lightning_fleet.planning import FleetError, Plan

pytestmark = pytest.mark.pure

KNOB_KEYS = {"value", "derived", "assumed"}


@pytest.fixture(scope="module")
def data_and_runs():
    return pr.read_runs()


def _knobs(mapping):
    return [(k, v) for k, v in mapping.items()]


def test_every_knob_says_where_it_comes_from(data_and_runs):
    """Every model and layout knob holds exactly one of value / derived / assumed, with its quote, row, reason or
    derivation (the yaml header's schema)."""
    data, _ = data_and_runs
    for run in data["runs"]:
        for part in ("model", "layout"):
            for name, entry in run[part].items():
                assert isinstance(entry, dict), (run["id"], part, name)
                held = KNOB_KEYS & set(entry)
                assert len(held) == 1, (run["id"], part, name, entry)
                if "value" in held:
                    assert {"from", "quote"} & set(entry), (run["id"], name)
                if "derived" in held:
                    assert entry.get("how"), (run["id"], name)
                if "assumed" in held:
                    assert entry.get("why"), (run["id"], name)


def test_enough_runs_and_sources_are_priced(data_and_runs):
    """Issue 13: at least 25 published runs from at least 5 independent sources, each priced at its layout or with
    a named reason it cannot be."""
    data, runs = data_and_runs
    priced = [pr.price(r) for r in runs]
    ok = [p for p in priced if p.estimate is not None]
    assert len(ok) >= 25
    assert len({p.run.source for p in ok}) >= 5
    assert all(p.reason for p in priced if p.estimate is None)
    assert {r["source"] for r in data["runs"]} <= set(data["sources"])


def test_knob_takes_spec_over_the_published_value():
    """A published value outside lightning_fleet's vocabulary is priced as its `spec`."""
    assert pr.knob({"value": "alibi", "quote": "x", "spec": "rope"}) == "rope"
    assert pr.knob({"assumed": 4, "why": "x"}) == 4
    assert pr.knob({"derived": False, "how": "x"}) is False
    assert pr.provenance({"assumed": 1, "why": "x"}) == "assumed"
    assert pr.provenance({"value": 1, "from": "row"}) == "published"


def test_plan_of_a_layout_and_what_it_refuses(data_and_runs):
    """A layout becomes the Plan of its keys; context parallelism is named as outside the plan vocabulary."""
    _, runs = data_and_runs
    run = next(r for r in runs if r.id == "megatron-h100-7.1b")
    assert pr.plan_of(run) == Plan(dp=48, tp=2, pp=1, zero=1, mbs=1, gas=4, recompute="none", sp=True, vpp=1, offload="none")
    cp = next(r for r in runs if r.layout.get("cp", 1) != 1)
    with pytest.raises(FleetError, match="context parallelism"):
        pr.plan_of(cp)


def test_reference_step_time_is_published_or_derived(data_and_runs):
    """The reference is the published step time where there is one (Korthikanti's Table 5: 22B seq+sel 1.10 s)."""
    _, runs = data_and_runs
    run = next(r for r in runs if r.id == "korthikanti-22b-seqsel")
    assert (run.reference_step_s, run.reference_how) == (1.10, "published")
    derived = next(r for r in runs if r.id == "megatron-h100-1.7b")
    assert derived.reference_step_s == pytest.approx(0.452) and derived.reference_how != "published"


def test_published_gb_are_converted_to_gib(tmp_path):
    """Memory published in GB is compared in GiB (80 GB = 74.5 GiB)."""
    data = yaml.safe_load(pr.RUNS.read_text())
    run = next(r for r in data["runs"] if any(p["metric"] == "memory_per_gpu" for p in r["published"]))
    mem = next(p for p in run["published"] if p["metric"] == "memory_per_gpu")
    mem["value"], mem["unit"] = 80, "GB per GPU"
    assert pr._run(run).memory_gib == pytest.approx(80e9 / 2**30)


def test_report_summary_by_hand(data_and_runs):
    """The summary's median and worst are over the priced runs' |predicted / reference - 1|."""
    data, runs = data_and_runs
    priced = [pr.price(r) for r in runs]
    _, summary = pr.report(data, priced)
    errors = sorted(abs(p.estimate.time.step_s / p.run.reference_step_s - 1) for p in priced if p.estimate is not None)
    assert summary["worst"] == pytest.approx(errors[-1])
    n = len(errors)
    median = errors[n // 2] if n % 2 else (errors[n // 2 - 1] + errors[n // 2]) / 2
    assert summary["median"] == pytest.approx(median)
    assert not math.isnan(summary["memory_median"])
