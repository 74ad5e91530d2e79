"""Tier-1 tests of the fits `fleet calibrate` applies to its microbenchmarks (lightning_fleet/calibrate/), and its summary."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_fleet.calibrate.measure import fit_alpha_beta, fit_link, fit_saturation, least_squares_line


@pytest.mark.pure
def test_least_squares_line_through_exact_points() -> None:
    """y = 3 + 2x exactly: intercept 3, slope 2."""
    assert least_squares_line([1.0, 2.0, 4.0], [5.0, 7.0, 11.0]) == pytest.approx((3.0, 2.0))


@pytest.mark.pure
def test_least_squares_line_averages_noise() -> None:
    """(0, 1), (1, 1), (2, 4): mean x 1, mean y 2; slope (-1*-1 + 0 + 1*2) / 2 = 1.5, intercept 2 - 1.5 = 0.5."""
    assert least_squares_line([0.0, 1.0, 2.0], [1.0, 1.0, 4.0]) == pytest.approx((0.5, 1.5))


@pytest.mark.pure
def test_fit_saturation_recovers_peak_and_half_size() -> None:
    """Rates from r(d) = 1e11 * d / (d + 100) at d = 32 ... 512 give back (1e11, 100)."""
    points = [(d, 1e11 * d / (d + 100)) for d in (32, 64, 128, 256, 512)]
    peak, half = fit_saturation(points)
    assert peak == pytest.approx(1e11, rel=1e-9) and half == pytest.approx(100, rel=1e-9)


@pytest.mark.pure
def test_fit_saturation_flat_rate() -> None:
    """A rate that falls with size (no saturation to fit): half size 0 and the peak that minimises the relative
    errors, sum((p / r - 1)^2) -> p = sum(1/r) / sum(1/r^2)."""
    peak, half = fit_saturation([(64, 2e10), (512, 1.5e10)])
    assert half == 0.0
    assert peak == pytest.approx((1 / 2e10 + 1 / 1.5e10) / (1 / 2e10**2 + 1 / 1.5e10**2), rel=1e-12)


@pytest.mark.pure
def test_fit_saturation_minimises_the_relative_errors() -> None:
    """On rates the curve cannot follow exactly (a sharp knee), the fit is the least-squares one in relative error:
    moving the peak by 1 % or the half size by 5 % either way only makes sum(((r(d) - rate) / rate)^2) larger."""
    points = [(32, 7.9e9), (51, 26.2e9), (64, 38.5e9), (102, 58.7e9), (128, 61.8e9), (203, 69.2e9), (256, 71.5e9), (406, 72e9), (512, 72e9)]

    def objective(peak: float, half: float) -> float:
        return sum((peak * d / (d + half) / rate - 1) ** 2 for d, rate in points)

    peak, half = fit_saturation(points)
    assert half > 0
    best = objective(peak, half)
    for p, h in ((peak * 1.01, half), (peak * 0.99, half), (peak, half * 1.05), (peak, half * 0.95)):
        assert objective(p, h) > best


@pytest.mark.pure
def test_fit_alpha_beta_recovers_the_ring_model() -> None:
    """t = 2(n-1) a + 2(n-1)/n B b with n = 4, a = 50 us, b = 1e-9 s/B: 6 a + 1.5 B b."""
    alpha, beta = 50e-6, 1e-9
    points = [(b, 6 * alpha + 1.5 * b * beta) for b in (4096, 65536, 1 << 20, 8 << 20)]
    fitted = fit_alpha_beta(points, 4)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


@pytest.mark.pure
def test_fit_alpha_beta_of_a_one_pass_collective() -> None:
    """rounds=1, the all-gather / reduce-scatter ring formula: t = (n-1) a + (n-1)/n B b with n = 2, a = 200 us,
    b = 5e-9 s/B (0.2 GB/s): 200 us + 0.5 B * 5e-9."""
    points = [(b, 200e-6 + 0.5 * b * 5e-9) for b in (4096, 65536, 1 << 20, 8 << 20)]
    assert fit_alpha_beta(points, 2, rounds=1) == pytest.approx((200e-6, 5e-9), rel=1e-6)
    assert fit_alpha_beta(points, 2) == pytest.approx((100e-6, 2.5e-9), rel=1e-6)  # read as an all-reduce: half of each


@pytest.mark.pure
def test_fit_link_fits_each_collective_by_its_own_ring_formula() -> None:
    """Timings shaped like gloo's on this box at n = 2 (the lead's /tmp/gx/coll.py: 64 MiB all-reduce 51.6 ms,
    reduce-scatter 86.9 ms, all-gather 67.7 ms), written as exact ring formulas:
    all-reduce     2(n-1) a + 2(n-1)/n B b = 2 * 150 us + B / 1.3 GB/s          -> 1.3 GB/s, 150 us
    all-gather      (n-1) a +  (n-1)/n B b =     90 us + 0.5 B / 1.0 GB/s         -> 1.0 GB/s,  90 us
    reduce-scatter  (n-1) a +  (n-1)/n B b =    400 us + 0.5 B / 0.39 GB/s        -> 0.39 GB/s, 400 us
    so the reduce-scatter of a large tensor costs (0.5 / 0.39) / (1 / 1.3) = 1.67 x the all-reduce (the ring model: 0.5)."""
    sizes = (4096, 65536, 1 << 20, 8 << 20)
    points = {
        "all_reduce": [(b, 2 * 150e-6 + b / 1.3e9) for b in sizes],
        "all_gather": [(b, 90e-6 + 0.5 * b / 1.0e9) for b in sizes],
        "reduce_scatter": [(b, 400e-6 + 0.5 * b / 0.39e9) for b in sizes],
    }
    link = fit_link(points, 2)
    assert (link.bandwidth_GBps, link.latency_us) == (1.3, 150.0)
    assert (link.allgather_GBps, link.allgather_latency_us) == (1.0, 90.0)
    assert (link.reduce_scatter_GBps, link.reduce_scatter_latency_us) == (0.39, 400.0)


@pytest.mark.pure
def test_fit_link_of_a_ring_world_states_the_ring_numbers() -> None:
    """Collectives that run exactly at their ring share (n = 4: all-gather = reduce-scatter = half the all-reduce's
    bandwidth term and latency) fit the link's own bandwidth and latency for all three: 25 GB/s, 10 us."""
    sizes = (4096, 65536, 1 << 20, 8 << 20)
    ring = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    points = {kind: [(b, r * 3 * 10e-6 + r * 3 / 4 * b / 25e9) for b in sizes] for kind, r in ring.items()}
    link = fit_link(points, 4)
    assert link.bandwidth_GBps == link.allgather_GBps == link.reduce_scatter_GBps == 25.0
    assert link.latency_us == link.allgather_latency_us == link.reduce_scatter_latency_us == 10.0


@pytest.mark.multiprocess
def test_fleet_calibrate_writes_a_cluster_for_two_processes(tmp_path):
    """`fleet calibrate --nproc-per-node 2` measures under torchrun (gloo, 127.0.0.1) and writes a cluster file the planner
    loads: 2 devices, a measured link, and the framework probe's per-ZeRO-stage tables."""
    import subprocess
    import sys

    from lightning_fleet.planning import Calibration, load_cluster
    from tests.multiprocess import ROOT, worker_env

    out = tmp_path / "cluster.yaml"
    done = subprocess.run([sys.executable, "-m", "lightning_fleet", "calibrate", "--nproc-per-node", "2", "--out", str(out)],
                          env=worker_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # a short summary, none of the probe's framework messages (621 lines before they were kept out)
    lines = done.stdout.splitlines()
    assert done.stderr == "" and len(lines) == 8, done.stdout + done.stderr
    assert lines[0].startswith("fleet calibrate: 2 x cpu-") and "GEMM peak   fp32 " in lines[1]
    assert f"written to  {out}" in lines[-1]
    cluster = load_cluster(str(out))
    c = cluster.calibration
    assert cluster.world_size == 2 and cluster.intra_node.latency_us > 0
    # each collective's own fit, printed on the link line (gloo's reduce-scatter is no half all-reduce)
    assert cluster.intra_node.allgather_GBps and cluster.intra_node.reduce_scatter_GBps and "reduce-scatter" in lines[3]
    assert len(c.zero_step_overhead_s) == 4 and len(c.zero_tensor_overhead_s) == 4
    # measured extras beyond zero 0, clamped at 0: on this loaded 2-core machine a stage's extra can be under the noise
    # (ZeRO-3's per-tensor gathers measured 0.0 once, beside two other test lanes); their size is benchmarks' business
    assert all(v >= 0 for v in (*c.zero_step_overhead_s, *c.zero_tensor_overhead_s))
    assert any(v > 0 for v in (*c.zero_step_overhead_s[1:], *c.zero_tensor_overhead_s[1:]))  # sharding costs something
    # each runtime's own, at the shard levels it runs: what the planner prices its plans with
    assert {r.runtime: r.zero_stages for r in c.runtimes} == {"torch": (0, 1, 2, 3), "deepspeed": (0, 1, 2, 3)}
    assert "on each runtime: torch at zero 0, 1, 2, 3" in lines[6] and "deepspeed at zero 0, 1, 2, 3" in lines[6]
    torch_priced = cluster.for_runtime("torch").calibration
    assert torch_priced.zero_step_overhead_s[2] == c.runtimes[0].step_overhead_s[2]
    assert c.adam_params_per_s > 0 and c.op_overhead_s > 0 and c.memory_reserve_gib > 0.1
    assert 1e-11 < c.elementwise_s < 1e-7  # memory-bound operators: ~1 ns an element on this CPU
    assert "FLASH_ATTENTION fp32" in lines[5]  # the CPU's fused kernel was timed
    assert 0 < c.attention_efficiency < 10 and c.attention_efficiency != Calibration().attention_efficiency


@pytest.mark.pure
def test_fleet_calibrate_bad_process_count_is_one_line(capsys):
    from lightning_fleet.cli import main

    assert main(["calibrate", "--out", "x.yaml", "--nproc-per-node", "0"]) == 2
    assert "--nproc-per-node must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.pure
def test_elementwise_s_is_the_slope_not_the_dispatch() -> None:
    """The per-element cost of LayerNorm/GELU/add/softmax on this CPU: positive, well under a microsecond, and (being a
    slope over sizes) not inflated by the per-call dispatch that op_overhead_s prices."""
    import torch

    from lightning_fleet.calibrate.measure import elementwise_s

    seconds = elementwise_s(torch.device("cpu"))
    assert 1e-11 < seconds < 1e-7


@pytest.mark.pure
def test_fit_saturation_with_a_largest_peak_is_the_constrained_least_squares() -> None:
    """Bounded to max_peak, the fit takes the peak at the bound when the free fit lies above it, and the half size that
    then minimises the relative errors: moving the half 5 % either way only makes the objective larger."""
    points = [(d, 1e11 * d / (d + 100)) for d in (32, 64, 128, 256, 512)]
    bound = max(rate for _, rate in points)
    peak, half = fit_saturation(points, max_peak=bound)
    assert peak == bound and 0 < half < 100

    def objective(h: float) -> float:
        return sum((bound * d / (d + h) / rate - 1) ** 2 for d, rate in points)

    assert objective(half) < objective(half * 1.05) and objective(half) < objective(half * 0.95)
    assert fit_saturation(points, max_peak=2e11) == pytest.approx(fit_saturation(points))  # a bound above the fit changes nothing


@pytest.mark.pure
def test_a_curve_still_rising_is_not_extrapolated() -> None:
    """Rates that grow faster than the curve can follow (bf16 on this VM's AMX: 4 GFLOP/s at d = 32, 1.7 TFLOP/s at
    d = 406, measured) fitted half = 1e5 and a peak of ~20 TFLOP/s unbounded; the peak written is the fastest measured."""
    from lightning_fleet.calibrate.measure import fit_matmul

    measured = [(32, 4.1e9), (51, 19.4e9), (64, 38.2e9), (102, 137.5e9), (128, 249.3e9), (203, 661e9), (256, 914.7e9),
                (406, 1584e9), (512, 1521e9), (1024, 1637e9)]
    fit = fit_matmul("bf16", measured)
    assert fit.unbounded_peak_flops > 10e12 and fit.bounded
    assert fit.peak_flops == fit.best_flops == 1637e9
    assert not fit.still_rising  # 1024 ran at 1637, not 5 % above 1584


@pytest.mark.pure
def test_matmul_points_grow_the_gemm_while_it_gets_faster(monkeypatch) -> None:
    """After MATMUL_SHAPES, square GEMMs of doubling width are measured while each is >= 5 % faster than all before,
    so a saturating device's fastest GEMM is within a few percent of its peak; a flat one adds a single size."""
    import torch

    from lightning_fleet.calibrate import measure

    def saturating(tokens, width, device, dtype, dispatch_s=0.0):  # r(d) = 1e14 * d / (d + 300), a GPU-like curve
        d = (tokens * width * width) ** (1 / 3)
        return 1e14 * d / (d + 300)

    monkeypatch.setattr(measure, "matmul_rate", saturating)
    points = measure.matmul_points(torch.device("cpu"), torch.float32, 0.0)
    widths = [round(d) for d, _ in points[len(measure.MATMUL_SHAPES):]]
    assert widths == [1024, 2048, 4096, 8192]  # 8192 is the largest width; 4096 -> 8192 still gains 3.5 % < 5 %: stops
    fit = measure.fit_matmul("bf16", points)
    assert fit.peak_flops == fit.best_flops and 0.96e14 < fit.peak_flops <= 1e14

    monkeypatch.setattr(measure, "matmul_rate", lambda *args, **kwargs: 2e11)
    points = measure.matmul_points(torch.device("cpu"), torch.float32, 0.0)
    assert len(points) == len(measure.MATMUL_SHAPES) + 1
    fit = measure.fit_matmul("fp32", points)
    assert (fit.peak_flops, fit.half_dim, fit.bounded) == (pytest.approx(2e11), 0.0, False)


@pytest.mark.pure
def test_summary_says_what_was_measured_in_eight_lines() -> None:
    """The summary names the device, the peaks (and when the bound applied), memory, link, operators, attention,
    framework, file."""
    import dataclasses

    from lightning_fleet.calibrate.command import summary
    from lightning_fleet.calibrate.measure import AttentionFit, AttentionPoint, MatmulFit, Measurement
    from lightning_fleet.planning import Calibration
    from tests.conftest import make_cluster

    cluster = make_cluster(nodes=1, devices_per_node=2, step_overhead_s=0.002, microbatch_overhead_s=0.0003)
    fits = (
        MatmulFit(precision="fp32", points=((32.0, 1e11), (64.0, 2e11)), peak_flops=2.3e11, half_dim=10.0,
                  unbounded_peak_flops=2.3e11),
        MatmulFit(precision="bf16", points=((32.0, 1e11), (64.0, 1.6e12)), peak_flops=1.6e12, half_dim=1e5,
                  unbounded_peak_flops=2e13),
    )
    lines = summary(Measurement(cluster=cluster, matmul=fits), cluster, "out.yaml", 12.3, framework=True)
    assert len(lines) == 8 and lines[0] == "fleet calibrate: 2 x gpu on 1 node(s), measured in 12.3 s"
    assert "fp32 0.23 TFLOP/s (still rising at d=64" in lines[1]
    assert "bf16 1.6 TFLOP/s (the fastest GEMM measured; the unbounded fit said 20)" in lines[1]
    assert lines[5] == ("  attention   causal scaled_dot_product_attention runs the math path here: efficiency not measured "
                        "(default 0.83 kept)")
    assert "2 ms per step, 0.3 ms per micro-batch" in lines[6] and lines[7].startswith("  written to  out.yaml")
    unprobed = summary(Measurement(cluster=cluster, matmul=fits), cluster, "o", 1.0, framework=False)
    assert "not measured (--no-framework)" in unprobed[6]
    # a fit: two shapes at 0.5 and 0.7 (forward 1 s, backward 2 s and 3 s), the median 0.6 written
    points = [AttentionPoint(shape=(1, 1, 8, 8), forward_s=1.0, total_s=t, gemm_flops_per_s=1.0) for t in (3.0, 4.0)]
    fit = AttentionFit(precision="bf16", backend="FLASH_ATTENTION", points=tuple(points), efficiencies=(0.5, 0.7), efficiency=0.6,
                       capped=0)
    fitted = cluster.with_calibration(Calibration(attention_efficiency=0.6))
    lines = summary(Measurement(cluster=fitted, matmul=fits, attention=fit), fitted, "o", 1.0, framework=True)
    assert lines[5] == ("  attention   fused kernel at 0.6 x the GEMM rate (causal SDPA, FLASH_ATTENTION bf16, median of 2 "
                        "shapes 0.5-0.7); backward 2.5 x forward (priced 2.5)")
    capped = dataclasses.replace(fit, efficiencies=(0.5, 10.0), capped=1)
    line = summary(Measurement(cluster=fitted, matmul=fits, attention=capped), fitted, "o", 1.0, framework=True)[5]
    assert line.endswith("shapes 0.5-10); backward 2.5 x forward (priced 2.5); 1 shape(s) at the bound 10 (measured faster than "
                         "the bound allows)")


QUIET_SCRIPT = """
import logging, os, sys, warnings
from lightning_fleet.calibrate.probe import quiet_output
logging.basicConfig(level=logging.INFO)
levels = (logging.getLogger().level, logging.getLogger("DeepSpeed").level)
filters = list(warnings.filters)
with quiet_output():
    print("python stdout")
    print("python stderr", file=sys.stderr)
    os.write(1, b"fd 1\\n")
    os.write(2, b"fd 2\\n")
    warnings.warn("a warning")
    logging.getLogger("DeepSpeed").warning("a log record")
    os.system("echo from a subprocess")
assert (logging.getLogger().level, logging.getLogger("DeepSpeed").level) == levels and warnings.filters == filters
print("after")
if sys.argv[1] == "fail":
    with quiet_output():
        print("the probe said why")
        raise RuntimeError("probe failed")
"""


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_quiet_output_keeps_everything_out_then_restores(mode, tmp_path) -> None:
    """Inside quiet_output nothing reaches the real stdout/stderr (Python, fd writes, warnings, logs, subprocesses);
    afterwards output, logger levels and warning filters are as before; on failure the captured tail is shown."""
    import subprocess
    import sys

    from tests.multiprocess import ROOT, worker_env

    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, mode], env=worker_env(tmp_path), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "after\n"
    if mode == "ok":
        assert done.returncode == 0 and done.stderr == ""
    else:
        assert done.returncode == 1
        assert done.stderr.startswith("the probe said why\n") and "RuntimeError: probe failed" in done.stderr


@pytest.mark.pure
def test_matmul_points_stop_before_a_gemm_would_take_too_long(monkeypatch) -> None:
    """A slow device whose rate keeps rising: the next GEMM is not run once one call would exceed MATMUL_LONGEST_S."""
    import torch

    from lightning_fleet.calibrate import measure

    def slow_rising(tokens, width, device, dtype, dispatch_s=0.0):  # 1 GFLOP/s at d = 512, doubling with d
        return 1e9 * (tokens * width * width) ** (1 / 3) / 512

    monkeypatch.setattr(measure, "matmul_rate", slow_rising)
    points = measure.matmul_points(torch.device("cpu"), torch.float32, 0.0)
    assert len(points) == len(measure.MATMUL_SHAPES)  # 2 * 1024**3 / 1e9 = 2.1 s > 1 s: not run
    monkeypatch.setattr(measure, "MATMUL_LONGEST_S", 3.0)
    points = measure.matmul_points(torch.device("cpu"), torch.float32, 0.0)
    assert [round(d) for d, _ in points[len(measure.MATMUL_SHAPES):]] == [1024]  # 2048 would take 8.6 s


def _attention_point(total_s: float, shape: tuple[int, int, int, int] = (2, 4, 128, 32)):
    from lightning_fleet.calibrate.measure import AttentionPoint

    return AttentionPoint(shape=shape, forward_s=total_s / 3.5, total_s=total_s, gemm_flops_per_s=1e11)


@pytest.mark.pure
def test_attention_point_counts_as_the_cost_model() -> None:
    """b = 2, a = 4, s = 128, d = 32 (h = 128): the causal kernel executes 4 s^2 h / 2 = 2 * 16384 * 128 = 4194304 FLOPs a
    sample, 8388608 for two (the kernel's softmax is inside its time: no memory-bound elements)."""
    point = _attention_point(1e-3)
    assert point.kernel_flops == 8388608


@pytest.mark.pure
def test_attention_efficiency_by_hand() -> None:
    """The shape above at a GEMM rate of 1e11 FLOP/s: at efficiency 0.5 the cost model prices the kernel, forward and
    backward, at 3.5 * 8388608 / (1e11 * 0.5) = 587.20256 us; that measured time gives back 0.5, and so does it with
    10 us more of dispatch for each of the two calls when dispatch_s = 10 us is taken off."""
    from lightning_fleet.calibrate.measure import attention_efficiency_of

    assert attention_efficiency_of(_attention_point(587.20256e-6)) == pytest.approx(0.5, rel=1e-12)
    assert attention_efficiency_of(_attention_point(607.20256e-6), 10e-6) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.pure
def test_attention_efficiency_is_bounded() -> None:
    """A kernel measured faster than the bound (10) allows is fitted at the bound: 587.20256 us at 0.5 -> 29.360128 us
    at 10; and when the dispatch alone takes the measured time nothing is left to fit."""
    from lightning_fleet.calibrate.measure import attention_efficiency_of
    from lightning_fleet.planning.cluster import ATTENTION_EFFICIENCY_MAX

    assert attention_efficiency_of(_attention_point(20e-6)) == ATTENTION_EFFICIENCY_MAX == 10  # would be 14.7
    assert attention_efficiency_of(_attention_point(29.360128e-6 * 2)) == pytest.approx(5.0)
    assert attention_efficiency_of(_attention_point(20e-6), 10e-6) == 10


@pytest.mark.pure
def test_fit_attention_efficiency_is_the_median_of_the_shapes() -> None:
    """Shapes at 0.25, 0.5 and the bound (kernel times 2x and 1x the 587.20256 us of 0.5, and 10 us): the median 0.5, one
    capped."""
    from lightning_fleet.calibrate.measure import fit_attention_efficiency

    points = [_attention_point(t) for t in (2 * 587.20256e-6, 587.20256e-6, 10e-6)]
    fit = fit_attention_efficiency(points, precision="fp32", backend="FLASH_ATTENTION")
    assert fit.efficiencies == pytest.approx((0.25, 0.5, 10.0)) and fit.efficiency == pytest.approx(0.5) and fit.capped == 1
    assert fit.backward_ratio == pytest.approx(2.5)  # forward_s = total / 3.5


@pytest.mark.pure
def test_attention_efficiency_in_a_cluster_file_is_checked_and_round_trips() -> None:
    """A cluster file's attention_efficiency: above the bound or not positive, one line naming the key; a measured value
    survives dump and load."""
    import yaml

    from lightning_fleet.planning import SpecError, cluster_from_dict
    from tests.conftest import make_cluster

    cluster = make_cluster(attention_efficiency=0.594)
    assert cluster_from_dict(yaml.safe_load(cluster.to_yaml())) == cluster
    data = cluster.to_dict()
    for bad, says in ((83.0, "calibration.attention_efficiency is a fused attention kernel's rate over the GEMMs' and must be "
                              "<= 10, got 83.0: measure it with fleet calibrate or leave it out"),
                      (0, "calibration.attention_efficiency must be > 0, got 0")):
        data["calibration"]["attention_efficiency"] = bad
        with pytest.raises(SpecError) as error:
            cluster_from_dict(data)
        assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.pure
def test_measure_attention_times_the_cpu_fused_kernel_on_tiny_shapes() -> None:
    """On this CPU, causal scaled_dot_product_attention runs PyTorch's fused flash kernel (what profiling prices as fused);
    two tiny shapes give a finite positive efficiency against a stated 100 GFLOP/s GEMM curve, forward and backward timed."""
    import math

    import torch

    from lightning_fleet.calibrate.measure import MatmulFit, fused_attention_backend, measure_attention

    cpu = torch.device("cpu")
    assert fused_attention_backend((2, 2, 64, 16), cpu, torch.float32) == "FLASH_ATTENTION"
    curve = MatmulFit(precision="fp32", points=((64.0, 1e11),), peak_flops=1e11, half_dim=0.0, unbounded_peak_flops=1e11)
    fit = measure_attention(cpu, curve, 0.0, shapes=((2, 2, 64, 16), (1, 2, 128, 16)))
    assert fit is not None and fit.backend == "FLASH_ATTENTION" and fit.precision == "fp32" and len(fit.points) == 2
    assert all(p.gemm_flops_per_s == 1e11 and 0 < p.forward_s < p.total_s for p in fit.points)
    assert math.isfinite(fit.efficiency) and 0 < fit.efficiency <= 10


@pytest.mark.unit
def test_one_process_has_one_speed_and_no_per_rank_devices(monkeypatch) -> None:
    """Without a process group every rank-wide figure is this process' own, and one rank never differs from itself;
    one round of the sustained probe runs its GEMMs and adds for the time asked (the mean over the span, not a median)."""
    import time

    import torch

    from lightning_fleet.calibrate import measure

    assert measure.all_ranks(3.5, torch.device("cpu")) == [3.5]
    start = time.perf_counter()
    speed = measure.sustained_speed(torch.device("cpu"), width=64, seconds=0.05)
    assert time.perf_counter() - start >= 0.05 and speed.flops_per_s > 0 and speed.ops_per_s > 0
    monkeypatch.setattr(measure, "matmul_rate", lambda *args, **kwargs: 2e11)
    start = time.perf_counter()
    _, _, ranks = measure._device_spec(torch.device("cpu"), measure.WorldShape(world_size=1, local_world_size=1, num_nodes=1), 0.0)
    # one process has no rank to compare: one shortest round, not RANK_PROBE_S (1 s at every single-process start)
    assert time.perf_counter() - start < measure.RANK_PROBE_S / 2
    assert len(ranks.flops_rounds) == 1 and ranks.world_size == 1 and not ranks.differ()
    assert ranks.judged().line() == "ranks    one process: no other rank to compare, not probed"
    assert ranks.host_is_device and ranks.identity == (measure.device_identity(measure.device_identity_text(torch.device("cpu"))),)


def _probe(device: list[tuple[float, ...]], host: list[tuple[float, ...]] | None = None, memory=(10.0, 10.0), identity=(7, 7),
           cpu: bool = True):
    """A probe of two ranks, round by round (GEMM rates as given; host rates the same unless given)."""
    from lightning_fleet.calibrate.ranks import RankMeasures

    return RankMeasures(flops_rounds=tuple(device), ops_rounds=tuple(host or device), memory_gib=memory, identity=identity,
                        host_is_device=cpu)


@pytest.mark.pure
def test_a_rank_is_slower_only_where_every_probe_round_says_so() -> None:
    """Rank 1 at half speed in three of four rounds and level in one (another process' time slice on a busy machine) is
    the same device; at half speed in each round it is slower, by the inverse of its median slowdown over the rounds.
    The single-probe rule this replaces split on any one round at 1.2x (the first round here)."""
    passing = _probe([(1.0, 0.5), (1.0, 0.5), (0.5, 0.5), (1.0, 0.5)])
    judged = passing.judged()
    assert judged.speeds == judged.host_speeds == (1.0, 1.0) and not judged.differ and not passing.differ()
    assert passing.flops_per_s == (1.0, 0.5)  # its median: what the old single probe took as the speed
    assert judged.line().startswith("ranks    alike: no rank slower by 1.2x in each of 4 probe rounds")
    assert "rank 1 GEMMs 0.50/0.50/1.00/0.50, host 0.50/0.50/1.00/0.50" in judged.line()
    slow = _probe([(1.0, 0.5), (2.0, 0.8), (1.0, 0.4), (1.0, 0.5)]).judged()  # slowdowns 2, 2.5, 2.5, 2
    assert slow.differ and slow.slower == (1,)
    assert slow.speeds == slow.host_speeds == (1.0, pytest.approx(1 / 2.25))
    assert slow.line().startswith("ranks    differ: rank(s) 1 slower by 1.2x or more in each of 4 probe rounds (GEMMs and host); "
                                  "speeds 1.00/0.44, host 1.00/0.44; all report one device (host, model, cores)")
    # the threshold: 1.2x in each round is slower, 1.19x in one of them is not
    assert _probe([(1.2, 1.0)] * 3 + [(1.19, 1.0)]).judged().speeds == (1.0, 1.0)
    assert _probe([(1.2, 1.0)] * 4).judged().speeds == (1.0, pytest.approx(1 / 1.2))


@pytest.mark.pure
def test_on_a_cpu_both_figures_must_agree_and_one_identity_holds_one_memory() -> None:
    """A CPU rank's GEMMs and its dispatch time the same cores: a host that is slower in every round while its GEMMs
    keep pace is noise there (judged alike), but on a GPU it is a slower host (host_slowdown). Ranks of one identity
    hold the least of their memories (a CPU rank's share of the host's available RAM moved 10 % between two reads);
    devices of another identity differ by RANK_MEMORY_SPREAD."""
    gemms, host = [(1.0, 1.0)] * 4, [(5.0, 2.5)] * 4
    assert _probe(gemms, host).judged().speeds == _probe(gemms, host).judged().host_speeds == (1.0, 1.0)
    gpu = _probe(gemms, host, cpu=False).judged()
    assert gpu.speeds == (1.0, 1.0) and gpu.host_speeds == (1.0, 0.5) and gpu.slower == (1,)
    assert "(GEMMs or host)" in gpu.line()
    wobble = _probe(gemms, memory=(10.0, 9.0)).judged()
    assert wobble.memory_gib == (9.0, 9.0) and not wobble.differ
    cards = _probe(gemms, memory=(80.0, 40.0), identity=(1, 2), cpu=False).judged()
    assert cards.memory_gib == (80.0, 40.0) and cards.differ and not cards.slower
    assert cards.line().startswith("ranks    differ in memory: 80/40 GiB; 2 device identities (ranks 0; 1)")


@pytest.mark.pure
def test_rank_measures_make_one_device_each_from_the_judged_speeds() -> None:
    """Where the ranks differ each gets the fastest device scaled by its judged speeds, with its identity's memory; where
    they do not (also when a difference did not persist) the cluster lists no rank devices."""
    from lightning_fleet.calibrate.measure import rank_devices, with_rank_devices
    from lightning_fleet.calibrate.ranks import RankMeasures
    from lightning_fleet.planning import load_cluster

    cpu = load_cluster("cpu")
    device = cpu.groups[0].device
    assert rank_devices(device, _probe([(1.0, 0.5), (1.0, 1.0)] * 2)) == ()
    slow = rank_devices(device, _probe([(2.0, 1.0)] * 4, [(6.0, 2.0)] * 4))
    assert [d.slowdown for d in slow] == [1.0, 2.0] and [d.host_slowdown for d in slow] == [1.0, 3.0]
    assert slow[1].peak_tflops.fp32 == device.peak_tflops.fp32 / 2 and [d.memory_gib for d in slow] == [10.0, 10.0]
    two = dataclasses.replace(cpu, groups=(dataclasses.replace(cpu.groups[0], devices_per_node=2),))
    assert with_rank_devices(two, _probe([(2.0, 1.0)] * 4)).rank_devices[1].slowdown == 2.0
    assert with_rank_devices(dataclasses.replace(two, rank_devices=slow), _probe([(1.0, 1.0)] * 4)).rank_devices == ()
    with pytest.raises(ValueError, match="rank measures need the same ranks in each round and positive rates"):
        RankMeasures(flops_rounds=((1.0,),), ops_rounds=((1.0, 1.0),), memory_gib=(1.0,), identity=(1,))


@pytest.mark.unit
def test_the_cache_keeps_no_per_rank_speed(tmp_path) -> None:
    """A job's measurement is cached without its rank devices, and a cache written before (which kept them: every later
    job on the host split its batch by one busy measurement) reads back without them; an explicit cluster file
    (``fleet calibrate --out``) keeps them."""
    from lightning_fleet.calibrate.measure import load_cached, save_cache, write_cluster
    from lightning_fleet.planning import cluster_from_dict, load_cluster
    from lightning_fleet.planning.cluster import devices_by_speed

    cpu = load_cluster("cpu")
    two = dataclasses.replace(cpu, groups=(dataclasses.replace(cpu.groups[0], devices_per_node=2),))
    split = dataclasses.replace(two, rank_devices=devices_by_speed(two.groups[0].device, [1.0, 0.4], [1.0, 0.45]))
    save_cache(split, tmp_path / "new.yaml")
    assert "rank_devices" not in (tmp_path / "new.yaml").read_text() and load_cached(tmp_path / "new.yaml") == two
    write_cluster(split, tmp_path / "old.yaml")  # what the cache held before
    assert "rank_devices" in (tmp_path / "old.yaml").read_text() and load_cached(tmp_path / "old.yaml") == two
    assert cluster_from_dict(yaml.safe_load((tmp_path / "old.yaml").read_text())) == split
