"""Tier-1 tests of what a runtime hides behind compute (lightning_fleet/planning/overlap.py) and its time terms.

Every expected value is a literal or a visible arithmetic expression with the formula named; "before" numbers were
computed with the time model as it was before Overlaps existed (commit 2e84307) and must not move.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from lightning_fleet.cli import main
from lightning_fleet.planning import FleetError, Overlaps, estimate, load_cluster, load_model, parse_plan, plan
from lightning_fleet.planning.cluster import Calibration, LinkSpec
from lightning_fleet.planning.model import Precision
from lightning_fleet.planning.stages import StageLoad
from lightning_fleet.planning.time import dp_comm_s, pp_comm_s, pp_exposed_s, pp_split_gather_s, tp_exposed_s
from lightning_fleet.runtime import ANY
from lightning_fleet.runtime.base import ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

pytestmark = pytest.mark.pure

REL = 1e-9
LINK = LinkSpec(bandwidth_GBps=100, latency_us=5)  # alpha = 5e-6 s, beta = 1e-11 s/B
SYMMETRIC = Overlaps.of(["dp_grad_reduce", "dp_param_gather"])

# n = 4e9 params, tp = 4, bf16: 2e9 B per device; dp = 8 on LINK (ring, Thakur 2005)
AG = 7 * 5e-6 + 7 / 8 * 2e9 / 100e9  # all-gather = reduce-scatter: 3.5e-5 + 0.0175 = 0.017535
AR = 2 * AG  # all-reduce: 0.03507
GAS, FWD, BWD, OVERLAP = 4, 0.01, 0.02, 0.8


def _dp(zero: int, overlaps: Overlaps, *, pp: int = 1) -> float:
    return dp_comm_s(4e9, tp=4, dp=8, zero=zero, gas=GAS, precision=Precision.BF16_MIXED, link=LINK, forward_time_s=FWD,
                     backward_time_s=BWD, overlap=OVERLAP, overlaps=overlaps, pp=pp)


# --- the value ----------------------------------------------------------------------------------


def test_of_builds_a_runtime_from_names() -> None:
    """Megatron-LM with --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap and interleaving, by name."""
    got = Overlaps.of(["dp_grad_reduce", "dp_param_gather", "tp_comm", "pp_p2p"])
    assert got == Overlaps(dp_grad_reduce=(0, 1, 2, 3), dp_param_gather=(1, 2, 3), tp_comm=True, pp_p2p=True)
    assert Overlaps.of([]) == Overlaps.NONE
    assert got.symmetric and not got.pp_p2p_split_over_tp and not got.dp_exposed_in_pipeline


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Overlaps.of(["dp_grad_reduce", "prefetch"]), "unknown overlap 'prefetch': choose from dp_grad_reduce,"),
        (lambda: Overlaps.of("tp_comm"), "Overlaps.of takes a list of names, got the string 'tp_comm'"),
        (lambda: Overlaps(dp_param_gather=(0, 3)), "Overlaps dp_param_gather: 0 is not one of the ZeRO stages it applies to"),
        (lambda: Overlaps(dp_grad_reduce=(4,)), "Overlaps dp_grad_reduce: 4 is not one of the ZeRO stages"),
        (lambda: Overlaps(tp_comm=1), "Overlaps tp_comm must be True or False, got 1"),
    ],
)
def test_bad_values_are_one_line_fleet_errors(call, message: str) -> None:
    with pytest.raises(FleetError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_default_is_the_long_standing_assumption_and_asymmetric() -> None:
    """Overlaps() hides every gradient reduction and ZeRO-3's gathers, not ZeRO-1/2's: the asymmetry, named."""
    assert Overlaps() == Overlaps.DEFAULT == Overlaps(dp_grad_reduce=(0, 1, 2, 3), dp_param_gather=(3,))
    assert not Overlaps.DEFAULT.symmetric
    assert Overlaps.NONE.symmetric and Overlaps.ALL.symmetric and SYMMETRIC.symmetric
    assert str(Overlaps.NONE) == "nothing"
    assert str(Overlaps.DEFAULT) == "dp_grad_reduce(zero 0, 1, 2, 3), dp_param_gather(zero 3)"


# --- data-parallel terms, hand-computed ---------------------------------------------------------


@pytest.mark.parametrize(
    ("zero", "overlaps", "expected"),
    [
        # ZeRO-1: scatter behind the last backward, the updated weights' gather behind the next forward (0.01 s window)
        (1, SYMMETRIC, (AG - 0.8 * AG) + (AG - 0.8 * 0.01)),  # 0.003507 + 0.009535 = 0.013042
        (1, Overlaps.DEFAULT, (AG - 0.8 * AG) + AG),  # the gather exposed: 0.003507 + 0.017535 = 0.021042
        # ZeRO-2: a scatter per micro-batch, one gather
        (2, SYMMETRIC, 4 * (AG - 0.8 * AG) + (AG - 0.8 * 0.01)),  # 0.014028 + 0.009535 = 0.023563
        # ZeRO-0 not overlapped (DeepSpeed's engine all-reduces after backward)
        (0, Overlaps(dp_grad_reduce=(1, 2, 3)), AR),  # 0.03507
        (0, Overlaps.DEFAULT, AR - 0.8 * BWD),  # 0.03507 - 0.016 = 0.01907
        # ZeRO-3 with prefetch only: the backward window hides only the gather of the pair
        (3, Overlaps(dp_grad_reduce=(), dp_param_gather=(3,)), 4 * ((AG - 0.8 * FWD) + (2 * AG - 0.8 * AG))),  # 0.122308
        # ZeRO-3 with gradient overlap only: forward gather exposed, backward hides the scatter
        (3, Overlaps(dp_grad_reduce=(3,), dp_param_gather=()), 4 * (AG + (2 * AG - 0.8 * AG))),  # 0.154308
        # both: today's ZeRO-3 (the pair hides together, up to the 0.02 s backward)
        (3, Overlaps.DEFAULT, 4 * ((AG - 0.8 * FWD) + (2 * AG - 0.8 * BWD))),  # 4 * (0.009535 + 0.01907) = 0.11442
        (3, Overlaps.NONE, 4 * 3 * AG),  # 0.21042
        # ZeRO-1/2 reducing with a full all-reduce (DeepSpeed 0.19): the all-reduce behind the backward, as ZeRO-0's
        (1, Overlaps(dp_grad_allreduce=(1, 2)), (AR - 0.8 * BWD) + AG),  # 0.01907 + 0.017535 = 0.036605
        (2, Overlaps(dp_grad_allreduce=(1, 2)), 4 * (AR - 0.8 * BWD) + AG),  # 0.07628 + 0.017535 = 0.093815
    ],
)
def test_dp_comm_s_under_overlaps(zero: int, overlaps: Overlaps, expected: float) -> None:
    """Exposed = comm - overlap * min(comm, window) for what the runtime overlaps, all of it for the rest (ZeRO Sec. 7)."""
    assert _dp(zero, overlaps) == pytest.approx(expected, rel=REL)


def test_pipeline_exposes_data_parallel_communication_where_the_runtime_says_so() -> None:
    """DeepSpeed's pipeline engine reduces after its last backward: ZeRO-1 in a pipeline is its gradient all-reduce and
    the weights' gather, exposed; outside a pipeline the all-reduce hides behind the last backward (0.02 s)."""
    assert _dp(1, DEEPSPEED.overlaps, pp=2) == pytest.approx(AR + AG, rel=REL)  # 0.052605
    assert _dp(1, DEEPSPEED.overlaps, pp=1) == pytest.approx((AR - 0.8 * BWD) + AG, rel=REL)  # 0.036605
    assert _dp(1, Overlaps.DEFAULT, pp=2) == _dp(1, Overlaps.DEFAULT, pp=1)


# --- tensor- and pipeline-parallel terms, hand-computed ------------------------------------------


@pytest.mark.parametrize(
    ("comm", "compute", "overlap", "expected"),
    [
        (0.05, 0.2, 0.8, 0.05 - 0.8 * 0.05),  # hidden behind the GEMMs up to the calibrated fraction: 0.01
        (0.3, 0.2, 0.8, 0.3 - 0.8 * 0.2),  # longer than the compute: 0.14
        (0.05, 0.2, 0.0, 0.05),  # not overlapped
    ],
)
def test_tp_exposed_s(comm: float, compute: float, overlap: float, expected: float) -> None:
    assert tp_exposed_s(comm, compute, overlap) == pytest.approx(expected, rel=REL)


LOAD = StageLoad(index=0, boundary_bytes=1e6)


def test_split_sends_carry_one_tp_th_and_add_the_all_gather() -> None:
    """Scatter-gather (Narayanan 2021 Sec. 4.1), mbs 2, tp 4, one virtual stage: 2 sends of 2e6 / 4 B, 2 all-gathers of 2e6 B."""
    whole = pp_comm_s(LOAD, mbs=2, tp=4, sp=False, pp=4, vpp=1, link=LINK)
    split = pp_comm_s(LOAD, mbs=2, tp=4, sp=False, pp=4, vpp=1, link=LINK, split_over_tp=True)
    gathers = pp_split_gather_s(LOAD, mbs=2, tp=4, pp=4, vpp=1, link=LINK)
    assert whole == pytest.approx(2 * (5e-6 + 2e6 * 1e-11), rel=REL)  # 5e-5
    assert split == pytest.approx(2 * (5e-6 + 2e6 / 4 * 1e-11), rel=REL)  # 2e-5
    assert gathers == pytest.approx(2 * (3 * 5e-6 + 3 / 4 * 2e6 * 1e-11), rel=REL)  # 6e-5
    assert pp_split_gather_s(LOAD, mbs=2, tp=4, pp=1, vpp=1, link=LINK) == 0.0


def test_pp_exposed_s_hides_the_sends_not_the_gathers() -> None:
    assert pp_exposed_s(2e-5, 6e-5, 1e-3, 0.8) == pytest.approx(2e-5 - 0.8 * 2e-5 + 6e-5, rel=REL)  # 6.4e-5
    assert pp_exposed_s(2e-5, 0.0, 1e-3, 0.0) == 2e-5


# --- through the estimate -----------------------------------------------------------------------

GPT, NODE = load_model("gpt-1.7b"), load_cluster("dgx-a100-80gb")


def _estimate(text: str, overlaps: Overlaps = Overlaps.DEFAULT):
    return estimate(GPT, NODE, parse_plan(text, global_batch_size=GPT.global_batch_size), overlaps=overlaps)


def test_tp_comm_hides_sequence_parallel_collectives_behind_the_compute() -> None:
    """Per micro-batch: tp - 0.8 * min(tp, compute) (Megatron --tp-comm-overlap needs sp; without sp nothing moves)."""
    tp_comm = dataclasses.replace(Overlaps.DEFAULT, tp_comm=True)
    base, hidden = _estimate("dp=4,tp=2,mbs=2,zero=1,sp=true"), _estimate("dp=4,tp=2,mbs=2,zero=1,sp=true", tp_comm)
    gas, overlap = base.plan.gas, NODE.calibration.overlap
    per_mb, compute = base.time.tp_comm_s / gas, base.time.compute_s / gas
    assert hidden.time.tp_comm_s == pytest.approx(gas * (per_mb - overlap * min(per_mb, compute)), rel=REL)
    assert hidden.time.tp_comm_s < base.time.tp_comm_s and hidden.time.dp_comm_s == base.time.dp_comm_s
    no_sp = "dp=4,tp=2,mbs=2,zero=1,sp=false"
    assert _estimate(no_sp, tp_comm).time == _estimate(no_sp).time


def test_split_over_tp_through_the_estimate() -> None:
    """Without sp the pipeline term becomes sends of 1/tp plus all-gathers over tp; with sp it does not change."""
    text = "dp=2,tp=2,pp=2,mbs=2,zero=1"
    split_over_tp = dataclasses.replace(Overlaps.DEFAULT, pp_p2p_split_over_tp=True)
    base, split = _estimate(text), _estimate(text, split_over_tp)
    assert split.time.pp_comm_s != base.time.pp_comm_s
    assert split.time.compute_s == base.time.compute_s and split.time.dp_comm_s == base.time.dp_comm_s
    sp = "dp=2,tp=2,pp=2,mbs=2,zero=1,sp=true"
    assert _estimate(sp, split_over_tp).time == _estimate(sp).time


def test_pp_p2p_hides_the_sends_of_interleaved_schedules_only() -> None:
    """Megatron's overlap_p2p_comm runs with vpp > 1 only: per micro-batch sends - 0.8 * min(sends, compute)."""
    pp_p2p = dataclasses.replace(Overlaps.DEFAULT, pp_p2p=True)
    text = "dp=2,tp=1,pp=4,mbs=2,zero=1,vpp=2"
    base, hidden = _estimate(text), _estimate(text, pp_p2p)
    gas, overlap = base.plan.gas, NODE.calibration.overlap
    sends, compute = base.time.pp_comm_s / gas, base.time.compute_s / gas
    assert hidden.time.pp_comm_s == pytest.approx(gas * (sends - overlap * min(sends, compute)), rel=REL)
    one_chunk = "dp=2,tp=1,pp=4,mbs=2,zero=1,vpp=1"
    assert _estimate(one_chunk, pp_p2p).time == _estimate(one_chunk).time


# step_s, dp_comm_s, tp_comm_s, pp_comm_s computed before Overlaps existed (memory-bound operators folded into the
# matmul rate then: elementwise_s=0 below reproduces that compute model)
BEFORE = [
    ("gpt3-175b", "dgx-a100-80gb-x128", "dp=16,tp=8,pp=8,mbs=1,recompute=full,zero=1",
     (29.86714801244586, 0.2694360908259406, 2.5481177702399997, 0.38846705664000003)),
    ("gpt3-175b", "dgx-a100-80gb-x128", "dp=16,tp=8,pp=8,mbs=1,recompute=selective,sp=true,vpp=2,zero=1",
     (21.65852949632778, 0.31836188744455446, 1.7103804211199995, 0.10047676416000001)),
    ("gpt3-175b", "dgx-a100-80gb-x128", "dp=128,tp=8,pp=1,mbs=1,recompute=full,zero=3",
     (69.78175312195933, 43.055972381922686, 2.5219384780799996, 0.0)),
    ("gpt-1.7b", "dgx-a100-80gb", "dp=8,mbs=4,zero=0", (8.12145348246352, 0.0038692048639999994, 0.0, 0.0)),
    ("gpt-1.7b", "dgx-a100-80gb", "dp=8,mbs=4,zero=2", (8.12929689219152, 0.040626651071999996, 0.0, 0.0)),
    ("gpt-1.7b", "dgx-a100-80gb", "dp=2,tp=2,pp=2,mbs=2,zero=1",
     (9.280603502948818, 0.0017809094399999998, 0.45732012031999997, 0.01738612736)),
]


@pytest.mark.parametrize(("model", "cluster", "text", "before"), BEFORE)
def test_default_overlaps_reproduce_the_numbers_from_before(model: str, cluster: str, text: str, before: tuple) -> None:
    spec = load_model(model)
    folded = load_cluster(cluster).with_calibration(Calibration(elementwise_s=0.0))
    e = estimate(spec, folded, parse_plan(text, global_batch_size=spec.global_batch_size))
    assert (e.time.step_s, e.time.dp_comm_s, e.time.tp_comm_s, e.time.pp_comm_s) == pytest.approx(before, rel=1e-12, abs=0)


# --- the search ---------------------------------------------------------------------------------

TINY = load_model("gpt-tiny")


def _best(overlaps: Overlaps):
    return plan(TINY, NODE, top=1, zero_stages=(1, 3), max_tp=1, max_pp=1, allow_offload=False, overlaps=overlaps).best


def test_a_symmetric_overlap_no_longer_prefers_zero3_for_hiding_what_zero1_may_not() -> None:
    """gpt-tiny on 8 A100s: ZeRO-3 moves 1.5x ZeRO-1's bytes, yet wins when only its gathers may hide."""
    asymmetric, symmetric = _best(Overlaps.DEFAULT), _best(SYMMETRIC)
    assert asymmetric.plan.zero == 3
    assert symmetric.plan.zero == 1
    # every candidate is priced with the constraint's one value: the winner's time is estimate()'s under it
    again = estimate(TINY, NODE, symmetric.plan, overlaps=SYMMETRIC)
    assert symmetric.time.step_s == again.time.step_s


# --- one description per runtime ---------------------------------------------------------------


def test_runtimes_state_their_overlaps_and_their_constraints_carry_them() -> None:
    assert ANY.overlaps == Overlaps.DEFAULT
    assert DEEPSPEED.overlaps == Overlaps(
        dp_grad_reduce=(1, 2, 3), dp_param_gather=(3,), dp_exposed_in_pipeline=True, dp_grad_allreduce=(1, 2)
    )
    hooks = ModuleHooks.assumed()
    assert DEEPSPEED.constraints(hooks).overlaps == DEEPSPEED.overlaps
    assert ANY.constraints(hooks).overlaps == Overlaps.DEFAULT


def _deepspeed_source(relative: str) -> str:
    """A file of the installed DeepSpeed, read as text (DeepSpeed is not imported)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / relative).read_text()


@pytest.mark.parametrize(
    ("relative", "evidence"),
    [
        # ZeRO-0: the gradient all-reduce runs after backward returns, not in hooks (dp_grad_reduce lacks 0)
        ("runtime/engine.py", "# Traditional code path that allreduces the module parameter grads"),
        # ZeRO-1/2 reduce in backward hooks with overlap_comm (dp_grad_reduce has 1, 2)
        ("runtime/zero/stage_1_and_2.py", "if self.partition_gradients or self.overlap_comm:"),
        # ZeRO-1/2 gather the updated weights inside step() (dp_param_gather lacks 1, 2)
        ("runtime/zero/stage_1_and_2.py", "# Gather the updated weights from everyone."),
        # ZeRO-3 prefetches on its own all-gather stream (dp_param_gather has 3)
        ("runtime/zero/partitioned_param_coordinator.py", "kick off all gather for params in the next few submodules (prefetch)"),
        # the pipeline turns overlap_comm off (dp_exposed_in_pipeline)
        ("runtime/engine.py", "Pipeline parallelism does not support overlapped communication, will be disabled."),
        # AutoTP's row-parallel all-reduce inline, its overlap option off by default (tp_comm False)
        ("runtime/tensor_parallel/config.py", "tp_overlap_comm: bool = False"),
        # ZeRO-1/2 all-reduce the gradient slices (dp_grad_allreduce has 1, 2)
        ("runtime/zero/stage_1_and_2.py", 'bucket_key = ("allreduce", process_group)'),
        ("runtime/zero/config.py", "use_multi_rank_bucket_allreduce: bool = True"),
        # blocking pipeline sends (pp_p2p False)
        ("runtime/pipe/p2p.py", 'assert async_op == False, "Doesn\'t support async_op true"'),
    ],
)
def test_deepspeed_overlaps_match_the_installed_source(relative: str, evidence: str) -> None:
    """DEEPSPEED.overlaps cites DeepSpeed 0.19.8's code; each citation is still true of the installed copy."""
    assert evidence in _deepspeed_source(relative)


# --- the command --------------------------------------------------------------------------------


def test_fleet_estimate_takes_overlaps(capsys) -> None:
    """--overlaps prices with the named value; the runtime's own by default; a bad name is one line, exit 2."""
    args = ["estimate", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--plan", "dp=8,mbs=4,zero=1", "--json"]
    outs = {}
    for extra in ([], ["--overlaps", "default"], ["--overlaps", "dp_grad_reduce,dp_param_gather"], ["--overlaps", "none"]):
        assert main(args + extra) == 0
        outs[tuple(extra)] = capsys.readouterr().out
    assert outs[()] == outs[("--overlaps", "default")]
    dp = [float(out.split('"dp_comm_s": ')[1].split(",")[0]) for out in outs.values()]
    assert dp[2] < dp[1] < dp[3]  # the gather hidden too < today's < nothing hidden
    assert main(args + ["--overlaps", "dp_grad_reduce,bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleet: error: unknown overlap 'bogus'") and err.count("\n") == 1
