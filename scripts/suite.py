"""The whole test suite, as ``bash scripts/test.sh`` runs it without arguments: two phases, one closing line.

1. ``pytest -n 2 --dist loadgroup -m "not serial"``: two xdist workers; the fault tests (elastic tier) run in one
   lane and the other multi-process tests in the other (tests/conftest.py ``LANES``), so that at most two jobs share
   the two cores, and the one-process tiers fill in around them.
2. ``pytest -m serial``: the tests that measure the ranks' speed or bound a wall-clock time, with nothing beside them.

Both phases share one calibration cache (``FLEET_TEST_CACHE``, tests/multiprocess.py), removed at the end. The last
line counts both phases: ``suite: N passed, N failed, N skipped``; the exit status is 0 only when both phases
passed and at least one test ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = (
    ("parallel", ("-n", "2", "--dist", "loadgroup", "-m", "not serial")),
    ("serial", ("-m", "serial")),
)
NO_TESTS = 5
"""pytest's exit status when a selection holds no test (a phase may be empty; the whole suite may not)."""


def counts(junit: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one phase's JUnit XML report; a test that errored counts as failed."""
    tests = failed = skipped = 0
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def main() -> int:
    started = time.monotonic()
    passed = failed = skipped = 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="fleet-suite-") as tmp:
        env = {**os.environ, "FLEET_TEST_CACHE": str(Path(tmp) / "calibration")}
        for name, args in PHASES:
            junit = Path(tmp) / f"{name}.xml"
            print(f"== {name} phase: pytest {' '.join(args)}", flush=True)
            code = subprocess.call([sys.executable, "-m", "pytest", *args, f"--junitxml={junit}"], cwd=ROOT, env=env)
            ok &= code in (0, NO_TESTS) and junit.is_file()
            if junit.is_file():
                p, f, s = counts(junit)
                passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"== both phases in {(time.monotonic() - started) / 60:.1f} min")
    print(f"suite: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if ok and not failed and passed else 1


if __name__ == "__main__":
    sys.exit(main())
