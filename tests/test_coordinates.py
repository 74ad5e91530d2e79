"""Where each rank sits in a plan's mesh: Plan.stride, Plan.coordinates and Plan.rank_at (lightning_fleet/planning/plan.py).

The one definition the cost model (comm.axis_level), the sampler and the runtime's pipeline topology derive from.
The first part is pure (no torch, no deepspeed); the last test builds DeepSpeed's ProcessTopology from a plan the way
the runtime does and checks that it puts every rank where the plan says.
"""

from __future__ import annotations

import itertools

import pytest

from lightning_fleet.planning import Axis, Coordinates, Plan, PlanError
from lightning_fleet.planning.cluster import LinkLevel
from lightning_fleet.planning.comm import axis_level

pytestmark = pytest.mark.pure

ORDERS = [tuple(order) for order in itertools.permutations(("tp", "dp", "pp"))]
"""All six placements, innermost axis first."""

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 3, 1), (2, 2, 2), (3, 2, 2), (2, 3, 4), (4, 1, 3), (5, 2, 1)]
"""(dp, tp, pp) shapes for the round trips; sizes differ so that a swapped axis shows."""


def _plan(dp: int, tp: int, pp: int, order: tuple[str, ...]) -> Plan:
    return Plan(dp=dp, tp=tp, pp=pp, order=order)  # type: ignore[arg-type]


# --- hand-computed: dp=2, tp=3, pp=2 (12 ranks) in each of the six orders ----------------------------------------------


@pytest.mark.parametrize(
    ("order", "strides", "ranks"),
    [
        # rank = tp + 3 dp + 6 pp: 5 = 3*1 + 2, 10 = 6 + 3*1 + 1
        (("tp", "dp", "pp"), {"tp": 1, "dp": 3, "pp": 6}, {1: (0, 1, 0), 5: (1, 2, 0), 10: (1, 1, 1)}),
        # rank = tp + 3 pp + 6 dp: 5 = 3*1 + 2, 10 = 6 + 3*1 + 1
        (("tp", "pp", "dp"), {"tp": 1, "pp": 3, "dp": 6}, {1: (0, 1, 0), 5: (0, 2, 1), 10: (1, 1, 1)}),
        # rank = dp + 2 tp + 6 pp: 5 = 2*2 + 1, 10 = 6 + 2*2 + 0
        (("dp", "tp", "pp"), {"dp": 1, "tp": 2, "pp": 6}, {1: (1, 0, 0), 5: (1, 2, 0), 10: (0, 2, 1)}),
        # rank = dp + 2 pp + 4 tp: 5 = 4*1 + 1, 10 = 4*2 + 2*1 + 0
        (("dp", "pp", "tp"), {"dp": 1, "pp": 2, "tp": 4}, {1: (1, 0, 0), 5: (1, 1, 0), 10: (0, 2, 1)}),
        # rank = pp + 2 tp + 6 dp: 5 = 2*2 + 1, 10 = 6 + 2*2 + 0
        (("pp", "tp", "dp"), {"pp": 1, "tp": 2, "dp": 6}, {1: (0, 0, 1), 5: (0, 2, 1), 10: (1, 2, 0)}),
        # rank = pp + 2 dp + 4 tp: 5 = 4*1 + 1, 10 = 4*2 + 2*1 + 0
        (("pp", "dp", "tp"), {"pp": 1, "dp": 2, "tp": 4}, {1: (0, 0, 1), 5: (0, 1, 1), 10: (1, 2, 0)}),
    ],
)
def test_coordinates_by_hand(order: tuple[str, ...], strides: dict[str, int], ranks: dict[int, tuple[int, int, int]]) -> None:
    """The first axis of ``order`` varies fastest: stride 1, the next the first's degree, the last the product of both.
    Expected coordinates are (dp, tp, pp)."""
    plan = _plan(2, 3, 2, order)
    assert {axis: plan.stride(Axis(axis)) for axis in strides} == strides
    assert plan.coordinates(0) == Coordinates(dp=0, tp=0, pp=0)
    assert plan.coordinates(11) == Coordinates(dp=1, tp=2, pp=1)
    for rank, (dp, tp, pp) in ranks.items():
        assert plan.coordinates(rank) == Coordinates(dp=dp, tp=tp, pp=pp), rank
        assert plan.rank_at(Coordinates(dp=dp, tp=tp, pp=pp)) == rank


def test_default_order_puts_tensor_parallel_ranks_next_to_each_other() -> None:
    """tp-dp-pp (the default) on dp=2, tp=2: ranks 0, 1, 2, 3 are (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1), so the
    data-parallel replica of a rank is rank // tp % dp."""
    plan = Plan(dp=2, tp=2)
    assert [(c.dp, c.tp, c.pp) for c in map(plan.coordinates, range(4))] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    wide = Plan(dp=3, tp=2, pp=2)
    assert [wide.coordinates(r).dp for r in range(12)] == [r // 2 % 3 for r in range(12)]


# --- properties over shapes and orders -----------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_covers_the_mesh_once(shape: tuple[int, int, int], order: tuple[str, ...]) -> None:
    """rank -> coordinates -> rank is the identity for every rank, and the coordinates are every cell of the mesh once."""
    plan = _plan(*shape, order)
    cells = [plan.coordinates(rank) for rank in range(plan.world_size)]
    assert [plan.rank_at(c) for c in cells] == list(range(plan.world_size))
    dp, tp, pp = shape
    assert sorted((c.dp, c.tp, c.pp) for c in cells) == list(itertools.product(range(dp), range(tp), range(pp)))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_step_along_an_axis_moves_the_rank_by_its_stride(shape: tuple[int, int, int], order: tuple[str, ...]) -> None:
    """Neighbours on an axis are stride(axis) ranks apart; strides of the axes in order multiply up the degrees."""
    plan = _plan(*shape, order)
    expected = 1
    for axis in plan.order:
        assert plan.stride(axis) == expected
        expected *= getattr(plan, axis.value)
    assert expected == plan.world_size
    for rank in range(plan.world_size):
        here = plan.coordinates(rank)
        for axis in Axis:
            index = getattr(here, axis.value)
            if index + 1 < getattr(plan, axis.value):
                step = Coordinates(**{**{a.value: getattr(here, a.value) for a in Axis}, axis.value: index + 1})
                assert plan.rank_at(step) == rank + plan.stride(axis)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 4, 2), (4, 2, 1), (2, 2, 4), (8, 1, 2), (1, 8, 1), (2, 2, 2)])
@pytest.mark.parametrize("devices_per_node", [1, 2, 4, 8])
def test_axis_level_agrees_with_where_the_groups_fall(
    dp: int, tp: int, pp: int, order: tuple[str, ...], devices_per_node: int
) -> None:
    """The cost model's link level is where the coordinates put each group: with power-of-two degrees and nodes, an axis
    (of degree > 1) is intra-node exactly when every group of ranks that differ only on it lies inside one node."""
    plan = _plan(dp, tp, pp, order)
    for axis in Axis:
        if getattr(plan, axis.value) == 1:
            continue
        groups: dict[tuple[int, ...], set[int]] = {}
        for rank in range(plan.world_size):
            c = plan.coordinates(rank)
            others = tuple(getattr(c, a.value) for a in Axis if a is not axis)
            groups.setdefault(others, set()).add(rank // devices_per_node)
        inside = all(len(nodes) == 1 for nodes in groups.values())
        assert (axis_level(plan, axis, devices_per_node) is LinkLevel.INTRA) == inside, axis


# --- errors --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.0, "0", None])
def test_a_rank_outside_the_plan_is_a_clear_error(rank: object) -> None:
    """A rank that is not an int in 0..world_size-1 names the plan, the rank and the world size."""
    plan = Plan(dp=2, tp=2, pp=2)
    with pytest.raises(PlanError) as err:
        plan.coordinates(rank)  # type: ignore[arg-type]
    assert f"rank {rank!r} is not one of its ranks 0..7 (dp(2) * tp(2) * pp(2) = 8)" in str(err.value)
    assert "\n" not in str(err.value)


def test_coordinates_outside_the_mesh_are_a_clear_error() -> None:
    """rank_at refuses an index beyond its axis' degree; Coordinates refuses negative or non-integer indices."""
    plan = Plan(dp=2, tp=4)
    with pytest.raises(PlanError, match=r"pp index 1 is outside 0\.\.0"):
        plan.rank_at(Coordinates(dp=0, tp=0, pp=1))
    with pytest.raises(PlanError, match=r"tp index 4 is outside 0\.\.3"):
        plan.rank_at(Coordinates(dp=1, tp=4, pp=0))
    for bad in (-1, 1.5, True, None):
        with pytest.raises(PlanError, match="coordinates: dp must be a non-negative integer index"):
            Coordinates(dp=bad, tp=0, pp=0)  # type: ignore[arg-type]


def test_stride_of_an_unknown_axis_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="'ep' is not an axis"):
        Plan(dp=2).stride("ep")  # type: ignore[arg-type]


# --- DeepSpeed's pipeline topology, built from the plan as the runtime builds it -----------------------------------------

DEEPSPEED_AXIS = {Axis.PP: "pipe", Axis.DP: "data", Axis.TP: "model"}
"""DeepSpeed's names of our axes (deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology)."""


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 1, 2), (2, 2, 1), (3, 2, 2)])
def test_deepspeed_topology_from_the_plan_puts_every_rank_where_the_plan_does(
    dp: int, tp: int, pp: int, order: tuple[str, ...]
) -> None:
    """ProcessTopology(axes, dims) is row-major over ``axes`` (the last axis varies fastest), so the plan's order,
    innermost first, reversed and renamed (pp -> pipe, dp -> data, tp -> model) gives the same rank -> coordinates map
    both ways."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    plan = _plan(dp, tp, pp, order)
    outermost_first = list(reversed(plan.order))
    axes, dims = [DEEPSPEED_AXIS[a] for a in outermost_first], [getattr(plan, a.value) for a in outermost_first]
    topology = ProcessTopology(axes=axes, dims=dims)
    assert topology.world_size() == plan.world_size
    for rank in range(plan.world_size):
        theirs = topology.get_coord(rank)
        ours = plan.coordinates(rank)
        assert (theirs.data, theirs.model, theirs.pipe) == (ours.dp, ours.tp, ours.pp), rank
        assert topology.get_rank(data=ours.dp, model=ours.tp, pipe=ours.pp) == plan.rank_at(ours) == rank
