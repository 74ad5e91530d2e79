"""Tier-1 tests of the "tight" memory verdict: a plan that needs every byte of the device but the fragmentation
allowance (MemoryEstimate.tight) is reported as tight, not as "does not fit", and the planner still never chooses it.

Every expected value is a literal or a visible arithmetic expression.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_fleet.cli import main
from lightning_fleet.planning import estimate, load_model, parse_plan, plan
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.memory import MemoryEstimate, fragmentation_bytes, reserve_bytes
from tests.conftest import make_cluster

pytestmark = pytest.mark.pure


def _memory(total_gib: float, host_gib: float = 0.0) -> MemoryEstimate:
    return MemoryEstimate(
        params_bytes=0.0, grads_bytes=0.0, optimizer_bytes=0.0, activations_bytes=(total_gib - 5) * GIB,
        other_bytes=5 * GIB, limit_bytes=80 * GIB, host_bytes=host_gib * GIB, host_limit_bytes=10 * GIB, stage=0,
        fragmentation_bytes=4 * GIB,
    )


@pytest.mark.parametrize(("total_gib", "host_gib", "fits", "tight"), [
    (79.0, 0.0, True, False),   # fits with the allowance
    (82.0, 0.0, False, True),   # 82 - 4 = 78 <= 80: every byte held, none to spare
    (84.0, 0.0, False, True),   # 84 - 4 = 80: exactly the device
    (84.5, 0.0, False, False),  # 80.5 > 80: does not fit at all
    (82.0, 11.0, False, False),  # the host is short: not tight either
])
def test_tight_is_the_window_of_the_fragmentation_allowance(total_gib: float, host_gib: float, fits: bool, tight: bool) -> None:
    m = _memory(total_gib, host_gib)
    assert (m.fits, m.tight) == (fits, tight)


def test_the_allowance_is_the_reserve_fraction_of_the_device() -> None:
    c = make_cluster().calibration
    assert fragmentation_bytes(80 * GIB, c) == 0.05 * 80 * GIB
    assert reserve_bytes(80 * GIB, c) == 1 * GIB + 0.05 * 80 * GIB


def _tight_cluster():
    """A cluster whose device holds the plan below only without the fragmentation allowance."""
    model = load_model("gpt-1.7b")
    text = "dp=8,mbs=4,zero=0"
    probe = estimate(model, make_cluster(), parse_plan(text, global_batch_size=model.global_batch_size)).memory
    need_gib = (probe.total_bytes - probe.fragmentation_bytes) / GIB  # all but the allowance: fixed for any device size
    # tight needs need <= X < need + 0.05 X, i.e. need <= X < need / 0.95: take the middle
    return model, text, make_cluster(memory_gib=need_gib / 0.975)


def test_an_estimate_in_the_window_is_tight_and_the_planner_does_not_choose_it() -> None:
    model, text, cluster = _tight_cluster()
    e = estimate(model, cluster, parse_plan(text, global_batch_size=model.global_batch_size))
    assert not e.fits and e.memory.tight
    assert e.to_dict()["tight"] is True and e.to_dict()["fits"] is False
    chosen = plan(model, cluster, top=500, max_tp=1, max_pp=1, zero_stages=(0,), allow_offload=False)
    assert chosen.plans and all(p.fits for p in chosen.plans)
    assert e.plan not in [p.plan for p in chosen.plans]
    roomy = estimate(model, make_cluster(memory_gib=1000), e.plan)
    assert roomy.fits and e.plan in [p.plan for p in plan(model, make_cluster(memory_gib=1000), top=500, max_tp=1,
                                                          max_pp=1, zero_stages=(0,), allow_offload=False).plans]


def test_fleet_estimate_says_tight_in_one_line(tmp_path, capsys) -> None:
    model, text, cluster = _tight_cluster()
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster.to_yaml())
    assert main(["estimate", "--model", "gpt-1.7b", "--cluster", str(path), "--plan", text]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "tight" in line)
    assert "does not fit" not in out
    assert "fragmentation" in line and "expandable_segments:True" in out and "never chooses it" in out
    assert main(["estimate", "--model", "gpt-1.7b", "--cluster", str(path), "--plan", text, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tight"] is True and data["fits"] is False
    roomy = dataclasses.replace(cluster, groups=(dataclasses.replace(
        cluster.groups[0], device=dataclasses.replace(cluster.groups[0].device, memory_gib=1000)),))
    path.write_text(roomy.to_yaml())
    assert main(["estimate", "--model", "gpt-1.7b", "--cluster", str(path), "--plan", text, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tight"] is False
