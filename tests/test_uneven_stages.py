"""Uneven pipeline stages: pp need not divide the layers (issue 13).

The default split balances the stages by cost with the embedding and the head counted on the end stages
(planning/stages.py ``balanced_stage_layers``: a stage's load is the larger of its FLOPs and parameters in average
layers); a plan may fix it (``stage_layers=7/8/8/7``); DeepSpeed runs it
(runtime/deepspeed/pipeline.py ``stage_parts``). Hand-computed numbers: a model of chosen block costs, and Llama 3.1
405B, whose published split is "one Transformer layer [less] each from the first and the last stages" (Llama Team
2024, arXiv 2407.21783, Sec. 3.3.2): 126 layers on 16 stages = 7/8x14/7.
"""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pytest

from lightning_fleet.planning import (
    BlockSpec,
    ModelSpec,
    Plan,
    PlanError,
    Role,
    estimate,
    load_model,
    parse_partial_plan,
    parse_plan,
    plan,
)
from lightning_fleet.planning.plan import plan_from_mapping
from lightning_fleet.planning.stages import stage_layers, stage_loads
from lightning_fleet.runtime.base import ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from tests.conftest import make_cluster, make_model


def _blocks_model(layers: int = 70, *, pre: bool = True) -> ModelSpec:
    """Layers of 100 params and 10 FLOPs; an embedding of 50 params and no FLOPs; a head of 60 params and 8 FLOPs."""
    blocks = [BlockSpec(name="layer", role=Role.LAYER, count=layers, params=100, flops=10.0)]
    if pre:
        blocks.insert(0, BlockSpec(name="embedding", role=Role.PRE, params=50, flops=0.0))
    blocks.append(BlockSpec(name="head", role=Role.POST, params=60, flops=8.0))
    return ModelSpec(name="blocks", blocks=tuple(blocks), hidden_size=64, num_heads=8, seq_length=16, global_batch_size=96)


# --- the default split -----------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_seventy_layers_on_twelve_stages_by_hand() -> None:
    """70 layers (100 params, 10 FLOPs each) on 12 stages: some stage holds 6 layers, a load of 6 average layers. The
    head weighs max(8 / 10, 60 / 100) = 0.8 layers, so the last stage holds 5 (5.8; 6 would be 6.8); the embedding
    max(0 / 10, 50 / 100) = 0.5, so the first holds 5 (5.5; 6 would be 6.5): 5/6x10/5, BLOOM's split of its 70 layers."""
    model = _blocks_model()
    assert stage_layers(model, 12) == (5,) + (6,) * 10 + (5,)
    first, middle = stage_loads(model, 12)  # the last (560 params, 58 FLOPs) is no fuller than a middle stage
    assert (first.index, first.layers, first.params, first.flops, first.layer_flops) == (0, 5, 550, 50.0, 50.0)
    assert (middle.index, middle.layers, middle.params, middle.flops) == (1, 6, 600, 60.0)


@pytest.mark.pure
def test_without_an_embedding_the_first_stage_keeps_a_layer() -> None:
    """An end stage may hold no layer only when pre or post blocks occupy it; filling from the last stage leaves the
    first stages the remainder (5 layers on 4 stages: some stage holds 2; the last holds 1 layer and the head, a load of
    1.8 layers, as 2 would be 2.8; the next takes 2, and the two first stages keep one layer each)."""
    model = _blocks_model(5, pre=False)
    assert stage_layers(model, 4) == (1, 1, 2, 1)


@pytest.mark.pure
def test_llama_3_405b_split_and_stage_loads_by_hand() -> None:
    """126 layers on 16 stages: 7/8x14/7 (the paper's split). Per layer: q and o 16384^2 each, k and v 16384 * 1024 each,
    SwiGLU 3 * 16384 * 53248, two RMSNorms 2 * 16384: 3,187,703,808 parameters; embedding and head 128256 * 16384 each
    (untied), final norm 16384 (126 layers + both: 405,853,388,800, the published count)."""
    model = load_model("llama-3.1-405b")
    layer, table = 2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384, 128256 * 16384
    assert layer == 3_187_703_808 and 126 * layer + 2 * table + 16384 == model.params == 405_853_388_800
    assert stage_layers(model, 16) == (7,) + (8,) * 14 + (7,)
    loads = {load.index: load for load in stage_loads(model, 16)}
    assert loads[0].layers == 7 and loads[0].params == table + 7 * layer == 24_415_272_960
    assert loads[1].layers == 8 and loads[1].params == 8 * layer == 25_501_630_464
    flops = next(b.flops for b in model.blocks if b.role is Role.LAYER)
    assert loads[0].flops == 7 * flops and loads[1].flops == 8 * flops
    last = stage_loads(model, 16, (7,) + (8,) * 14 + (7,))[-1]
    assert last.index == 15 and last.params == 7 * layer + table + 16384
    assert last.flops == 7 * flops + 2.0 * 8192 * 16384 * 128256  # the head's projection, 2 s h V


@pytest.mark.pure
def test_even_splits_are_unchanged() -> None:
    """pp dividing the layers splits them evenly, with or without writing the split; an even stage_layers is no key."""
    model = make_model(layers=8)
    assert stage_layers(model, 4) == (2, 2, 2, 2)
    assert stage_loads(model, 4) == stage_loads(model, 4, (2, 2, 2, 2))
    assert Plan(dp=1, pp=4, stage_layers=(2, 2, 2, 2)) == Plan(dp=1, pp=4)
    cluster = make_cluster(nodes=1, devices_per_node=4)
    even = estimate(model, cluster, parse_plan("dp=1,pp=4", global_batch_size=model.global_batch_size))
    assert even.plan.stage_layers is None and "stage_layers" not in str(even.plan) and "stage_layers" not in even.to_dict()["plan"]


# --- plans ------------------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_plan_text_and_dict_round_trip() -> None:
    """stage_layers=7/8/8/7 parses, prints last, and survives to_dict (a list), JSON and back."""
    text = "dp=1,tp=1,pp=4,zero=1,mbs=1,gas=8,recompute=none,sp=false,vpp=1,offload=none,stage_layers=7/8/8/7"
    p = parse_plan(text)
    assert p.stage_layers == (7, 8, 8, 7) and str(p) == text and parse_plan(str(p)) == p
    assert p.to_dict()["stage_layers"] == [7, 8, 8, 7]
    assert plan_from_mapping(json.loads(json.dumps(p.to_dict()))) == p
    assert plan_from_mapping({**p.to_dict(), "stage_layers": "7/8/8/7"}) == p
    partial = parse_partial_plan("stage_layers=2/1,zero=1")
    assert (partial.pp, partial.stage_layers, str(partial)) == (2, (2, 1), "pp=2,zero=1,stage_layers=2/1")
    assert "stage_layers" not in partial.missing


@pytest.mark.pure
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dp=1,pp=3,gas=1,stage_layers=7/8", "stage_layers=7/8 names 2 stages, but pp=3: give one count per stage"),
        ("dp=1,pp=3,gas=1,stage_layers=4/0/4", "leaves a middle stage without layers"),
        ("dp=1,pp=3,vpp=2,gas=1,stage_layers=3/1/4", "each of a stage's 2 virtual stages needs a layer"),
        ("dp=1,pp=2,vpp=3,gas=1,stage_layers=1/5", "each of a stage's 3 virtual stages needs a layer"),
        ("dp=1,pp=2,gas=1,stage_layers=3/x", "stage_layers must be layer counts per stage such as 7/8/8/7, got '3/x'"),
        ("dp=1,pp=2,gas=1,stage_layers=-1/5", "non-negative layer counts"),
    ],
)
def test_bad_stage_layers_are_one_line(text: str, message: str) -> None:
    with pytest.raises(PlanError) as err:
        parse_plan(text)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.pure
def test_an_interleaved_uneven_split_gives_the_end_stages_one_layer_fewer() -> None:
    """Llama 3 405B (arXiv 2407.21783 Sec. 3.3.2): 126 layers on 16 ranks x 8 virtual stages, one layer fewer on the
    first and the last rank, whose embedding and head fill the freed virtual stage."""
    split = "/".join(["7"] + ["8"] * 14 + ["7"])
    plan = parse_plan(f"dp=64,tp=8,pp=16,zero=2,gas=32,sp=true,vpp=8,stage_layers={split}")
    assert plan.stage_layers == (7,) + (8,) * 14 + (7,) and plan.vpp == 8
    plan.check(world_size=8192, num_layers=126, num_heads=128, num_kv_heads=8, global_batch_size=2048)


@pytest.mark.pure
def test_a_fixed_split_must_fit_the_model() -> None:
    """The counts add up to the layers; an end stage stays empty only where the embedding or the head sits."""
    cluster = make_cluster(nodes=1, devices_per_node=2)
    with pytest.raises(PlanError, match=r"stage_layers=3/4 adds up to 7 != num_layers\(8\)"):
        estimate(make_model(layers=8), cluster, parse_plan("dp=1,pp=2,stage_layers=3/4", global_batch_size=32))
    with pytest.raises(PlanError, match="leaves stage 0 without layers, and model 'blocks' has no pre block"):
        stage_layers(_blocks_model(5, pre=False), 2, (0, 5))
    assert stage_layers(_blocks_model(5), 2, (0, 5)) == (0, 5)  # the embedding occupies stage 0
    with pytest.raises(PlanError, match=r"pp\(9\) > num_layers\(8\)"):
        estimate(make_model(layers=8, heads=1), make_cluster(nodes=1, devices_per_node=9), parse_plan("dp=1,pp=9", global_batch_size=36))


# --- search and estimate ------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_search_plans_seventy_layers_on_twelve_stages() -> None:
    """No "pp must divide" rejection: the planner returns pp=12 plans for 70 layers, with their split written out."""
    model = make_model(layers=70, hidden=1024, heads=16, seq=1024, gbs=96)
    result = plan(model, make_cluster(nodes=12, devices_per_node=8), pp=12, top=3)
    for e in result.plans:
        assert e.plan.pp == 12 and e.plan.stage_layers == stage_layers(model, 12) and sum(e.plan.stage_layers) == 70
        assert e.plan.vpp == 1 and parse_plan(str(e.plan)) == e.plan


@pytest.mark.pure
def test_estimate_writes_out_the_default_split_and_prices_a_fixed_one() -> None:
    """A plan without stage_layers gets the default split written out when it is uneven; a fixed split is priced with its
    own stage loads (the busier last stage shows in the step time)."""
    model = _blocks_model()
    cluster = make_cluster(nodes=12, devices_per_node=1)
    default = estimate(model, cluster, parse_plan("dp=1,pp=12,mbs=1", global_batch_size=96))
    assert default.plan.stage_layers == (5,) + (6,) * 10 + (5,)
    heavy = estimate(model, cluster, parse_plan("dp=1,pp=12,mbs=1,stage_layers=" + "/".join(["6"] * 10 + ["1", "9"]), global_batch_size=96))
    assert heavy.time.compute_s > default.time.compute_s


@pytest.mark.pure
def test_a_fixed_split_is_honoured_by_the_search() -> None:
    model = make_model(layers=6, hidden=256, heads=4, seq=128, gbs=16)
    result = plan(model, make_cluster(nodes=1, devices_per_node=3), constraints=dataclasses.replace(
        DEEPSPEED.constraints(ModuleHooks.assumed()), stage_layers=(1, 2, 3)))
    assert {e.plan.stage_layers for e in result.all_feasible} == {(1, 2, 3)}


@pytest.mark.pure
def test_a_runtime_without_uneven_stages_is_never_planned_one() -> None:
    """Capabilities say it once: DeepSpeed runs uneven stages; a runtime that does not gets only dividing pp, and a fixed
    uneven split is refused in one line."""
    hooks = ModuleHooks.assumed()
    assert DEEPSPEED.uneven_stages and DEEPSPEED.constraints(hooks).uneven_stages
    even_only = dataclasses.replace(DEEPSPEED, uneven_stages=False)
    model = make_model(layers=6, hidden=256, heads=4, seq=128, gbs=16)
    result = plan(model, make_cluster(nodes=1, devices_per_node=4), constraints=even_only.constraints(hooks), exhaustive=True)
    assert all(6 % e.plan.pp == 0 and e.plan.stage_layers is None for e in result.all_feasible)
    refusal = even_only.refusal(parse_partial_plan("stage_layers=2/1"), hooks)
    assert refusal == "plan pp=2,stage_layers=2/1: DeepSpeed splits the layers of a pipeline evenly only; leave stage_layers out"
    assert DEEPSPEED.refusal(parse_partial_plan("stage_layers=2/1"), hooks) is None


# --- the runtime --------------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_stage_parts_put_the_split_into_deepspeeds_boundaries() -> None:
    """PipelineModule.parts: what precedes the layer stack on stage 0, what follows it on the last stage; an even split
    gives DeepSpeed's own 'type:' partition (deepspeed.runtime.utils.partition_balanced of [0, 1, 1, 1, 1, 0] is [0, 3, 6])."""
    from torch import nn

    from lightning_fleet.planning import FleetError
    from lightning_fleet.runtime.deepspeed.pipeline import stage_parts

    class Block(nn.Identity):
        pass

    layers = [nn.Embedding(4, 2), Block(), Block(), Block(), Block(), nn.Linear(2, 4)]
    assert stage_parts(layers, Plan(dp=1, pp=2), "Block") == [0, 3, 6]
    assert stage_parts(layers, Plan(dp=1, pp=2, stage_layers=(1, 3)), "Block") == [0, 2, 6]
    assert stage_parts(layers, Plan(dp=1, pp=3, stage_layers=(0, 3, 1)), "Block") == [0, 1, 4, 6]
    with pytest.raises(FleetError, match="do not split evenly over pp=3: give the plan's stage_layers"):
        stage_parts(layers, Plan(dp=1, pp=3), "Block")
    with pytest.raises(FleetError, match="stage_layers adds up to 5 layers, but fleet_pipeline\\(\\) has 4"):
        stage_parts(layers, Plan(dp=1, pp=2, stage_layers=(2, 3)), "Block")


STEPS, GBS = 4, 8
UNEVEN_PLANS = ["dp=1,pp=2,zero=0", "dp=1,pp=2,zero=0,stage_layers=2/1", "dp=1,pp=2,zero=1,mbs=2,stage_layers=1/2"]


@pytest.mark.multiprocess
def test_deepspeed_trains_uneven_stages_like_one_process(tmp_path) -> None:
    """The example GPT with 3 layers on pp=2 (2 processes, gloo, real DeepSpeed): the default split and both fixed ones
    train to the single-process reference's loss, and rank 0 really holds the layers its split gives it (one layer's
    parameters more under 2/1 than under 1/2)."""
    from examples.gpt.model import GPT
    from tests import reference
    from tests.multiprocess import ROOT, run_worker
    from tests.workers.uneven_gpt import LAYERS

    with mock.patch.dict(reference.SIZES, num_layers=LAYERS):
        ref_loss, _ = reference.reference_run(STEPS, GBS)
        block = sum(p.numel() for p in GPT(**reference.SIZES).blocks[0].parameters())
    worker = ROOT / "tests" / "workers" / "uneven_gpt.py"
    results, _ = run_worker(tmp_path, "--plans", ";".join(UNEVEN_PLANS), "--steps", str(STEPS), "--gbs", str(GBS),
                            "--cluster", "cpu", worker=worker)
    by_plan = dict(zip(UNEVEN_PLANS, results))
    for text, result in by_plan.items():
        assert result["global_step"] == STEPS
        assert result["eval_loss"] == pytest.approx(ref_loss, rel=1e-5), text
    default = parse_plan(by_plan[UNEVEN_PLANS[0]]["plan"])
    assert default.stage_layers in ((1, 2), (2, 1))  # written out by the planner: 3 layers do not split evenly
    assert parse_plan(by_plan[UNEVEN_PLANS[1]]["plan"]).stage_layers == (2, 1)
    assert by_plan[UNEVEN_PLANS[1]]["local_params"] - by_plan[UNEVEN_PLANS[2]]["local_params"] == block
