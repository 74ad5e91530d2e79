"""Plan values: the string form, defaults, validation that names every factor."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fleet.planning import Axis, Offload, Plan, PlanError, Recompute, parse_plan
from lightning_fleet.planning.plan import plan_from_mapping

ISSUE_STRING = "dp=32,tp=8,pp=4,zero=1,mbs=2,gas=28,recompute=full,sp=false,vpp=1,offload=none"


def test_issue_string_round_trips():
    """str(parse(s)) == s for the issue's plan string; every field parsed."""
    p = parse_plan(ISSUE_STRING)
    assert str(p) == ISSUE_STRING
    assert (p.dp, p.tp, p.pp, p.zero, p.mbs, p.gas, p.recompute, p.sp, p.vpp, p.offload) == (32, 8, 4, 1, 2, 28, Recompute.FULL, False, 1, Offload.NONE)
    assert p.world_size == 1024 and p.global_batch_size == 32 * 2 * 28


def test_left_out_keys_take_defaults_and_gas_comes_from_the_batch():
    """Only dp given: zero=0, mbs=1, recompute=none, sp=false, vpp=1, offload=none; gas = gbs / (dp * mbs)."""
    p = parse_plan("dp=4,mbs=2", global_batch_size=64)
    assert str(p) == "dp=4,tp=1,pp=1,zero=0,mbs=2,gas=8,recompute=none,sp=false,vpp=1,offload=none"


def test_plans_are_frozen_values():
    """Plans compare by value, hash, and cannot be mutated."""
    a, b = parse_plan(ISSUE_STRING), parse_plan(ISSUE_STRING)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dp = 2  # type: ignore[misc]


def test_order_is_printed_only_when_not_default():
    """The placement is part of the plan; the default tp-dp-pp is left out of the string."""
    p = parse_plan(ISSUE_STRING + ",order=dp-tp-pp")
    assert p.order == (Axis.DP, Axis.TP, Axis.PP)
    assert str(p).endswith(",order=dp-tp-pp")
    assert plan_from_mapping(p.to_dict()) == p


@pytest.mark.parametrize(
    "text,message",
    [
        ("dp=0,gas=1", "dp must be a positive integer, got 0"),
        ("dp=2,tp=1,sp=true,gas=1", "sp=true needs tp > 1"),
        ("dp=2,vpp=2,gas=1", "vpp=2 needs pp > 1"),
        ("dp=2,zero=0,offload=optimizer,gas=1", "offload=optimizer needs zero >= 1"),
        ("dp=2,zero=2,offload=optimizer+params,gas=1", "offload=optimizer+params needs zero=3"),
        ("dp=2,recompute=some,gas=1", "recompute must be one of none, selective, full, got 'some'"),
        ("dp=2,sp=yes,gas=1", "sp must be true or false"),
        ("dp=2,order=tp-tp-pp,gas=1", "order must name dp, tp and pp once each"),
        ("dp=2,dp=3,gas=1", "dp given twice"),
        ("dp=2,tp", "'tp' is not key=value"),
        ("tp=2,gas=1", "needs dp=N"),
        ("dp=2", "no gas= and no global batch size"),
    ],
)
def test_bad_plan_strings(text, message):
    """Each malformed plan string is one PlanError line that says what is wrong."""
    with pytest.raises(PlanError) as err:
        parse_plan(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_check_names_every_factor():
    """A plan wrong in four ways lists all four factors in one message."""
    p = Plan(dp=3, tp=3, pp=5, gas=2)
    with pytest.raises(PlanError) as err:
        p.check(world_size=16, num_layers=12, num_heads=16, global_batch_size=8)
    message = str(err.value)
    assert "dp(3) * tp(3) * pp(5) = 45 != world size 16" in message
    assert "tp(3) does not divide num_heads(16)" in message
    assert "pp(5) * vpp(1) = 5 does not divide num_layers(12)" in message
    assert "dp(3) * mbs(1) * gas(2) = 6 != global batch size 8" in message
