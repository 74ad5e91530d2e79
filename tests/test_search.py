"""The planner against brute force on small cases, and its errors."""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import make_cluster, make_model
from lightning_fleet.planning import (
    Axis,
    Constraints,
    NoFeasiblePlanError,
    Offload,
    Plan,
    PlanError,
    Recompute,
    estimate,
    plan,
)
from lightning_fleet.planning.search import divisors


def brute_force(model, cluster, cons: Constraints = Constraints()):
    """Every valid plan (all placements), estimated one by one: the ground truth for the search."""
    world = cluster.world_size
    out = []
    for tp, pp in itertools.product(divisors(world), repeat=2):
        if world % (tp * pp) or model.num_heads % tp or model.num_layers % pp:
            continue
        dp = world // (tp * pp)
        if model.global_batch_size % dp:
            continue
        batch = model.global_batch_size // dp
        for zero, mbs, recompute, offload, sp, vpp in itertools.product(
            cons.zero_stages, divisors(batch), cons.recompute, list(Offload), (False, True), divisors(model.num_layers)
        ):
            if pp > 1 and zero > cons.max_zero_with_pp or (offload is not Offload.NONE and cluster.host is None):
                continue
            if pp > 1 and model.num_layers % (pp * vpp):
                continue
            try:
                candidate = Plan(dp=dp, tp=tp, pp=pp, zero=zero, mbs=mbs, gas=batch // mbs, recompute=recompute, sp=sp, vpp=vpp, offload=offload)
            except PlanError:
                continue
            for order in itertools.permutations(Axis):
                out.append(estimate(model, cluster, candidate.replace(order=order)))
    return out


CASES = [
    pytest.param(
        make_model(layers=4, hidden=1024, heads=8, seq=1024, gbs=16),
        make_cluster(nodes=2, devices_per_node=2, memory_gib=1.3, memory_reserve_gib=0.25),
        id="tight-2x2",
    ),
    pytest.param(make_model(layers=8, hidden=2048, heads=16, seq=1024, gbs=16), make_cluster(nodes=2, devices_per_node=4, memory_gib=3), id="offload-2x4"),
    pytest.param(
        make_model(layers=4, hidden=512, heads=4, seq=512, gbs=12, precision="fp32"),
        make_cluster(nodes=1, devices_per_node=4, memory_gib=0.5, host=False, memory_reserve_gib=0.1),
        id="fp32-nohost-1x4",
    ),
    pytest.param(
        make_model(layers=6, hidden=1536, heads=12, seq=1024, gbs=24),
        make_cluster(nodes=3, devices_per_node=2, memory_gib=2.5, overlap=0.5, memory_reserve_gib=0.25),
        id="3x2-overlap",
    ),
]


@pytest.mark.parametrize("model,cluster", CASES)
def test_search_finds_the_brute_force_best(model, cluster):
    """The planner's first plan is as fast as the fastest fitting plan of an exhaustive enumeration."""
    truth = [e for e in brute_force(model, cluster) if e.fits]
    result = plan(model, cluster, top=3)
    best = min(e.time.step_s for e in truth)
    assert result.best.time.step_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("model,cluster", CASES)
def test_search_never_returns_a_plan_that_does_not_fit(model, cluster):
    """Every returned plan fits when estimated on its own, and the counts match brute force."""
    result = plan(model, cluster, top=50, exhaustive=True)
    for e in result.all_feasible:
        assert estimate(model, cluster, e.plan).fits
    every = brute_force(model, cluster)
    default_order = [e for e in every if e.plan.order == (Axis.TP, Axis.DP, Axis.PP)]
    assert result.candidates == len(default_order)
    assert result.feasible == sum(e.fits for e in default_order)


@pytest.mark.parametrize("model,cluster", CASES)
def test_branch_and_bound_keeps_the_exact_top(model, cluster):
    """Skipping plans that cannot enter the top K changes nothing in the top K."""
    pruned = plan(model, cluster, top=4)
    full = plan(model, cluster, top=4, exhaustive=True)
    assert [e.time.step_s for e in pruned.plans] == [e.time.step_s for e in full.plans]
    assert (pruned.candidates, pruned.feasible) == (full.candidates, full.feasible)
    assert len(pruned.all_feasible) <= len(full.all_feasible)


def test_top_plans_are_sorted_and_distinct(cluster, model):
    """Plans come fastest first, each once."""
    result = plan(model, cluster, top=10)
    times = [e.time.step_s for e in result.plans]
    assert times == sorted(times)
    assert len({str(e.plan) for e in result.plans}) == len(result.plans)


def test_constraints_narrow_the_search(cluster, model):
    """Runtime limits (zero <= 1 with pp > 1, no offload, max tp/pp) are respected by every plan."""
    cons = dict(zero_stages=(0, 1, 2), max_tp=2, max_pp=2, max_zero_with_pp=1, allow_offload=False, max_vpp=1, allow_sp=False)
    result = plan(model, cluster, top=200, exhaustive=True, **cons)
    for e in result.all_feasible:
        p = e.plan
        assert p.tp <= 2 and p.pp <= 2 and p.zero <= 2 and p.vpp == 1 and not p.sp
        assert p.offload is Offload.NONE
        assert p.pp == 1 or p.zero <= 1


def test_nothing_fits_names_the_closest_plan_and_what_helps():
    """A model that fits nowhere: one line naming the need, the best plan, the device size and remedies."""
    model = make_model(layers=8, hidden=4096, heads=32, seq=2048, gbs=8)
    tiny = make_cluster(nodes=1, devices_per_node=2, memory_gib=1, host=False)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, tiny)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model {model.name!r} needs ")
    assert "GiB memory per device with the best plan (dp=" in message
    assert "devices have 1.00 GiB" in message
    assert "add devices" in message and "allow offload" in message


def test_no_layout_divides_is_a_clear_error():
    """Heads, layers and batch that no factorization divides: the error says so."""
    model = make_model(layers=3, hidden=768, heads=3, seq=128, gbs=5)
    with pytest.raises(NoFeasiblePlanError, match="no layout divides"):
        plan(model, make_cluster(nodes=1, devices_per_node=4))


def test_misfit_reasons_name_the_term_and_the_shortfall():
    """Rejected families say how much memory they lack and which term is largest."""
    model = make_model(layers=4, hidden=2048, heads=16, seq=2048, gbs=64)
    result = plan(model, make_cluster(nodes=1, devices_per_node=4, memory_gib=16), top=1)
    misfits = [r for r in result.rejected if r.reason.startswith("needs")]
    assert misfits, result.rejected
    assert all("short" in r.reason and "largest term" in r.reason for r in misfits)


def test_heterogeneous_cluster_plans_on_the_slowest_device():
    """Two device kinds: the planner uses the smaller memory and the lower peak."""
    from lightning_fleet.planning import cluster_from_dict

    data = {
        "name": "mixed",
        "groups": [
            {"nodes": 1, "devices_per_node": 4, "device": {"name": "big", "memory_gib": 80, "peak_tflops": {"bf16": 312, "fp16": 312, "fp32": 19.5}}},
            {"nodes": 1, "devices_per_node": 4, "device": {"name": "small", "memory_gib": 40, "peak_tflops": {"bf16": 100, "fp16": 100, "fp32": 10}}},
        ],
        "intra_node": {"bandwidth_GBps": 300, "latency_us": 5},
        "inter_node": {"bandwidth_GBps": 25, "latency_us": 10},
    }
    mixed = cluster_from_dict(data)
    device = mixed.planning_device()
    assert (device.memory_gib, device.peak_tflops.bf16) == (40, 100)
    result = plan(make_model(), mixed, top=1)
    assert result.best.memory.limit_bytes == 40 * 1024**3
    assert result.best.plan.world_size == 8


def test_placement_is_searched_when_the_default_crosses_nodes():
    """With slow inter-node links, a placement other than tp-dp-pp can win and is recorded in the plan."""
    model = make_model(layers=8, hidden=2048, heads=16, seq=1024, gbs=64)
    slow = make_cluster(nodes=2, devices_per_node=4)
    result = plan(model, slow, top=1, zero_stages=(0,), allow_offload=False, recompute=(Recompute.NONE,))
    truth = [e for e in brute_force(model, slow, Constraints(zero_stages=(0,), recompute=(Recompute.NONE,))) if e.fits and e.plan.offload is Offload.NONE]
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in truth), rel=1e-12)


@pytest.mark.parametrize("model,cluster", CASES)
def test_search_prices_plans_as_estimate_does(model, cluster):
    """The search's memoised memory and time terms are those of estimate(), bit for bit, placements included."""
    for exhaustive in (True, False):
        result = plan(model, cluster, top=3, exhaustive=exhaustive)
        for e in result.all_feasible:
            single = estimate(model, cluster, e.plan)
            assert (e.memory, e.time) == (single.memory, single.time), e.plan
    for misfit in result.misfit_plans:
        assert not estimate(model, cluster, misfit).fits


def test_room_is_the_exact_threshold_of_a_rounded_sum():
    """a + other <= limit (as floats round it) holds exactly for a <= room(other, limit), at every scale."""
    import math
    import random

    from lightning_fleet.planning.search import room

    rng = random.Random(7)
    pairs = [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0), (79.9999e9, 80e9), (1e-300, 1e300), (3.0, 1e-9)]
    pairs += [(rng.uniform(0, 1e11), rng.uniform(1e9, 1e11)) for _ in range(300)]
    for other, limit in pairs:
        r = room(other, limit)
        assert r + other <= limit and not math.nextafter(r, math.inf) + other <= limit
        for a in (r, math.nextafter(r, -math.inf), math.nextafter(r, math.inf), limit - other, 0.0, rng.uniform(0, 2 * limit)):
            assert (a + other <= limit) == (a <= r)


def test_fit_table_agrees_with_the_sums():
    """Variants fit on ranks exactly when activations + other bytes <= limit on every stage and the host fits."""
    import random

    from lightning_fleet.planning.search import _FitTable, _State, room

    rng = random.Random(3)
    limit = 80.0 * 1024**3
    recomputes = tuple(Recompute)
    for _ in range(200):
        stages = rng.choice((1, 2, 3))
        offloads = [Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS][: rng.choice((1, 2, 3))]
        others = [[rng.uniform(0.2, 1.0) * limit for _ in range(stages)] for _ in offloads]
        states = [
            _State(terms=(), rooms=tuple(room(o, limit) for o in other), host_fits=rng.random() < 0.8) for other in others
        ]
        table = _FitTable(recomputes, states)
        ranked = table.states(0, offloads, states)
        by_mode = {r: tuple(rng.choice((0.0, rng.uniform(0, 0.8) * limit, states[0].rooms[k])) for k in range(stages)) for r in recomputes}
        expected = [
            (r, o)
            for r in recomputes
            for o, other, state in zip(offloads, others, states)
            if state.host_fits and all(a + b <= limit for a, b in zip(by_mode[r], other))
        ]
        assert table.fitting(ranked, table.signature(by_mode)) == expected
        assert table.fitting(ranked, table.signature(by_mode)) == expected  # remembered


def _fastest_link_bound_off(monkeypatch):
    from lightning_fleet.planning import search

    monkeypatch.setattr(search, "_SLACK", float("inf"))


@pytest.mark.parametrize("model,cluster", CASES)
def test_fastest_link_bound_keeps_the_plans_and_rejections(model, cluster, monkeypatch):
    """Skipping variants whose fastest-link time cannot reach the reported plans changes no plan and no rejection."""
    pruned = [plan(model, cluster, top=top, max_rejected=rejected) for top, rejected in ((1, 1), (2, 3), (3, 20))]
    _fastest_link_bound_off(monkeypatch)
    for result, (top, rejected) in zip(pruned, ((1, 1), (2, 3), (3, 20))):
        full = plan(model, cluster, top=top, max_rejected=rejected)
        assert [(e.plan, e.time, e.memory) for e in result.plans] == [(e.plan, e.time, e.memory) for e in full.plans]
        assert result.rejected == full.rejected
        assert (result.candidates, result.feasible) == (full.candidates, full.feasible)
        assert {str(e.plan) for e in result.all_feasible} <= {str(e.plan) for e in full.all_feasible}


def test_fastest_link_bound_prunes_and_a_wrong_bound_is_caught(monkeypatch):
    """The bound skips estimates on a larger case; a mutant that prunes against half the threshold changes the answer."""
    from lightning_fleet.planning import search

    model = make_model(layers=8, hidden=2048, heads=16, seq=1024, gbs=64)
    cluster = make_cluster(nodes=4, devices_per_node=4, memory_gib=16)
    pruned = plan(model, cluster, top=1, max_rejected=2)
    monkeypatch.setattr(search, "_SLACK", 0.5)  # not a lower bound any more
    wrong = plan(model, cluster, top=1, max_rejected=2)
    _fastest_link_bound_off(monkeypatch)
    full = plan(model, cluster, top=1, max_rejected=2)
    assert len(pruned.all_feasible) < len(full.all_feasible)
    assert (pruned.plans, pruned.rejected) == (full.plans, full.rejected)
    assert (wrong.plans, wrong.rejected) != (full.plans, full.rejected)
