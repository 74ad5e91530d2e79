"""The planner against brute force on small cases, and its errors."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests.conftest import make_cluster, make_model
from lightning_fleet.planning import (
    Axis,
    Constraints,
    HostSpec,
    LinkSpec,
    NoFeasiblePlanError,
    Offload,
    Plan,
    PlanError,
    Recompute,
    RejectionKind,
    estimate,
    parse_plan,
    plan,
)
from lightning_fleet.planning.search import divisors

pytestmark = pytest.mark.pure


def shard_groups(dp: int, tp: int, zero: int, devices_per_node: int, *, every: bool = False) -> list:
    """The hybrid shard groups (Plan.dp_shard) of a layout: None (all of dp) and, at zero >= 1, the group the search
    prices (the largest inside a node), or with ``every`` each divisor 2 <= g < dp."""
    groups = [g for g in divisors(dp) if 2 <= g < dp] if zero else []
    if not every:
        groups = [g for g in groups if tp * g <= devices_per_node][-1:]
    return [None, *groups]


def brute_force(model, cluster, cons: Constraints = Constraints(), *, every_group: bool = False, shard_degree: int | None = None):
    """Every valid plan (all placements; the hybrid shard groups the search prices, or with ``every_group`` all of
    them; with ``shard_degree`` only the plans sharding over groups of that size), estimated one by one: the ground
    truth for the search."""
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
            for group in shard_groups(dp, tp, zero, cluster.devices_per_node, every=every_group):
                try:
                    candidate = Plan(dp=dp, tp=tp, pp=pp, zero=zero, mbs=mbs, gas=batch // mbs, recompute=recompute, sp=sp,
                                     vpp=vpp, offload=offload, dp_shard=group)
                except PlanError:
                    continue
                if shard_degree is not None and (not zero or candidate.shard_degree != shard_degree):
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


def test_hybrid_groups_the_search_leaves_out_are_never_faster():
    """A shard group smaller than one node's dp ranks holds more and talks on the same link: the best of every group
    (brute force over each divisor of dp) is the best of the groups the search prices, on a cluster where a hybrid plan
    wins (fast nodes, a slow link between them)."""
    model = make_model(layers=4, hidden=1024, heads=8, seq=512, gbs=32)
    cluster = dataclasses.replace(make_cluster(nodes=2, devices_per_node=4, memory_gib=8),
                                  inter_node=LinkSpec(bandwidth_GBps=1, latency_us=10))
    truth = [e for e in brute_force(model, cluster, every_group=True) if e.fits]
    result = plan(model, cluster, top=3)
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in truth), rel=1e-12)
    data_parallel = [e for e in truth if e.plan.tp == e.plan.pp == 1]  # dp=8: groups of 2 and 4 inside a node
    result = plan(model, cluster, top=3, max_tp=1, max_pp=1)
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in data_parallel), rel=1e-12)
    assert result.best.plan.dp_shard == 4, result.best.plan


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
    assert "GiB memory per device with the closest plan (dp=" in message
    assert "devices have 1.00 GiB" in message
    assert "add devices" in message and "give the cluster a host: section (memory_gib, pcie_GBps) to allow offload" in message


def test_no_layout_divides_is_a_clear_error():
    """Heads, layers and batch that no factorization divides: the error says so."""
    model = make_model(layers=3, hidden=768, heads=3, seq=128, gbs=5)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, make_cluster(nodes=1, devices_per_node=4))
    message = str(err.value)
    assert "no layout dp x tp x pp = 4 is left: " in message
    for part in ("tp must divide num_heads (3)", "pp must be at most num_layers (3)", "dp must divide the global batch size (5)"):
        assert part in message
    assert message.endswith(": change the device count or the global batch size")


def test_misfit_reasons_name_the_term_and_the_shortfall():
    """Rejected families say how much memory they lack and which term is largest."""
    model = make_model(layers=4, hidden=2048, heads=16, seq=2048, gbs=64)
    result = plan(model, make_cluster(nodes=1, devices_per_node=4, memory_gib=16), top=1)
    misfits = [r for r in result.rejected if r.kind is RejectionKind.MEMORY]
    assert misfits, result.rejected
    assert all("short" in r.reason and "largest term" in r.reason for r in misfits)


def test_every_rejection_has_a_kind_in_report_order():
    """Runners-up (slower), then families that do not fit (memory, closest first), then the layout that cannot split the
    batch (dp=8 does not divide 12) come back with their kind, which to_dict carries next to the reason."""
    model = make_model(layers=4, hidden=2048, heads=16, seq=2048, gbs=12)
    result = plan(model, make_cluster(nodes=1, devices_per_node=8, memory_gib=4), top=2, max_rejected=25)
    kinds = [r.kind for r in result.rejected]
    assert set(kinds) == set(RejectionKind) - {RejectionKind.SPARSE}  # no sparse gradients here: tests/test_sparse.py
    assert kinds == sorted(kinds, key=[RejectionKind.SLOWER, RejectionKind.MEMORY, RejectionKind.LAYOUT].index)
    slower = [r for r in result.rejected if r.kind is RejectionKind.SLOWER]
    assert [r.plan for r in slower] == [str(e.plan) for e in result.all_feasible[2 : 2 + len(slower)]]
    memory = [r for r in result.rejected if r.kind is RejectionKind.MEMORY]
    assert len(memory) == len(result.misfit_plans) and all("short" in r.reason for r in memory)
    (layout,) = [r for r in result.rejected if r.kind is RejectionKind.LAYOUT]
    assert layout.plan == "dp=8,tp=1,pp=1" and layout.reason == "dp(8) does not divide the global batch size 12"
    assert layout.to_dict() == {"plan": "dp=8,tp=1,pp=1", "kind": "layout", "reason": layout.reason}
    assert all(r.to_dict()["kind"] == r.kind.value for r in result.rejected)


def test_rejection_kind_is_exported_and_required():
    """RejectionKind is public API; a Rejection cannot be made without one."""
    import lightning_fleet.planning as planning
    from lightning_fleet.planning.search import Rejection

    assert planning.RejectionKind is RejectionKind and "RejectionKind" in planning.__all__
    assert [k.value for k in RejectionKind] == ["layout", "memory", "slower", "sparse"]
    with pytest.raises(TypeError):
        Rejection(plan="dp=1", reason="slower")  # type: ignore[call-arg]


def test_heterogeneous_cluster_plans_on_the_slowest_device():
    """Two device kinds: an even split is planned with the smaller memory and the lower peak (the uneven split the
    planner may choose instead: tests/test_hetero_plan.py)."""
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
    result = plan(make_model(), mixed, top=1, search_dp_mbs=False)
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
        ranked = table.states((0, None), offloads, states)
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


# --- partial plans: fixed axes, the planner chooses the rest -------------------------------------------------------

from functools import lru_cache  # noqa: E402

from lightning_fleet.planning import PartialPlan, narrow, parse_partial_plan  # noqa: E402
from lightning_fleet.planning.plan import DEFAULT_ORDER  # noqa: E402

SMALL = {"offload-2x4": CASES[1].values, "tight-2x2": CASES[0].values}


@lru_cache(maxsize=None)
def every_plan(case: str) -> tuple:
    """brute_force of a case, kept: the fixed-axis tests filter it many ways."""
    model, cluster = SMALL[case]
    return tuple(brute_force(model, cluster))


def admitted(p: Plan, partial: PartialPlan) -> bool:
    """The plan agrees with every fixed field (order too: a plan with no fixed order is counted at the default placement)."""
    fixed = partial.fixed
    order = fixed.pop("order", DEFAULT_ORDER)
    return p.order == order and all(getattr(p, name) == value for name, value in fixed.items())


def check_against_brute_force(case: str, partial: PartialPlan) -> None:
    """Only plans with the fixed values are candidates; counts, the best time and every returned plan match brute force."""
    model, cluster = SMALL[case]
    candidates = [e for e in every_plan(case) if admitted(e.plan, partial)]  # at the fixed placement, else the default
    result = plan(model, cluster, top=3, exhaustive=True, constraints=narrow(Constraints(), partial))
    assert result.candidates == len(candidates) > 0
    assert result.feasible == sum(e.fits for e in candidates)
    # without a fixed order the search may also place the best plans otherwise: compare with every placement
    placed = candidates
    if partial.order is None:
        placed = [e for e in every_plan(case) if admitted(e.plan.replace(order=DEFAULT_ORDER), partial)]
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in placed if e.fits), rel=1e-12)
    for e in result.all_feasible:
        assert admitted(e.plan.replace(order=partial.order or DEFAULT_ORDER), partial), e.plan
        assert estimate(model, cluster, e.plan).fits


FIXED_ALONE = ["dp=2", "tp=2", "pp=2", "zero=1", "zero=3", "mbs=2", "gas=4", "recompute=selective", "sp=true", "sp=false",
               "vpp=2", "offload=optimizer", "offload=none", "order=dp-tp-pp", "order=pp-dp-tp"]


@pytest.mark.parametrize("text", FIXED_ALONE)
def test_each_fixed_axis_alone_matches_brute_force(text):
    """One fixed axis: the search counts, prices and returns only plans with that value, as an enumeration does."""
    check_against_brute_force("offload-2x4", parse_partial_plan(text))


FIXED_TOGETHER = ["dp=2,zero=1", "tp=2,sp=true,recompute=full", "pp=2,vpp=2,zero=1,mbs=2", "zero=3,offload=optimizer+params,gas=2",
                  "dp=4,tp=2,order=dp-tp-pp", "mbs=1,recompute=none,offload=none", "tp=1,pp=4,vpp=2"]


@pytest.mark.parametrize("text", FIXED_TOGETHER)
def test_fixed_axes_together_match_brute_force(text):
    """Several fixed axes at once on two small cases (one tight on memory)."""
    for case in SMALL:
        model, cluster = SMALL[case]
        partial = parse_partial_plan(text)
        if not any(admitted(e.plan, partial) for e in every_plan(case)):
            with pytest.raises(NoFeasiblePlanError):
                plan(model, cluster, constraints=narrow(Constraints(), partial))
            continue
        try:
            check_against_brute_force(case, partial)
        except NoFeasiblePlanError:
            assert not any(e.fits for e in every_plan(case) if admitted(e.plan.replace(order=DEFAULT_ORDER), partial))


def test_a_fixed_shard_group_is_every_plans_group():
    """dp_shard=2 fixed: every plan shards at zero >= 1 over groups of 2 (dp=2 itself being one such group), and the best
    is the best of an enumeration of every group, filtered to those."""
    model, cluster = SMALL["offload-2x4"]
    result = plan(model, cluster, top=3, exhaustive=True, constraints=narrow(Constraints(), parse_partial_plan("dp_shard=2")))
    assert all(e.plan.shard_degree == 2 and e.plan.zero >= 1 for e in result.all_feasible)
    assert {e.plan.dp for e in result.all_feasible} == {2, 4, 8}
    truth = [e for e in brute_force(model, cluster, every_group=True, shard_degree=2) if e.fits]
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in truth), rel=1e-12)
    with pytest.raises(PlanError, match="dp_shard=2 is not allowed here .allowed: none, as zero is 0 here and hybrid"):
        narrow(Constraints(zero_stages=(0,)), parse_partial_plan("dp_shard=2"))
    with pytest.raises(PlanError, match="as this runtime runs no hybrid sharding"):
        narrow(Constraints(hybrid_zero_stages=()), parse_partial_plan("dp=4,dp_shard=2"))


def test_a_fully_fixed_string_gives_exactly_that_plan():
    """Every axis fixed: one candidate, and it is the plan to_plan() builds without a search."""
    model, cluster = SMALL["offload-2x4"]
    partial = parse_partial_plan("dp=2,tp=2,pp=2,zero=1,mbs=2,recompute=full,sp=true,vpp=2,offload=optimizer")
    assert partial.complete
    forced = partial.to_plan(model.global_batch_size)
    result = plan(model, cluster, constraints=narrow(Constraints(), partial))
    assert result.candidates == 1 and result.best.plan == forced and len(result.plans) == 1
    alone = estimate(model, cluster, forced)
    assert (result.best.memory, result.best.time) == (alone.memory, alone.time)


def test_fixed_micro_batch_size_is_kept_when_a_larger_one_is_faster():
    """mbs fixed (micro_batch_size=N in the strategy) holds even where the free search picks another size."""
    model, cluster = SMALL["offload-2x4"]
    free = plan(model, cluster, top=1).best.plan.mbs
    pinned = 1 if free != 1 else 2
    result = plan(model, cluster, top=5, constraints=narrow(Constraints(), PartialPlan(mbs=pinned)))
    assert {e.plan.mbs for e in result.plans} == {pinned}


NARROW_ERRORS = [
    ("zero=3", dict(zero_stages=(0, 1)), "zero=3 is not allowed here (allowed: zero 0, 1)"),
    ("pp=2,zero=2", dict(max_zero_with_pp=1), "zero=2 is not allowed here (allowed: zero 0, 1 with pp > 1)"),
    ("tp=2", dict(max_tp=1), "tp=2 is not allowed here (allowed: tp <= 1)"),
    ("pp=4", dict(max_pp=2), "pp=4 is not allowed here (allowed: pp <= 2)"),
    ("vpp=2", dict(max_vpp=1), "vpp=2 is not allowed here (allowed: vpp <= 1)"),
    ("vpp=2", dict(max_pp=1), "vpp=2 is not allowed here (allowed: vpp=1, as pp <= 1 here"),
    ("tp=2,pp=2", dict(tp_with_pp=False), "tp=2 is not allowed here (allowed: tp=1 when pp > 1)"),
    ("recompute=selective", dict(recompute=("none", "full")),
     "recompute=selective is not allowed here (allowed: recompute none, full)"),
    ("zero=1,offload=optimizer", dict(allow_offload=False), "offload=optimizer is not allowed here (allowed: offload none)"),
    ("offload=none", dict(require_offload=True),
     "offload=none is not allowed here (allowed: offload optimizer, optimizer+params)"),
    ("pp=2,offload=optimizer", dict(offload_with_pp=False), "offload=optimizer is not allowed here (allowed: offload none)"),
    ("offload=optimizer+params", dict(zero_stages=(0, 1, 2)),
     "offload=optimizer+params is not allowed here (allowed: offload none, as zero is 0, 1, 2"),
    ("sp=true", dict(allow_sp=False), "sp=true is not allowed here (allowed: sp=false)"),
    ("sp=true", dict(max_tp=1), "sp=true is not allowed here (allowed: sp=false, as tp <= 1 here"),
    ("order=dp-tp-pp", dict(search_placement=False),
     "order=dp-tp-pp is not allowed here (allowed: the default placement tp-dp-pp only)"),
    ("mbs=4", dict(mbs=(1, 2)), "mbs=4 is not allowed here (allowed: mbs 1, 2)"),
    ("dp=4", dict(dp=2), "dp=4 is not allowed here (allowed: dp=2)"),
]


@pytest.mark.parametrize("text,base,message", NARROW_ERRORS)
def test_a_fixed_value_outside_the_runtime_is_one_line(text, base, message):
    """Narrowing a runtime's constraints to a value it does not run names the key, the value and what is allowed."""
    with pytest.raises(PlanError) as err:
        narrow(Constraints(**base), parse_partial_plan(text))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"plan {text!r}: ")


def test_narrowing_keeps_the_runtime_limits():
    """Fixed axes are added to what the base allows; nothing the base forbids comes back."""
    base = Constraints(max_tp=1, max_pp=1, recompute=("none", "full"), allow_sp=False, search_placement=False,
                       allow_offload=False)
    narrowed = narrow(base, parse_partial_plan("dp=2,zero=1,mbs=4"))
    assert (narrowed.dp, narrowed.zero_stages, narrowed.mbs) == (2, (1,), (4,))
    kept = (narrowed.max_tp, narrowed.max_pp, narrowed.allow_sp, narrowed.allow_offload, narrowed.search_placement)
    assert kept == (1, 1, False, False, False)
    assert narrowed.recompute == (Recompute.NONE, Recompute.FULL)
    assert narrow(base, parse_partial_plan("")) == base


# --- truthful "nothing fits" --------------------------------------------------------------------------------------


def test_require_offload_without_a_host_section_says_so():
    """require_offload on a cluster without host memory blames the missing host: section, not divisibility."""
    model = make_model(layers=4, hidden=512, heads=4, seq=512, gbs=12)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, make_cluster(nodes=1, devices_per_node=4, host=False), require_offload=True)
    message = str(err.value)
    assert "require_offload needs host memory" in message and "no host: section" in message
    assert "(memory_gib, pcie_GBps)" in message and "drop require_offload" in message
    assert "divide" not in message and "\n" not in message
    with pytest.raises(NoFeasiblePlanError, match="offload=optimizer needs host memory.*leave offload to the planner"):
        cons = narrow(Constraints(), PartialPlan(offload="optimizer"))
        plan(model, make_cluster(nodes=1, devices_per_node=4, host=False), constraints=cons)


def test_require_offload_with_only_zero_0_says_so():
    model = make_model(layers=4, hidden=512, heads=4, seq=512, gbs=12)
    with pytest.raises(NoFeasiblePlanError, match="require_offload needs ZeRO stage 1, 2 or 3.*zero_stages is 0"):
        plan(model, make_cluster(nodes=1, devices_per_node=4), require_offload=True, zero_stages=(0,))


@pytest.mark.parametrize("kind", ["no-host", "small-host", "roomy-host"])
def test_nothing_fits_reports_the_plan_closest_to_fitting(kind):
    """The plan named is the one missing the fewest bytes (device or host, whichever is worse) of an exhaustive
    enumeration, with its own need; the remedies fit the case (host memory only when the host is short)."""
    import dataclasses

    from lightning_fleet.planning import HostSpec

    model = make_model(layers=4, hidden=4096, heads=32, seq=2048, gbs=8)
    cluster = make_cluster(nodes=1, devices_per_node=2, memory_gib=1, host=kind != "no-host")
    if kind == "small-host":
        cluster = dataclasses.replace(cluster, host=HostSpec(memory_gib=2, pcie_GBps=25))
    every = brute_force(model, cluster)
    assert not any(e.fits for e in every)
    closest = min(e.memory.shortfall_bytes() for e in every)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, cluster)
    message = str(err.value)
    named = message.split("with the closest plan (")[1].split(")")[0]
    e = estimate(model, cluster, parse_plan(named))
    assert e.memory.shortfall_bytes() == closest
    device_short = e.memory.total_bytes > e.memory.limit_bytes
    assert (f"needs {e.memory.total_bytes / 1024**3:.2f} GiB memory per device" in message) == device_short
    host_short = e.memory.host_bytes > e.memory.host_limit_bytes
    assert (f"{e.memory.host_bytes / 1024**3:.2f} GiB host memory per device" in message) == host_short
    assert ("add nodes or host memory" in message) == host_short
    assert ("give the cluster a host: section" in message) == (kind == "no-host")


NO_CANDIDATE = [
    (dict(tp=3), "tp(3) does not divide world size 4"),
    (dict(tp=2, pp=4), "tp(2) * pp(4) = 8 does not divide world size 4"),
    (dict(dp=2, tp=1, pp=1), "dp(2) * tp(1) * pp(1) = 2 != world size 4"),
    (dict(mbs=(5,)), "mbs 5 does not split the global batch size (12) / dp into mbs * gas"),
    (dict(gas=5), "gas 5 does not split the global batch size (12) / dp"),
    (dict(sp=True, allow_sp=False), "sp=true needs tp > 1 and allow_sp"),
    (dict(vpp=3), "vpp=3 needs pp > 1 with pp * vpp dividing num_layers (4)"),
    (dict(pp=2, zero_stages=(2, 3), max_zero_with_pp=1), "zero 2, 3 cannot run with pp > 1 here (at most zero=1)"),
    (dict(pp=2, require_offload=True, offload_with_pp=False), "offload optimizer, optimizer+params cannot run with pp > 1 here"),
    (dict(offloads=("optimizer+params",), zero_stages=(1, 2)), "offload optimizer+params needs zero 3, but zero is 1, 2 here"),
]


@pytest.mark.parametrize("fields,message", NO_CANDIDATE)
def test_no_candidate_names_what_excluded_them(fields, message):
    """When constraints leave no candidate at all, the error names the rule that did (not divisibility, unless it was)."""
    model = make_model(layers=4, hidden=512, heads=4, seq=512, gbs=12)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, make_cluster(nodes=1, devices_per_node=4), **fields)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"no plan for {model.name!r} on 4 devices: ")


def test_limits_that_leave_no_layout_are_named_with_the_divisibility():
    """Heads 4, batch 6, 8 devices, max_tp=1, max_pp=1: dp=8 does not divide 6 and the limits rule out the rest."""
    model = make_model(layers=4, hidden=512, heads=4, seq=512, gbs=6)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, make_cluster(nodes=1, devices_per_node=8), max_tp=1, max_pp=1)
    message = str(err.value)
    assert "no layout dp x tp x pp = 8 is left" in message
    assert "dp must divide the global batch size (6)" in message and "tp is limited to max_tp=1" in message
    assert message.endswith("change those fixed values or limits, the device count or the global batch size")


def test_misfit_reasons_name_the_host_too_when_both_are_short():
    """A family short on the device and on the host says both (it used to name the device only)."""
    from lightning_fleet.planning.search import explain_misfit

    model = make_model(layers=4, hidden=4096, heads=32, seq=2048, gbs=8)
    small_host = dataclasses.replace(make_cluster(nodes=1, devices_per_node=2, memory_gib=1), host=HostSpec(memory_gib=2, pcie_GBps=25))
    both = estimate(model, small_host, parse_plan("dp=2,zero=1,offload=optimizer", global_batch_size=8)).memory
    assert both.total_bytes > both.limit_bytes and both.host_bytes > both.host_limit_bytes
    reason = explain_misfit(both)
    assert reason.startswith("needs ") and "largest term" in reason and "; host memory: needs " in reason
    host_only = dataclasses.replace(both, params_bytes=0.0, grads_bytes=0.0, optimizer_bytes=0.0, activations_bytes=0.0, other_bytes=0.0)
    assert explain_misfit(host_only).startswith("host memory: needs ")


def test_remedies_are_those_that_apply():
    """Each remedy appears exactly when its constraint is what stands in the way (and never for the defaults)."""
    model = make_model(layers=4, hidden=4096, heads=32, seq=2048, gbs=8)
    roomy_host = make_cluster(nodes=1, devices_per_node=2, memory_gib=1)
    narrow = dict(recompute=("none",), max_tp=1, mbs=(4,), dp=2, allow_offload=False, zero_stages=(0, 1))
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, roomy_host, **narrow)
    message = str(err.value)
    for remedy in ("add devices or use devices with more memory", "allow offload", "allow zero=3", "allow recompute=full",
                   "allow a smaller micro-batch size (mbs 4)", "allow larger tp / pp (max_tp=1)", "leave dp=2 to the planner"):
        assert remedy in message, remedy
    assert "host: section" not in message and "add nodes or host memory" not in message
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(model, roomy_host)  # nothing narrowed: only more or larger devices can help
    assert str(err.value).endswith(": add devices or use devices with more memory")


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(require_offload=True, offloads=("none",)), "constraints leave no ZeRO stage, recompute mode or offload mode"),
        (dict(allow_offload=False, offloads=("optimizer",)), "constraints leave no ZeRO stage, recompute mode or offload mode"),
        (dict(offloads=("disk",)), "constraint offloads: 'disk' is not one of none, optimizer, optimizer+params"),
        (dict(tp=0), "constraint tp must be an integer >= 1, got 0"),
        (dict(mbs=(0, 2)), "constraint mbs must be positive integers, got (0, 2)"),
        (dict(order="dp-dp-pp"), "order must name dp, tp and pp once each"),
        (dict(sp="yes"), "constraint sp must be True, False or None, got 'yes'"),
    ],
)
def test_contradictory_or_malformed_constraints_are_one_line(fields, message):
    with pytest.raises(PlanError) as err:
        Constraints(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_constraints_normalise_their_sets():
    """Sets are sorted lightest first (the search relies on it); the default placement is the module's own tuple."""
    cons = Constraints(offloads=("optimizer+params", "none"), mbs=(4, 1, 4), order="tp-dp-pp")
    assert cons.offloads == (Offload.NONE, Offload.OPTIMIZER_PARAMS) and cons.mbs == (1, 4) and cons.order is DEFAULT_ORDER
