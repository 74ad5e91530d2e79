"""Data-parallel replicas with different micro-batch sizes (Plan.dp_mbs, issue 14): the plan value, each replica's
share of a step's samples, the loss weights, what the runtime refuses, the decision, and (multiprocess) real DeepSpeed
training on gloo against the single-process reference at every ZeRO stage, and a checkpoint resumed under another split.

Every expected value is a literal or a visible arithmetic expression.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import pytest
import torch

from lightning_fleet.decide import Resume, ResumeKind, resume_of
from lightning_fleet.elastic.sampler import GlobalBatchSampler, MicroBatchCollate, check_shares, rank_share
from lightning_fleet.planning import FleetError, Plan, estimate, parse_partial_plan, parse_plan
from lightning_fleet.planning.plan import plan_from_mapping
from lightning_fleet.runtime import ANY
from lightning_fleet.runtime.base import ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from tests.conftest import make_cluster
from tests.test_decide import facts, manifest, run

HOOKS = ModuleHooks(name="GPT", tensor_parallel=True, pipeline=True, layers=True, automatic_optimization=True)


# --- the plan value -------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_plan_text_dict_and_batch_arithmetic() -> None:
    plan = parse_plan("dp=2,zero=1,dp_mbs=3/1", global_batch_size=8)
    assert (plan.mbs, plan.gas) == (3, 2)  # mbs is the largest; gas = 8 / (3 + 1)
    assert str(plan) == "dp=2,tp=1,pp=1,zero=1,mbs=3,gas=2,recompute=none,sp=false,vpp=1,offload=none,dp_mbs=3/1"
    assert plan.global_batch_size == 2 * (3 + 1) == 8
    assert plan.replica_samples() == (2 * 3, 2 * 1)
    assert (plan.replica_mbs(0), plan.replica_mbs(1)) == (3, 1)
    assert (plan.loss_weight(0), plan.loss_weight(1)) == (2 * 3 / 4, 2 * 1 / 4)
    assert plan.to_dict()["dp_mbs"] == [3, 1]
    assert parse_plan(str(plan)) == plan and plan_from_mapping(plan.to_dict()) == plan


@pytest.mark.pure
def test_equal_sizes_are_the_even_plan_with_one_spelling() -> None:
    even = parse_plan("dp=2,dp_mbs=2/2", global_batch_size=8)
    assert even == parse_plan("dp=2,mbs=2", global_batch_size=8) and even.dp_mbs is None
    assert "dp_mbs" not in str(even) and "dp_mbs" not in even.to_dict()
    assert even.loss_weight(0) == even.loss_weight(1) == 1.0
    assert even.replica_samples() == (4, 4)


@pytest.mark.pure
@pytest.mark.parametrize(("text", "message"), [
    ("dp=3,dp_mbs=3/1", "dp_mbs=3/1 names 2 replicas, but dp=3: give one micro-batch size per replica"),
    ("dp=2,mbs=2,dp_mbs=3/1", "dp_mbs=3/1 has largest micro-batch 3, but mbs=2: mbs is the largest"),
    ("dp=2,dp_mbs=3/0", "dp_mbs must be positive micro-batch sizes, one per data-parallel replica"),
    ("dp=2,dp_mbs=three/1", "dp_mbs must be micro-batch sizes per replica such as 6/2, got 'three/1'"),
    ("dp=2,dp_mbs=3/2", r"global batch size 8 is not divisible by sum\(dp_mbs=3/2\) = 5"),
])
def test_bad_sizes_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(FleetError, match=message) as err:
        parse_plan(text, global_batch_size=8)
    assert "\n" not in str(err.value)


@pytest.mark.pure
def test_a_plan_checks_its_split_against_the_global_batch() -> None:
    plan = parse_plan("dp=2,dp_mbs=3/1,gas=2")
    with pytest.raises(FleetError, match=r"gas\(2\) \* sum\(dp_mbs=3/1\) = 8 != global batch size 12"):
        plan.check(world_size=2, num_layers=2, num_heads=4, global_batch_size=12)


@pytest.mark.pure
def test_a_partial_plan_fixing_the_sizes_fixes_dp_and_mbs() -> None:
    partial = parse_partial_plan("dp_mbs=6/2,zero=2")
    assert (partial.dp, partial.mbs, partial.dp_mbs) == (2, 6, (6, 2))
    assert not partial.complete
    with pytest.raises(FleetError, match="names 2 replicas, but dp=4"):
        parse_partial_plan("dp=4,dp_mbs=6/2")


# --- each replica's samples -----------------------------------------------------------------------------------------


@pytest.mark.pure
def test_the_replicas_shares_are_the_step_in_order() -> None:
    step = list(range(100, 112))
    shares = (6, 2, 4)
    parts = [rank_share(step, 3, r, shares) for r in range(3)]
    assert parts == [list(range(100, 106)), [106, 107], list(range(108, 112))]
    assert rank_share(torch.arange(4), 2, 1) == [2, 3]  # even: unchanged
    micro = MicroBatchCollate(lambda xs: list(xs), gas=2)
    assert micro(parts[0]) == [[100, 101, 102], [103, 104, 105]]  # gas micro-batches of that replica's size


@pytest.mark.pure
def test_a_step_is_the_same_samples_whatever_the_split() -> None:
    def step_samples(shares: tuple[int, ...] | None, dp: int) -> list[list[int]]:
        steps = []
        for step in range(3):
            union = []
            for rank in range(dp):
                sampler = GlobalBatchSampler(50, global_batch_size=8, dp_size=dp, dp_rank=rank, seed=3,
                                             first_step=lambda step=step: step, shares=shares)
                union += next(iter(sampler))
            steps.append(union)
        return steps

    single = step_samples(None, 1)
    assert step_samples(None, 2) == step_samples((6, 2), 2) == step_samples((2, 6), 2) == step_samples((1, 3, 4), 3) == single


@pytest.mark.pure
@pytest.mark.parametrize(("shares", "message"), [
    ((6, 2, 1), "must be 2 positive sample counts"),
    ((6, 0), "must be 2 positive sample counts"),
    ((6, 4), "add up to 10, not the global batch 8"),
    ((5, 3), r"do not each split into gas 2 equal micro-batches"),
])
def test_bad_shares_are_one_line(shares: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_shares(shares, global_batch_size=8, dp_size=2, gas=2)


# --- the runtime and the decision -----------------------------------------------------------------------------------


@pytest.mark.pure
def test_deepspeed_runs_uneven_replicas_outside_a_pipeline_only() -> None:
    assert DEEPSPEED.refusal(parse_partial_plan("dp_mbs=3/1,zero=3"), HOOKS) is None
    why = DEEPSPEED.refusal(parse_partial_plan("dp_mbs=3/1,pp=2"), HOOKS)
    assert why is not None and "computes the loss itself" in why and "use pp=1 with dp_mbs" in why
    assert ANY.refusal(parse_partial_plan("dp_mbs=3/1,pp=2"), HOOKS) is None


@pytest.mark.pure
def test_the_decision_plans_the_rest_for_the_largest_and_prices_the_real_sizes() -> None:
    module = facts(gbs=32)
    decision = run(module, world=4, plan="dp_mbs=5/1/1/1")
    chosen = decision.plan
    assert chosen.dp_mbs == (5, 1, 1, 1) and chosen.mbs == 5 and chosen.gas == 32 // 8
    assert (chosen.tp, chosen.pp) == (1, 1) and chosen.global_batch_size == 32
    assert decision.estimate == estimate(module.spec, make_cluster(devices_per_node=4), chosen, overlaps=DEEPSPEED.overlaps)
    as_even = estimate(dataclasses.replace(module.spec, global_batch_size=4 * 5 * 4), make_cluster(devices_per_node=4),
                       chosen.replace(dp_mbs=None), overlaps=DEEPSPEED.overlaps)
    assert decision.estimate.time == as_even.time and decision.estimate.memory == as_even.memory  # paced by the largest
    assert decision.estimate.samples_per_s == pytest.approx(32 / as_even.time.step_s)


@pytest.mark.pure
def test_uneven_sizes_are_refused_for_a_loss_that_depends_on_the_micro_batch_and_for_a_bad_total() -> None:
    with pytest.raises(FleetError, match="the loss depends on the micro-batch .* leave dp_mbs out"):
        run(facts(batch_dependent=True), world=2, plan="dp_mbs=3/1")
    with pytest.raises(FleetError, match="takes 5 samples a micro-step, which does not make the global batch 32"):
        run(facts(), world=2, plan="dp_mbs=3/2")
    with pytest.raises(FleetError, match="pipeline engine computes the loss itself"):
        run(facts(), world=4, plan="dp_mbs=3/1,pp=2")


def _rounds(*rounds: tuple[float, float]):
    """A probe of two ranks of one GPU model (GEMM and host rates alike), round by round."""
    from lightning_fleet.calibrate.ranks import RankMeasures

    return RankMeasures(flops_rounds=rounds, ops_rounds=rounds, memory_gib=(80.0, 80.0), identity=(1, 1))


@pytest.mark.pure
def test_a_rebalance_splits_for_a_lasting_slowdown_only_and_goes_back_to_even_when_it_ends() -> None:
    """On two ranks of 16 samples each: rank 1 at half speed in every probe round moves samples to rank 0 (22/10); at half
    speed in three rounds of four (noise) nothing changes; and a split whose cause is gone (the ranks alike again, or
    only noise left) returns to the even split, saying so with the figures behind it."""
    from lightning_fleet.calibrate.ranks import rebalance_by

    spec, cluster = facts(gbs=32).spec, make_cluster(devices_per_node=2)
    even = parse_plan("dp=2,zero=1,mbs=16,gas=1", global_batch_size=32)
    split = parse_plan("dp=2,zero=1,mbs=24,gas=1,dp_mbs=24/8", global_batch_size=32)
    noise = _rounds((1.0, 0.5), (1.0, 0.5), (1.0, 0.5), (1.0, 1.0))

    def after(probe, plan):  # type: ignore[no-untyped-def]
        return rebalance_by(probe, spec, cluster, plan, overlaps=DEEPSPEED.overlaps, step=100, start=102)

    slower, line = after(_rounds(*[(1.0, 0.5)] * 4), even)
    assert slower.plan.dp_mbs == (22, 10)
    assert line.startswith("lightning_fleet: rank speeds 1.00/0.50 at step 100: micro-batches 22/10 from step 102 (predicted ")
    assert "differ: rank(s) 1 slower by 1.2x or more in each of 4 probe rounds" in line
    assert after(noise, even) is None
    for probe in (_rounds(*[(1.0, 1.0)] * 4), noise):
        back, line = after(probe, split)
        assert back.plan == even and back.plan.dp_mbs is None
        assert "micro-batches 16 on every replica (the even split: the ranks measure alike again) from step 102" in line
        assert "alike: no rank slower by 1.2x in each of 4 probe rounds" in line


@pytest.mark.pure
def test_a_checkpoint_continues_under_another_split_of_the_same_layout() -> None:
    text = "dp=4,tp=1,pp=1,zero=2,mbs=2,gas=4,recompute=none,sp=false,vpp=1,offload=none"
    resume = resume_of("/c/step-000000007", manifest(text, 4), 4)
    assert resume.kind is ResumeKind.CONTINUE
    decision = run(facts(), world=4, resume=resume, plan="dp_mbs=5/1/1/1")
    assert decision.plan == parse_plan(text).replace(mbs=5, gas=4, dp_mbs=(5, 1, 1, 1), runtime="deepspeed")
    back = resume_of("/c/step-000000009", manifest(str(decision.plan), 4), 4)
    assert run(facts(), world=4, resume=back, plan="mbs=2").plan == parse_plan(text).replace(runtime="deepspeed")  # and back to even
    assert run(facts(), world=4, resume=back).plan == decision.plan  # nothing fixed: the checkpoint's split continues
    with pytest.raises(FleetError, match="but this job fixes dp=2, mbs=3, dp_mbs=3/1: drop those"):
        run(facts(), world=4, resume=resume, plan="dp_mbs=3/1")  # two replicas: another layout, not another split
    with pytest.raises(FleetError, match="with the fixed mbs=3 takes 24 samples a step, not the global batch 32"):
        run(facts(), world=4, resume=resume, plan="mbs=3")
    with pytest.raises(FleetError, match="but this job fixes zero=3"):
        run(facts(), world=4, resume=resume, plan="zero=3,dp_mbs=5/1/1/1")
    assert isinstance(resume, Resume) and isinstance(decision.plan, Plan)


# --- real training: 2 processes, gloo, DeepSpeed --------------------------------------------------------------------

STEPS, GBS = 6, 8
UNEVEN = ["dp=2,zero=0,dp_mbs=3/1", "dp=2,zero=1,dp_mbs=1/3", "dp=2,zero=2,dp_mbs=3/1", "dp=2,zero=3,dp_mbs=3/1"]


@pytest.fixture(scope="module")
def reference():
    from tests.reference import reference_run

    return reference_run(STEPS, GBS)


def _matches_reference(result: dict, reference: tuple, text: str, atol: float = 2e-6) -> None:
    """The eval loss within 1e-6 relative of the reference's, every weight within ``atol`` (+ 1e-6 relative): float32
    sums in another order, which Adam's normalisation amplifies where a gradient is near zero."""
    ref_loss, ref_state = reference
    assert parse_plan(result["plan"]).dp_mbs == parse_plan(text, global_batch_size=GBS).dp_mbs, result["plan"]
    assert result["eval_loss"] == pytest.approx(ref_loss, rel=1e-6)
    for name, tensor in result["state"].items():
        torch.testing.assert_close(tensor, ref_state[name], atol=atol, rtol=1e-6, msg=lambda m, name=name: f"{text}: {name}: {m}")


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> tuple[list[dict], Path]:
    """Every UNEVEN plan trained 6 steps in one job, each saving a checkpoint after step 3 (mid-fit) under DIR/<index>."""
    from tests.multiprocess import run_worker

    tmp = tmp_path_factory.mktemp("uneven")
    results, _ = run_worker(tmp, "--plans", ";".join(UNEVEN), "--steps", str(STEPS), "--gbs", str(GBS), "--cluster", "cpu",
                            "--save-to", str(tmp / "ckpt"), "--save-at", "3")
    return results, tmp / "ckpt"


@pytest.mark.multiprocess
def test_uneven_replicas_train_the_single_process_model_at_every_zero_stage(uneven, reference) -> None:
    """Replica 0 takes 3 samples a micro-batch and replica 1 one (or the other way round), 2 micro-batches a step: the
    weights after 6 AdamW steps equal the one-process reference at ZeRO 0-3 (with the replicas' losses unweighted they
    would not: the gradient would weight replica 1's two samples like replica 0's six)."""
    for text, result in zip(UNEVEN, uneven[0]):
        _matches_reference(result, reference, text)


@pytest.mark.multiprocess
def test_a_checkpoint_taken_under_one_split_resumes_under_another(tmp_path, uneven, reference) -> None:
    """The step-3 checkpoint of replicas at 1/3, resumed by a new job at 3/1 to step 6: the reference's weights."""
    from tests.multiprocess import run_worker

    saved = UNEVEN.index("dp=2,zero=1,dp_mbs=1/3")
    results, _ = run_worker(tmp_path, "--plans", "dp=2,zero=1,dp_mbs=3/1", "--gbs", str(GBS), "--cluster", "cpu",
                            "--steps", str(STEPS), "--resume-from", str(uneven[1]), "--resume-index", str(saved))
    _matches_reference(results[0], reference, "dp=2,zero=1,dp_mbs=3/1")


CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
THROTTLED_ATOL = 1e-4
"""Weight tolerance for the throttled worker's larger model, where the eval loss (1e-6 relative) is the sharp test: the
key projection's bias has no gradient in exact arithmetic (a shift of every score of a row leaves its softmax as is), so
AdamW moves it by the rounding noise of its gradient, which depends on how the batch was split (seen: 1.3e-5 after 12
steps); an unweighted split moves the eval loss by 5e-4 relative."""


needs_cgroups = pytest.mark.skipif(os.geteuid() != 0 or not os.access(CPU_CGROUPS, os.W_OK),
                                   reason="needs root and a writable cgroup v1 cpu controller to slow one rank down")


def _throttled_run(tmp_path: Path, monkeypatch, quota_us: int, steps: int, plan: str = "dp=2,zero=1", **env: str) -> tuple[list[dict], str]:
    """The training worker with rank 1 in a CPU cgroup of its own (period 10 ms, quota ``quota_us``, -1: none yet),
    each rank on its own core; the cgroup is removed afterwards."""
    from tests.multiprocess import ROOT, run_worker

    group = CPU_CGROUPS / f"fleet-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        monkeypatch.setenv("FLEET_TEST_THROTTLED_CGROUP", str(group))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return run_worker(tmp_path, "--plans", plan, "--steps", str(steps), "--gbs", str(GBS),
                          worker=ROOT / "tests" / "workers" / "throttled_gpt.py")
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        group.rmdir()


@pytest.mark.multiprocess
@needs_cgroups
@pytest.mark.serial
def test_the_job_measures_each_rank_and_gives_the_slower_one_less(tmp_path, monkeypatch) -> None:
    """Rank 1 at a 30 % CPU quota (each rank pinned to its own core), no cluster file: the strategy's own measurement
    sees the ranks differ (ClusterSpec.rank_devices), the planner gives rank 0 the larger micro-batch, and the model
    trained is still the one-process reference's."""
    results, log = _throttled_run(tmp_path, monkeypatch, 3000, STEPS)
    chosen = parse_plan(results[0]["plan"])
    assert chosen.dp_mbs is not None and chosen.dp_mbs[0] > chosen.dp_mbs[1], (results[0]["plan"], log[-3000:])
    # the start-up report says why: slower in every probe round, with the figures
    assert re.search(r"  ranks    differ: rank\(s\) 1 slower by 1.2x or more in each of 4 probe rounds \(GEMMs and host\).*"
                     r"rank 1 GEMMs 0\.\d\d/0\.\d\d/0\.\d\d/0\.\d\d", log), log[-3000:]
    _matches_reference(results[0], _throttled_reference(STEPS), results[0]["plan"], atol=THROTTLED_ATOL)


@pytest.mark.multiprocess
@pytest.mark.serial
def test_a_busy_homogeneous_machine_keeps_the_even_split(tmp_path, monkeypatch) -> None:
    """Two unpinned ranks on one host while a busy loop holds core 1 (taskset) for the whole job, starting from a cache
    that a busy measurement left (rank 1 "2.5x slower", as every job on the host then split its batch), probing every 2
    steps: the cache's per-rank devices are not used, this start's probe rounds find the ranks alike and the report says
    so with the figures, the job trains the even split and never re-splits."""
    import socket
    import subprocess
    import sys

    from lightning_fleet.calibrate.measure import write_cluster
    from lightning_fleet.planning import load_cluster
    from lightning_fleet.planning.cluster import devices_by_speed
    from tests.multiprocess import ROOT, run_worker

    cpu = load_cluster("cpu")
    stale = dataclasses.replace(cpu, rank_devices=devices_by_speed(cpu.groups[0].device, [1.0, 0.4], [1.0, 0.4]))
    write_cluster(stale, tmp_path / "cache" / f"cluster-{socket.gethostname()}-cpu-1x2.yaml")  # as the old cache held it
    monkeypatch.setenv("FLEET_TEST_REBALANCE_EVERY", "2")
    monkeypatch.delenv("FLEET_TEST_THROTTLED_CGROUP", raising=False)
    busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    try:
        results, log = run_worker(tmp_path, "--plans", "dp=2,zero=1", "--steps", "6", "--gbs", str(GBS),
                                  worker=ROOT / "tests" / "workers" / "throttled_gpt.py", private_cache=True)
    finally:
        busy.kill()
        busy.wait()
    assert parse_plan(results[0]["plan"]).dp_mbs is None, (results[0]["plan"], log[-3000:])
    assert re.search(r"  ranks    alike: no rank slower by 1.2x in each of 4 probe rounds .*rank 1 GEMMs [\d./]+, host", log), log[-3000:]
    assert "lightning_fleet: rank speeds" not in log, log[-3000:]


@functools.cache  # two tests hold their runs against the same reference
def _throttled_reference(steps: int) -> tuple:
    """The one-process reference of the throttled worker's model (tests/workers/throttled_gpt.py SIZES)."""
    from unittest import mock

    from tests import reference
    from tests.workers.throttled_gpt import SIZES

    with mock.patch.dict(reference.SIZES, SIZES):
        return reference.reference_run(steps, GBS)


@pytest.mark.multiprocess
@needs_cgroups
@pytest.mark.serial
def test_a_slowdown_mid_run_is_rebalanced_without_changing_the_optimisation(tmp_path, monkeypatch) -> None:
    """Both ranks at full speed, so the job starts even; at step 2 rank 1 drops to a 30 % quota. With a probe every 2
    steps the strategy moves samples to rank 0 from a later step, prints it, and after 12 steps the weights are still the
    one-process reference's (the same samples formed every step, the gradient stayed the global mean)."""
    steps = 12
    results, log = _throttled_run(tmp_path, monkeypatch, -1, steps, FLEET_TEST_QUOTA_AT_STEP="2", FLEET_TEST_QUOTA_US="3000",
                                  FLEET_TEST_REBALANCE_EVERY="2")
    assert parse_plan(results[0]["plan"]).dp_mbs is not None, log[-3000:]
    sizes = parse_plan(results[0]["plan"]).dp_mbs
    assert sizes[0] > sizes[1]
    assert "lightning_fleet: rank speeds" in log and "from step" in log
    assert re.search(r"  split    changed \d+ time\(s\) as the ranks' speeds drifted; last: rank speeds", log)  # the summary
    _matches_reference(results[0], _throttled_reference(steps), results[0]["plan"], atol=THROTTLED_ATOL)


@pytest.mark.multiprocess
@needs_cgroups
@pytest.mark.serial
def test_a_pipeline_over_unequal_ranks_gives_the_faster_stage_more_layers(tmp_path, monkeypatch) -> None:
    """pp=2 fixed, rank 1 (the second stage) at a 30 % quota, no cluster file: the job's measurement sees the ranks
    differ, the planner gives the first stage more of the 4 layers (balanced_stage_layers with the stages' speeds),
    DeepSpeed runs that split, and the model trained has the one-process reference's eval loss."""
    results, log = _throttled_run(tmp_path, monkeypatch, 3000, STEPS, plan="dp=1,pp=2,zero=1")
    chosen = parse_plan(results[0]["plan"])
    assert chosen.stage_layers is not None and chosen.stage_layers[0] > chosen.stage_layers[1], (results[0]["plan"], log[-3000:])
    assert results[0]["eval_loss"] == pytest.approx(_throttled_reference(STEPS)[0], rel=1e-6)
