"""The whole test suite, as ``bash scripts/test.sh`` runs it without arguments: three lanes side by side, then the
serial tests alone, one closing line.

The suite's time is process start-up (each rank of each job imports torch, Lightning and DeepSpeed: about 4 s of CPU)
and waiting (for a kill, a restart, a timeout), not one long computation; one pytest process left half the 2 cores
idle. So three pytest processes run at once, each on its own share of the tests (LANES, by tier marker):

- faults: the elastic tier (real kills, restarts, resizes under torchrun);
- jobs: the multiprocess tier (2-4 process jobs on gloo);
- one-process: the pure and unit tiers (and the gpu tier, skipped without CUDA);

and then the tests marked ``serial`` (they measure the ranks' speed, pin ranks to cores, or bound a wall-clock time)
with nothing beside them. Each lane has its own temporary directory and report; all share one calibration cache
(``FLEET_TEST_CACHE``, tests/multiprocess.py), removed at the end. A lane's output is printed when it ends, a progress
line every minute before. The last line counts every lane: ``suite: N passed, N failed, N skipped``; the exit status
is 0 only when every lane passed and at least one test ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANES = (
    ("faults", "elastic and not serial"),
    ("jobs", "multiprocess and not serial"),
    ("one-process", "(pure or unit or gpu) and not serial"),
)
"""The lanes that run side by side: (name, pytest -m expression); together with SERIAL they select every test once."""
SERIAL = ("serial", "serial")
"""The lane that runs after them, alone."""
NO_TESTS = 5
"""pytest's exit status when a selection holds no test (a lane may be empty; the whole suite may not)."""
PROGRESS_EVERY_S = 60.0
SLOWEST = 25
"""Each lane's log ends with its slowest tests (pytest --durations): where the suite's time goes."""


def counts(junit: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one lane's JUnit XML report; a test that errored counts as failed."""
    tests = failed = skipped = 0
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def verdict(codes: list[int], passed: int, failed: int) -> int:
    """The suite's exit status: 0 where every lane ended 0 (or held no test) with a report, nothing failed and
    something passed; else 1. ``codes``: each lane's pytest exit status, -1 where it left no report."""
    return 0 if all(code in (0, NO_TESTS) for code in codes) and not failed and passed else 1


def progress(log: Path) -> int:
    """How many tests a lane has finished: the outcome letters of pytest -q's progress lines in its log."""
    if not log.is_file():
        return 0
    lines = log.read_text(errors="replace").splitlines()
    return sum(len(m.group(1)) for line in lines if (m := re.fullmatch(r"([.FEsxX]+)\s*(\[\s*\d+%\])?", line.strip())))


class Lane:
    """One pytest process over one marker expression, its output to a log, its report to JUnit XML."""

    def __init__(self, name: str, expression: str, tmp: Path, env: dict[str, str]) -> None:
        self.name, self.expression = name, expression
        self.log, self.junit = tmp / f"{name}.log", tmp / f"{name}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", expression,
               f"--basetemp={tmp / name}", f"--junitxml={self.junit}", f"--durations={SLOWEST}"]
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.code: int | None = None

    def finish(self) -> tuple[int, int, int]:
        """Print the lane's output under a header; (passed, failed, skipped) from its report."""
        self.code = self.proc.wait()
        print(f"\n== lane {self.name} (pytest -m {self.expression!r}): exit {self.code} after "
              f"{(time.monotonic() - self.started) / 60:.1f} min", flush=True)
        print(self.log.read_text(errors="replace"), end="", flush=True)
        if not self.junit.is_file():
            self.code = -1
            return 0, 0, 0
        return counts(self.junit)


def run_lanes(lanes: list[Lane]) -> list[tuple[int, int, int]]:
    """Wait for every lane, printing each as it ends and a progress line every PROGRESS_EVERY_S before."""
    results: dict[str, tuple[int, int, int]] = {}
    last = time.monotonic()
    while len(results) < len(lanes):
        for lane in lanes:
            if lane.name not in results and lane.proc.poll() is not None:
                results[lane.name] = lane.finish()
        if len(results) < len(lanes) and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            running = ", ".join(f"{lane.name} {progress(lane.log)} done" for lane in lanes if lane.name not in results)
            print(f"== running: {running}", flush=True)
        time.sleep(0.5)
    return [results[lane.name] for lane in lanes]


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-suite-") as tmp:
        env = {**os.environ, "FLEET_TEST_CACHE": str(Path(tmp) / "calibration")}
        print(f"== {len(LANES)} lanes side by side ({', '.join(name for name, _ in LANES)}), then the serial tests alone",
              flush=True)
        side_by_side = [Lane(name, expression, Path(tmp), env) for name, expression in LANES]
        results = run_lanes(side_by_side)
        serial = Lane(*SERIAL, Path(tmp), env)
        results += run_lanes([serial])
        codes = [lane.code if lane.code is not None else -1 for lane in [*side_by_side, serial]]
    passed, failed, skipped = (sum(column) for column in zip(*results))
    print(f"== every lane in {(time.monotonic() - started) / 60:.1f} min")
    print(f"suite: {passed} passed, {failed} failed, {skipped} skipped")
    return verdict(codes, passed, failed)


if __name__ == "__main__":
    sys.exit(main())
