"""scripts/suite.py, what the README's test command runs: every test in exactly one lane, the lanes' reports summed into one
closing line and one exit status that fails when any lane failed, left no report, or nothing ran."""

from __future__ import annotations

import importlib.util

import pytest

from tests.multiprocess import ROOT

pytestmark = pytest.mark.pure


def _suite():
    spec = importlib.util.spec_from_file_location("fleet_suite", ROOT / "scripts" / "suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="{errors}" failures="{failures}" skipped="{skipped}"
tests="{tests}" time="1.0"></testsuite></testsuites>"""


def test_a_report_counts_passed_failed_and_skipped(tmp_path):
    """pytest's JUnit XML counts an errored test apart from a failed one; both are failures of the suite."""
    report = tmp_path / "phase.xml"
    report.write_text(JUNIT.format(tests=10, failures=2, errors=1, skipped=3))
    assert _suite().counts(report) == (4, 3, 3)


@pytest.mark.parametrize(("codes", "passed", "failed", "status"), [
    ([0, 0], 10, 0, 0),
    ([0, 5], 10, 0, 0),  # a lane may select nothing
    ([5, 5], 0, 0, 1),  # the suite may not
    ([1, 0], 9, 1, 1),
    ([0, -1], 10, 0, 1),  # a lane that left no report (interrupted, crashed) is no pass
    ([2, 0], 10, 0, 1),  # pytest interrupted or refused its arguments
])
def test_the_exit_status_passes_only_a_suite_that_ran_and_passed(codes, passed, failed, status):
    assert _suite().verdict(codes, passed, failed) == status


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("tier", ["pure", "unit", "multiprocess", "elastic", "gpu"])
def test_every_test_runs_in_exactly_one_lane(tier, serial):
    """Whatever its tier and whether it is serial, a test is selected by one lane's -m expression and by no other."""
    from tests.conftest import TIERS

    suite = _suite()
    assert tier in TIERS
    markers = {name: name == tier for name in TIERS} | {"serial": serial}
    chosen = [name for name, expression in (*suite.LANES, suite.SERIAL) if eval(expression, {}, markers)]  # and/or/not
    expected = "serial" if serial else {"elastic": "faults", "multiprocess": "jobs"}.get(tier, "one-process")
    assert chosen == [expected]


def test_the_progress_line_counts_the_tests_a_lane_finished(tmp_path):
    log = tmp_path / "lane.log"
    assert _suite().progress(log) == 0
    log.write_text("........................................  [ 45%]\n..F.s\n")
    assert _suite().progress(log) == 45
    log.write_text(log.read_text() + "=== FAILURES ===\n....... and so on\n")  # a report's text is no outcome
    assert _suite().progress(log) == 45
