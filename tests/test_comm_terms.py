"""Tier-1 tests of the alpha-beta collective costs and mesh-axis placement (lightning_fleet/planning/comm.py).

Every expected value is written out by hand: a literal or a visible arithmetic expression with the source formula named.
"""

from __future__ import annotations

import pytest

from lightning_fleet.planning.cluster import LinkLevel, LinkSpec
from lightning_fleet.planning.comm import allgather_s, allreduce_s, axis_level, p2p_s, reduce_scatter_s
from lightning_fleet.planning.plan import Axis, Plan

pytestmark = pytest.mark.pure

REL = 1e-9
LINK = LinkSpec(bandwidth_GBps=100, latency_us=5)  # alpha = 5e-6 s, beta = 1 / 100e9 s/B
GB = 1e9


def test_link_spec_alpha_beta() -> None:
    """Alpha-beta model: alpha = latency_us * 1e-6 s, beta = 1 / (bandwidth_GBps * 1e9) s/B."""
    assert LINK.alpha_s == pytest.approx(5e-6, rel=REL)
    assert LINK.beta_s_per_byte == pytest.approx(1e-11, rel=REL)


@pytest.mark.parametrize("fn", [allreduce_s, allgather_s, reduce_scatter_s])
def test_group_of_one_costs_nothing(fn) -> None:
    """Thakur 2005 ring collectives: a group of n=1 moves nothing, costs 0 s."""
    assert fn(GB, 1, LINK) == 0.0


@pytest.mark.parametrize(
    ("n", "nbytes", "expected"),
    [
        (8, GB, 2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / 100e9),  # 7e-5 + 0.0175 = 0.01757
        (2, GB, 2 * 1 * 5e-6 + 2 * 1 / 2 * 1e9 / 100e9),  # 1e-5 + 0.01 = 0.01001
        (4, 2e6, 2 * 3 * 5e-6 + 2 * 3 / 4 * 2e6 / 100e9),  # 3e-5 + 3e-5 = 6e-5
        (8, 0.0, 2 * 7 * 5e-6),  # latency only
    ],
)
def test_allreduce_s(n: int, nbytes: float, expected: float) -> None:
    """Ring all-reduce (Thakur 2005): 2(n-1) alpha + 2(n-1)/n * bytes * beta."""
    assert allreduce_s(nbytes, n, LINK) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("n", "nbytes", "expected"),
    [
        (8, GB, 7 * 5e-6 + 7 / 8 * 1e9 / 100e9),  # 3.5e-5 + 0.00875 = 0.008785
        (2, GB, 1 * 5e-6 + 1 / 2 * 1e9 / 100e9),  # 5e-6 + 0.005
        (4, 4e6, 3 * 5e-6 + 3 / 4 * 4e6 / 100e9),  # 1.5e-5 + 3e-5 = 4.5e-5
    ],
)
def test_allgather_s(n: int, nbytes: float, expected: float) -> None:
    """Ring all-gather of the full tensor (Thakur 2005): (n-1) alpha + (n-1)/n * bytes * beta."""
    assert allgather_s(nbytes, n, LINK) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("n", "nbytes", "expected"),
    [
        (8, GB, 7 * 5e-6 + 7 / 8 * 1e9 / 100e9),  # 0.008785, same as the all-gather
        (16, 8e9, 15 * 5e-6 + 15 / 16 * 8e9 / 100e9),  # 7.5e-5 + 0.075
    ],
)
def test_reduce_scatter_s(n: int, nbytes: float, expected: float) -> None:
    """Ring reduce-scatter (Thakur 2005): (n-1) alpha + (n-1)/n * bytes * beta, the all-gather's cost."""
    assert reduce_scatter_s(nbytes, n, LINK) == pytest.approx(expected, rel=REL)


def test_allreduce_is_reduce_scatter_plus_allgather() -> None:
    """Rabenseifner / ring all-reduce = reduce-scatter + all-gather (Thakur 2005)."""
    # 0.008785 + 0.008785 = 0.01757
    assert allreduce_s(GB, 8, LINK) == pytest.approx(0.008785 + 0.008785, rel=REL)


@pytest.mark.parametrize(
    ("nbytes", "link", "expected"),
    [
        (GB, LINK, 5e-6 + 1e9 / 100e9),  # 0.010005
        (0.0, LINK, 5e-6),  # latency only
        (2e6, LinkSpec(bandwidth_GBps=25, latency_us=10), 10e-6 + 2e6 / 25e9),  # 1e-5 + 8e-5 = 9e-5
        (1e6, LinkSpec(bandwidth_GBps=50, latency_us=0), 1e6 / 50e9),  # bandwidth only: 2e-5
    ],
)
def test_p2p_s(nbytes: float, link: LinkSpec, expected: float) -> None:
    """Point-to-point message (alpha-beta): alpha + bytes * beta."""
    assert p2p_s(nbytes, link) == pytest.approx(expected, rel=REL)


# --- axis_level (strides: Plan.stride, tests/test_coordinates.py) -------------------------------


@pytest.mark.parametrize(
    ("plan", "devices_per_node", "levels"),
    [
        # tp=8 innermost on 8-device nodes: span 1*8 = 8 -> intra; dp span 8*2 = 16 -> inter; pp span 16*4 = 64 -> inter
        (Plan(dp=2, tp=8, pp=4), 8, {Axis.TP: LinkLevel.INTRA, Axis.DP: LinkLevel.INTER, Axis.PP: LinkLevel.INTER}),
        # tp=4, dp=2: dp span 4*2 = 8 fits one 8-device node; pp span 8*2 = 16 does not
        (Plan(dp=2, tp=4, pp=2), 8, {Axis.TP: LinkLevel.INTRA, Axis.DP: LinkLevel.INTRA, Axis.PP: LinkLevel.INTER}),
        # dp innermost: dp span 2 intra; tp span 2*8 = 16 > 8 -> inter
        (Plan(dp=2, tp=8, pp=1, order=("dp", "tp", "pp")), 8, {Axis.DP: LinkLevel.INTRA, Axis.TP: LinkLevel.INTER}),
        # same plan on 16-device nodes: everything fits in one node
        (Plan(dp=2, tp=8, pp=1, order=("dp", "tp", "pp")), 16, {Axis.DP: LinkLevel.INTRA, Axis.TP: LinkLevel.INTRA}),
        # tp=8 on 4-device nodes spans two nodes even innermost
        (Plan(dp=1, tp=8), 4, {Axis.TP: LinkLevel.INTER}),
        # a degree-1 axis outside tp=8: span 8*1 = 8 -> intra on 8-device nodes
        (Plan(dp=1, tp=8, pp=2), 8, {Axis.DP: LinkLevel.INTRA, Axis.PP: LinkLevel.INTER}),
        # pp innermost, pp=2 tp=4: pp span 2 intra, tp span 2*4 = 8 intra, dp span 8*2 = 16 inter
        (
            Plan(dp=2, tp=4, pp=2, order=("pp", "tp", "dp")),
            8,
            {Axis.PP: LinkLevel.INTRA, Axis.TP: LinkLevel.INTRA, Axis.DP: LinkLevel.INTER},
        ),
    ],
)
def test_axis_level(plan: Plan, devices_per_node: int, levels: dict[Axis, LinkLevel]) -> None:
    """An axis runs intra-node when stride * degree <= devices_per_node (its group's consecutive ranks fit one node)."""
    for axis, level in levels.items():
        assert axis_level(plan, axis, devices_per_node) is level, axis
