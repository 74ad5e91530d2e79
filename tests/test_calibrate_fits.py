"""Tier-1 tests of the fits `fleet calibrate` applies to its microbenchmarks (lightning_fleet/calibrate.py)."""

from __future__ import annotations

import pytest

from lightning_fleet.calibrate import fit_alpha_beta, fit_saturation, least_squares_line


def test_least_squares_line_through_exact_points() -> None:
    """y = 3 + 2x exactly: intercept 3, slope 2."""
    assert least_squares_line([1.0, 2.0, 4.0], [5.0, 7.0, 11.0]) == pytest.approx((3.0, 2.0))


def test_least_squares_line_averages_noise() -> None:
    """(0, 1), (1, 1), (2, 4): mean x 1, mean y 2; slope (-1*-1 + 0 + 1*2) / 2 = 1.5, intercept 2 - 1.5 = 0.5."""
    assert least_squares_line([0.0, 1.0, 2.0], [1.0, 1.0, 4.0]) == pytest.approx((0.5, 1.5))


def test_fit_saturation_recovers_peak_and_half_size() -> None:
    """Rates from r(d) = 1e11 * d / (d + 100) at d = 32 ... 512 give back (1e11, 100)."""
    points = [(d, 1e11 * d / (d + 100)) for d in (32, 64, 128, 256, 512)]
    peak, half = fit_saturation(points)
    assert peak == pytest.approx(1e11, rel=1e-9) and half == pytest.approx(100, rel=1e-9)


def test_fit_saturation_flat_rate() -> None:
    """A rate that falls with size (no saturation to fit): half size 0 and the peak that minimises the relative
    errors, sum((p / r - 1)^2) -> p = sum(1/r) / sum(1/r^2)."""
    peak, half = fit_saturation([(64, 2e10), (512, 1.5e10)])
    assert half == 0.0
    assert peak == pytest.approx((1 / 2e10 + 1 / 1.5e10) / (1 / 2e10**2 + 1 / 1.5e10**2), rel=1e-12)


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


def test_fit_alpha_beta_recovers_the_ring_model() -> None:
    """t = 2(n-1) a + 2(n-1)/n B b with n = 4, a = 50 us, b = 1e-9 s/B: 6 a + 1.5 B b."""
    alpha, beta = 50e-6, 1e-9
    points = [(b, 6 * alpha + 1.5 * b * beta) for b in (4096, 65536, 1 << 20, 8 << 20)]
    fitted = fit_alpha_beta(points, 4)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


def test_fleet_calibrate_writes_a_cluster_for_two_processes(tmp_path):
    """`fleet calibrate --nproc-per-node 2` measures under torchrun (gloo, 127.0.0.1) and writes a cluster file the planner
    loads: 2 devices, a measured link, and the framework probe's per-ZeRO-stage tables."""
    import subprocess
    import sys

    from lightning_fleet.planning import load_cluster
    from tests.multiprocess import ROOT, worker_env

    out = tmp_path / "cluster.yaml"
    done = subprocess.run([sys.executable, "-m", "lightning_fleet", "calibrate", "--nproc-per-node", "2", "--out", str(out)],
                          env=worker_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cluster = load_cluster(str(out))
    c = cluster.calibration
    assert cluster.world_size == 2 and cluster.intra_node.latency_us > 0
    assert len(c.zero_step_overhead_s) == 4 and len(c.zero_tensor_overhead_s) == 4
    assert c.zero_tensor_overhead_s[3] > 0  # ZeRO-3's gathers cost time per tensor
    assert c.adam_params_per_s > 0 and c.op_overhead_s > 0 and c.memory_reserve_gib > 0.1
    assert 1e-11 < c.elementwise_s < 1e-7  # memory-bound operators: ~1 ns an element on this CPU


def test_fleet_calibrate_bad_process_count_is_one_line(capsys):
    from lightning_fleet.cli import main

    assert main(["calibrate", "--out", "x.yaml", "--nproc-per-node", "0"]) == 2
    assert "--nproc-per-node must be >= 1, got 0" in capsys.readouterr().err


def test_elementwise_s_is_the_slope_not_the_dispatch() -> None:
    """The per-element cost of LayerNorm/GELU/add/softmax on this CPU: positive, well under a microsecond, and (being a
    slope over sizes) not inflated by the per-call dispatch that op_overhead_s prices."""
    import torch

    from lightning_fleet.calibrate import elementwise_s

    seconds = elementwise_s(torch.device("cpu"))
    assert 1e-11 < seconds < 1e-7
