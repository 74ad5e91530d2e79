"""Parameters with sparse gradients (``nn.EmbeddingBag(sparse=True)``, the recommender setting): the cost terms of their
touched rows (planning/model.py ``touched_sparse``, memory.py, time.py), the estimate that adds them up, the search's
SPARSE rejection, DeepSpeed's one-line refusal of a fixed shard level that cannot run them, the profiler that finds them,
and one real 2-process job whose automatic plan under tight memory trains them and matches one plain process.

Every expected number is a literal or a visible arithmetic expression.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fleet.decide import JobOptions, ModuleFacts, Resume, ResumeKind, decide
from lightning_fleet.planning import FleetError, PlanError, RejectionKind, estimate, parse_partial_plan, parse_plan, plan
from lightning_fleet.planning.cluster import Calibration, LinkSpec
from lightning_fleet.planning.memory import sparse_grads_bytes, sparse_index_bytes
from lightning_fleet.planning.model import BlockSpec, ModelSpec, Precision, Role, SpecError, TouchedRows, touched_sparse
from lightning_fleet.planning.time import sparse_grad_allgather_s, sparse_optimizer_step_s
from lightning_fleet.runtime.base import ANY, ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from tests.conftest import make_cluster

TABLES = 4_000_000
"""Elements of the sparse tables of :func:`recommender` (4 tables)."""
DENSE = 1000
"""Dense parameters of its MLP."""


def recommender(gbs: int = 16, **spec: object) -> ModelSpec:
    """4 sparse tables (12 lookups per sample, rows 16 wide) before a small dense MLP, in fp32."""
    tables = BlockSpec(name="tables", role=Role.PRE, params=TABLES, flops=0.0, sparse_params=TABLES, sparse_tensors=4,
                       sparse_rows_per_sample=12, sparse_elements_per_sample=12 * 16)
    mlp = BlockSpec(name="mlp", role=Role.LAYER, params=DENSE, flops=2.0 * DENSE)
    head = BlockSpec(name="head", role=Role.POST, params=0, flops=0.0)
    return ModelSpec(name="recsys", blocks=(tables, mlp, head), hidden_size=16, num_heads=1, seq_length=1,
                     precision=Precision.FP32, global_batch_size=gbs, **spec)  # type: ignore[arg-type]


def densely(model: ModelSpec) -> ModelSpec:
    """The same model with its sparse gradients unknown: every gradient priced dense (what the planner did before)."""
    blocks = tuple(dataclasses.replace(b, sparse_params=0, sparse_tensors=0, sparse_rows_per_sample=0.0,
                                       sparse_elements_per_sample=0.0) for b in model.blocks)
    return dataclasses.replace(model, blocks=blocks)


SPARSE_HOOKS = ModuleHooks(name="DLRM", tensor_parallel=False, pipeline=False, layers=True, automatic_optimization=True,
                           sparse_params=("tables.0.weight", "tables.1.weight"))


# --- cost terms ------------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_touched_rows_are_the_lookups_at_most_the_tables() -> None:
    """10 samples x 2 lookups of 16-wide rows: 20 rows, 320 elements; 100 samples would look up 3200 > 1000 elements:
    capped at the tables, rows at the average width (1000 / 16)."""
    assert touched_sparse(1000, 2, 32, 10) == TouchedRows(rows=20, elements=320)
    assert touched_sparse(1000, 2, 32, 100) == TouchedRows(rows=1000 / 16, elements=1000)
    assert touched_sparse(0, 0, 0, 10) == TouchedRows(rows=0, elements=0)


@pytest.mark.pure
def test_sparse_gradient_bytes_are_every_replicas_rows_values_and_indices() -> None:
    touched = TouchedRows(rows=20, elements=320)
    assert sparse_index_bytes(Precision.FP32) == 8 and sparse_index_bytes(Precision.BF16_MIXED) == 4
    assert sparse_grads_bytes(touched, dp=2, precision=Precision.FP32) == 2 * (320 * 4 + 20 * 8)
    assert sparse_grads_bytes(touched, dp=2, precision=Precision.BF16_MIXED) == 2 * (320 * 2 + 20 * 4)


@pytest.mark.pure
def test_sparse_allgather_is_four_ring_allgathers_per_tensor() -> None:
    """alpha 1 ms, 1 GB/s, 2 ranks, 2 tensors holding 20 rows / 320 fp32 elements per replica: per tensor two counts
    (16 B in all), its indices (2 * 10 rows * 8 B) and values (2 * 160 * 4 B), each (n-1) alpha + (n-1)/n bytes beta."""
    link, touched = LinkSpec(bandwidth_GBps=1, latency_us=1000), TouchedRows(rows=20, elements=320)
    per_tensor = 4 * 1e-3 + 0.5 * (2 * 16 + 2 * 10 * 8 + 2 * 160 * 4) / 1e9
    got = sparse_grad_allgather_s(touched, tensors=2, dp=2, precision=Precision.FP32, link=link)
    assert got == pytest.approx(2 * per_tensor, rel=1e-12)
    assert sparse_grad_allgather_s(touched, tensors=2, dp=1, precision=Precision.FP32, link=link) == 0.0
    assert sparse_optimizer_step_s(touched, dp=2, adam_params_per_s=1e6) == 2 * 320 / 1e6


@pytest.mark.pure
def test_sparse_fields_are_checked_in_one_line() -> None:
    with pytest.raises(SpecError, match=r"sparse_params \(5\) must be <= its trainable parameters \(4\)"):
        BlockSpec(name="t", params=4, flops=0.0, sparse_params=5, sparse_tensors=1)
    with pytest.raises(SpecError, match="must be both 0 or both > 0"):
        BlockSpec(name="t", params=4, flops=0.0, sparse_params=4)
    with pytest.raises(SpecError, match="a row has at least one element"):
        BlockSpec(name="t", params=4, flops=0.0, sparse_params=4, sparse_tensors=1, sparse_rows_per_sample=2,
                  sparse_elements_per_sample=1)


# --- the estimate ----------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_zero0_prices_sparse_gradients_by_the_touched_rows_and_shard_levels_dense() -> None:
    """dp=2, mbs=8: a replica looks up 8 * 12 = 96 rows, 96 * 16 = 1536 elements of the 4M; the gradient on a device
    is both replicas' rows, the dense MLP's 1000 gradients beside it; the all-gathers, the dense all-reduce and the
    optimizer step as the terms give them. ZeRO-1 keeps every gradient dense (4 bytes x all trainable)."""
    model, cluster = recommender(), make_cluster(devices_per_node=2, memory_gib=80)
    zero0 = estimate(model, cluster, parse_plan("dp=2,zero=0,mbs=8", global_batch_size=16), overlaps=DEEPSPEED.overlaps)
    touched = TouchedRows(rows=96, elements=1536)
    assert zero0.memory.grads_bytes == 4 * DENSE + 2 * (1536 * 4 + 96 * 8)
    alpha, beta = 5e-6, 1 / 300e9  # make_cluster's intra-node link
    dense_allreduce = 2 * alpha + 4 * DENSE * beta
    sparse = 4 * (4 * alpha + 0.5 * (2 * 16 + 2 * 96 * 8 / 4 + 2 * 1536 * 4 / 4) * beta)
    assert zero0.time.dp_comm_s == pytest.approx(dense_allreduce + sparse, rel=1e-12)
    rate = Calibration().adam_params_per_s
    assert zero0.time.optimizer_s == pytest.approx(DENSE / rate + 2 * 1536 / rate, rel=1e-12)
    assert sparse_grad_allgather_s(touched, tensors=4, dp=2, precision=Precision.FP32, link=cluster.intra_node) == pytest.approx(sparse)
    zero1 = estimate(model, cluster, parse_plan("dp=2,zero=1,mbs=8", global_batch_size=16), overlaps=DEEPSPEED.overlaps)
    assert zero1.memory.grads_bytes == 4 * (TABLES + DENSE)
    dense0 = estimate(densely(model), cluster, zero0.plan, overlaps=DEEPSPEED.overlaps)  # as it was priced before
    assert dense0.memory.grads_bytes == 4 * (TABLES + DENSE)
    assert dense0.time.optimizer_s == pytest.approx((TABLES + DENSE) / rate, rel=1e-12)
    assert dense0.time.dp_comm_s == pytest.approx(2 * alpha + 4 * (TABLES + DENSE) * beta, rel=1e-12)


@pytest.mark.pure
def test_the_search_plans_sparse_gradients_only_where_the_runtime_runs_them() -> None:
    cluster = make_cluster(devices_per_node=2)
    result = plan(recommender(), cluster, top=3, max_rejected=50, sparse_zero_stages=(0,))
    assert {e.plan.zero for e in result.all_feasible} == {0}
    sparse = [r for r in result.rejected if r.kind is RejectionKind.SPARSE]
    assert [r.plan for r in sparse] == ["zero=1", "zero=2", "zero=3"]
    assert sparse[0].reason == ("model 'recsys' has 4,000,000 parameters with sparse gradients (embedding lookups with "
                                "sparse=True); the runtime runs them at zero 0 only")
    assert {e.plan.zero for e in plan(densely(recommender()), cluster, top=50, sparse_zero_stages=(0,)).plans} == {0, 1, 2, 3}
    with pytest.raises(PlanError) as err:
        plan(recommender(), cluster, zero_stages=(1, 2), sparse_zero_stages=(0,))
    assert str(err.value) == ("model 'recsys' has 4,000,000 parameters with sparse gradients (embedding lookups with "
                              "sparse=True), and the runtime runs them at zero 0 only, but zero 1, 2 was asked for: allow "
                              "zero 0, or build the embeddings with sparse=False")


@pytest.mark.pure
def test_tight_memory_no_longer_sends_sparse_gradients_to_a_shard_level() -> None:
    """A device that holds ZeRO-2 priced dense but not ZeRO-0 priced dense: the planner chose a shard level (which
    DeepSpeed cannot run); priced by their rows ZeRO-0 fits and is chosen, under DeepSpeed's constraints."""
    model, plain = recommender(), make_cluster(devices_per_node=2, memory_reserve_fraction=0.0)
    e = {z: estimate(densely(model), plain, parse_plan(f"dp=2,zero={z},mbs=8", global_batch_size=16)).memory.total_bytes
         for z in (0, 2)}  # the reserve does not depend on the device's size here, so neither do these
    cluster = make_cluster(devices_per_node=2, memory_gib=(e[0] + e[2]) / 2 / 2**30, memory_reserve_fraction=0.0)
    constraints = DEEPSPEED.constraints(SPARSE_HOOKS)
    assert plan(densely(model), cluster, constraints=dataclasses.replace(constraints, sparse_zero_stages=(0, 1, 2, 3))).best.plan.zero >= 1
    assert plan(model, cluster, constraints=constraints).best.plan.zero == 0


# --- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_a_fixed_shard_level_is_refused_in_one_line_naming_the_parameters() -> None:
    line = DEEPSPEED.refusal(parse_partial_plan("zero=1"), SPARSE_HOOKS)
    assert line == ("plan zero=1: DLRM's tables.0.weight, tables.1.weight get sparse gradients (an embedding with "
                    "sparse=True), which DeepSpeed runs at zero 0 only, not zero=1: use zero=0 (or leave zero to the "
                    "planner), or build the embedding with sparse=False to shard it")
    assert DEEPSPEED.refusal(parse_partial_plan("zero=0"), SPARSE_HOOKS) is None
    assert DEEPSPEED.refusal(parse_partial_plan("dp=2"), SPARSE_HOOKS) is None
    assert ANY.refusal(parse_partial_plan("zero=3"), SPARSE_HOOKS) is None
    facts = ModuleFacts(spec=recommender(), hooks=SPARSE_HOOKS, loader_batch_size=8, batch_dependent=False)
    with pytest.raises(FleetError) as err:
        decide(facts, make_cluster(devices_per_node=2), world_size=2, options=JobOptions(plan="dp=2,zero=1"),
               runtimes=(DEEPSPEED,), resume=Resume(kind=ResumeKind.FRESH))
    assert str(err.value).startswith("plan dp=2,zero=1: DLRM's tables.0.weight") and "\n" not in str(err.value)
    chosen = decide(facts, make_cluster(devices_per_node=2), world_size=2, options=JobOptions(), runtimes=(DEEPSPEED,),
                    resume=Resume(kind=ResumeKind.FRESH))
    assert chosen.plan.zero == 0


# --- profiling -------------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_profiling_finds_the_parameters_looked_up_sparsely() -> None:
    """The DLRM's four EmbeddingBag(sparse=True) tables (3 ids per bag, 16 wide) and a functional sparse lookup are
    found with their lookups per sample; a dense embedding and the MLP are not."""
    import torch
    from torch import nn

    from lightning_fleet.profiling import profile
    from tests.workers.sparse_dlrm import BAG, BATCH, DIM, DLRM, TABLES as N_TABLES, dlrm_data

    measured = profile(DLRM(rows=1000), dlrm_data(1000)[:BATCH], global_batch_size=16)
    assert measured.sparse_params == tuple(f"tables.{i}.weight" for i in range(N_TABLES))
    assert measured.spec.sparse_params == N_TABLES * 1000 * DIM
    blocks = measured.spec.blocks
    assert sum(b.sparse_rows_per_sample * b.count for b in blocks) == N_TABLES * BAG
    assert sum(b.sparse_elements_per_sample * b.count for b in blocks) == N_TABLES * BAG * DIM
    assert sum(b.sparse_tensors * b.count for b in blocks) == N_TABLES
    assert any(line.startswith("sparse gradients: tables.0.weight") for line in measured.notes)

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(50, 4))
            self.dense = nn.Embedding(50, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return (nn.functional.embedding(ids, self.table, sparse=True) + self.dense(ids)).sum()

    found = profile(Functional(), torch.randint(0, 50, (4, 5)), global_batch_size=4)
    assert found.sparse_params == ("table",)
    assert sum(b.sparse_rows_per_sample for b in found.spec.blocks) == 5


# --- a real job ------------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_automatic_plan_under_tight_memory_trains_sparse_embeddings_as_one_process(tmp_path) -> None:
    """2 processes, DeepSpeed, a device memory that holds ZeRO-2/3 priced dense but not ZeRO-0 priced dense (so the
    planner used to choose a shard level, which crashes at the first step): the plan is ZeRO-0, and 4 steps give the
    weights of 4 plain SGD steps of one process."""
    import torch

    from lightning_fleet.planning import load_cluster
    from lightning_fleet.profiling import profile
    from tests.multiprocess import ROOT, run_worker
    from tests.workers.sparse_dlrm import BATCH, DLRM, dlrm_data, reference_state

    gbs, steps, rows = 2 * BATCH, 4, 20_000
    spec = profile(DLRM(rows=rows), dlrm_data(rows)[:BATCH], global_batch_size=gbs).spec
    cpu = load_cluster("cpu")
    need = {z: estimate(densely(spec), cpu, parse_plan(f"dp=2,zero={z},mbs={BATCH}", global_batch_size=gbs)).memory
            for z in (0, 2)}
    limit = (need[0].total_bytes + need[2].total_bytes) / 2
    tight = cpu.with_device(dataclasses.replace(cpu.groups[0].device, memory_gib=limit / 2**30))
    (tmp_path / "tight.yaml").write_text(tight.to_yaml())
    assert need[2].total_bytes < limit < need[0].total_bytes  # dense pricing: only a shard level fits
    result, log = run_worker(tmp_path, "--plan", "auto", "--cluster", str(tmp_path / "tight.yaml"), "--steps", str(steps),
                             "--rows", str(rows), worker=ROOT / "tests" / "workers" / "sparse_dlrm.py")
    assert result["plan"].startswith("dp=2,tp=1,pp=1,zero=0,") and result["global_step"] == steps
    assert "sparse gradients: tables.0.weight" in log
    reference = reference_state(steps, gbs, rows)
    for name, tensor in reference.items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
