"""The cost-model benchmark's statistics and plan enumeration (benchmarks/cost_model.py), checked by hand."""

from __future__ import annotations

import pytest

from benchmarks import cost_model
from benchmarks.cost_model import executable_plans, ranks, regret, relative_error, round_noise, spearman
from lightning_fleet.planning import parse_plan
from lightning_fleet.runtime.base import ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

pytestmark = pytest.mark.pure


def test_ranks_average_ties() -> None:
    assert ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]


def test_spearman() -> None:
    """Same order: 1; reversed: -1; x = 1..4, y = 1,3,2,4: d^2 = 0+1+1+0 = 2, 1 - 6*2/(4*15) = 0.8."""
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_round_noise_is_the_median_half_range_over_jobs_run_more_than_once() -> None:
    """Half-ranges over medians: (0.6-0.4)/2/0.5 = 0.2, (1.1-0.9)/2/1.0 = 0.1, (2.2-1.8)/2/2.0 = 0.1; one run adds nothing."""
    assert round_noise([[0.4, 0.5, 0.6], [0.9, 1.0, 1.1], [1.8, 2.0, 2.2], [7.0]]) == pytest.approx(0.1)
    assert round_noise([[3.0]]) == 0.0


def test_relative_error_and_regret() -> None:
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert relative_error(0.5, 1.0) == pytest.approx(0.5)
    assert regret(1.1, [1.0, 1.1, 2.0]) == pytest.approx(1.1)


def test_executable_plans_are_what_the_runtime_runs() -> None:
    """Two processes, 4 layers, 4 heads, global batch 4: dp=2 (mbs 1, 2), tp=2 (mbs 1, 2, 4), pp=2 (mbs 1, 2, 4); 8 ZeRO/offload
    combinations (ZeRO 0, 1, 1+opt, 2, 2+opt, 3, 3+opt, 3+opt+params; at pp=2 only ZeRO 0 and 1) x 2 recomputations."""
    plans = executable_plans(2, num_layers=4, num_heads=4, global_batch=4)
    assert len(plans) == 8 * 2 * 2 + 8 * 2 * 3 + 2 * 2 * 3
    assert len(set(plans)) == len(plans)
    allowed = DEEPSPEED.constraints(ModuleHooks.assumed())
    for text in plans:
        plan = parse_plan(text)  # valid: offload needs ZeRO >= 1, parameter offload ZeRO-3
        assert plan.dp * plan.tp * plan.pp == 2 and plan.dp * plan.mbs * plan.gas == 4
        if plan.pp > 1:
            assert plan.zero <= allowed.max_zero_with_pp and plan.tp == 1 and str(plan.offload) == "none"


def test_timed_steps_follow_the_prediction_within_bounds() -> None:
    """0.3 s of timed steps by the predicted step time, at least 3 (a median) and at most 5."""
    assert cost_model.timed_steps(0.01) == 5
    assert cost_model.timed_steps(0.075) == 4  # ceil(0.3 / 0.075) = 4
    assert cost_model.timed_steps(0.1) == 3
    assert cost_model.timed_steps(2.0) == 3


def test_combine_runs_keeps_the_fastest_time_and_the_largest_memory() -> None:
    runs = [
        {"measured_step_s": 0.12, "measured_peak_bytes": 100.0, "error": "", "step_samples": 3},
        {"measured_step_s": 0.10, "measured_peak_bytes": 90.0, "error": "", "step_samples": 4},
    ]
    out = cost_model.combine_runs(runs)
    assert out["measured_step_s"] == 0.10 and out["step_samples"] == 4
    assert out["measured_peak_bytes"] == 100.0
    assert out["runs_step_s"] == [0.12, 0.10]


def test_combine_runs_reports_a_failed_run() -> None:
    runs = [
        {"measured_step_s": 0.12, "measured_peak_bytes": 100.0, "error": ""},
        {"measured_step_s": float("nan"), "measured_peak_bytes": float("nan"), "error": "did not finish within 180 s"},
    ]
    assert cost_model.combine_runs(runs)["error"] == "did not finish within 180 s"
