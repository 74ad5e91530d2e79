"""Tier-1 tests of the per-device memory terms (lightning_fleet/planning/memory.py) and the GPT closed forms they rest on.

Every expected value is written out by hand: a literal or a visible arithmetic expression with the source formula named.
"""

from __future__ import annotations

import pytest

from lightning_fleet.planning.cluster import GIB, Calibration
from lightning_fleet.planning.memory import (
    BUCKET_ELEMENTS,
    activation_bytes_per_sample,
    activations_bytes,
    comm_buffer_bytes,
    grads_bytes,
    host_bytes,
    in_flight_microbatches,
    optimizer_bytes,
    optimizer_bytes_per_param,
    params_bytes,
    recompute_transient_bytes,
    reserve_bytes,
    zero3_gather_bytes,
)
from lightning_fleet.planning.model import (
    Precision,
    TransformerSpec,
    layer_act_attention_bytes,
    layer_act_replicated_bytes,
    layer_act_sharded_bytes,
    layer_flops,
    layer_params,
    transformer_model,
)
from lightning_fleet.planning.plan import Offload, Recompute
from lightning_fleet.planning.stages import StageLoad, stage_loads

pytestmark = pytest.mark.pure

REL = 1e-9
MIXED = Precision.BF16_MIXED
FP32 = Precision.FP32

# A small GPT whose Korthikanti terms come out round: s=16, h=64, a=4 -> 5*a*s/h = 5, s*h = 1024.
S, H, A, V, L = 16, 64, 4, 100, 2


def _gpt(num_layers: int = L, precision: Precision = MIXED) -> TransformerSpec:
    return TransformerSpec(
        name="tiny-gpt",
        num_layers=num_layers,
        hidden_size=H,
        num_heads=A,
        seq_length=S,
        vocab_size=V,
        precision=precision,
        global_batch_size=8,
    )


def _load(**fields: float) -> StageLoad:
    """A hand-built StageLoad: every field 0 unless given."""
    return StageLoad(**{"index": 0, **fields})


# A stage of round numbers: 1000 replicated bytes (800 from layers), 4000 sharded (3000 from layers),
# 2000 attention-score bytes (all from layers), 200 checkpoint bytes; its largest layer has 400 replicated and 2500 split bytes.
HAND = _load(
    layers=2,
    act_replicated_bytes=1000.0,
    act_sharded_bytes=4000.0,
    act_attention_bytes=2000.0,
    layer_act_replicated_bytes=800.0,
    layer_act_sharded_bytes=3000.0,
    layer_act_attention_bytes=2000.0,
    checkpoint_bytes=200.0,
    largest_layer_replicated_bytes=400.0,
    largest_layer_split_bytes=2500.0,
)


# --- optimizer_bytes_per_param --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        (Precision.BF16_MIXED, 12),  # fp32 master 4 + momentum 4 + variance 4
        (Precision.FP16_MIXED, 12),
        (Precision.FP32, 8),  # momentum 4 + variance 4 (the fp32 weights are the working copy)
    ],
)
def test_optimizer_bytes_per_param(precision: Precision, expected: int) -> None:
    """ZeRO paper (Rajbhandari 2020) Sec. 3.1: Adam K = 12 bytes/param in mixed precision, 8 in fp32."""
    assert optimizer_bytes_per_param(precision) == expected


# --- params_bytes / grads_bytes / optimizer_bytes / host_bytes -------------------------------------

N = 1_000_000  # parameters of the stage before tp
TP, DP = 2, 4


@pytest.mark.parametrize(
    ("zero", "offload", "precision", "expected"),
    [
        (0, Offload.NONE, MIXED, 2 * N / TP),  # 2 B/param, split by tp only
        (1, Offload.NONE, MIXED, 2 * N / TP),
        (2, Offload.NONE, MIXED, 2 * N / TP),
        (3, Offload.NONE, MIXED, 2 * N / (TP * DP)),  # P_os+g+p: also split by dp
        (1, Offload.OPTIMIZER, MIXED, 2 * N / TP),  # ZeRO-Offload keeps working weights on device
        (2, Offload.OPTIMIZER, MIXED, 2 * N / TP),
        (3, Offload.OPTIMIZER, MIXED, 2 * N / (TP * DP)),
        (3, Offload.OPTIMIZER_PARAMS, MIXED, 0.0),  # ZeRO-Infinity: weights live on the host
        (0, Offload.NONE, FP32, 4 * N / TP),  # 4 B/param in fp32
        (2, Offload.NONE, FP32, 4 * N / TP),
        (3, Offload.NONE, FP32, 4 * N / (TP * DP)),
        (3, Offload.OPTIMIZER_PARAMS, FP32, 0.0),
    ],
)
def test_params_bytes(zero: int, offload: Offload, precision: Precision, expected: float) -> None:
    """ZeRO paper: working weights 2 (mixed) or 4 (fp32) B/param / tp, / dp under ZeRO-3, 0 under ZeRO-Infinity."""
    got = params_bytes(N, tp=TP, dp=DP, zero=zero, offload=offload, precision=precision)
    assert got == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "precision", "expected"),
    [
        (0, MIXED, 2 * N / TP),  # 1_000_000 / 1 -> 1e6
        (1, MIXED, 2 * N / TP),  # P_os leaves gradients whole
        (2, MIXED, 2 * N / (TP * DP)),  # P_os+g: 250_000
        (3, MIXED, 2 * N / (TP * DP)),
        (0, FP32, 4 * N / TP),  # 2e6
        (1, FP32, 4 * N / TP),
        (2, FP32, 4 * N / (TP * DP)),  # 5e5
        (3, FP32, 4 * N / (TP * DP)),
    ],
)
def test_grads_bytes(zero: int, precision: Precision, expected: float) -> None:
    """ZeRO paper: gradients 2 or 4 B/param / tp, / dp from ZeRO-2 (P_os+g) on."""
    assert grads_bytes(N, tp=TP, dp=DP, zero=zero, precision=precision) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "offload", "precision", "expected"),
    [
        (0, Offload.NONE, MIXED, 12 * N / TP),  # 6e6: K=12, no ZeRO sharding
        (1, Offload.NONE, MIXED, 12 * N / (TP * DP)),  # 1.5e6: P_os
        (2, Offload.NONE, MIXED, 12 * N / (TP * DP)),
        (3, Offload.NONE, MIXED, 12 * N / (TP * DP)),
        (0, Offload.NONE, FP32, 8 * N / TP),  # 4e6: K=8
        (1, Offload.NONE, FP32, 8 * N / (TP * DP)),  # 1e6
        (3, Offload.NONE, FP32, 8 * N / (TP * DP)),
        (1, Offload.OPTIMIZER, MIXED, 0.0),  # states on the host
        (2, Offload.OPTIMIZER, FP32, 0.0),
        (3, Offload.OPTIMIZER_PARAMS, MIXED, 0.0),
    ],
)
def test_optimizer_bytes(zero: int, offload: Offload, precision: Precision, expected: float) -> None:
    """ZeRO paper P_os: K B/param / tp, / dp from ZeRO-1 on; none on the device when offloaded."""
    got = optimizer_bytes(N, tp=TP, dp=DP, zero=zero, offload=offload, precision=precision)
    assert got == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "dp", "expected_per_param"),
    [
        (0, 1, 2 + 2 + 12),  # ZeRO paper baseline: (2 + 2 + K) * psi = 16 psi
        (1, 64, (2 + 2) + 12 / 64),  # P_os: 4 psi + K psi / Nd
        (2, 64, 2 + (2 + 12) / 64),  # P_os+g: 2 psi + (2 + K) psi / Nd
        (3, 64, (2 + 2 + 12) / 64),  # P_os+g+p: (2 + 2 + K) psi / Nd
    ],
)
def test_zero_paper_model_states_total(zero: int, dp: int, expected_per_param: float) -> None:
    """ZeRO paper Fig. 1: model-state bytes per parameter for each stage at K=12, mixed precision, no tp."""
    total = (
        params_bytes(N, tp=1, dp=dp, zero=zero, offload=Offload.NONE, precision=MIXED)
        + grads_bytes(N, tp=1, dp=dp, zero=zero, precision=MIXED)
        + optimizer_bytes(N, tp=1, dp=dp, zero=zero, offload=Offload.NONE, precision=MIXED)
    )
    assert total == pytest.approx(expected_per_param * N, rel=REL)


@pytest.mark.parametrize(
    ("offload", "precision", "expected"),
    [
        (Offload.NONE, MIXED, 0.0),
        (Offload.NONE, FP32, 0.0),
        (Offload.OPTIMIZER, MIXED, 16 * N / (TP * DP)),  # 2e6: fp32 master+m+v 12 + fp32 grad 4
        (Offload.OPTIMIZER, FP32, 16 * N / (TP * DP)),
        (Offload.OPTIMIZER_PARAMS, MIXED, (16 + 2) * N / (TP * DP)),  # 2.25e6: + bf16 working weights
        (Offload.OPTIMIZER_PARAMS, FP32, (16 + 4) * N / (TP * DP)),  # 2.5e6: + fp32 working weights
    ],
)
def test_host_bytes(offload: Offload, precision: Precision, expected: float) -> None:
    """ZeRO-Offload (Ren 2021) Sec. 4: 16 B/param host partition per device; ZeRO-Infinity adds the working weights."""
    got = host_bytes(N, tp=TP, dp=DP, offload=offload, precision=precision)
    assert got == pytest.approx(expected, rel=REL)


# --- in_flight_microbatches ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "pp", "gas", "expected"),
    [
        (0, 4, 8, 4.0),  # pp - 0
        (1, 4, 8, 3.0),  # pp - 1
        (3, 4, 8, 1.0),  # last stage holds one
        (0, 4, 2, 2.0),  # capped by gas
        (1, 4, 3, 3.0),  # pp - 1 = 3 = gas
        (0, 1, 5, 1.0),  # no pipeline: one micro-batch at a time
    ],
)
def test_in_flight_1f1b(stage: int, pp: int, gas: int, expected: float) -> None:
    """1F1B (Narayanan 2021): stage i holds pp - i micro-batches, never more than gas."""
    assert in_flight_microbatches(stage=stage, pp=pp, vpp=1, gas=gas) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("pp", "vpp", "expected"),
    [
        (4, 2, 4 * (1 + (4 - 1) / (4 * 2))),  # 5.5
        (8, 4, 8 * (1 + (8 - 1) / (8 * 4))),  # 9.75
        (2, 3, 2 * (1 + (2 - 1) / (2 * 3))),  # 2 + 1/3
    ],
)
def test_in_flight_interleaved_stage0(pp: int, vpp: int, expected: float) -> None:
    """Korthikanti 2022 Sec. 4.2.3: interleaved first stage holds pp * (1 + (pp-1)/(pp*vpp)) stage-units."""
    assert in_flight_microbatches(stage=0, pp=pp, vpp=vpp, gas=1000) == pytest.approx(expected, rel=REL)


def test_in_flight_interleaved_later_stages_and_cap() -> None:
    """Megatron interleaved warm-up ((pp-i-1)*2 + (vpp-1)*pp + 1) / vpp, capped by gas."""
    # pp=4, vpp=2, stage 3: (0*2 + 1*4 + 1) / 2 = 2.5; stage 1: (2*2 + 4 + 1) / 2 = 4.5
    assert in_flight_microbatches(stage=3, pp=4, vpp=2, gas=16) == pytest.approx(2.5, rel=REL)
    assert in_flight_microbatches(stage=1, pp=4, vpp=2, gas=16) == pytest.approx(4.5, rel=REL)
    # stage 0 would hold 5.5 but only 4 micro-batches exist
    assert in_flight_microbatches(stage=0, pp=4, vpp=2, gas=4) == pytest.approx(4.0, rel=REL)


# --- activation_bytes_per_sample / recompute_transient_bytes / activations_bytes (hand-built load) --


@pytest.mark.parametrize(
    ("sp", "recompute", "expected"),
    [
        (False, Recompute.NONE, 1000 + (4000 + 2000) / 4),  # 2500: replicated whole, sharded+attention / tp
        (True, Recompute.NONE, 1000 / 4 + (4000 + 2000) / 4),  # 1750: sp splits the replicated part too
        (False, Recompute.SELECTIVE, 1000 + 4000 / 4),  # 2000: attention scores dropped
        (True, Recompute.SELECTIVE, 1000 / 4 + 4000 / 4),  # 1250
        (False, Recompute.FULL, (1000 - 800) + (4000 - 3000) / 4 + 200),  # 650: non-layer parts + checkpoints
        (True, Recompute.FULL, (1000 - 800) / 4 + (4000 - 3000) / 4 + 200 / 4),  # 350
    ],
)
def test_activation_bytes_per_sample_hand_load(sp: bool, recompute: Recompute, expected: float) -> None:
    """Korthikanti 2022 eqs. 2-4: replicated / (tp if sp), sharded / tp; selective drops scores, full keeps layer inputs."""
    got = activation_bytes_per_sample(HAND, tp=4, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("sp", "recompute", "expected"),
    [
        (False, Recompute.NONE, 0.0),
        (True, Recompute.SELECTIVE, 0.0),
        (False, Recompute.FULL, 2 * (400 + 2500 / 4)),  # 2050: mbs * (largest layer replicated + split / tp)
        (True, Recompute.FULL, 2 * (400 / 4 + 2500 / 4)),  # 1450
    ],
)
def test_recompute_transient_bytes_hand_load(sp: bool, recompute: Recompute, expected: float) -> None:
    """Korthikanti 2022 Sec. 5: full recompute re-materialises one layer's activations during its backward."""
    got = recompute_transient_bytes(HAND, tp=4, sp=sp, recompute=recompute, mbs=2)
    assert got == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("recompute", "in_flight", "expected"),
    [
        (Recompute.NONE, 2.5, 2500 * 2 * 2.5),  # 12500: per-sample * mbs * in flight, no transient
        (Recompute.SELECTIVE, 3.0, 2000 * 2 * 3.0),  # 12000
        (Recompute.FULL, 3.0, 650 * 2 * 3.0 + 2 * (400 + 2500 / 4)),  # 3900 + 2050 = 5950
    ],
)
def test_activations_bytes_hand_load(recompute: Recompute, in_flight: float, expected: float) -> None:
    """Stage activations = per-sample bytes * mbs * micro-batches in flight + the full-recompute transient."""
    got = activations_bytes(HAND, tp=4, sp=False, recompute=recompute, mbs=2, in_flight=in_flight)
    assert got == pytest.approx(expected, rel=REL)


# --- the GPT closed forms against the papers -----------------------------------------------------


def test_layer_act_closed_forms_korthikanti() -> None:
    """Korthikanti 2022 Sec. 4.1 per layer, b=1, e=2: replicated 10sh, sharded 24sh (f=4h), attention 5as^2."""
    assert layer_act_replicated_bytes(S, H, 2) == pytest.approx(10 * 16 * 64, rel=REL)  # 10240
    assert layer_act_sharded_bytes(S, H, 4 * H, 2) == pytest.approx(24 * 16 * 64, rel=REL)  # 24576
    assert layer_act_attention_bytes(S, A, 2) == pytest.approx(5 * 4 * 16 * 16, rel=REL)  # 5120
    # their sum is s*h*(34 + 5*a*s/h) = 1024 * (34 + 5) = 39936
    total = layer_act_replicated_bytes(S, H, 2) + layer_act_sharded_bytes(S, H, 4 * H, 2) + layer_act_attention_bytes(S, A, 2)
    assert total == pytest.approx(16 * 64 * (34 + 5 * 4 * 16 / 64), rel=REL)


def test_transformer_layer_block_activation_fields() -> None:
    """Korthikanti 2022 Sec. 4.1: the transformer layer block carries 10sh + 24sh + 5as^2 bytes, output 2sh."""
    layer = transformer_model(_gpt()).blocks[1]
    assert layer.count == L
    assert layer.act_replicated_bytes == pytest.approx(10 * 16 * 64, rel=REL)
    assert layer.act_sharded_bytes == pytest.approx(24 * 16 * 64, rel=REL)
    assert layer.act_attention_bytes == pytest.approx(5 * 4 * 16 * 16, rel=REL)
    assert layer.output_bytes == pytest.approx(2 * 16 * 64, rel=REL)  # full-recompute checkpoint 2sbh


# Non-layer saved bytes of the single pp=1 stage (Korthikanti 2022 Sec. 4.3), per sample at e=2:
EMB_REP = 16 * 64  # embedding dropout mask: s*h (1 byte each)  = 1024
HEAD_REP = 2 * 2 * 16 * 64  # final LayerNorm input + projection input: 2 * 2sh = 4096
HEAD_SHARDED = 4 * 16 * 100  # fp32 logits for the cross entropy: 4sV, vocab-parallel = 6400


@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "per_layer"),
    [
        # no parallelism: s*h*(34 + 5*a*s/h) = 1024 * 39 = 39936
        (1, False, Recompute.NONE, 16 * 64 * (34 + 5 * 4 * 16 / 64)),
        # tp=2, no sp: s*h*(10 + 24/t + 5*a*s/(h*t)) = 1024 * (10 + 12 + 2.5) = 25088
        (2, False, Recompute.NONE, 16 * 64 * (10 + 24 / 2 + 5 * 4 * 16 / (64 * 2))),
        # tp=2 + sp: s*h/t*(34 + 5*a*s/h) = 512 * 39 = 19968
        (2, True, Recompute.NONE, 16 * 64 / 2 * (34 + 5 * 4 * 16 / 64)),
        # tp=2, selective, no sp: s*h*(10 + 24/t) = 1024 * 22 = 22528
        (2, False, Recompute.SELECTIVE, 16 * 64 * (10 + 24 / 2)),
        # tp=2 + sp, selective: 34*s*h/t = 17408
        (2, True, Recompute.SELECTIVE, 34 * 16 * 64 / 2),
        # tp=4 + sp, selective: 34*s*h/t = 8704
        (4, True, Recompute.SELECTIVE, 34 * 16 * 64 / 4),
    ],
)
def test_transformer_stage_activations_korthikanti(tp: int, sp: bool, recompute: Recompute, per_layer: float) -> None:
    """Korthikanti 2022 Table 2 per layer (times L) plus the Sec. 4.3 embedding/head terms, on the pp=1 stage."""
    (load,) = stage_loads(transformer_model(_gpt()), 1)
    rep_div = tp if sp else 1
    expected = L * per_layer + (EMB_REP + HEAD_REP) / rep_div + HEAD_SHARDED / tp
    got = activation_bytes_per_sample(load, tp=tp, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=REL)


def test_transformer_full_recompute_keeps_2sbh_per_layer() -> None:
    """Korthikanti 2022 Table 2: full recompute keeps 2*s*b*h per layer (no sp), plus the embedding/head terms."""
    (load,) = stage_loads(transformer_model(_gpt()), 1)
    got = activation_bytes_per_sample(load, tp=2, sp=False, recompute=Recompute.FULL)
    # 2 layers * 2sh + embedding mask + head replicated + head logits / tp = 4096 + 1024 + 4096 + 3200
    assert got == pytest.approx(L * 2 * 16 * 64 + EMB_REP + HEAD_REP + HEAD_SHARDED / 2, rel=REL)


def test_transformer_full_recompute_with_sp_splits_checkpoints() -> None:
    """Megatron-LM with sp: the layer-boundary checkpoint is sequence-sharded, 2*s*b*h/t per layer."""
    (load,) = stage_loads(transformer_model(_gpt()), 1)
    got = activation_bytes_per_sample(load, tp=2, sp=True, recompute=Recompute.FULL)
    # (2 layers * 2sh + embedding mask + head replicated) / t + head logits / t = (4096 + 1024 + 4096 + 6400) / 2
    assert got == pytest.approx((L * 2 * 16 * 64 + EMB_REP + HEAD_REP + HEAD_SHARDED) / 2, rel=REL)


def test_transformer_full_recompute_transient_is_one_layer() -> None:
    """Korthikanti 2022 Sec. 5: the transient under full recompute is one layer, s*b*h*(34 + 5as/h) at t=1."""
    (load,) = stage_loads(transformer_model(_gpt()), 1)
    got = recompute_transient_bytes(load, tp=1, sp=False, recompute=Recompute.FULL, mbs=3)
    assert got == pytest.approx(3 * 16 * 64 * (34 + 5 * 4 * 16 / 64), rel=REL)  # 3 * 39936


@pytest.mark.parametrize("h", [64, 1024, 12288])
def test_layer_params_megatron(h: int) -> None:
    """Megatron-LM / Narayanan 2021: one GPT layer with f=4h has 12h^2 + 13h parameters."""
    assert layer_params(h, 4 * h) == 12 * h * h + 13 * h


def test_layer_params_custom_ffn() -> None:
    """QKV 3h^2+3h, proj h^2+h, fc1 hf+f, fc2 fh+h, two LayerNorms 4h, at h=64, f=100."""
    # 3*4096+192 + 4096+64 + 6400+100 + 6400+64 + 256 = 12480 + 4160 + 6500 + 6464 + 256 = 29860
    assert layer_params(64, 100) == 29860


@pytest.mark.parametrize(("layers", "h", "v", "s"), [(2, 64, 100, 16), (24, 1024, 50257, 2048)])
def test_transformer_params_narayanan(layers: int, h: int, v: int, s: int) -> None:
    """Narayanan 2021: P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) = 12lh^2 + 13lh + (V+s)h, tied embedding once.

    The paper's formula leaves out the final LayerNorm (2h parameters); Megatron's GPT has one and
    the planner counts it, so the planner's count is the paper's P plus 2h.
    """
    spec = TransformerSpec(
        name="gpt", num_layers=layers, hidden_size=h, num_heads=4, seq_length=s, vocab_size=v, global_batch_size=1
    )
    narayanan = 12 * layers * h * h + 13 * layers * h + (v + s) * h  # exact integer form of P
    final_layernorm = 2 * h
    model = transformer_model(spec)
    assert model.params == narayanan + final_layernorm
    # one pipeline stage stores the tied embedding once as well
    (load,) = stage_loads(model, 1)
    assert load.params == narayanan + final_layernorm


def test_transformer_params_small_literal() -> None:
    """Narayanan 2021 P for l=2, h=64, V=100, s=16: 98304 + 1664 + 7424 = 107392, plus final LayerNorm 128."""
    assert transformer_model(_gpt()).params == 107392 + 128


def test_tied_embedding_stored_on_both_end_stages() -> None:
    """With pp > 1 the first and last stage each hold a copy of the tied embedding (V*h counted twice over stages)."""
    model = transformer_model(_gpt(num_layers=4))
    loads = stage_loads(model, 2)  # identical layers: first and last stage kept
    assert [ld.index for ld in loads] == [0, 1]
    # stage 0: embedding (V+s)h + 2 layers; stage 1: 2 layers + head Vh + 2h
    layer = 12 * 64 * 64 + 13 * 64
    assert loads[0].params == (100 + 16) * 64 + 2 * layer
    assert loads[1].params == 2 * layer + 100 * 64 + 2 * 64
    assert loads[0].params + loads[1].params == model.params + 100 * 64


@pytest.mark.parametrize(("s", "h"), [(16, 64), (2048, 12288), (4096, 1024)])
def test_layer_flops_narayanan(s: int, h: int) -> None:
    """Narayanan 2021: forward FLOPs of one layer per sample = 24*s*h^2*(1 + s/(6h)) for f=4h."""
    assert layer_flops(s, h, 4 * h) == pytest.approx(24 * s * h * h * (1 + s / (6 * h)), rel=REL)


def test_layer_flops_small_literal() -> None:
    """Narayanan 2021 at s=16, h=64: 24*16*64^2*(1 + 16/384) = 1572864 + 65536 = 1638400."""
    assert layer_flops(16, 64, 256) == pytest.approx(1638400.0, rel=REL)


def test_transformer_flops_narayanan_step() -> None:
    """Narayanan 2021: with full recompute a step costs 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) FLOPs (B=1)."""
    model = transformer_model(_gpt())
    # forward per sample = l layers + logits 2shV; Narayanan: layers run 4x (fwd, recompute, 2x bwd), logits 3x
    layers_fwd = L * 24 * 16 * 64 * 64 * (1 + 16 / (6 * 64))  # 2 * 1638400
    logits_fwd = 2 * 16 * 64 * 100  # 204800
    assert model.flops_per_sample == pytest.approx(layers_fwd + logits_fwd, rel=REL)
    narayanan = 96 * 16 * L * 64 * 64 * (1 + 16 / (6 * 64) + 100 / (16 * L * 64))
    assert 4 * layers_fwd + 3 * logits_fwd == pytest.approx(narayanan, rel=REL)


# --- comm_buffer_bytes / zero3_gather_bytes / reserve_bytes ---------------------------------------


@pytest.mark.parametrize(
    ("n", "tp", "dp", "zero", "precision", "expected"),
    [
        (1e9, 2, 1, 2, MIXED, 0.0),  # no data parallelism, no buckets
        (1e9, 2, 8, 0, MIXED, 1 * 2 * 50_000_000),  # one reduce bucket of 5e7 elements (shard 5e8 is larger)
        (1e9, 2, 8, 1, MIXED, 2 * 2 * 50_000_000),  # reduce + all-gather buckets
        (1e9, 2, 8, 3, MIXED, 2 * 2 * 50_000_000),
        (1e6, 2, 8, 0, MIXED, 1 * 2 * 1e6 / 2),  # shard 5e5 elements < bucket: 1e6 bytes
        (1e6, 2, 8, 2, MIXED, 2 * 2 * 1e6 / 2),  # 2e6
        (1e9, 1, 4, 3, FP32, 2 * 4 * 50_000_000),  # fp32 buckets: 4e8
    ],
)
def test_comm_buffer_bytes(n: float, tp: int, dp: int, zero: int, precision: Precision, expected: float) -> None:
    """DeepSpeed buckets: (1 if zero 0 else 2) * e * min(n/tp, 5e7) bytes, none when dp == 1."""
    assert BUCKET_ELEMENTS == 50_000_000
    assert comm_buffer_bytes(n, tp=tp, dp=dp, zero=zero, precision=precision) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize(
    ("zero", "precision", "expected"),
    [
        (0, MIXED, 0.0),
        (2, MIXED, 0.0),
        (3, MIXED, 2 * 2 * 1_000_000 / 2),  # current + prefetched block, 2 B each, / tp: 2e6
        (3, FP32, 2 * 4 * 1_000_000 / 2),  # 4e6
    ],
)
def test_zero3_gather_bytes(zero: int, precision: Precision, expected: float) -> None:
    """DeepSpeed stage-3 prefetch: two gathered blocks of e * largest_block / tp bytes each, only under ZeRO-3."""
    assert zero3_gather_bytes(1_000_000, tp=2, zero=zero, precision=precision) == pytest.approx(expected, rel=REL)


def test_reserve_bytes() -> None:
    """Reserve = memory_reserve_gib GiB + memory_reserve_fraction * device memory."""
    assert GIB == 2**30
    default = Calibration()  # 1 GiB + 5 %
    assert reserve_bytes(80 * 2**30, default) == pytest.approx(1 * 2**30 + 0.05 * 80 * 2**30, rel=REL)  # 5 GiB
    custom = Calibration(memory_reserve_gib=2.0, memory_reserve_fraction=0.1)
    assert reserve_bytes(40e9, custom) == pytest.approx(2 * 2**30 + 0.1 * 40e9, rel=REL)
    nothing = Calibration(memory_reserve_gib=0.0, memory_reserve_fraction=0.0)
    assert reserve_bytes(80 * 2**30, nothing) == 0.0


def test_full_recompute_keeps_attention_bytes_of_non_layer_blocks():
    """Full recompute drops only the layers' saved tensors: 500 attention bytes of a pre/post block stay (split by tp=2)."""
    load = _load(act_attention_bytes=2000.0, layer_act_attention_bytes=1500.0, checkpoint_bytes=100.0)
    # kept: (2000 - 1500) / 2 = 250 attention + 100 checkpoint (replicated, no sp)
    assert activation_bytes_per_sample(load, tp=2, sp=False, recompute=Recompute.FULL) == pytest.approx(350.0, rel=1e-9)


# --- frozen parameters: gradients, optimizer states and offload follow the trainable ones ------------------------


@pytest.mark.parametrize(
    ("offload", "expected"),
    [
        (Offload.NONE, 0.0),
        (Offload.OPTIMIZER, 16 * 2.5e8 / (2 * 4)),  # fp32 master/momentum/variance/gradient of the trainable: 5e8
        (Offload.OPTIMIZER_PARAMS, (16 * 2.5e8 + 2 * 1e9) / (2 * 4)),  # + bf16 working weights of all 1e9: 7.5e8
    ],
)
def test_host_bytes_of_a_partly_frozen_stage(offload: Offload, expected: float) -> None:
    """ZeRO-Offload keeps 16 B per trainable parameter on the host; ZeRO-Infinity adds every working weight."""
    assert host_bytes(1e9, tp=2, dp=4, offload=offload, precision=MIXED, trainable=2.5e8) == pytest.approx(expected, rel=REL)


def _frozen_backbone(tied_frozen: bool):
    """An embedding (1000) tied to the head's weight, two layers of 500 whose adapters (100 each) train, a head of 1100
    (the tied 1000 and 100 of its own); ``tied_frozen``: the tied embedding is frozen, else everything but the layers'
    backbone trains."""
    from lightning_fleet.planning.model import BlockSpec, ModelSpec, Role

    return ModelSpec(
        name="frozen-backbone",
        blocks=(
            BlockSpec(name="embedding", role=Role.PRE, params=1000, trainable_params=0 if tied_frozen else None, flops=0.0),
            BlockSpec(name="layer", role=Role.LAYER, count=2, params=500, trainable_params=100, flops=1.0),
            BlockSpec(name="head", role=Role.POST, params=1100, trainable_params=100 if tied_frozen else None, flops=1.0),
        ),
        hidden_size=8,
        num_heads=1,
        seq_length=4,
        precision=MIXED,
        global_batch_size=8,
        tied_params=1000,
        tied_trainable_params=0 if tied_frozen else None,
    )


@pytest.mark.parametrize(
    ("tied_frozen", "trainable"),
    [
        (True, 0 + 2 * 100 + 100 - 0),  # 300: adapters and the head's own 100
        (False, 1000 + 2 * 100 + 1100 - 1000),  # 1300: the tied 1000 train too, counted in both ends, stored once
    ],
)
def test_stage_trainable_params(tied_frozen: bool, trainable: int) -> None:
    """One stage holds 1000 + 2 x 500 + 1100 - 1000 tied = 2100 parameters; its trainable ones sum the blocks' and
    subtract the tied ones that train."""
    model = _frozen_backbone(tied_frozen)
    (load,) = stage_loads(model, 1)
    assert load.params == 2100
    assert load.trainable_params == model.trainable_params == trainable
    first, last = stage_loads(model, 2)  # one layer each; each end stores (and, if it trains, updates) its copy of the tie
    assert (first.trainable_params, last.trainable_params) == ((0 + 100, 100 + 100) if tied_frozen else (1000 + 100, 100 + 1100))


def test_state_bytes_of_a_partly_frozen_model() -> None:
    """ZeRO-1, dp 2, bf16, the tied embedding frozen: weights 2 B x 2100; gradients 2 B x 300 trainable; Adam 12 B x
    300 / dp 2; ZeRO-Offload 16 B x 300 / dp 2 on the host."""
    from lightning_fleet.planning.estimate import Hardware, stage_state_bytes
    from tests.conftest import make_cluster

    model = _frozen_backbone(tied_frozen=True)
    (load,) = stage_loads(model, 1)
    hw = Hardware.of(make_cluster(devices_per_node=2), model)
    s = stage_state_bytes(model, hw, load, tp=1, dp=2, zero=1, offload=Offload.NONE)
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes, s.host_bytes) == (2 * 2100, 2 * 300, 12 * 300 / 2, 0.0)
    s = stage_state_bytes(model, hw, load, tp=1, dp=2, zero=2, offload=Offload.OPTIMIZER)
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes, s.host_bytes) == (2 * 2100, 2 * 300 / 2, 0.0, 16 * 300 / 2)


def test_state_bytes_with_activations_is_the_stage_memory() -> None:
    """StateBytes next to a stage's activations is the MemoryEstimate stage_memory builds: ZeRO-1 with the optimizer
    offloaded at dp 2, bf16, 300 of 2100 parameters training: weights 2 B x 2100, gradients 2 B x 300, no Adam state
    on the device, 16 B x 300 / dp 2 on the host; device_bytes sums params, grads, optimizer and other in that order."""
    from lightning_fleet.planning.estimate import Hardware, stage_activation_bytes, stage_memory, stage_state_bytes
    from lightning_fleet.planning.plan import Plan
    from tests.conftest import make_cluster

    model = _frozen_backbone(tied_frozen=True)
    (load,) = stage_loads(model, 1)
    hw = Hardware.of(make_cluster(devices_per_node=2), model)
    plan = Plan(dp=2, zero=1, mbs=4, gas=1, offload=Offload.OPTIMIZER)
    state = stage_state_bytes(model, hw, load, tp=1, dp=2, zero=1, offload=Offload.OPTIMIZER)
    assert (state.params_bytes, state.grads_bytes, state.optimizer_bytes) == (2 * 2100, 2 * 300, 0.0)
    assert state.host_bytes == 16 * 300 / 2
    assert state.device_bytes == 2 * 2100 + 2 * 300 + 0.0 + state.other_bytes
    activations = stage_activation_bytes(load, plan, plan.recompute)
    memory = state.with_activations(activations, hw, load.index)
    assert memory == stage_memory(model, hw, plan, load)
    assert (memory.activations_bytes, memory.limit_bytes, memory.host_limit_bytes, memory.stage) == (
        activations, hw.memory_bytes, hw.host_bytes_per_device, 0
    )


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_sharding_splits_the_state_over_its_group(zero: int) -> None:
    """dp=8 in groups of 4 holds what dp=4 sharded over all of dp holds: each copy of the sharded state is split 4 ways
    (weights at zero 3, gradients from 2, optimizer states from 1), replicated across the 2 groups; the rest is dp=8's."""
    from lightning_fleet.planning.estimate import memory_estimate
    from lightning_fleet.planning.estimate import Hardware
    from lightning_fleet.planning.plan import Plan
    from tests.conftest import make_cluster, make_model

    model, cluster = make_model(gbs=32), make_cluster(nodes=1, devices_per_node=8)
    hw = Hardware.of(cluster, model)
    hybrid = memory_estimate(model, hw, Plan(dp=8, zero=zero, gas=4, dp_shard=4))
    four = memory_estimate(model, hw, Plan(dp=4, zero=zero, gas=8))
    eight = memory_estimate(model, hw, Plan(dp=8, zero=zero, gas=4))
    for term in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(hybrid, term) == getattr(four, term)
    assert hybrid.optimizer_bytes == 2 * eight.optimizer_bytes
    assert hybrid.activations_bytes == eight.activations_bytes
