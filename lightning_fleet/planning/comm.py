"""Alpha-beta cost of collectives on one link level, and which level a mesh axis runs on.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
Operations in MPICH"; the same terms alpa's LogicalDeviceMesh uses). ``nbytes`` is always the
full (unsharded) message size; ``n`` the group size; a group of one costs nothing. A link may state its own fit for
the all-gather and the reduce-scatter (what `fleet calibrate` measures): their formulas keep the ring shape, at that
collective's bandwidth and latency.

Pure: imports neither torch nor deepspeed; imported by the estimate and the search.
"""

from __future__ import annotations

from lightning_fleet.planning.cluster import LinkLevel, LinkSpec
from lightning_fleet.planning.plan import Axis, Plan


def allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(n-1) alpha + 2(n-1)/n * bytes * beta."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes * link.beta_s_per_byte


def allgather_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total: (n-1) alpha + (n-1)/n * bytes * beta, at the link's all-gather
    fit where it states one (:attr:`LinkSpec.allgather_GBps`), else at its ring alpha and beta."""
    if n == 1:
        return 0.0
    return (n - 1) * link.allgather_alpha_s + (n - 1) / n * nbytes * link.allgather_beta_s_per_byte


def reduce_scatter_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of ``nbytes`` in total: (n-1) alpha + (n-1)/n * bytes * beta, at the link's reduce-scatter
    fit where it states one (:attr:`LinkSpec.reduce_scatter_GBps`), else at its ring alpha and beta (the all-gather's
    ring cost)."""
    if n == 1:
        return 0.0
    return (n - 1) * link.reduce_scatter_alpha_s + (n - 1) / n * nbytes * link.reduce_scatter_beta_s_per_byte


def p2p_s(nbytes: float, link: LinkSpec) -> float:
    """One point-to-point message: alpha + bytes * beta."""
    return link.alpha_s + nbytes * link.beta_s_per_byte


def axis_level(plan: Plan, axis: Axis, devices_per_node: int) -> LinkLevel:
    """Intra-node when the axis' whole group spans at most one node's consecutive ranks (:meth:`Plan.stride` times its
    degree), else inter-node."""
    span = plan.stride(axis) * getattr(plan, axis.value)
    return LinkLevel.INTRA if span <= devices_per_node else LinkLevel.INTER



def shard_level(plan: Plan, devices_per_node: int) -> LinkLevel:
    """The level the shard group of hybrid sharding runs on (:attr:`Plan.dp_shard` consecutive dp ranks, each
    :meth:`Plan.stride` of dp apart): intra-node when the group spans at most one node, as :func:`axis_level`; the dp
    axis' own level without hybrid sharding."""
    span = plan.stride(Axis.DP) * plan.shard_degree
    return LinkLevel.INTRA if span <= devices_per_node else LinkLevel.INTER
