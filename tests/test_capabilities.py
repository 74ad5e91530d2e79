"""What a runtime executes, stated once (lightning_fleet/runtime/base.py, runtime/deepspeed/capabilities.py), and the
module hooks it reads (lightning_fleet/hooks.py): the constraints the planner gets, every one-line refusal, resharding,
the registry, ``fleet plan|estimate --runtime``, and DeepSpeed's pipeline topology from the plan's order.

Pure tier: nothing started. The last tests build torch modules and DeepSpeed's (pure Python) ProcessTopology in this
process; everything else imports neither torch nor deepspeed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from lightning_fleet.cli import main
from lightning_fleet.planning import Constraints, FleetError, Offload, Overlaps, Plan, Recompute, parse_partial_plan
from lightning_fleet.runtime import RUNTIME_NAMES, RUNTIMES, capabilities_of, runtime_named, runtime_of_format
from lightning_fleet.runtime.torch.capabilities import TORCH
from lightning_fleet.runtime.base import ANY, ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

pytestmark = pytest.mark.pure

NONE, FULL = Recompute.NONE, Recompute.FULL


def hooks(tp: bool = True, pp: bool = True, layers: bool = True, automatic: bool = True) -> ModuleHooks:
    return ModuleHooks(name="Net", tensor_parallel=tp, pipeline=pp, layers=layers, automatic_optimization=automatic)


def deepspeed_constraints(**varying: object) -> Constraints:
    """What DeepSpeed's limits are, written out: no sp, no vpp, zero <= 1 and neither tp, offload nor uneven replicas with
    pp, the default placement, sparse gradients at ZeRO-0 only, no hybrid sharding; ``varying`` the fields that depend on the module's hooks
    and the job's options."""
    return Constraints(
        allow_sp=False, max_vpp=1, max_zero_with_pp=1, search_placement=False, tp_with_pp=False, offload_with_pp=False,
        uneven_dp_with_pp=False, sparse_zero_stages=(0,), hybrid_zero_stages=(),
        overlaps=Overlaps(dp_grad_reduce=(1, 2, 3), dp_param_gather=(3,), dp_exposed_in_pipeline=True, dp_grad_allreduce=(1, 2)),
        **varying,  # type: ignore[arg-type]
    )


# --- constraints ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "pp", "layers", "automatic", "max_tp", "max_pp", "recompute"),
    [
        # tensor_parallel, pipeline, layers, automatic optimization -> max_tp, max_pp, recompute modes
        (True, True, True, True, None, None, (NONE, FULL)),
        (True, True, True, False, None, 1, (NONE, FULL)),  # a pipeline steps the optimizer itself
        (True, True, False, True, None, None, (NONE,)),  # (pipeline without layers: module_hooks never says so)
        (True, True, False, False, None, 1, (NONE,)),
        (True, False, True, True, None, 1, (NONE, FULL)),
        (True, False, True, False, None, 1, (NONE, FULL)),
        (True, False, False, True, None, 1, (NONE,)),
        (True, False, False, False, None, 1, (NONE,)),
        (False, True, True, True, 1, None, (NONE, FULL)),
        (False, True, True, False, 1, 1, (NONE, FULL)),
        (False, True, False, True, 1, None, (NONE,)),
        (False, True, False, False, 1, 1, (NONE,)),
        (False, False, True, True, 1, 1, (NONE, FULL)),
        (False, False, True, False, 1, 1, (NONE, FULL)),
        (False, False, False, True, 1, 1, (NONE,)),
        (False, False, False, False, 1, 1, (NONE,)),
    ],
)
def test_deepspeed_constraints_for_every_hooks_combination(tp, pp, layers, automatic, max_tp, max_pp, recompute) -> None:
    got = DEEPSPEED.constraints(hooks(tp, pp, layers, automatic))
    assert got == deepspeed_constraints(max_tp=max_tp, max_pp=max_pp, recompute=recompute)


def test_deepspeed_constraints_carry_the_jobs_options() -> None:
    """allow/require offload, zero_stages and the tp/pp limits pass through; a limit without the hook stays 1; 0 is no limit."""
    got = DEEPSPEED.constraints(hooks(), allow_offload=False, require_offload=True, max_tp=4, max_pp=2, zero_stages=(1, 3))
    assert got == deepspeed_constraints(
        allow_offload=False, require_offload=True, max_tp=4, max_pp=2, zero_stages=(1, 3), recompute=(NONE, FULL)
    )
    assert DEEPSPEED.constraints(hooks(tp=False, pp=False), max_tp=4, max_pp=2).max_tp == 1
    assert DEEPSPEED.constraints(hooks(), max_tp=0, max_pp=0) == deepspeed_constraints(recompute=(NONE, FULL))


def test_any_runtime_is_the_cost_models_whole_space() -> None:
    """'any' gives what fleet plan searched before runtimes existed: the planner's defaults, hooks or not."""
    assert ANY.constraints(hooks(False, False, False, False)) == Constraints()
    assert ANY.constraints(ModuleHooks.assumed(), allow_offload=False, max_tp=8, max_pp=4, zero_stages=(0, 1)) == Constraints(
        allow_offload=False, max_tp=8, max_pp=4, zero_stages=(0, 1)
    )
    for text in ("tp=2,sp=true", "pp=2,vpp=2", "recompute=selective", "pp=2,zero=3,tp=2,offload=optimizer", "order=dp-tp-pp"):
        assert ANY.refusal(parse_partial_plan(text), hooks(False, False, False, False)) is None, text


def test_assumed_hooks_are_every_hook() -> None:
    assumed = ModuleHooks.assumed()
    assert (assumed.tensor_parallel, assumed.pipeline, assumed.layers, assumed.automatic_optimization) == (True, True, True, True)
    assert DEEPSPEED.constraints(assumed) == deepspeed_constraints(recompute=(NONE, FULL))


# --- check: one line for each plan DeepSpeed cannot run ------------------------------------------------------------------

PIPELINE_LIMITS = "DeepSpeed's pipeline engine runs with zero <= 1, without tp and without offload"
NO_SCHEDULES = "DeepSpeed runs neither sequence parallelism nor interleaved pipelines; use sp=false, vpp=1"

REFUSALS = [
    ("dp=1,tp=2", hooks(tp=False), {},
     "plan dp=1,tp=2 has tp=2, but Net defines no fleet_tensor_parallel() hook: add it or use tp=1"),
    ("dp=1,pp=2", hooks(pp=False), {},
     "plan dp=1,pp=2 has pp=2, but Net defines no fleet_pipeline() (and fleet_layers()) hook: add it or use pp=1"),
    ("dp=1,pp=2", hooks(automatic=False), {},
     "plan dp=1,pp=2 has pp=2, but Net optimizes manually, and a pipeline runs forward, backward and step itself: use pp=1"),
    ("pp=2,zero=2", hooks(), {}, f"plan pp=2,zero=2: {PIPELINE_LIMITS}"),
    ("pp=2,zero=3", hooks(), {}, f"plan pp=2,zero=3: {PIPELINE_LIMITS}"),
    ("tp=2,pp=2", hooks(), {}, f"plan tp=2,pp=2: {PIPELINE_LIMITS}"),
    ("pp=2,zero=1,offload=optimizer", hooks(), {}, f"plan pp=2,zero=1,offload=optimizer: {PIPELINE_LIMITS}"),
    ("tp=2,sp=true", hooks(), {}, f"plan tp=2,sp=true: {NO_SCHEDULES}"),
    ("pp=2,vpp=2", hooks(), {}, f"plan pp=2,vpp=2: {NO_SCHEDULES}"),
    ("recompute=selective", hooks(), {},
     "plan recompute=selective: selective recomputation needs attention internals; use recompute=full or none"),
    ("dp=1,recompute=full", hooks(layers=False), {},
     "plan dp=1,recompute=full: recompute=full needs the layer stack: add fleet_layers() to Net"),
    ("dp=1,zero=3", hooks(), {"zero_stages": (0, 1)}, "plan dp=1,zero=3: zero=3 is outside zero_stages=(0, 1)"),
    ("zero=1,offload=optimizer", hooks(), {"allow_offload": False},
     "plan zero=1,offload=optimizer offloads, but allow_offload=False"),
    ("dp=4,zero=3,dp_shard=2", hooks(), {},
     "plan dp=4,zero=3,dp_shard=2: DeepSpeed shards over all data-parallel replicas only (no hybrid sharding); leave dp_shard out"),
    ("order=dp-tp-pp", hooks(), {},
     "plan order=dp-tp-pp: DeepSpeed places the axes tp-dp-pp only (it builds its own process groups, and the data order "
     "follows them); use order=tp-dp-pp or leave order out"),
]


@pytest.mark.parametrize(("text", "module", "options", "message"), REFUSALS)
def test_check_refuses_with_one_line(text: str, module: ModuleHooks, options: dict, message: str) -> None:
    constraints = DEEPSPEED.constraints(module, **options)
    with pytest.raises(FleetError) as err:
        DEEPSPEED.check(parse_partial_plan(text), constraints, module)
    assert str(err.value) == message


@pytest.mark.parametrize("text", [
    "", "dp=2,tp=2,zero=3,offload=optimizer+params", "pp=2,zero=1,recompute=full", "dp=4,zero=2,offload=optimizer,recompute=full",
    "tp=2,sp=false,vpp=1", "order=tp-dp-pp,zero=0",
])
def test_check_accepts_what_deepspeed_runs(text: str) -> None:
    DEEPSPEED.check(parse_partial_plan(text), DEEPSPEED.constraints(hooks()), hooks())
    assert DEEPSPEED.refusal(parse_partial_plan(text), hooks()) is None


def test_hybrid_sharding_is_torchs_and_searched_there_only() -> None:
    """torch runs dp_shard (FSDP2 over a 2-D mesh) at its shard levels: its constraints search the groups, DeepSpeed's
    do not, and a fixed group narrows torch's search to it."""
    assert TORCH.refusal(parse_partial_plan("dp=4,zero=3,dp_shard=2"), hooks()) is None
    assert TORCH.constraints(hooks()).hybrid_zero_stages == (2, 3) and not DEEPSPEED.constraints(hooks()).hybrid_zero_stages
    assert "torch runs hybrid sharding at zero 2 or 3 only" in TORCH.refusal(parse_partial_plan("dp=4,zero=1,dp_shard=2"), hooks())


def test_refusal_reads_whole_plans_too() -> None:
    """A whole Plan (fleet estimate, the benchmarks) is judged as the partial plan of all its fields."""
    assert DEEPSPEED.refusal(Plan(dp=1, pp=2, zero=1, gas=4), hooks()) is None
    whole = "dp=1,tp=1,pp=2,zero=2,mbs=1,gas=4,recompute=none,sp=false,vpp=1,offload=none"
    assert DEEPSPEED.refusal(Plan(dp=1, pp=2, zero=2, gas=4), hooks()) == f"plan {whole}: {PIPELINE_LIMITS}"


# --- resharding ----------------------------------------------------------------------------------------------------------


def test_reshard_constraints_are_data_parallel_into_zero_1_to_3() -> None:
    got = DEEPSPEED.reshard_constraints(
        hooks(), allow_offload=True, require_offload=False, zero_stages=(0, 1, 2, 3), checkpoint="ck/step-4"
    )
    assert got == deepspeed_constraints(max_tp=1, max_pp=1, zero_stages=(1, 2, 3), recompute=(NONE, FULL))
    narrower = DEEPSPEED.reshard_constraints(
        hooks(layers=False), allow_offload=False, require_offload=False, zero_stages=(0, 3), checkpoint="ck/step-4"
    )
    assert narrower == deepspeed_constraints(max_tp=1, max_pp=1, zero_stages=(3,), allow_offload=False, recompute=(NONE,))


def test_reshard_without_a_zero_stage_it_loads_is_one_line() -> None:
    with pytest.raises(FleetError) as err:
        DEEPSPEED.reshard_constraints(
            hooks(), allow_offload=True, require_offload=False, zero_stages=(0,), checkpoint="ck/step-4"
        )
    assert str(err.value) == (
        "checkpoint ck/step-4 must be resharded to this job's world size, which needs ZeRO stage 1, 2 or 3, "
        "but FleetStrategy(zero_stages=(0,)): allow one of them"
    )


# --- the registry --------------------------------------------------------------------------------------------------------


def test_the_runtime_table_names_each_runtime_once_with_its_parts() -> None:
    """One table: every runtime's capabilities, backend, reader and face, by name; 'any' is the cost model's space."""
    assert RUNTIME_NAMES == ("any", "torch", "deepspeed")
    assert capabilities_of("deepspeed") is DEEPSPEED and capabilities_of("any") is ANY and capabilities_of("torch") is TORCH
    assert [r.name for r in RUNTIMES] == ["torch", "deepspeed"]
    assert len({r.layout_format for r in RUNTIMES}) == len({r.face for r in RUNTIMES}) == len(RUNTIMES)
    assert runtime_of_format("lightning_fleet.layout/1") is runtime_named("deepspeed")  # checkpoints written before the table
    with pytest.raises(FleetError) as err:
        capabilities_of("bogus")
    assert str(err.value) == "unknown runtime 'bogus' (known: any, torch, deepspeed)"
    with pytest.raises(FleetError, match="unknown runtime 'ddp' \\(known: torch, deepspeed, or 'auto'"):
        runtime_named("ddp")
    with pytest.raises(FleetError, match="layout format 'x/1' is not one lightning_fleet writes"):
        runtime_of_format("x/1")


def test_torch_runs_shard_levels_0_to_3_and_tp_and_says_what_to_use_for_the_rest() -> None:
    """A plan on an axis the torch runtime does not run is refused in one line naming the axis; the constraints it
    hands the planner leave those axes out."""
    module = hooks()
    for plan, why in (
        ("dp=4,zero=1,dp_shard=2", "torch runs hybrid sharding at zero 2 or 3 only; use one of them or leave dp_shard out"),
        ("pp=2", "torch runs no pipelines; use pp=1"),
        ("zero=2,offload=optimizer", "torch runs offload=optimizer+params only; use it or offload=none"),
        ("pp=2,vpp=2", "torch runs no pipelines; use pp=1"),
        ("zero=0,offload=optimizer", None),  # offload needs zero >= 1: the plan itself refuses it
    ):
        if why is None:
            with pytest.raises(FleetError):
                parse_partial_plan(plan)
            continue
        assert TORCH.refusal(parse_partial_plan(plan), module) == f"plan {parse_partial_plan(plan)}: {why}"
    for runs in ("zero=0,dp=2", "zero=1", "zero=3", "zero=2,tp=2", "dp=2,tp=2,zero=0", "dp=2,tp=2,zero=1", "dp=4,zero=2,dp_shard=2",
                 "zero=3,offload=optimizer+params"):
        assert TORCH.refusal(parse_partial_plan(runs), module) is None, runs
    constraints = TORCH.constraints(module, max_tp=8, max_pp=8)
    assert (constraints.zero_stages, constraints.max_tp, constraints.max_pp, constraints.allow_offload) == ((0, 1, 2, 3), 8, 1, True)
    assert constraints.offloads == (Offload.NONE, Offload.OPTIMIZER_PARAMS)  # FSDP2 has no optimizer-only offload
    assert DEEPSPEED.constraints(module).offloads is None  # every offload
    assert TORCH.job_refusal(require_offload=True, zero_stages=(0, 1, 2, 3)) is None
    no_offload = dataclasses.replace(TORCH, offloads=())
    assert no_offload.job_refusal(require_offload=True, zero_stages=(3,)) == "torch runs no offload, and FleetStrategy(require_offload=True)"
    assert no_offload.refusal(parse_partial_plan("zero=3,offload=optimizer+params"), module).endswith("torch runs no offload; use offload=none")
    assert TORCH.job_refusal(require_offload=False, zero_stages=(1,)) is None
    assert DEEPSPEED.job_refusal(require_offload=True, zero_stages=(3,)) is None


# --- fleet plan / estimate --runtime -------------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def planned(capsys, *argv: str) -> list[str]:
    """Every plan fleet plan --json lists (the top ones and the rejected ones), as plan strings."""
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    result = json.loads(out)
    return [e["plan_string"] for e in result["plans"]] + [r["plan"] for r in result["rejected"]]


def deepspeed_runs(text: str) -> bool:
    fields = dict(part.split("=") for part in text.split(","))
    pipelined = int(fields["pp"]) > 1
    return (
        fields["sp"] == "false" and fields["vpp"] == "1" and fields["recompute"] != "selective" and "order" not in fields
        and not (pipelined and (int(fields["zero"]) > 1 or int(fields["tp"]) > 1 or fields["offload"] != "none"))
    )


@pytest.mark.parametrize("argv", [
    ("--model", "gpt3-175b", "--cluster", "dgx-a100-80gb-x128", "--top", "20"),
    ("--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "10", "--fix", "pp=2"),
])
def test_fleet_plan_runtime_deepspeed_proposes_only_what_deepspeed_runs(capsys, argv: tuple[str, ...]) -> None:
    """The same search with --runtime any proposes plans DeepSpeed cannot run (sp, vpp, selective recomputation, ZeRO-2
    with a pipeline); with --runtime deepspeed none is listed, not even among the rejected."""
    anything = planned(capsys, *argv)
    assert any(not deepspeed_runs(p) for p in anything)
    deepspeed = planned(capsys, *argv, "--runtime", "deepspeed")
    assert deepspeed and all(deepspeed_runs(p) for p in deepspeed), [p for p in deepspeed if not deepspeed_runs(p)]


def test_fleet_plan_default_runtime_is_any(capsys) -> None:
    argv = ("--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "10", "--fix", "pp=2")
    assert planned(capsys, *argv) == planned(capsys, *argv, "--runtime", "any")


@pytest.mark.parametrize(("argv", "message"), [
    (("plan", "--model", "gpt-tiny", "--cluster", "cpu", "--runtime", "bogus"),
     "unknown runtime 'bogus' (known: any, torch, deepspeed)"),
    (("plan", "--model", "gpt-tiny", "--cluster", "cpu", "--runtime", "deepspeed", "--fix", "tp=2,sp=true"),
     f"plan tp=2,sp=true: {NO_SCHEDULES} (--runtime deepspeed)"),
    (("estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=1,pp=2,zero=2", "--runtime", "deepspeed"),
     f"plan dp=1,tp=1,pp=2,zero=2,mbs=1,gas=16,recompute=none,sp=false,vpp=1,offload=none: {PIPELINE_LIMITS} "
     "(--runtime deepspeed)"),
])
def test_runtime_errors_are_one_line(capsys, argv: tuple[str, ...], message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"fleet: error: {message}\n"


def test_fleet_estimate_of_a_plan_deepspeed_runs_is_the_same_estimate(capsys) -> None:
    argv = ("estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=1,pp=2,zero=1", "--json")
    code, anything, _ = run_cli(capsys, *argv)
    assert code == 0
    code, deepspeed, _ = run_cli(capsys, *argv, "--runtime", "deepspeed")
    assert code == 0 and json.loads(deepspeed) == json.loads(anything)


# --- the module's hooks and DeepSpeed's pipeline topology (torch and DeepSpeed's topology, in this process) --------------


def test_module_hooks_reads_each_hook() -> None:
    from torch import nn

    from lightning_fleet.hooks import module_hooks

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class Hooked(Stack):
        automatic_optimization = True

        def fleet_tensor_parallel(self) -> dict:
            return {"num_heads": 2, "column": [r"blocks\.\d+\.weight"], "row": []}

        def fleet_pipeline(self) -> dict:
            return {"layers": list(self.blocks), "loss_fn": nn.functional.mse_loss}

    class Manual(Hooked):
        automatic_optimization = False

    class Malformed(Stack):
        def fleet_pipeline(self) -> dict:
            return {"layers": []}

    read = module_hooks(Hooked())
    assert read == ModuleHooks(
        name="Hooked", tensor_parallel=True, pipeline=True, layers=True, automatic_optimization=True, tp_limits=read.tp_limits,
        sequence_problem="names no 'sequence' modules (its norms) in fleet_tensor_parallel(): add them or use sp=false",
    )
    assert [(limit.layer, limit.parts) for limit in read.tp_limits] == [("blocks.0", 2), ("blocks.1", 2), ("blocks.2", 2)]
    assert module_hooks(Manual()).automatic_optimization is False
    assert module_hooks(Stack()) == ModuleHooks(
        name="Stack", tensor_parallel=False, pipeline=False, layers=True, automatic_optimization=True
    )
    assert module_hooks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).layers is False  # two types: no layer stack
    with pytest.raises(FleetError, match=r"Malformed.fleet_pipeline\(\) must return"):
        module_hooks(Malformed())


ORDERS = [tuple(order) for order in itertools.permutations(("tp", "dp", "pp"))]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dp", "pp"), [(1, 2), (2, 2), (3, 2), (2, 4)])
def test_pipeline_topology_puts_every_rank_where_the_plan_does(dp: int, pp: int, order: tuple[str, ...]) -> None:
    from lightning_fleet.runtime.deepspeed.pipeline import pipeline_topology

    plan = Plan(dp=dp, pp=pp, order=order)  # type: ignore[arg-type]
    topology = pipeline_topology(plan)
    assert "model" not in topology.get_axis_names()  # a model axis would rename DeepSpeed's layer checkpoint files
    for rank in range(plan.world_size):
        coordinates, theirs = plan.coordinates(rank), topology.get_coord(rank)
        assert (theirs.data, theirs.pipe) == (coordinates.dp, coordinates.pp), rank


def test_pipeline_topology_of_the_default_order_is_deepspeeds_own() -> None:
    """tp-dp-pp gives exactly the PipeDataParallelTopology(num_pp, num_dp) the runtime built before: stages outermost."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from lightning_fleet.runtime.deepspeed.pipeline import pipeline_topology

    ours, theirs = pipeline_topology(Plan(dp=3, pp=2)), PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert (ours.get_axis_names(), ours.dims, ours.mapping) == (theirs.get_axis_names(), theirs.dims, theirs.mapping)
    with pytest.raises(FleetError, match="runs without tp"):
        pipeline_topology(Plan(dp=1, tp=2, pp=2))


@pytest.mark.parametrize("name", ["torch", "deepspeed"])
def test_each_backend_implements_the_backend_protocol(name: str) -> None:
    """Every call of runtime.base.Backend exists on the runtime's backend with the same parameters (the pipeline calls
    where its capabilities run pipelines), and its capabilities are the value the table, the planner and the CLI read."""
    import inspect

    from lightning_fleet.runtime.base import PIPELINE_CALLS, Backend

    runtime = runtime_named(name)
    backend = type(runtime.load_backend())
    calls = {key: value for key, value in vars(Backend).items() if inspect.isfunction(value) and not key.startswith("_")}
    assert len(calls) >= 15
    for key, declared in calls.items():
        if key in PIPELINE_CALLS and not runtime.capabilities.pipeline:
            continue
        implemented = getattr(backend, key, None)
        assert callable(implemented), f"{backend.__name__} lacks {key}"
        assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters), key
    assert backend.capabilities is runtime.capabilities
    assert isinstance(backend.zeroes_gradients, bool)
