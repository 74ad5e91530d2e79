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


# A link with its own all-gather and reduce-scatter fits (what `fleet calibrate` writes on gloo, where a reduce-scatter
# takes ~1.7x an all-reduce of the same tensor): alpha 5 us / beta 1e-11 for the all-reduce, all-gather 50 GB/s + 8 us,
# reduce-scatter 20 GB/s + 40 us.
FITTED = LinkSpec(bandwidth_GBps=100, latency_us=5, allgather_GBps=50, allgather_latency_us=8,
                  reduce_scatter_GBps=20, reduce_scatter_latency_us=40)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (allreduce_s, 2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / 100e9),  # the link's own: 0.01757, unchanged by the other fits
        (allgather_s, 7 * 8e-6 + 7 / 8 * 1e9 / 50e9),  # 5.6e-5 + 0.0175 = 0.017556
        (reduce_scatter_s, 7 * 40e-6 + 7 / 8 * 1e9 / 20e9),  # 2.8e-4 + 0.04375 = 0.04403
    ],
)
def test_a_link_prices_each_collective_at_its_own_fit(fn, expected: float) -> None:
    """The ring formula of each collective (Thakur 2005) keeps its shape, at that collective's fitted alpha and beta."""
    assert fn(GB, 8, FITTED) == pytest.approx(expected, rel=REL)


def test_fits_left_out_are_exactly_the_ring_model() -> None:
    """None (the default) prices the all-gather and reduce-scatter from the link's bandwidth and latency, bit for bit as
    before the fits existed: (n-1) alpha + (n-1)/n * bytes * beta with alpha 5e-6, beta 1e-11."""
    for n, nbytes in ((8, GB), (2, 3e6), (64, 7.5e8)):
        ring = (n - 1) * 5e-6 + (n - 1) / n * nbytes * (1.0 / (100 * 1e9))
        assert allgather_s(nbytes, n, LINK) == ring
        assert reduce_scatter_s(nbytes, n, LINK) == ring


def test_a_bandwidth_fit_alone_keeps_the_links_latency() -> None:
    """reduce_scatter_GBps without its latency: (n-1) * the link's 5 us + (n-1)/n * bytes / 20 GB/s."""
    link = LinkSpec(bandwidth_GBps=100, latency_us=5, reduce_scatter_GBps=20)
    assert reduce_scatter_s(GB, 4, link) == pytest.approx(3 * 5e-6 + 3 / 4 * 1e9 / 20e9, rel=REL)  # 1.5e-5 + 0.0375
    assert allgather_s(GB, 4, link) == pytest.approx(3 * 5e-6 + 3 / 4 * 1e9 / 100e9, rel=REL)  # the ring model's


def test_fastest_with_takes_each_collectives_faster_fit() -> None:
    """The lower bound over placements (estimate.Hardware.with_fastest_links) is at least as fast as either link for every
    collective: a fit stated on one link is compared with the other's ring numbers."""
    slow = LinkSpec(bandwidth_GBps=25, latency_us=10, reduce_scatter_GBps=5, reduce_scatter_latency_us=50)
    best = FITTED.fastest_with(slow)
    assert best == LinkSpec(bandwidth_GBps=100, latency_us=5, allgather_GBps=50, allgather_latency_us=8,
                            reduce_scatter_GBps=20, reduce_scatter_latency_us=40)
    # all-gather: FITTED's 50 GB/s + 8 us beat slow's ring 25 GB/s + 10 us; a link without fits keeps its ring numbers
    assert LinkSpec(bandwidth_GBps=100, latency_us=5).fastest_with(slow).reduce_scatter_GBps == 100  # 100 > 5
    assert LINK.fastest_with(LinkSpec(bandwidth_GBps=25, latency_us=10)) == LINK  # no fits: none appear
    for fn in (allreduce_s, allgather_s, reduce_scatter_s):
        assert fn(GB, 8, best) <= min(fn(GB, 8, FITTED), fn(GB, 8, slow))


def test_link_yaml_round_trip_writes_only_the_fits_stated() -> None:
    """A link's mapping leaves fits that are None out (existing cluster files dump byte for byte as before) and reads back
    equal."""
    from lightning_fleet.planning.yamlspec import from_mapping

    assert LINK.to_dict() == {"bandwidth_GBps": 100, "latency_us": 5}
    partial = LinkSpec(bandwidth_GBps=0.6, latency_us=95.5, reduce_scatter_GBps=0.18)
    assert partial.to_dict() == {"bandwidth_GBps": 0.6, "latency_us": 95.5, "reduce_scatter_GBps": 0.18}
    for link in (LINK, partial, FITTED):
        assert from_mapping(LinkSpec, link.to_dict(), "link") == link


def test_cluster_file_with_fits_round_trips(tmp_path) -> None:
    """A cluster file whose intra-node link states both fits loads, dumps them, and loads back equal; the inter-node link
    without fits dumps just its two keys."""
    import yaml

    from lightning_fleet.planning.cluster import cluster_from_dict, load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(
        "name: box\nnodes: 1\ndevices_per_node: 2\n"
        "device: {name: cpu, memory_gib: 8, peak_tflops: {bf16: 0.1, fp16: 0.1, fp32: 0.1}}\n"
        "intra_node: {bandwidth_GBps: 0.65, latency_us: 120, allgather_GBps: 0.31, allgather_latency_us: 80,\n"
        "             reduce_scatter_GBps: 0.19, reduce_scatter_latency_us: 300}\n"
        "inter_node: {bandwidth_GBps: 0.65, latency_us: 120}\n"
    )
    cluster = load_cluster(path)
    assert (cluster.intra_node.allgather_GBps, cluster.intra_node.reduce_scatter_latency_us) == (0.31, 300)
    data = yaml.safe_load(cluster.to_yaml())
    assert data["inter_node"] == {"bandwidth_GBps": 0.65, "latency_us": 120}
    assert data["intra_node"]["reduce_scatter_GBps"] == 0.19
    assert cluster_from_dict(data) == cluster


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("reduce_scatter_GBps: 0", "link.reduce_scatter_GBps must be > 0 GB/s or left out (the ring model from bandwidth_GBps), got 0"),
        ("allgather_GBps: -1.5", "link.allgather_GBps must be > 0 GB/s or left out (the ring model from bandwidth_GBps), got -1.5"),
        ("allgather_latency_us: -3", "link.allgather_latency_us must be >= 0 us or left out (the link's latency_us), got -3"),
        ("reduce_scatter_GBps: fast", "cluster file 'c.yaml'.intra_node.reduce_scatter_GBps must be a number, got 'fast'"),
        ("all_to_all_GBps: 3", "unknown key 'all_to_all_GBps' in cluster file 'c.yaml'.intra_node"),
    ],
)
def test_bad_fit_is_one_line(tmp_path, extra: str, message: str) -> None:
    """A bad per-collective fit in a cluster file is one SpecError line naming the key and what to write instead."""
    from lightning_fleet.planning import SpecError
    from lightning_fleet.planning.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(
        "name: box\nnodes: 1\ndevices_per_node: 2\n"
        "device: {name: cpu, memory_gib: 8, peak_tflops: {bf16: 0.1, fp16: 0.1, fp32: 0.1}}\n"
        f"intra_node: {{bandwidth_GBps: 0.65, latency_us: 120, {extra}}}\n"
        "inter_node: {bandwidth_GBps: 0.65, latency_us: 120}\n"
    )
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
