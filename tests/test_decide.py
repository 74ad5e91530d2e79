"""The one decision of a fit (lightning_fleet/decide.py), without a process group or torch: fresh, continued and
resharded jobs, what the user and the module fix, what the runtime refuses, and the report."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from lightning_fleet.decide import (
    Decision,
    JobOptions,
    ModuleFacts,
    Resume,
    ResumeKind,
    decide,
    fixed_axes,
    job_global_batch_size,
    resume_of,
)
from lightning_fleet.elastic.layout import Manifest
from lightning_fleet.planning import FleetError, Plan, estimate, parse_plan, plan
from lightning_fleet.runtime.base import ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from tests.conftest import make_cluster, make_model

pytestmark = pytest.mark.pure

GPT = dict(name="GPT", tensor_parallel=True, pipeline=True, layers=True, automatic_optimization=True)


def facts(gbs: int = 32, batch_dependent: bool | None = False, loader_batch_size: int = 4, **hooks: object) -> ModuleFacts:
    return ModuleFacts(
        spec=make_model(layers=4, hidden=512, heads=8, seq=512, gbs=gbs),
        hooks=ModuleHooks(**{**GPT, **hooks}),
        loader_batch_size=loader_batch_size,
        batch_dependent=batch_dependent,
        profile_lines=("profiling: meta (exact)",),
    )


def manifest(plan_text: str, world: int, gbs: int = 32, step: int = 7) -> Manifest:
    return Manifest(format=1, step=step, world_size=world, plan=plan_text, global_batch_size=gbs, model=None, data_seed=0, files={})


def run(module: ModuleFacts, world: int = 8, resume: Resume = Resume(kind=ResumeKind.FRESH), **options: object) -> Decision:
    cluster = make_cluster(devices_per_node=world)
    return decide(module, cluster, world_size=world, options=JobOptions(**options), runtimes=(DEEPSPEED,), resume=resume)


def test_a_fresh_decision_is_the_searched_best_plan_under_the_runtimes_capabilities():
    module = facts()
    decision = run(module)
    cluster = make_cluster(devices_per_node=8)
    best = plan(module.spec, cluster, top=3, constraints=DEEPSPEED.constraints(module.hooks)).best
    assert decision.plan == best.plan.replace(runtime="deepspeed") and decision.estimate.time == best.time
    assert decision.runtime == DEEPSPEED.name and decision.resume.kind is ResumeKind.FRESH
    assert decision.plan.sp is False and decision.plan.vpp == 1  # DeepSpeed runs neither
    assert decision.report[0].startswith("lightning_fleet plan for gpt-4x512")
    assert "  profiling: meta (exact)" in decision.report
    assert any(line.startswith("  chosen   " + str(decision.plan)) for line in decision.report)
    assert not any("slower" in line and line.startswith("  misfit") for line in decision.report)  # by kind, not text


def test_a_decision_is_a_frozen_value_that_pickles_as_broadcast():
    decision = run(facts())
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.plan = None  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(decision)) == decision


def test_a_complete_plan_is_priced_not_searched():
    text = "dp=8,tp=1,pp=1,zero=3,mbs=2,gas=2,recompute=none,sp=false,vpp=1,offload=none"
    decision = run(facts(), plan=text)
    assert str(decision.plan) == text + ",runtime=deepspeed"
    assert not any(line.startswith("  searched") for line in decision.report)
    assert any("fixed    " in line and "FleetStrategy(plan=...)" in line for line in decision.report)


def test_fixed_axes_say_why_in_the_report():
    partial, notes = fixed_axes(facts(batch_dependent=True, loader_batch_size=4), JobOptions(plan="zero=1"))
    assert partial.zero == 1 and partial.mbs == 4
    assert any(note.startswith("fixed    mbs=4: the loss depends on the micro-batch") for note in notes)
    partial, notes = fixed_axes(facts(batch_dependent=None), JobOptions(micro_batch_size=2))
    assert partial.mbs == 2 and notes[-1] == "fixed    mbs=2 (FleetStrategy(micro_batch_size=...))"
    partial, notes = fixed_axes(facts(batch_dependent=None), JobOptions())
    assert partial.mbs is None and notes[-1].startswith("note     whether the loss depends on the micro-batch is unknown")
    partial, notes = fixed_axes(facts(batch_dependent=True, loader_batch_size=5), JobOptions())
    assert partial.mbs is None and "does not divide the global batch 32" in notes[-1]


def test_manual_optimization_fixes_one_micro_batch_and_refuses_accumulation():
    decision = run(facts(automatic_optimization=False))
    assert decision.plan.gas == 1 and decision.plan.pp == 1
    with pytest.raises(FleetError, match="steps its own optimizer once per training_step, so gas must be 1"):
        run(facts(automatic_optimization=False), plan="gas=2")


def test_what_the_runtime_cannot_run_is_refused_before_searching():
    with pytest.raises(FleetError, match="defines no fleet_tensor_parallel"):
        run(facts(tensor_parallel=False), plan="tp=2")
    with pytest.raises(FleetError, match="sp=false"):
        run(facts(), plan="tp=2,sp=true")


def test_global_batch_comes_from_the_checkpoint_then_the_option_then_the_loader():
    options = JobOptions(global_batch_size=64)
    assert job_global_batch_size(options, loader_batch_size=4, world_size=2, manifest=manifest("dp=2,mbs=4,gas=2", 2, gbs=16)) == 16
    assert job_global_batch_size(options, loader_batch_size=4, world_size=2, manifest=None) == 64
    assert job_global_batch_size(JobOptions(), loader_batch_size=4, world_size=2, manifest=None) == 8


def test_resume_kind_follows_the_world_size_and_refuses_resharding_what_the_writer_cannot():
    """DeepSpeed's tp checkpoints (and pre-runtime ones, DeepSpeed's) reshard only data-parallel; the torch runtime's
    DCP checkpoints reshard tp too."""
    assert resume_of(None, None, 4).kind is ResumeKind.FRESH
    same = resume_of("/c/step-000000007", manifest("dp=4,tp=1,pp=1,zero=2,mbs=2,gas=4", 4), 4)
    assert same.kind is ResumeKind.CONTINUE and same.path == "/c/step-000000007"
    assert resume_of("/c/s", manifest("dp=4,tp=1,pp=1,zero=2,mbs=2,gas=4", 4), 2).kind is ResumeKind.RESHARD
    for written in ("dp=2,tp=2,pp=1,zero=1,mbs=2,gas=8", "dp=2,tp=2,pp=1,zero=1,mbs=2,gas=8,runtime=deepspeed"):
        with pytest.raises(FleetError, match=r"resharding DeepSpeed's checkpoints to 2 processes needs a data-parallel one "
                                             r"\(tp=1, pp=1\): relaunch with 4 processes"):
            resume_of("/c/s", manifest(written, 4), 2)
    tp = resume_of("/c/s", manifest("dp=2,tp=2,pp=1,zero=2,mbs=2,gas=8,runtime=torch", 4), 2)
    assert tp.kind is ResumeKind.RESHARD


def test_a_continued_checkpoint_keeps_its_plan_and_a_clash_is_one_line():
    text = "dp=8,tp=1,pp=1,zero=2,mbs=1,gas=4,recompute=none,sp=false,vpp=1,offload=none"
    resume = resume_of("/c/step-000000007", manifest(text, 8), 8)
    decision = run(facts(), resume=resume)
    assert str(decision.plan) == text + ",runtime=deepspeed" and decision.resume == resume  # the legacy runtime
    priced = estimate(facts().spec, make_cluster(devices_per_node=8), parse_plan(text), overlaps=DEEPSPEED.overlaps)
    assert decision.estimate.time == priced.time
    assert "  resumed  /c/step-000000007: its plan continues" in decision.report
    with pytest.raises(FleetError, match="but this job fixes zero=3: drop those"):
        run(facts(), resume=resume, plan="zero=3")
    with pytest.raises(FleetError, match="which this job may not run"):
        run(facts(), resume=resume, zero_stages=(3,))


def test_a_resharded_checkpoint_is_replanned_data_parallel_with_zero_1_to_3():
    resume = resume_of("/c/s", manifest("dp=4,tp=1,pp=1,zero=0,mbs=2,gas=4", 4), 8)
    decision = run(facts(), resume=resume)
    assert decision.plan.tp == decision.plan.pp == 1 and decision.plan.zero >= 1
    assert decision.resume.kind is ResumeKind.RESHARD
    with pytest.raises(FleetError, match="needs ZeRO stage 1, 2 or 3"):
        run(facts(), resume=resume, zero_stages=(0,))


def test_a_plan_string_fixed_order_other_than_the_runtimes_is_refused():
    with pytest.raises(FleetError, match="order"):
        run(facts(), plan="order=dp-tp-pp")


def test_decision_model_is_the_priced_spec():
    decision = run(facts())
    assert decision.model == decision.estimate.model
    assert isinstance(decision.plan, Plan)


# --- choosing the runtime ---------------------------------------------------------------------------------------------


def run_both(module: ModuleFacts, world: int = 8, resume: Resume = Resume(kind=ResumeKind.FRESH), calibration: dict | None = None,
             **options: object) -> Decision:
    from lightning_fleet.runtime.torch.capabilities import TORCH

    cluster = make_cluster(devices_per_node=world, **(calibration or {}))
    return decide(module, cluster, world_size=world, options=JobOptions(**options), runtimes=(TORCH, DEEPSPEED), resume=resume)


def test_each_runtime_is_priced_with_its_own_measured_framework_overheads():
    """Calibration.runtimes (fleet calibrate's per-runtime probe) prices each runtime's plans with its own per-shard-level
    time: the same fixed plan goes to whichever runtime measured cheaper there, and the estimate carries that runtime's
    overhead; without entries both are priced alike and the tie goes to the first in the table."""
    from lightning_fleet.planning import RuntimeOverheads

    def measured(torch_s: float, deepspeed_s: float) -> dict:
        return {"zero_step_overhead_s": (0.0, 0.0, 0.0, 0.0), "zero_tensor_overhead_s": (0.0, 0.0, 0.0, 0.0), "runtimes": (
            RuntimeOverheads(runtime="torch", zero_stages=(0, 2, 3), step_overhead_s=(0.0, torch_s, 0.0), tensor_overhead_s=(0.0, 0.0, 0.0)),
            RuntimeOverheads(runtime="deepspeed", zero_stages=(0, 1, 2, 3), step_overhead_s=(0.0, 0.0, deepspeed_s, 0.0),
                             tensor_overhead_s=(0.0, 0.0, 0.0, 0.0)))}

    plan = "zero=2,dp=8,mbs=4"
    alike = run_both(facts(), plan=plan)
    torch_s, deepspeed_s = (run_both(facts(), plan=f"{plan},runtime={r}").estimate.time.step_s for r in ("torch", "deepspeed"))
    slow_torch = run_both(facts(), plan=plan, calibration=measured(0.5, 0.1))
    slow_deepspeed = run_both(facts(), plan=plan, calibration=measured(0.1, 0.5))
    assert (alike.runtime, slow_torch.runtime, slow_deepspeed.runtime) == ("torch", "deepspeed", "torch")
    assert slow_torch.estimate.time.step_s == pytest.approx(deepspeed_s + 0.1)
    assert slow_deepspeed.estimate.time.step_s == pytest.approx(torch_s + 0.1)
    line = next(line for line in slow_torch.report if line.startswith("  runtime  "))
    assert line.startswith("  runtime  deepspeed: ") and f"torch {torch_s + 0.5:.4g} s/step" in line
    assert slow_torch.cluster.calibration.zero_step_overhead_s[2] == 0.1  # the decision keeps the chosen runtime's view


def test_the_fastest_executable_runtime_trains_and_the_report_says_by_how_much():
    """Each runtime's best plan is priced; the faster one trains (a tie goes to the first given), and the report
    names the other with its predicted step."""
    decision = run_both(facts())
    deepspeed_best = run(facts()).estimate.time.step_s
    line = next(line for line in decision.report if line.startswith("  runtime  "))
    assert decision.estimate.time.step_s <= deepspeed_best
    if decision.runtime == "deepspeed":  # torch's zero=0 best was slower
        assert decision.estimate.time.step_s < run_both(facts(), zero_stages=(0,)).estimate.time.step_s
    assert f"{'deepspeed' if decision.runtime == 'torch' else 'torch'} " in line
    assert line.startswith(f"  runtime  {decision.runtime}: predicted {decision.estimate.time.step_s:.4g} s/step; ")
    assert str(decision.plan).endswith(f",runtime={decision.runtime}")


def test_required_offload_on_torch_is_fsdp2s_host_offload_at_shard_level_3():
    """runtime=torch with offload required: the planner offers only what FSDP2's CPUOffloadPolicy runs (optimizer and
    parameters, at zero=3); under "auto" an optimizer-only offload plan may still go to DeepSpeed."""
    from lightning_fleet.planning import Offload

    torch_only = run_both(facts(), plan="runtime=torch", require_offload=True)
    assert torch_only.runtime == "torch"
    assert (torch_only.plan.offload, torch_only.plan.zero) == (Offload.OPTIMIZER_PARAMS, 3)
    assert run_both(facts(), plan="zero=2,offload=optimizer").runtime == "deepspeed"


def test_a_plan_only_one_runtime_runs_goes_to_it_and_one_no_runtime_runs_names_each_refusal():
    decision = run_both(facts(), plan="zero=1,offload=optimizer")
    assert decision.runtime == "deepspeed" and decision.plan.zero == 1
    assert "torch: plan zero=1,offload=optimizer: torch runs offload=optimizer+params only" in next(
        line for line in decision.report if "runtime  " in line)
    for zero in range(4):
        assert run_both(facts(), plan=f"zero={zero},runtime=torch").runtime == "torch"
    with pytest.raises(FleetError) as err:
        run_both(facts(), plan="zero=1,offload=optimizer,runtime=torch")
    assert str(err.value) == "plan zero=1,offload=optimizer: torch runs offload=optimizer+params only; use it or offload=none"
    assert run_both(facts(), plan="zero=3,offload=optimizer+params,runtime=torch").plan.offload.value == "optimizer+params"
    with pytest.raises(FleetError) as err:  # torch runs no pipeline at all: DeepSpeed would
        run_both(facts(), plan="pp=2,runtime=torch")
    assert str(err.value) == "plan pp=2: torch runs no pipelines; use pp=1"
    with pytest.raises(FleetError) as err:  # torch runs sp where the module lays out for it, DeepSpeed never: each says so
        run_both(facts(), plan="sp=true,tp=2")
    assert str(err.value) == (
        "no runtime executes this job: torch: plan tp=2,sp=true has sp=true, but GPT names no 'sequence' modules (its norms) "
        "in fleet_tensor_parallel(): add them or use sp=false; deepspeed: plan tp=2,sp=true: DeepSpeed runs neither "
        "sequence parallelism nor interleaved pipelines; use sp=false, vpp=1")
    sequenced = run_both(facts(sequence_parallel=True), plan="sp=true,tp=2")
    assert sequenced.runtime == "torch" and sequenced.plan.sp


def test_a_hybrid_shard_group_goes_to_torch_and_is_refused_in_one_line_on_deepspeed():
    """dp_shard: torch executes it (HSDP), DeepSpeed does not, and a group that does not divide dp is the plan's own
    error."""
    decision = run_both(facts(), plan="dp=8,zero=3,dp_shard=4")
    assert decision.runtime == "torch" and decision.plan.dp_shard == 4
    assert "deepspeed: plan dp=8,zero=3,dp_shard=4: DeepSpeed shards over all data-parallel replicas only" in next(
        line for line in decision.report if "runtime  " in line)
    with pytest.raises(FleetError) as err:
        run_both(facts(), plan="dp=8,zero=3,dp_shard=4,runtime=deepspeed")
    assert str(err.value) == ("plan dp=8,zero=3,dp_shard=4: DeepSpeed shards over all data-parallel replicas only (no "
                              "hybrid sharding); leave dp_shard out")
    with pytest.raises(FleetError) as err:
        run_both(facts(), plan="dp=8,zero=3,dp_shard=3")
    assert "dp_shard=3 does not divide dp=8" in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_continues_on_the_runtime_that_wrote_it():
    text = "dp=8,tp=1,pp=1,zero=0,mbs=1,gas=4,recompute=none,sp=false,vpp=1,offload=none"
    for written, expected in ((text, "deepspeed"), (text + ",runtime=torch", "torch")):
        resume = resume_of("/c/step-000000007", manifest(written, 8), 8)
        assert run_both(facts(), resume=resume).runtime == expected
    resharded = resume_of("/c/step-000000007", manifest(text + ",runtime=torch", 4), 8)
    assert run_both(facts(), resume=resharded).runtime == "torch"  # its own runtime first: it wins a tie


def test_a_checkpoint_moves_to_the_other_runtime_when_the_job_fixes_it_or_may_not_use_its_writer():
    """The other runtime imports it (its whole state, at the same world size too): the decision reshards, planned with
    the importer's resharding constraints (DeepSpeed's: data-parallel, ZeRO 1-3)."""
    text = "dp=8,tp=1,pp=1,zero=0,mbs=1,gas=4,recompute=none,sp=false,vpp=1,offload=none"
    torch_written = resume_of("/c/step-000000007", manifest(text + ",runtime=torch", 8), 8)
    only_deepspeed = run(facts(), resume=torch_written)  # the job may use DeepSpeed only
    assert only_deepspeed.runtime == "deepspeed" and only_deepspeed.resume.kind is ResumeKind.RESHARD
    assert only_deepspeed.plan.zero in (1, 2, 3) and only_deepspeed.plan.tp == only_deepspeed.plan.pp == 1
    fixed = run_both(facts(), resume=resume_of("/c/step-000000007", manifest(text, 8), 8), plan="runtime=torch")
    assert fixed.runtime == "torch" and fixed.resume.kind is ResumeKind.RESHARD
    kept = run_both(facts(), resume=torch_written, plan="runtime=torch")
    assert kept.runtime == "torch" and kept.resume.kind is ResumeKind.CONTINUE
