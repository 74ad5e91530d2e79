"""Tier-1 tests of the gradient copies a stack keeps (``grad_accum_dtype``) and their memory term.

Every expected value is written out by hand with its source: Megatron-LM's distributed-optimizer table
(docs/user-guide/features/dist_optimizer.md), DeepSpeed's BF16_Optimizer (runtime/bf16_optimizer.py: an fp32
``zeros_like`` of the whole bf16 flat buffer), and BLOOM's training files (bigscience-workshop/bigscience
train/tr11-176B-ml/: the slurm script, the README's "Deepspeed config" and the prequel chronicles).
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lightning_fleet.planning.cluster import GIB, load_cluster
from lightning_fleet.planning.errors import SpecError
from lightning_fleet.planning.estimate import Hardware, memory_estimate, stage_state_bytes
from lightning_fleet.planning.memory import grad_bytes_per_param, grads_bytes, optimizer_bytes, params_bytes
from lightning_fleet.planning.model import (
    BlockSpec,
    GradAccumDtype,
    ModelSpec,
    Precision,
    Role,
    TransformerSpec,
    load_model,
    load_transformer,
    model_from_dict,
    transformer_from_dict,
    transformer_model,
)
from lightning_fleet.planning.plan import Offload, Plan, Recompute
from lightning_fleet.planning.search import plan
from lightning_fleet.planning.stages import stage_loads
from tests.conftest import make_cluster, make_model

pytestmark = pytest.mark.pure

WORKING, FP32_ONLY, BOTH = GradAccumDtype.WORKING, GradAccumDtype.FP32, GradAccumDtype.FP32_AND_WORKING
MIXED, FP16, FP32 = Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.FP32
REL = 1e-12
N = 1_000_000  # trainable parameters of a stage before tp
TP, DP = 2, 4


# --- grad_bytes_per_param ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype", "expected"),
    [
        (MIXED, WORKING, 2),  # bf16 .grad
        (FP16, WORKING, 2),
        (FP32, WORKING, 4),
        (MIXED, FP32_ONLY, 4),  # Megatron main_grad: bf16 .grad freed after main_grad.add_
        (FP16, FP32_ONLY, 4),
        (FP32, FP32_ONLY, 4),  # the fp32 gradient is the working one
        (MIXED, BOTH, 4 + 2),  # BF16_Optimizer: fp32 buffer + the bf16 .grad it keeps
        (FP16, BOTH, 4 + 2),
    ],
)
def test_grad_bytes_per_param(precision: Precision, dtype: GradAccumDtype, expected: int) -> None:
    """Bytes of gradient per trainable parameter for each precision and gradient-copy setting."""
    assert grad_bytes_per_param(precision, dtype) == expected


# --- grads_bytes: each setting x ZeRO stage ---------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "zero", "expected"),
    [
        (WORKING, 0, 1_000_000),  # 2 B x 1e6 / tp 2
        (WORKING, 1, 1_000_000),  # P_os leaves gradients whole
        (WORKING, 2, 250_000),  # P_os+g: 2 B x 1e6 / (tp 2 x dp 4)
        (WORKING, 3, 250_000),
        (FP32_ONLY, 0, 2_000_000),  # 4 B x 1e6 / tp 2: Megatron DDP main_grad
        (FP32_ONLY, 1, 2_000_000),  # Megatron distributed optimizer: main_grad buffer unsharded ("6 + 12/d")
        (FP32_ONLY, 2, 500_000),  # 4 B x 1e6 / (2 x 4)
        (FP32_ONLY, 3, 500_000),  # DeepSpeed stage 3 / FSDP: fp32 gradient partitions
        (BOTH, 0, 3_000_000),  # 6 B x 1e6 / tp 2: BF16_Optimizer at ZeRO-0 (BLOOM's DeepSpeed of 2022)
        (BOTH, 1, 3_000_000),  # BF16_Optimizer at ZeRO-1: "doesn't shard the static fp32 buffer"
        (BOTH, 2, 750_000),  # 6 B x 1e6 / (2 x 4)
        (BOTH, 3, 750_000),
    ],
)
def test_grads_bytes_by_setting_and_zero_stage(dtype: GradAccumDtype, zero: int, expected: float) -> None:
    """bf16-mixed, n = 1e6 trainable, tp 2, dp 4: the copies' bytes / tp, / dp from ZeRO-2 on."""
    assert grads_bytes(N, tp=TP, dp=DP, zero=zero, precision=MIXED, grad_accum=dtype) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [MIXED, FP16, FP32])
def test_grads_bytes_default_is_the_working_precision(zero: int, precision: Precision) -> None:
    """Without the argument grads_bytes prices what it priced before the setting existed: element bytes / tp (/ dp)."""
    shard = DP if zero >= 2 else 1
    expected = precision.element_bytes * N / (TP * shard)
    assert grads_bytes(N, tp=TP, dp=DP, zero=zero, precision=precision) == expected
    assert grads_bytes(N, tp=TP, dp=DP, zero=zero, precision=precision, grad_accum=WORKING) == expected


@pytest.mark.parametrize(
    ("precision", "dtype", "zero", "expected_per_param"),
    [
        (MIXED, FP32_ONLY, 0, 18),  # "bf16 parameters, fp32 gradients", non-distributed optim: 18
        (MIXED, FP32_ONLY, 1, 6 + 12 / 8),  # distributed optim: 6 + 12/d
        (FP32, WORKING, 0, 16),  # "fp32 parameters, fp32 gradients": 16
        (FP32, FP32_ONLY, 1, 8 + 8 / 8),  # 8 + 8/d
    ],
)
def test_megatron_distributed_optimizer_table(
    precision: Precision, dtype: GradAccumDtype, zero: int, expected_per_param: float
) -> None:
    """Megatron-LM dist_optimizer.md, bytes per parameter at d = 8 (no tp): weights + gradients + optimizer states."""
    total = (
        params_bytes(N, tp=1, dp=8, zero=zero, offload=Offload.NONE, precision=precision)
        + grads_bytes(N, tp=1, dp=8, zero=zero, precision=precision, grad_accum=dtype)
        + optimizer_bytes(N, tp=1, dp=8, zero=zero, offload=Offload.NONE, precision=precision)
    )
    assert total == pytest.approx(expected_per_param * N, rel=REL)


# --- through the estimate and the planner ------------------------------------------------------------


def _hand_model(dtype: GradAccumDtype) -> ModelSpec:
    """Embedding 1000 tied to a head of 1100, two layers of 500: one stage stores 1000 + 2 x 500 + 1100 - 1000 = 2100."""
    return ModelSpec(
        name="hand",
        blocks=(
            BlockSpec(name="embedding", role=Role.PRE, params=1000, flops=0.0),
            BlockSpec(name="layer", role=Role.LAYER, count=2, params=500, flops=1.0),
            BlockSpec(name="head", role=Role.POST, params=1100, flops=1.0),
        ),
        hidden_size=8,
        num_heads=1,
        seq_length=4,
        global_batch_size=8,
        tied_params=1000,
        grad_accum_dtype=dtype,
    )


@pytest.mark.parametrize(
    ("dtype", "zero", "expected"),
    [
        (WORKING, 1, 2 * 2100),
        (WORKING, 2, 2 * 2100 / 2),
        (FP32_ONLY, 1, 4 * 2100),
        (FP32_ONLY, 2, 4 * 2100 / 2),
        (BOTH, 1, 6 * 2100),
        (BOTH, 2, 6 * 2100 / 2),
    ],
)
def test_stage_state_bytes_prices_the_models_setting(dtype: GradAccumDtype, zero: int, expected: float) -> None:
    """stage_state_bytes takes the setting from the ModelSpec (bf16, dp 2); weights, optimizer states and buffers do not move."""
    (load,) = stage_loads(_hand_model(dtype), 1)
    hw = Hardware.of(make_cluster(devices_per_node=2), _hand_model(dtype))
    state = stage_state_bytes(_hand_model(dtype), hw, load, tp=1, dp=2, zero=zero, offload=Offload.NONE)
    base = stage_state_bytes(_hand_model(WORKING), hw, load, tp=1, dp=2, zero=zero, offload=Offload.NONE)
    assert state.grads_bytes == expected
    assert (state.params_bytes, state.optimizer_bytes, state.other_bytes, state.host_bytes) == (
        base.params_bytes, base.optimizer_bytes, base.other_bytes, base.host_bytes
    )


def test_the_planner_prices_the_gradient_copies() -> None:
    """Every plan the search returns for an fp32+working model carries 6 B per trainable parameter of its worst stage,
    / tp, / its shard group from ZeRO-2 on (all of dp, or a hybrid group; the search keeps stage_state_bytes per layout)."""
    model = dataclasses.replace(make_model(layers=4, hidden=256, heads=4, seq=128, vocab=1000, gbs=16), grad_accum_dtype=BOTH)
    result = plan(model, make_cluster(devices_per_node=8), top=5)
    assert result.plans
    for e in result.plans:
        load = next(load for load in stage_loads(model, e.plan.pp) if load.index == e.memory.stage)
        shard = e.plan.shard_degree if e.plan.zero >= 2 else 1
        assert e.memory.grads_bytes == pytest.approx(6 * load.trainable_params / (e.plan.tp * shard), rel=REL)


# --- YAML --------------------------------------------------------------------------------------------

SHAPE = {
    "name": "tiny",
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "seq_length": 16,
    "vocab_size": 100,
    "precision": "bf16-mixed",
    "global_batch_size": 8,
}


@pytest.mark.parametrize("value", ["working", "fp32", "fp32+working"])
def test_yaml_round_trips_in_both_layouts(value: str) -> None:
    """The key loads as the enum, dumps as its string (left out when it is the default), and load -> dump -> load is the
    identity in the transformer layout and in the per-block layout ``transformer_model`` passes it to."""
    shape = transformer_from_dict({**SHAPE, "grad_accum_dtype": value})
    assert shape.grad_accum_dtype is GradAccumDtype(value)
    assert shape.to_dict().get("grad_accum_dtype", "working") == value
    assert transformer_from_dict(yaml.safe_load(shape.to_yaml())) == shape
    model = transformer_model(shape)
    assert model.grad_accum_dtype is GradAccumDtype(value)
    assert model.to_dict().get("grad_accum_dtype", "working") == value
    assert model_from_dict(yaml.safe_load(model.to_yaml())) == model


def test_default_leaves_the_yaml_as_it_was() -> None:
    """Unset, the setting is 'working' and neither layout writes the key: the shipped GPT presets dump as before."""
    assert transformer_from_dict(SHAPE).grad_accum_dtype is WORKING
    for name in ("gpt-tiny", "gpt-1.7b", "gpt3-175b", "megatron-1t"):
        assert load_model(name).grad_accum_dtype is WORKING
        assert "grad_accum_dtype" not in load_model(name).to_dict()
        assert "grad_accum_dtype" not in load_transformer(name).to_dict()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({**SHAPE, "grad_accum_dtype": "fp64"}, "model.grad_accum_dtype must be one of working, fp32, fp32+working, got 'fp64'"),
        ({**SHAPE, "grad_accum_dtype": 4}, "model.grad_accum_dtype must be one of working, fp32, fp32+working, got 4"),
        (
            {**SHAPE, "precision": "fp32", "grad_accum_dtype": "fp32+working"},
            "model.grad_accum_dtype 'fp32+working' needs bf16-mixed or fp16-mixed precision; in fp32 the working gradient is "
            "the fp32 one: use 'working'",
        ),
    ],
)
def test_bad_values_are_one_clear_error(data: dict, message: str) -> None:
    """A value outside the three, or an fp32 buffer beside fp32 gradients, is one SpecError naming the key (both layouts)."""
    with pytest.raises(SpecError) as err:
        model_from_dict(data)
    assert str(err.value) == message
    blocks = transformer_model(TransformerSpec(**SHAPE)).to_dict()
    with pytest.raises(SpecError) as err:
        model_from_dict({**blocks, "precision": data["precision"], "grad_accum_dtype": data["grad_accum_dtype"]})
    assert str(err.value) == message


# --- BLOOM-176B at its published layout --------------------------------------------------------------

# 12h^2 + 13h per layer at h = 14336 (tr11 README: "2_466_437_120 params"); the embedding 250880 x 14336 = 3_596_615_680
# (README) and this GPT shape's position table 2048 x 14336 = 29_360_128. Stage 0 holds the embedding and layers 0-4, as
# BLOOM's "pp rank 0: [embed | 5 transformer blocks]": 3_596_615_680 + 29_360_128 + 5 x 2_466_437_120.
BLOOM_STAGE0_PARAMS = 15_958_161_408
BLOOM_STAGE0_PER_DEVICE = 3_989_540_352  # / tp 4


def _bloom() -> tuple[ModelSpec, Hardware, Plan]:
    """tr11-176B-ml.slurm: TP_SIZE=4, PP_SIZE=12, 48 nodes x 8 A100 80GB (dp = 384 / 48 = 8), MICRO_BATCH_SIZE=2,
    GLOBAL_BATCH_SIZE=2048 (gas = 2048 / (8 x 2) = 128), --checkpoint-activations; BF16_Optimizer's own ZeRO-1."""
    model = load_model("bloom-176b")
    hw = Hardware.of(load_cluster("dgx-a100-80gb-x384").with_nodes(48), model)
    return model, hw, Plan(dp=8, tp=4, pp=12, zero=1, mbs=2, gas=128, recompute=Recompute.FULL)


def test_bloom_preset_says_fp32_accumulation() -> None:
    """The preset prices BLOOM's BF16_Optimizer: fp32 buffer beside the bf16 gradient, in both loaders."""
    assert load_transformer("bloom-176b").grad_accum_dtype is BOTH
    assert load_model("bloom-176b").grad_accum_dtype is BOTH


def test_bloom_first_stage_model_states() -> None:
    """Stage 0 per device: bf16 weights 2 B, gradients 4 + 2 B (whole), Adam 12 B / dp 8 = 9.5 B per parameter; the fp32
    buffer is the README's '4 bytes * params of additional memory' over the working-precision pricing."""
    model, hw, bloom = _bloom()
    first = stage_loads(model, bloom.pp)[0]
    assert first.index == 0 and first.params == first.trainable_params == BLOOM_STAGE0_PARAMS
    state = stage_state_bytes(model, hw, first, tp=4, dp=8, zero=1, offload=Offload.NONE)
    assert state.params_bytes == 2 * BLOOM_STAGE0_PER_DEVICE  # 7_979_080_704
    assert state.grads_bytes == 6 * BLOOM_STAGE0_PER_DEVICE  # 23_937_242_112 = 22.29 GiB
    assert state.optimizer_bytes == 12 * BLOOM_STAGE0_PER_DEVICE / 8  # 5_984_310_528
    as_working = dataclasses.replace(model, grad_accum_dtype=WORKING)
    working = stage_state_bytes(as_working, hw, first, tp=4, dp=8, zero=1, offload=Offload.NONE)
    assert state.device_bytes - working.device_bytes == 4 * BLOOM_STAGE0_PER_DEVICE  # 14.86 GiB


def test_bloom_layout_that_trained_fits() -> None:
    """BLOOM trained at this layout on 80 GB devices; with the fp32 buffer priced it still fits, and the worst device
    carries the buffer (published: 59GB by nvidia-smi, chronicles-prequel.md, 'Rebalancing layers', NHIDDEN=14336,
    NLAYERS=70, DP 8, TP 4, PP 12, MBS 2, NHEADS 112)."""
    model, hw, bloom = _bloom()
    memory = memory_estimate(model, hw, bloom)
    assert memory.fits and memory.limit_bytes == 80 * GIB
    worst = next(load for load in stage_loads(model, bloom.pp) if load.index == memory.stage)
    assert memory.grads_bytes == 6 * worst.trainable_params / 4
