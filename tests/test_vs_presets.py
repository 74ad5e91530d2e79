"""The presets benchmark's pure parts (benchmarks/vs_presets.py): merging ranks, the limit, the rankings, the report rows."""

from __future__ import annotations

import math

import pytest

from benchmarks.vs_presets import (GIB, MIB, LAYOUTS, STRATEGIES, Outcome, chosen_plan, combine_rounds, group_section, limit_between,
                                    lower_quartile, merge_ranks, ranking, round_order, verdict, verdict_section)

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
    assert "| ddp | named | 0.5000 | - | 32.0 |" in text
    assert "did not run: boom" in text
    assert "4.9 M parameters, global batch 16" in text


def _rounds(strategy: str, rounds: tuple[float, ...]) -> Outcome:
    import statistics

    return Outcome(model="gpt", size="S", strategy=strategy, ran_as="named", step_s=statistics.median(rounds), peak_rss_bytes=GIB,
                   cgroup_peak_bytes=math.nan, error="", plan="dp=2,zero=0", predicted_step_s=0.1, predicted_bytes=GIB / 2,
                   round_step_s=rounds, quiet_step_s=min(rounds))


def test_lower_quartile_and_the_slowest_rank_step_by_step() -> None:
    assert lower_quartile([0.9, 0.1, 0.5, 0.3, math.nan, 0.7]) == 0.3  # sorted 0.1 0.3 0.5 0.7 0.9: index 5 // 4 = 1
    assert math.isnan(lower_quartile([]))
    merged = merge_ranks([{"error": "", "median_step_s": 0.5, "peak_rss_bytes": 1, "step_times_s": [0.5, 0.4]},
                          {"error": "", "median_step_s": 0.6, "peak_rss_bytes": 1, "step_times_s": [0.4, 0.6]}])
    assert merged["step_times_s"] == [0.5, 0.6]


def test_combine_rounds_takes_the_median_of_round_medians_and_fails_a_strategy_that_failed_once() -> None:
    rounds = [{"error": "", "median_step_s": s, "peak_rss_bytes": b, "cgroup_peak_bytes": b, "step_times_s": [s, s]}
              for s, b in ((0.5, 3), (0.9, 5), (0.6, 4))]
    combined = combine_rounds(rounds)
    assert combined["step_times_s"] == [0.5, 0.5, 0.9, 0.9, 0.6, 0.6]
    assert (combined["median_step_s"], combined["round_step_s"], combined["peak_rss_bytes"], combined["cgroup_peak_bytes"]) == (0.6, [0.5, 0.9, 0.6], 5, 5)
    failed = combine_rounds([*rounds, {"error": "killed", "median_step_s": math.nan, "peak_rss_bytes": 9, "cgroup_peak_bytes": 9}])
    assert failed["error"] == "killed" and math.isnan(failed["median_step_s"])


def test_round_order_reverses_every_other_round() -> None:
    assert round_order(("a", "b", "c"), 0) == ("a", "b", "c")
    assert round_order(("a", "b", "c"), 1) == ("c", "b", "a")
    assert round_order(("a", "b", "c"), 2) == ("a", "b", "c")


def test_verdict_compares_fleet_with_the_fastest_preset_and_measures_the_noise() -> None:
    """fastest preset fsdp (median 0.50) vs fleet (median 0.52): 0.50/0.52 = 0.9615; paired per round 0.48/0.50, 0.50/0.52,
    0.56/0.54. Noise: half-ranges over medians -- fsdp (0.56-0.48)/2/0.50 = 0.08, fleet (0.54-0.50)/2/0.52 = 0.03846, ddp
    (0.70-0.60)/2/0.62 = 0.0806; median 0.08, so 0.9615 >= 0.92 is a tie; with fleet at 0.60 it is a miss."""
    outcomes = [_rounds("ddp", (0.60, 0.62, 0.70)), _rounds("fsdp", (0.48, 0.50, 0.56)), _rounds("fleet", (0.50, 0.52, 0.54))]
    said = verdict(outcomes)
    assert said.fastest == "fsdp" and said.ratio == pytest.approx(0.50 / 0.52)
    assert said.round_ratios == pytest.approx((0.96, 0.50 / 0.52, 0.56 / 0.54))
    assert said.noise == pytest.approx(0.08) and said.met == "tie"
    assert said.quiet_ratio == pytest.approx(0.48 / 0.50)
    slow = verdict([*outcomes[:2], _rounds("fleet", (0.60, 0.60, 0.60))])
    assert slow.met == "no" and "goal missed" in slow.line()
    fast = verdict([*outcomes[:2], _rounds("fleet", (0.40, 0.45, 0.50))])
    assert fast.met == "yes" and "goal met" in fast.line()
    assert verdict([_rounds("ddp", (0.5,))]) is None


def test_the_report_summarises_every_cell() -> None:
    outcomes = [_rounds("ddp", (0.60, 0.62, 0.70)), _rounds("fleet", (0.50, 0.52, 0.54))]
    text = "\n".join(verdict_section({"gpt S": verdict(outcomes), "llama L": None}))
    assert "| gpt S | ddp | 1.192x | 1.200, 1.192, 1.296 | 1.200x |" in text and "| met |" in text
    assert "| llama L | - | fleet or every preset did not run |" in text
    assert "0.600, 0.620, 0.700" in "\n".join(group_section("gpt", "S", 4.9e6, 16, outcomes))
