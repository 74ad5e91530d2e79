"""Tier-1 tests of the step-time terms (lightning_fleet/planning/time.py).

Every expected value is written out by hand: a literal or a visible arithmetic expression with the source formula named.
"""

from __future__ import annotations

import pytest

from lightning_fleet.planning.cluster import Calibration, LinkSpec
from lightning_fleet.planning.model import Precision
from lightning_fleet.planning.plan import Offload, Recompute
from lightning_fleet.planning.stages import StageLoad
from lightning_fleet.planning.time import (
    TimeEstimate,
    achieved_flops_per_s,
    backward_s,
    bubble_s,
    dp_comm_s,
    exposed_s,
    forward_s,
    gemm_dim,
    hybrid_reduce_s,
    microbatch_overhead_s,
    offload_s,
    optimizer_step_s,
    pp_comm_s,
    recompute_s,
    tp_comm_s,
)

pytestmark = pytest.mark.pure

REL = 1e-9
LINK = LinkSpec(bandwidth_GBps=100, latency_us=5)  # alpha = 5e-6 s, beta = 1e-11 s/B


def _load(**fields: float) -> StageLoad:
    """A hand-built StageLoad: every field 0 unless given."""
    return StageLoad(**{"index": 0, **fields})


# Forward 1e12 FLOPs/sample (8e11 in layers, 1e11 of it attention core); 8 tp all-reduces moving 8e6 B/sample,
# 3 of them forward ones of the layers (3e6 B/sample); 1e6 B/sample sent to the next stage.
LOAD = _load(
    layers=2,
    flops=1e12,
    layer_flops=8e11,
    recompute_flops=1e11,
    tp_allreduces=8,
    tp_allreduce_bytes=8e6,
    layer_tp_allreduces_fwd=3,
    layer_tp_allreduce_fwd_bytes=3e6,
    boundary_bytes=1e6,
)


# --- compute ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mbs", "s", "h", "tp", "expected"),
    [
        (1, 64, 64, 1, 64),  # 64 tokens x 64 x 64: a 64-cube
        (8, 64, 64, 1, 128),  # 2^9 * 2^6 * 2^6 = 2^21 -> 2^7
        (2, 2048, 4096, 8, 2048),  # 2^12 tokens * 2^12 * 2^9 = 2^33 -> 2^11
        (1, 1000, 1000, 1, 1000),
    ],
)
def test_gemm_dim(mbs: int, s: int, h: int, tp: int, expected: float) -> None:
    """Cube edge of the per-device layer GEMM: (mbs * s * h * h / tp) ** (1/3)."""
    assert gemm_dim(mbs=mbs, seq_length=s, hidden_size=h, tp=tp) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("dim", "efficiency", "half", "expected"),
    [
        (100, 0.5, 100.0, 1e15 * 0.5 * 100 / (100 + 100)),  # d = d_half: half of the efficiency, 2.5e14
        (300, 0.6, 100.0, 1e15 * 0.6 * 300 / (300 + 100)),  # 4.5e14
        (512, 0.6, 96.0, 1e15 * 0.6 * 512 / (512 + 96)),
        (50, 0.8, 0.0, 1e15 * 0.8),  # no half-dim: the plain efficiency
    ],
)
def test_achieved_flops_per_s(dim: float, efficiency: float, half: float, expected: float) -> None:
    """Saturating fit: peak * matmul_efficiency * d / (d + matmul_half_dim)."""
    calibration = Calibration(matmul_efficiency=efficiency, matmul_half_dim=half)
    assert achieved_flops_per_s(1e15, dim, calibration) == pytest.approx(expected, rel=REL)


def test_achieved_flops_per_s_approaches_efficiency() -> None:
    """Saturating fit: for d >> d_half the rate tends to peak * efficiency from below."""
    calibration = Calibration(matmul_efficiency=0.5, matmul_half_dim=100.0)
    big = achieved_flops_per_s(1e15, 1e8, calibration)
    assert big < 0.5e15
    assert big == pytest.approx(0.5e15 * 1e8 / (1e8 + 100), rel=REL)


def test_forward_s() -> None:
    """Forward of one micro-batch on one device: flops * mbs / tp / rate."""
    # 1e12 * 2 / 4 / 1e14 = 5e-3 s
    assert forward_s(LOAD, mbs=2, tp=4, flops_per_s=1e14) == pytest.approx(5e-3, rel=REL)
    # 1e12 * 1 / 1 / 2e14 = 5e-3 s
    assert forward_s(LOAD, mbs=1, tp=1, flops_per_s=2e14) == pytest.approx(5e-3, rel=REL)


def test_forward_s_prices_memory_bound_elements() -> None:
    """Output elements of operators without matmul cost elementwise_s each, split by tp like the FLOPs."""
    load = _load(flops=1e12, elementwise=4e8)
    # (1e12 / 1e14 + 4e8 * 1e-10) * 2 / 4 = (1e-2 + 4e-2) / 2 = 2.5e-2 s
    assert forward_s(load, mbs=2, tp=4, flops_per_s=1e14, elementwise_s=1e-10) == pytest.approx(2.5e-2, rel=REL)
    assert forward_s(load, mbs=2, tp=4, flops_per_s=1e14) == pytest.approx(5e-3, rel=REL)  # 0 s per element: FLOPs only


@pytest.mark.parametrize(
    ("recompute", "expected"),
    [
        (Recompute.NONE, 0.0),
        (Recompute.SELECTIVE, 1e11 * 2 / 4 / 1e14),  # the attention core's FLOPs only: 5e-4 s
        (Recompute.FULL, (8e11 / 1e14 + 3e8 * 1e-10) * 2 / 4),  # the layers' FLOPs and elements: 4e-3 + 1.5e-2 s
    ],
)
def test_full_recompute_redoes_the_layers_elements(recompute: Recompute, expected: float) -> None:
    """Full recomputation runs the layers' memory-bound operators again (not the pre/post blocks')."""
    load = _load(flops=1e12, layer_flops=8e11, recompute_flops=1e11, elementwise=4e8, layer_elementwise=3e8)
    assert recompute_s(load, mbs=2, tp=4, recompute=recompute, flops_per_s=1e14, elementwise_s=1e-10) == pytest.approx(expected, rel=REL)


def test_backward_s() -> None:
    """Narayanan 2021 Sec. 5.1: backward = 2 * forward."""
    assert backward_s(5e-3) == pytest.approx(1e-2, rel=REL)
    assert backward_s(0.0) == 0.0


@pytest.mark.parametrize(
    ("recompute", "expected"),
    [
        (Recompute.NONE, 0.0),
        (Recompute.SELECTIVE, 1e11 * 2 / 4 / 1e14),  # attention core: 5e-4 s
        (Recompute.FULL, 8e11 * 2 / 4 / 1e14),  # all layers' forward: 4e-3 s
    ],
)
def test_recompute_s(recompute: Recompute, expected: float) -> None:
    """Narayanan 2021 / Korthikanti 2022: full redoes the layers' forward, selective the attention core, none nothing."""
    assert recompute_s(LOAD, mbs=2, tp=4, recompute=recompute, flops_per_s=1e14) == pytest.approx(expected, rel=REL)


# --- tensor-parallel and pipeline communication --------------------------------------------------


@pytest.mark.parametrize(
    ("recompute", "expected"),
    [
        # 8 messages of 8e6 * 2 / 8 = 2e6 B each, ring all-reduce over 4: 2*3*5e-6 + 2*3/4*2e6/1e11 = 6e-5
        (Recompute.NONE, 8 * (2 * 3 * 5e-6 + 2 * 3 / 4 * 2e6 / 100e9)),  # 4.8e-4
        (Recompute.SELECTIVE, 8 * (2 * 3 * 5e-6 + 2 * 3 / 4 * 2e6 / 100e9)),  # selective repeats no all-reduce
        # full: 8 + 3 messages, (8e6 + 3e6) * 2 / 11 = 2e6 B each
        (Recompute.FULL, 11 * (2 * 3 * 5e-6 + 2 * 3 / 4 * 2e6 / 100e9)),  # 6.6e-4
    ],
)
def test_tp_comm_s(recompute: Recompute, expected: float) -> None:
    """Megatron-LM tp: messages * allreduce(bytes * mbs / messages, tp); full recompute adds the layers' forward all-reduces."""
    assert tp_comm_s(LOAD, mbs=2, tp=4, recompute=recompute, link=LINK) == pytest.approx(expected, rel=REL)


def test_tp_comm_s_takes_the_runtimes_sequence_parallel_traffic() -> None:
    """With sp, the runtime's layout over Megatron's (Overlaps.sp_traffic): torch's 1.5 prices 8 messages as 12; without
    sp the factor does not apply; a factor below 1 or not a number is refused."""
    from lightning_fleet.planning import Overlaps, PlanError
    from lightning_fleet.runtime.torch.capabilities import TORCH

    megatron = 8 * (2 * 3 * 5e-6 + 2 * 3 / 4 * 2e6 / 100e9)  # 4.8e-4, as test_tp_comm_s
    assert TORCH.overlaps.sp_traffic == 1.5
    assert tp_comm_s(LOAD, mbs=2, tp=4, recompute=Recompute.NONE, link=LINK, sp=True, sp_traffic=1.5) == pytest.approx(1.5 * megatron, rel=REL)
    assert tp_comm_s(LOAD, mbs=2, tp=4, recompute=Recompute.NONE, link=LINK, sp=False, sp_traffic=1.5) == pytest.approx(megatron, rel=REL)
    for bad in (0.5, "2", True):
        with pytest.raises(PlanError, match="sp_traffic must be a number >= 1"):
            Overlaps(sp_traffic=bad)


def test_tp_comm_s_tp1_and_no_messages() -> None:
    """tp = 1 or no tensor-parallel all-reduce costs 0 s."""
    assert tp_comm_s(LOAD, mbs=2, tp=1, recompute=Recompute.FULL, link=LINK) == 0.0
    assert tp_comm_s(_load(), mbs=2, tp=8, recompute=Recompute.FULL, link=LINK) == 0.0


def test_tp_comm_s_unequal_messages_sum() -> None:
    """Ring all-reduce is affine in bytes, so the averaged message equals the sum over unequal messages."""
    load = _load(tp_allreduces=2, tp_allreduce_bytes=1e6 + 3e6)  # one 1e6 B and one 3e6 B message per sample
    expected = (2 * 1 * 5e-6 + 1e6 / 100e9) + (2 * 1 * 5e-6 + 3e6 / 100e9)  # tp=2: 2*1*alpha + 2*1/2*bytes*beta each
    assert tp_comm_s(load, mbs=1, tp=2, recompute=Recompute.NONE, link=LINK) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("sp", "pp", "vpp", "expected"),
    [
        (False, 1, 1, 0.0),  # no pipeline, no sends
        (False, 2, 1, 2 * 1 * (5e-6 + 1e6 * 2 / 100e9)),  # fwd + bwd of 2e6 B: 2 * 2.5e-5 = 5e-5
        (False, 4, 2, 2 * 2 * (5e-6 + 1e6 * 2 / 100e9)),  # per virtual stage: 1e-4
        (True, 2, 1, 2 * 1 * (5e-6 + 1e6 * 2 / 4 / 100e9)),  # sp sends a 1/tp slice: 2 * 1e-5 = 2e-5
        (True, 2, 3, 2 * 3 * (5e-6 + 1e6 * 2 / 4 / 100e9)),  # 6e-5
    ],
)
def test_pp_comm_s(sp: bool, pp: int, vpp: int, expected: float) -> None:
    """Pipeline sends per micro-batch: 2 * vpp * p2p(boundary * mbs / (tp if sp else 1))."""
    got = pp_comm_s(LOAD, mbs=2, tp=4, sp=sp, pp=pp, vpp=vpp, link=LINK)
    assert got == pytest.approx(expected, rel=REL)


# --- bubble and overlap ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pp", "vpp", "expected"),
    [
        (1, 1, 0.0),  # no pipeline, no bubble
        (4, 1, (4 - 1) / 1 * 0.1),  # 0.3 s
        (4, 3, (4 - 1) / 3 * 0.1),  # 0.1 s
        (8, 2, (8 - 1) / 2 * 0.1),  # 0.35 s
    ],
)
def test_bubble_s(pp: int, vpp: int, expected: float) -> None:
    """Narayanan 2021 Sec. 2.2: bubble = (p - 1) / v micro-batch times."""
    assert bubble_s(0.1, pp=pp, vpp=vpp) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(("pp", "vpp", "m"), [(4, 1, 8), (4, 2, 8), (8, 4, 32), (2, 1, 1)])
def test_bubble_fraction_of_ideal(pp: int, vpp: int, m: int) -> None:
    """Narayanan 2021: bubble time fraction = (p - 1) / (m * v) of the ideal m * t_mb."""
    t_mb = 0.25
    ideal = m * t_mb
    assert bubble_s(t_mb, pp=pp, vpp=vpp) / ideal == pytest.approx((pp - 1) / (m * vpp), rel=REL)


@pytest.mark.parametrize(
    ("comm", "window", "overlap", "expected"),
    [
        (1.0, 0.5, 0.8, 1.0 - 0.8 * 0.5),  # window shorter than comm: 0.6
        (1.0, 2.0, 0.8, 1.0 - 0.8 * 1.0),  # window longer: 0.2
        (1.0, 2.0, 1.0, 0.0),  # fully hidden
        (1.0, 0.25, 1.0, 0.75),  # hidden up to the window
        (1.0, 2.0, 0.0, 1.0),  # no overlap
        (0.0, 2.0, 0.8, 0.0),  # nothing to hide
    ],
)
def test_exposed_s(comm: float, window: float, overlap: float, expected: float) -> None:
    """Exposed communication = comm - overlap * min(comm, window)."""
    assert exposed_s(comm, window, overlap) == pytest.approx(expected, rel=REL)


# --- data-parallel / ZeRO communication ----------------------------------------------------------

# n = 4e9 params, tp = 4, bf16: nbytes = 2 * 4e9 / 4 = 2e9 B per device; dp = 8 on LINK.
AR = 2 * 7 * 5e-6 + 2 * 7 / 8 * 2e9 / 100e9  # ring all-reduce: 7e-5 + 0.035 = 0.03507
AG = 7 * 5e-6 + 7 / 8 * 2e9 / 100e9  # all-gather / reduce-scatter: 3.5e-5 + 0.0175 = 0.017535
RS = AG
GAS = 4
FWD, BWD = 0.01, 0.02  # forward and backward of one micro-batch, seconds


def _dp(zero: int, overlap: float, *, dp: int = 8, **trainable: float) -> float:
    return dp_comm_s(
        4e9,
        tp=4,
        dp=dp,
        zero=zero,
        gas=GAS,
        precision=Precision.BF16_MIXED,
        link=LINK,
        forward_time_s=FWD,
        backward_time_s=BWD,
        overlap=overlap,
        **trainable,
    )


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        (0, AR),  # one all-reduce: 0.03507
        (1, RS + AG),  # reduce-scatter + weight all-gather: 0.03507
        (2, GAS * RS + AG),  # a reduce-scatter per micro-batch + the all-gather: 5 * 0.017535 = 0.087675
        (3, GAS * (AG + AG + RS)),  # forward gather, backward gather, scatter per micro-batch: 12 * 0.017535 = 0.21042
    ],
)
def test_dp_comm_s_no_overlap(zero: int, expected: float) -> None:
    """ZeRO paper Sec. 7 volumes with overlap 0: everything exposed."""
    assert _dp(zero, 0.0) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        (0, 0.03507 - 0.02),  # all-reduce minus the backward window: 0.01507
        (1, 0.0 + 0.017535),  # scatter (0.017535 < 0.02) fully hidden, gather after the step exposed
        (2, 4 * 0.0 + 0.017535),  # each micro-batch's scatter hidden, the gather exposed
        # per micro-batch: (gather - fwd window) + (gather + scatter - bwd window) = 0.007535 + 0.01507 = 0.022605
        (3, 4 * ((0.017535 - 0.01) + (0.017535 + 0.017535 - 0.02))),  # 0.09042
    ],
)
def test_dp_comm_s_full_overlap_finite_window(zero: int, expected: float) -> None:
    """DeepSpeed overlap_comm with overlap 1: hidden up to the forward / backward window, rest exposed."""
    assert _dp(zero, 1.0) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        (0, 0.03507 - 0.5 * 0.02),  # 0.02507
        (1, (0.017535 - 0.5 * 0.017535) + 0.017535),  # 0.0263025
        (2, 4 * (0.017535 - 0.5 * 0.017535) + 0.017535),  # 0.05261
        (3, 4 * ((0.017535 - 0.5 * 0.01) + (0.03507 - 0.5 * 0.02))),  # 4 * (0.012535 + 0.02507) = 0.15042
    ],
)
def test_dp_comm_s_half_overlap(zero: int, expected: float) -> None:
    """Exposed = comm - overlap * min(comm, window) per ZeRO stage, at overlap 0.5."""
    assert _dp(zero, 0.5) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_comm_s_dp1_is_free(zero: int) -> None:
    """No data parallelism, no data-parallel communication."""
    assert _dp(zero, 0.0, dp=1) == 0.0


SLOW = LinkSpec(bandwidth_GBps=10, latency_us=0)  # across the shard groups of hybrid sharding


def test_hybrid_reduce_s_all_reduces_one_shard_across_the_groups() -> None:
    """dp=8 in groups of 4: each rank all-reduces its quarter of the 4e9 B with the 1 other rank holding it, a ring of 2:
    2 * (1/2) * 1e9 B at 10 GB/s = 0.1 s; none when the group is all of dp."""
    assert hybrid_reduce_s(4e9, dp=8, shard=4, link=SLOW) == pytest.approx(0.1, rel=REL)
    assert hybrid_reduce_s(4e9, dp=8, shard=8, link=SLOW) == 0.0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_dp_comm_s_hybrid_gathers_in_the_group_and_reduces_across(zero: int) -> None:
    """Hybrid sharding, overlap 0: the gathers and reduce-scatters of a 4-rank group on its link, and every reduction
    followed by the all-reduce of the group's shard across the 2 groups on the slow link (bf16, tp=4: 2e9 B; ring of 4 at
    the test link: AG = RS = 3/4 * 2e9 B * beta; across: 2 * 1/2 * 5e8 B / 10 GB/s = 0.05 s)."""
    group_ag = group_rs = 3 * 5e-6 + 0.75 * 2e9 * 1e-11  # 0.015015
    across = 0.05
    expected = {1: group_rs + across + group_ag, 2: GAS * (group_rs + across) + group_ag,
                3: GAS * (group_ag + group_ag + group_rs + across)}[zero]
    assert _dp(zero, 0.0, shard=4, replica_link=SLOW) == pytest.approx(expected, rel=REL)
    assert _dp(zero, 0.0, shard=8, replica_link=SLOW) == pytest.approx(_dp(zero, 0.0), rel=REL)  # one group of all 8


def test_dp_comm_s_fp32_doubles_bytes() -> None:
    """fp32 gradients are 4 B/param: zero 0 all-reduce of 4 * 4e9 / 4 = 4e9 B over dp=8."""
    got = dp_comm_s(
        4e9,
        tp=4,
        dp=8,
        zero=0,
        gas=GAS,
        precision=Precision.FP32,
        link=LINK,
        forward_time_s=FWD,
        backward_time_s=BWD,
        overlap=0.0,
    )
    assert got == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * 4e9 / 100e9, rel=REL)  # 7e-5 + 0.07


# --- offload ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offload", "precision", "expected"),
    [
        (Offload.NONE, Precision.BF16_MIXED, 0.0),
        # shard 2 * 1e9 / (2 * 4) = 2.5e8 B; gas + 1 = 4 transfers at 25 GB/s = 0.04 s;
        # CPU Adam 1e9 / 8 params * 8 devices / 2e9 params/s = 0.5 s
        (Offload.OPTIMIZER, Precision.BF16_MIXED, (3 + 1) * 2.5e8 / 25e9 + 1.25e8 * 8 / 2e9),  # 0.54
        # ZeRO-Infinity: + 2 * gas weight fetches = 10 transfers: 0.1 s + 0.5 s
        (Offload.OPTIMIZER_PARAMS, Precision.BF16_MIXED, (3 + 1 + 2 * 3) * 2.5e8 / 25e9 + 1.25e8 * 8 / 2e9),  # 0.6
        # fp32: shard 4 * 1e9 / 8 = 5e8 B
        (Offload.OPTIMIZER, Precision.FP32, (3 + 1) * 5e8 / 25e9 + 1.25e8 * 8 / 2e9),  # 0.08 + 0.5
    ],
)
def test_offload_s(offload: Offload, precision: Precision, expected: float) -> None:
    """ZeRO-Offload (Ren 2021): (gas + 1 [+ 2 gas]) shard transfers over PCIe + CPU Adam on the host-shared rate."""
    got = offload_s(
        1e9,
        tp=2,
        dp=4,
        gas=3,
        offload=offload,
        precision=precision,
        pcie_GBps=25.0,
        cpu_adam_params_per_s=2e9,
        devices_per_node=8,
    )
    assert got == pytest.approx(expected, rel=REL)


# --- TimeEstimate -------------------------------------------------------------------------------


def test_time_estimate_step_is_sum_of_terms() -> None:
    """TimeEstimate.step_s = compute + tp + pp + dp + bubble + offload + overhead."""
    est = TimeEstimate(
        compute_s=1.0,
        tp_comm_s=0.25,
        pp_comm_s=0.125,
        dp_comm_s=0.5,
        bubble_s=0.375,
        offload_s=0.0625,
        optimizer_s=0.015625,
        overhead_s=0.03125,
    )
    expected = 1.0 + 0.25 + 0.125 + 0.5 + 0.375 + 0.0625 + 0.015625 + 0.03125  # 2.359375
    assert est.step_s == pytest.approx(expected, rel=REL)
    assert sum(est.terms().values()) == pytest.approx(expected, rel=REL)
    assert est.to_dict()["step_s"] == pytest.approx(expected, rel=REL)
    assert est.largest_term() == ("compute", 1.0)


# --- optimizer step and framework overhead (calibrated by `fleet calibrate`) -------------------------


@pytest.mark.parametrize(
    "zero,offload,expected",
    [
        (0, Offload.NONE, 8e8 / 2 / 1e8),  # ZeRO-0: every rank steps its whole tp shard: 4 s
        (1, Offload.NONE, 8e8 / 2 / 4 / 1e8),  # ZeRO-1..3: its 1/dp partition: 1 s
        (3, Offload.NONE, 8e8 / 2 / 4 / 1e8),
        (2, Offload.OPTIMIZER, 0.0),  # the host steps (priced in offload_s)
    ],
)
def test_optimizer_step_s(zero: int, offload: Offload, expected: float) -> None:
    """optimizer_step_s = n / tp / (dp if zero >= 1) / adam rate; 8e8 params, tp 2, dp 4, 1e8 params/s."""
    assert optimizer_step_s(8e8, tp=2, dp=4, zero=zero, offload=offload, adam_params_per_s=1e8) == pytest.approx(expected, rel=REL)


def test_microbatch_overhead_by_zero_stage_and_tensor() -> None:
    """fixed 2 ms + ZeRO-3's 0.5 ms per parameter tensor x 40 tensors + 3 x 100 ops x 10 us dispatch."""
    calibration = Calibration(microbatch_overhead_s=0.002, zero_tensor_overhead_s=(0.0, 0.0, 0.0001, 0.0005), op_overhead_s=1e-5)
    assert microbatch_overhead_s(100, calibration, 3, param_tensors=40) == pytest.approx(0.002 + 0.0005 * 40 + 3 * 100 * 1e-5, rel=REL)
    assert microbatch_overhead_s(100, calibration, 0, param_tensors=40) == pytest.approx(0.002 + 3 * 100 * 1e-5, rel=REL)
    assert Calibration().microbatch_overhead(3, 1000) == 0.0  # no ZeRO table: no per-tensor term


def test_recomputation_repeats_dispatch_and_zero3_gathers() -> None:
    """Recomputing half the forward: 3.5 x 100 ops dispatched; ZeRO-3 hooks on 40 x (1 + 0.5/2) = 50 tensors; ZeRO-2's do not rerun."""
    calibration = Calibration(microbatch_overhead_s=0.002, zero_tensor_overhead_s=(0.0, 0.0, 0.0001, 0.0005), op_overhead_s=1e-5)
    redo = microbatch_overhead_s(100, calibration, 3, param_tensors=40, recomputed=0.5)
    assert redo == pytest.approx(0.002 + 0.0005 * 50 + 3.5 * 100 * 1e-5, rel=REL)
    zero2 = microbatch_overhead_s(100, calibration, 2, param_tensors=40, recomputed=0.5)
    assert zero2 == pytest.approx(0.002 + 0.0001 * 40 + 3.5 * 100 * 1e-5, rel=REL)


def test_step_overhead_by_zero_stage() -> None:
    """step_overhead_s plus the stage's extra."""
    calibration = Calibration(step_overhead_s=0.02, zero_step_overhead_s=(0.0, 0.01, 0.015, 0.0))
    assert [calibration.step_overhead(z) for z in range(4)] == pytest.approx([0.02, 0.03, 0.035, 0.02], rel=REL)


@pytest.mark.parametrize("values", [(0.1, 0.2), (0.0, 0.0, -0.1, 0.0)])
def test_zero_tables_need_four_non_negative_values(values) -> None:
    from lightning_fleet.planning import SpecError

    with pytest.raises(SpecError, match="zero_tensor_overhead_s must be 4 non-negative seconds"):
        Calibration(zero_tensor_overhead_s=values)


def test_offload_adds_its_per_tensor_overhead() -> None:
    """Optimizer offload: + 0.2 ms per tensor; optimizer + parameter offload: + 0.6 ms (40 tensors, ZeRO-3 0.5 ms each)."""
    calibration = Calibration(zero_tensor_overhead_s=(0.0, 0.0, 0.0, 0.0005), offload_tensor_overhead_s=(0.0002, 0.0006))
    assert microbatch_overhead_s(0, calibration, 3, param_tensors=40, offload=Offload.OPTIMIZER) == pytest.approx(40 * 0.0007, rel=REL)
    assert microbatch_overhead_s(0, calibration, 3, param_tensors=40, offload=Offload.OPTIMIZER_PARAMS) == pytest.approx(40 * 0.0011, rel=REL)


# --- frozen parameters: gradient communication, the optimizer step and offload follow the trainable ones -----------

# 1e9 of the 4e9 parameters train: gradients 2 * 1e9 / 4 = 5e8 B per device; dp = 8 on LINK.
AR_T = 2 * 7 * 5e-6 + 2 * 7 / 8 * 5e8 / 100e9  # 7e-5 + 0.00875 = 0.00882
AG_T = 7 * 5e-6 + 7 / 8 * 5e8 / 100e9  # 3.5e-5 + 0.004375 = 0.00441 (the updated weights, the gradient scatter)


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        (0, AR_T),  # the trainable gradients' all-reduce: 0.00882
        (1, AG_T + AG_T),  # their reduce-scatter + the updated weights' all-gather: 0.00882
        (2, GAS * AG_T + AG_T),  # 5 * 0.00441 = 0.02205
        (3, GAS * (AG + AG + AG_T)),  # ZeRO-3 gathers all 4e9 weights twice, scatters 1e9 gradients: 4 * 0.03948 = 0.15792
    ],
)
def test_dp_comm_s_of_a_partly_frozen_stage(zero: int, expected: float) -> None:
    assert _dp(zero, 0.0, trainable=1e9) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("offload", "expected"),
    [
        # 2.5e8 of 1e9 train: gradient shard 2 * 2.5e8 / 8 = 6.25e7 B, gas + 1 = 4 transfers: 0.01 s; CPU Adam on
        # 2.5e8 / 8 params * 8 devices / 2e9 params/s = 0.125 s
        (Offload.OPTIMIZER, 4 * 6.25e7 / 25e9 + 2.5e8 / 8 * 8 / 2e9),  # 0.135
        # ZeRO-Infinity: + 2 * gas fetches of all weights, 6 * 2 * 1e9 / 8 = 1.5e9 B: 0.06 s
        (Offload.OPTIMIZER_PARAMS, (4 * 6.25e7 + 6 * 2.5e8) / 25e9 + 2.5e8 / 8 * 8 / 2e9),  # 0.195
    ],
)
def test_offload_s_of_a_partly_frozen_stage(offload: Offload, expected: float) -> None:
    got = offload_s(
        1e9,
        tp=2,
        dp=4,
        gas=3,
        offload=offload,
        precision=Precision.BF16_MIXED,
        pcie_GBps=25.0,
        cpu_adam_params_per_s=2e9,
        devices_per_node=8,
        trainable=2.5e8,
    )
    assert got == pytest.approx(expected, rel=REL)


def test_time_estimate_steps_only_the_trainable_parameters() -> None:
    """A model of 2100 parameters of which 300 train (tests/test_memory_terms.py's frozen backbone), ZeRO-1 at dp 2:
    the optimizer step is 300 / 2 params at the calibrated Adam rate, not 2100 / 2."""
    from lightning_fleet.planning.estimate import Hardware, time_estimate
    from lightning_fleet.planning.plan import Plan
    from tests.conftest import make_cluster
    from tests.test_memory_terms import _frozen_backbone

    model = _frozen_backbone(tied_frozen=True)
    hw = Hardware.of(make_cluster(devices_per_node=2), model)
    plan = Plan(dp=2, zero=1, mbs=4, gas=1)
    assert time_estimate(model, hw, plan).optimizer_s == pytest.approx(300 / 2 / hw.calibration.adam_params_per_s, rel=REL)


def test_axis_links_follow_the_placement() -> None:
    """Hardware.links on two 8-device nodes, dp=2, tp=4, pp=2: order tp-dp-pp keeps tp (span 4) and dp (span 4 x 2 = 8)
    in a node and sends pp (span 8 x 2 = 16) across; pp-dp-tp keeps pp (span 2) and dp (span 2 x 2 = 4) in, tp (span
    4 x 4 = 16) across. Placements are told apart by which link object each axis uses."""
    from lightning_fleet.planning.estimate import Hardware
    from lightning_fleet.planning.plan import Plan
    from tests.conftest import make_cluster, make_model

    hw = Hardware.of(make_cluster(nodes=2, devices_per_node=8), make_model())
    intra, inter = hw.intra_node, hw.inter_node
    default = hw.links(Plan(dp=2, tp=4, pp=2))
    assert (default.dp, default.tp, default.pp) == (intra, intra, inter) and default.pp is inter and default.tp is intra
    other = hw.links(Plan(dp=2, tp=4, pp=2, order=("pp", "dp", "tp")))
    assert other.pp is intra and other.dp is intra and other.tp is inter
    assert default.identity() == (id(intra), id(intra), id(inter), id(intra)) != other.identity()
    assert default.dp_shard is default.dp  # no hybrid sharding: the shard group is the dp axis


def test_a_hybrid_shard_group_inside_a_node_talks_on_its_link() -> None:
    """dp=8, tp=2 on two 8-device nodes: the dp axis spans 16 ranks (both nodes), a shard group of 4 spans 2 x 4 = 8 (one
    node), a group of 8 both nodes again."""
    from lightning_fleet.planning.estimate import Hardware
    from lightning_fleet.planning.plan import Plan
    from tests.conftest import make_cluster, make_model

    hw = Hardware.of(make_cluster(nodes=2, devices_per_node=8), make_model())
    links = hw.links(Plan(dp=8, tp=2, zero=3, dp_shard=4))
    assert links.dp is hw.inter_node and links.dp_shard is hw.intra_node
    assert hw.links(Plan(dp=8, tp=2, zero=3, dp_shard=8)).dp_shard is hw.inter_node
