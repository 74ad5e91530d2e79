"""Plan values: the string form, defaults, validation that names every factor."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fleet.planning import Axis, Offload, Plan, PlanError, Recompute, parse_plan
from lightning_fleet.planning.plan import plan_from_mapping

pytestmark = pytest.mark.pure

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
        ("dp=2,recompute=some,gas=1", "recompute must be one of none, selective, op, full, got 'some'"),
        ("dp=2,sp=yes,gas=1", "sp must be true or false"),
        ("dp=2,order=tp-tp-pp,gas=1", "order must name dp, tp and pp once each"),
        ("dp=2,dp=3,gas=1", "dp given twice"),
        ("dp=2,tp", "'tp' is not key=value"),
        ("tp=2,gas=1", "needs dp=N"),
        ("dp=2", "no gas= and no global batch size"),
        ("dp=8,zero=3,dp_shard=3,gas=1", "dp_shard=3 does not divide dp=8: give a shard group size that divides dp (2, 4, 8)"),
        ("dp=8,zero=0,dp_shard=4,gas=1", "dp_shard=4 needs zero >= 1"),
        ("dp=8,zero=2,dp_shard=1,gas=1", "dp_shard=1 shards nothing"),
        ("dp=8,zero=2,dp_shard=0,gas=1", "dp_shard must be a positive integer, got 0"),
        ("dp=8,zero=2,dp_shard=two,gas=1", "dp_shard must be an integer"),
    ],
)
def test_bad_plan_strings(text, message):
    """Each malformed plan string is one PlanError line that says what is wrong."""
    with pytest.raises(PlanError) as err:
        parse_plan(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_hybrid_sharding_is_printed_only_when_it_groups_the_replicas():
    """dp_shard smaller than dp is hybrid sharding, printed and kept; as large as dp it is plain sharding (one spelling)."""
    hybrid = parse_plan("dp=8,zero=3,dp_shard=4,gas=1")
    assert (hybrid.dp_shard, hybrid.shard_degree, hybrid.shard_replicas) == (4, 4, 2)
    assert str(hybrid).endswith(",dp_shard=4") and plan_from_mapping(hybrid.to_dict()) == hybrid
    whole = parse_plan("dp=8,zero=3,dp_shard=8,gas=1")
    assert whole == parse_plan("dp=8,zero=3,gas=1") and whole.dp_shard is None and "dp_shard" not in str(whole)
    assert (whole.shard_degree, whole.shard_replicas) == (8, 1)
    assert parse_partial_plan("dp_shard=2").fixed == {"dp_shard": 2}
    with pytest.raises(PlanError, match="dp_shard=2 needs zero >= 1"):
        parse_partial_plan("zero=0,dp_shard=2")


def test_check_names_every_factor():
    """A plan wrong in four ways lists all four factors in one message."""
    p = Plan(dp=3, tp=3, pp=5, vpp=2, gas=2)
    with pytest.raises(PlanError) as err:
        p.check(world_size=16, num_layers=12, num_heads=16, global_batch_size=8)
    message = str(err.value)
    assert "dp(3) * tp(3) * pp(5) = 45 != world size 16" in message
    assert "tp(3) does not divide num_heads(16)" in message
    assert "pp(5) * vpp(2) = 10 does not divide num_layers(12)" in message
    assert "dp(3) * mbs(1) * gas(2) = 6 != global batch size 8" in message


# --- partial plans ---------------------------------------------------------------------------------------------------

from lightning_fleet.planning import PartialPlan, parse_partial_plan  # noqa: E402


def test_partial_plan_keeps_only_the_keys_given():
    """'dp=2,zero=1' fixes dp and zero and nothing else (no mbs=1 filled in); its string is the keys given, in plan order."""
    p = parse_partial_plan("zero=1, dp=2")
    assert (p.dp, p.zero) == (2, 1)
    assert all(getattr(p, name) is None for name in ("tp", "pp", "mbs", "gas", "recompute", "sp", "vpp", "offload", "order"))
    assert str(p) == "dp=2,zero=1" and p.fixed == {"dp": 2, "zero": 1}
    assert not p.complete and p.missing == ("tp", "pp", "mbs", "recompute", "sp", "vpp", "offload")
    assert parse_partial_plan("") == PartialPlan() and str(PartialPlan()) == ""


def test_partial_plan_parses_every_key_as_parse_plan_does():
    """The full issue string read as a partial plan fixes every field to the value parse_plan reads."""
    full = parse_plan(ISSUE_STRING + ",order=dp-tp-pp")
    partial = parse_partial_plan(ISSUE_STRING + ",order=dp-tp-pp")
    assert partial.complete and partial.to_plan() == full and partial.to_plan(global_batch_size=32 * 2 * 28) == full
    assert str(partial) == str(full)
    assert partial.recompute is Recompute.FULL and partial.offload is Offload.NONE and partial.sp is False
    assert partial.order == (Axis.DP, Axis.TP, Axis.PP)


def test_to_plan_derives_gas_or_checks_it():
    """A complete partial plan without gas takes gas from the global batch; with gas it must agree with it."""
    p = parse_partial_plan("dp=2,tp=1,pp=1,zero=1,mbs=4,recompute=none,sp=false,vpp=1,offload=none")
    assert p.to_plan(global_batch_size=64).gas == 8
    with pytest.raises(PlanError, match="has no gas= and no global batch size"):
        p.to_plan()
    with pytest.raises(PlanError, match=r"global batch size 12 is not divisible by dp\(2\) \* mbs\(4\) = 8"):
        p.to_plan(global_batch_size=12)
    with pytest.raises(PlanError, match=r"dp\(2\) \* mbs\(4\) \* gas\(3\) = 24 != global batch size 64"):
        p.fix(gas=3).to_plan(global_batch_size=64)
    with pytest.raises(PlanError, match="leaves mbs, recompute to the planner"):
        parse_partial_plan("dp=2,tp=1,pp=1,zero=1,sp=false,vpp=1,offload=none").to_plan(global_batch_size=64)


def test_fix_adds_a_key_or_refuses_a_conflict():
    """micro_batch_size=N joins a plan string as mbs=N; the same value again is fine, another one is one line."""
    p = parse_partial_plan("dp=2,zero=1")
    assert p.fix(mbs=4) == PartialPlan(dp=2, zero=1, mbs=4)
    assert p.fix(mbs=4).fix(mbs=4) == p.fix(mbs=4)
    with pytest.raises(PlanError) as err:
        p.fix(mbs=4).fix(mbs=2)
    assert str(err.value) == "plan 'dp=2,zero=1,mbs=4' already fixes mbs=4; it cannot also be 2"
    with pytest.raises(PlanError, match="mbs must be a positive integer, got 0"):
        p.fix(mbs=0)
    with pytest.raises(PlanError, match="unknown key 'micro'"):
        p.fix(micro=2)


@pytest.mark.parametrize(
    "text,message",
    [
        ("dp=0", "dp must be a positive integer, got 0"),
        ("mbs=-1", "mbs must be a positive integer, got -1"),
        ("tp=1,sp=true", "sp=true needs tp > 1"),
        ("pp=1,vpp=2", "vpp=2 needs pp > 1"),
        ("zero=0,offload=optimizer", "offload=optimizer needs zero >= 1"),
        ("zero=2,offload=optimizer+params", "offload=optimizer+params needs zero=3"),
        ("recompute=some", "recompute must be one of none, selective, op, full, got 'some'"),
        ("offload=disk", "offload must be one of none, optimizer, optimizer+params, got 'disk'"),
        ("sp=yes", "sp must be true or false"),
        ("order=tp-tp-pp", "order must name dp, tp and pp once each"),
        ("order=tp-dp-xx", "order must be one of dp, tp, pp, got 'xx'"),
        ("zero=7", "zero must be 0, 1, 2 or 3, got 7"),
        ("mbs=two", "mbs must be an integer, got 'two'"),
        ("dp=2,dp=3", "dp given twice"),
        ("dp=2,tp", "'tp' is not key=value"),
        ("flavour=3", "unknown key 'flavour'"),
    ],
)
def test_bad_partial_plan_strings(text, message):
    """Each malformed partial plan is one PlanError line, worded as parse_plan words it."""
    with pytest.raises(PlanError) as err:
        parse_partial_plan(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_partial_plans_are_frozen_values():
    a, b = parse_partial_plan("dp=2,zero=1"), PartialPlan(zero=1, dp=2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dp = 4  # type: ignore[misc]
