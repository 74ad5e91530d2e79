"""The presets benchmark's pure parts (benchmarks/vs_presets.py): merging ranks, the limit, the rankings, the report rows."""

from __future__ import annotations

import math

import pytest

from benchmarks.vs_presets import GIB, MIB, LAYOUTS, STRATEGIES, Outcome, chosen_plan, group_section, limit_between, merge_ranks, ranking

pytestmark = pytest.mark.pure


def _outcome(strategy: str, step_s: float, predicted_s: float, error: str = "") -> Outcome:
    return Outcome(model="gpt", size="S", strategy=strategy, ran_as="named", step_s=step_s, peak_rss_bytes=GIB, cgroup_peak_bytes=math.nan,
                   error=error, plan="dp=2,zero=0", predicted_step_s=predicted_s, predicted_bytes=GIB / 2)


def test_every_preset_has_a_layout() -> None:
    assert set(LAYOUTS) == set(STRATEGIES) - {"fleet"}


def test_merge_ranks_takes_the_slowest_rank_and_largest_peak() -> None:
    merged = merge_ranks([{"error": "", "median_step_s": 0.5, "peak_rss_bytes": 10}, {"error": "", "median_step_s": 0.7, "peak_rss_bytes": 8}])
    assert (merged["median_step_s"], merged["peak_rss_bytes"], merged["error"]) == (0.7, 10, "")


def test_merge_ranks_keeps_an_error_and_drops_the_time() -> None:
    merged = merge_ranks([{"error": "", "median_step_s": 0.5, "peak_rss_bytes": 10}, {"error": "OOM", "median_step_s": math.nan, "peak_rss_bytes": 9}])
    assert merged["error"] == "OOM" and math.isnan(merged["median_step_s"])
    assert merge_ranks([])["error"] == "no rank wrote a result"


def test_limit_between_is_the_midpoint_rounded_down() -> None:
    """Peaks 500 MiB and 640 MiB: midpoint 570 MiB, rounded down to 16 MiB steps = 560 MiB."""
    assert limit_between([500 * MIB, math.nan, 640 * MIB, 600 * MIB]) == 560 * MIB
    with pytest.raises(ValueError):
        limit_between([500 * MIB])


def test_ranking_orders_by_measured_time_and_skips_failures() -> None:
    """Measured 1.0, 2.0, 3.0 against predicted 0.2, 0.1, 0.3: predicted ranks 2, 1, 3; d^2 = 1+1+0 = 2, rho = 1 - 6*2/(3*8) = 0.5."""
    outcomes = [_outcome("ddp", 2.0, 0.1), _outcome("fleet", 1.0, 0.2), _outcome("fsdp", 3.0, 0.3),
                _outcome("deepspeed_stage_3", math.nan, 0.05, error="killed")]
    rows, rho = ranking(outcomes)
    assert [(o.strategy, p, m) for o, p, m in rows] == [("fleet", 2.0, 1.0), ("ddp", 1.0, 2.0), ("fsdp", 3.0, 3.0)]
    assert rho == pytest.approx(0.5)


def test_chosen_plan_reads_fleets_startup_report() -> None:
    log = "lightning_fleet plan for GPT ...\n  profiling: meta\n  chosen   dp=2,tp=1,pp=1,zero=1,mbs=8,gas=1 \n  searched 200"
    assert chosen_plan(log) == "dp=2,tp=1,pp=1,zero=1,mbs=8,gas=1"
    assert chosen_plan("Traceback ...\nchosen poorly") == ""


def test_group_section_says_why_a_strategy_did_not_run() -> None:
    text = "\n".join(group_section("gpt", "S", 4.9e6, 16, [_outcome("ddp", 0.5, 0.4), _outcome("fsdp", math.nan, 0.6, error="boom")]))
    assert "| ddp | named | 0.5000 | 32.0 |" in text
    assert "did not run: boom" in text
    assert "4.9 M parameters, global batch 16" in text
