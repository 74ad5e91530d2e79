"""The bare-runtime benchmark's pure parts (benchmarks/strategy_vs_deepspeed.py): the order of a round's jobs and the
verdict sentence."""

from __future__ import annotations

import pytest

from benchmarks.strategy_vs_deepspeed import TABLES, round_jobs, verdict_line

pytestmark = pytest.mark.pure


def test_every_job_runs_once_per_round_in_reversed_order_every_other_round() -> None:
    first, second = round_jobs(0), round_jobs(1)
    assert second == first[::-1] and round_jobs(2) == first
    assert sorted(first) == sorted({role for table, bare in TABLES.items() for role in (*(r for r, _ in bare), f"fleet-{table}")})
    assert first.index("fleet-torch") > first.index("torch")  # a table's fleet job after its bare ones in even rounds


def test_verdict_line_says_met_tie_or_missed_against_the_noise() -> None:
    """Bare medians 0.20, fleet 0.21: ratio 0.952 -- a tie within 3 % of 0.98 noise, missed within 2 %; fleet 0.20: met."""
    bare, slow, even = [[0.20, 0.20, 0.20]], [[0.21, 0.21, 0.21]], [[0.20, 0.20, 0.20]]
    assert "0.952** by the medians" in verdict_line("bare DDP", bare, slow, 0.03) and "a tie within the measured noise" in verdict_line("b", bare, slow, 0.03)
    assert "**goal missed**" in verdict_line("b", bare, slow, 0.02)
    assert "goal met" in verdict_line("b", bare, even, 0.0) and "per round 1.000" in verdict_line("b", bare, even, 0.0)
