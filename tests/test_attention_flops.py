"""Attention FLOPs as the kernels run them and as published runs count them (issue 13).

A fused (flash) kernel under a causal mask executes half of the attention core's QK^T and scores x V work, its backward
is 2.5x its forward (it recomputes the scores) and it runs at ``calibration.attention_efficiency`` of the GEMMs' rate;
the math kernel and the model-FLOPs convention (``BlockSpec.flops``) count every score. The published conventions of
:mod:`lightning_fleet.planning.flops` are checked against numbers the sources (benchmarks/published_runs.yaml) state.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fleet.planning import BlockSpec, FleetError, Role
from lightning_fleet.planning import flops as conv
from lightning_fleet.planning import time as tm
from lightning_fleet.planning.cluster import Calibration, load_cluster
from lightning_fleet.planning.model import (
    AttentionKernel,
    ModelSpec,
    TransformerSpec,
    attention_kernel_flops,
    fused_attention_flops,
    model_from_dict,
    transformer_from_dict,
    transformer_model,
)
from lightning_fleet.planning.plan import Plan, Recompute
from lightning_fleet.planning.stages import StageLoad
from lightning_fleet.profiling import Method, profile

pytestmark = pytest.mark.pure

E = importlib.import_module("lightning_fleet.planning.estimate")  # the module, not the package's estimate() function

S, H, A, FFN, L = 8, 16, 4, 64, 2
CORE = 4 * S * S * H  # QK^T and scores x V of one layer, one sample: 4096


def _spec(**features: object) -> TransformerSpec:
    shape = dict(num_layers=L, hidden_size=H, num_heads=A, seq_length=S, vocab_size=10, ffn_hidden_size=FFN)
    return TransformerSpec(name="t", global_batch_size=4, **shape, **features)  # type: ignore[arg-type]


def _layer(spec: TransformerSpec) -> BlockSpec:
    (layer,) = [b for b in transformer_model(spec).blocks if b.role is Role.LAYER]
    return layer


# --- the spec -------------------------------------------------------------------------------------------------------


def test_a_causal_flash_kernel_executes_half_of_the_math_kernels_attention_core() -> None:
    math, flash = _layer(_spec()), _layer(_spec(attention_kernel="flash"))
    full = _layer(_spec(attention_kernel="flash", causal=False))
    assert (math.attention_flops, math.attention_kernel_flops) == (0.0, 0.0)
    assert (flash.attention_flops, flash.attention_kernel_flops) == (4096.0, 2048.0)
    assert (full.attention_flops, full.attention_kernel_flops) == (4096.0, 4096.0)
    assert math.flops == flash.flops == full.flops  # the model-FLOPs convention counts every score whatever the kernel
    assert fused_attention_flops(S, H, AttentionKernel.FLASH) == CORE
    assert attention_kernel_flops(S, H, kernel=AttentionKernel.FLASH) == CORE / 2
    assert attention_kernel_flops(S, H, kernel=AttentionKernel.MATH, causal=False) == 0.0


def test_causal_changes_nothing_under_the_math_kernel_and_is_left_out_of_a_dump_at_its_default() -> None:
    assert transformer_model(_spec(causal=False)) == transformer_model(_spec())
    assert "causal" not in _spec().to_dict()
    data = _spec(attention_kernel="flash", causal=False).to_dict()
    assert data["causal"] is False
    assert transformer_from_dict(data) == _spec(attention_kernel="flash", causal=False)
    with pytest.raises(FleetError, match="causal"):
        transformer_from_dict({**data, "causal": "yes"})


def test_block_attention_flops_are_part_of_its_flops_and_round_trip() -> None:
    with pytest.raises(FleetError, match="attention_flops .* must be <= flops"):
        BlockSpec(name="b", params=1, flops=10.0, attention_flops=11.0)
    with pytest.raises(FleetError, match="attention_kernel_flops .* must be <= attention_flops"):
        BlockSpec(name="b", params=1, flops=10.0, attention_flops=4.0, attention_kernel_flops=5.0)
    with pytest.raises(FleetError, match="attention_flops"):
        BlockSpec(name="b", params=1, flops=10.0, attention_flops=-1.0)
    gpt, llama = transformer_model(_spec()), transformer_model(_spec(attention_kernel="flash"))
    assert all("attention_flops" not in b for b in gpt.to_dict()["blocks"])  # zero: left out, the YAML stays as before
    assert model_from_dict(llama.to_dict()) == llama
    assert llama.to_dict()["blocks"][1]["attention_kernel_flops"] == 2048.0


# --- the time terms -------------------------------------------------------------------------------------------------


LOAD = StageLoad(index=0, flops=1000.0, attention_flops=400.0, attention_kernel_flops=200.0, layer_flops=1000.0,
                 layer_attention_flops=400.0, layer_attention_kernel_flops=200.0, elementwise=10.0, layer_elementwise=10.0)


def test_the_kernel_runs_its_executed_flops_at_its_own_rate_and_its_backward_is_two_and_a_half_times() -> None:
    """By hand, mbs 2, tp 2, rate 100 FLOP/s, kernel at half of it, 0.1 s per element: forward (600/100 + 200/50 + 1)
    = 11 s; the kernel's part 200/50 = 4 s; backward 2 x 11 + 0.5 x 4 = 24 s; full recomputation redoes the 11 s."""
    kwargs = dict(mbs=2, tp=2, flops_per_s=100.0)
    assert tm.forward_s(LOAD, **kwargs, elementwise_s=0.1, attention_efficiency=0.5) == pytest.approx(11.0)
    assert tm.fused_attention_s(LOAD.attention_kernel_flops, **kwargs, efficiency=0.5) == pytest.approx(4.0)
    assert tm.FUSED_ATTENTION_BACKWARD == 2.5
    assert tm.backward_s(11.0, 4.0) == pytest.approx(24.0)
    assert tm.backward_s(11.0) == 22.0
    full = tm.recompute_s(LOAD, **kwargs, recompute=Recompute.FULL, elementwise_s=0.1, attention_efficiency=0.5)
    assert full == pytest.approx(11.0)


def test_a_load_without_fused_attention_is_priced_exactly_as_before() -> None:
    load = dataclasses.replace(LOAD, attention_flops=0.0, attention_kernel_flops=0.0, layer_attention_flops=0.0,
                               layer_attention_kernel_flops=0.0)
    forward = tm.forward_s(load, mbs=3, tp=1, flops_per_s=7.0, elementwise_s=0.3, attention_efficiency=0.5)
    assert forward == (1000.0 / 7.0 + 3.0) * 3
    assert tm.backward_s(1.7, 0.0) == 2 * 1.7


def test_default_kernel_rate_is_the_cited_one_and_calibration_overrides_it() -> None:
    assert Calibration().attention_efficiency == 0.83  # 155 TFLOP/s / 312 / 0.6 (FlashAttention-2, A100, causal, d 128, 2k)
    assert round(155 / 312 / 0.6, 2) == 0.83
    with pytest.raises(FleetError, match="attention_efficiency"):
        Calibration(attention_efficiency=0.0)


def _compute_s(model: ModelSpec, attention_efficiency: float) -> tuple[float, float, E.Hardware]:
    cluster = load_cluster("dgx-a100-80gb")
    calibration = dataclasses.replace(cluster.calibration, attention_efficiency=attention_efficiency)
    cluster = dataclasses.replace(cluster, calibration=calibration)
    hw = E.Hardware.of(cluster, model)
    plan = Plan(dp=8, gas=model.global_batch_size // 8)
    return E.time_estimate(model, hw, plan).compute_s, E.achieved_rate(model, hw, plan), hw


def test_the_estimate_prices_a_causal_flash_layer_by_hand() -> None:
    """One micro-batch of one sample, dp 8: compute = forward + backward, forward = GEMM FLOPs at the achieved rate r,
    the kernel's 2*s^2*h per layer at 0.83 r, elementwise at the device memory's seconds per element; backward 2x forward plus
    half the kernel's forward."""
    spec = dataclasses.replace(_spec(attention_kernel="flash"), global_batch_size=8)
    model = transformer_model(spec)
    compute_s, rate, hw = _compute_s(model, 0.83)
    kernel_s = L * CORE / 2 / (rate * 0.83)
    assert hw.elementwise_s == 2 * 2 / 2039e9  # bf16 read + write at the A100 80GB's 2,039 GB/s
    elementwise_s = sum(b.elementwise * b.count for b in model.blocks) * hw.elementwise_s
    forward = (model.flops_per_sample - L * CORE) / rate + kernel_s + elementwise_s
    assert compute_s == pytest.approx(3 * forward + 0.5 * kernel_s, rel=1e-12)
    gpt = transformer_model(dataclasses.replace(_spec(), global_batch_size=8))
    assert _compute_s(gpt, 0.83)[0] == _compute_s(gpt, 0.2)[0]  # the math kernel's attention runs with the GEMMs


# --- the profiler ---------------------------------------------------------------------------------------------------


BATCH, WIDTH, HEADS, SEQ = 2, 32, 4, 64


class _Attention(nn.Module):
    """A residual attention layer calling scaled_dot_product_attention with is_causal, an explicit mask or dropout."""

    def __init__(self, causal: bool, masked: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.causal, self.masked, self.dropout = causal, masked, dropout
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.masked else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, is_causal=self.causal)
        return x + y.transpose(1, 2).reshape(b, s, WIDTH)


class _Stack(nn.Module):
    def __init__(self, reads_data: bool = False, **layer: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(**layer) for _ in range(2))  # type: ignore[arg-type]
        self.reads_data = reads_data

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.reads_data:
            self.total = batch.sum().tolist()  # meta cannot: the real method runs
        for layer in self.layers:
            batch = layer(batch)
        return batch.sum()


def _profiled_layer(module: nn.Module, method: Method = Method.META, **kwargs: object) -> BlockSpec:
    result = profile(module, torch.zeros(BATCH, SEQ, WIDTH), global_batch_size=BATCH, **kwargs)  # type: ignore[arg-type]
    assert result.method is method, result.fallback_reason
    (layer,) = [b for b in result.spec.blocks if b.role is Role.LAYER]
    return layer


PROFILED_CORE = 4.0 * SEQ * SEQ * WIDTH  # per sample: QK^T and scores x V of all heads (sdpa_flop_count)


@pytest.mark.parametrize("causal,masked,executed", [(True, False, 0.5), (False, False, 1.0), (False, True, 1.0)])
def test_profiled_sdpa_carries_the_kernels_work(causal: bool, masked: bool, executed: float) -> None:
    """is_causal=True with no mask: half executed; no mask, or an explicit (even causal) mask: every score."""
    layer = _profiled_layer(_Stack(causal=causal, masked=masked))
    assert layer.attention_flops == PROFILED_CORE
    assert layer.attention_kernel_flops == executed * PROFILED_CORE
    assert layer.flops == PROFILED_CORE + 2 * SEQ * WIDTH * 3 * WIDTH  # the counted FLOPs: unchanged


def test_profiled_math_path_and_real_cpu_kernels() -> None:
    """attention_kernel='math' prices separate matmuls (no kernel FLOPs); the real method on CPU runs PyTorch's fused CPU
    kernel without dropout (the same facts as the meta profile) and its math path with dropout (none)."""
    assert _profiled_layer(_Stack(causal=True), attention_kernel="math").attention_flops == 0.0
    real = _profiled_layer(_Stack(causal=True, reads_data=True), Method.REAL)
    assert (real.attention_flops, real.attention_kernel_flops) == (PROFILED_CORE, PROFILED_CORE / 2)
    dropped = _profiled_layer(_Stack(causal=True, dropout=0.1, reads_data=True), Method.REAL)
    assert (dropped.attention_flops, dropped.attention_kernel_flops) == (0.0, 0.0)


# --- published FLOP conventions -------------------------------------------------------------------------------------


def test_megatron_model_flops_of_the_h100_table_and_as_three_passes_of_the_spec() -> None:
    """megatron-h100-1.7b (published_runs.yaml derived): F = 8.866e15, step 0.452 s at 408.8 TFLOP/s on 48 GPUs."""
    f = conv.megatron_model_flops(batch=192, seq_length=4096, num_layers=24, hidden_size=2048, num_heads=16, vocab_size=131072)
    assert f == pytest.approx(8.866e15, rel=1e-3)
    assert conv.step_s_from_tflops(f, tflops_per_gpu=408.8, gpus=48) == pytest.approx(0.452, abs=5e-4)
    # by hand: 12 B s L h^2 ((1 + g/a + s/h) q/h + (f/h) 3/2 + V/2Lh) = 12*4*64*(2 + 3 + 1) = 18432
    assert conv.megatron_model_flops(batch=1, seq_length=4, num_layers=1, hidden_size=8, num_heads=4, num_kv_heads=2,
                                     ffn_hidden_size=16, vocab_size=16, swiglu=True) == 18432
    spec = _spec(num_kv_heads=2, ffn_kind="swiglu")  # the spec's forward FLOPs, three passes: the same count
    model = transformer_model(spec)
    megatron = conv.megatron_model_flops(batch=4, seq_length=S, num_layers=L, hidden_size=H, num_heads=A, num_kv_heads=2,
                                         ffn_hidden_size=FFN, vocab_size=10, swiglu=True)
    assert megatron == pytest.approx(3 * 4 * model.flops_per_sample, rel=1e-12)


def test_korthikanti_and_narayanan_against_their_published_figures() -> None:
    """Korthikanti 22B (h 6144, L 48, s 2048, B 4, V 51200, 8 GPUs, 1.10 s): the README's MFU 41.5 % of 312 lies within
    the rounding of the published 1.10 s. Narayanan 1.7B (Table 1: h 2304, L 24, B 512, 32 GPUs, 137 TFLOP/s): F = 1.547e16,
    3.528 s. BLOOM's log line (h 14336, L 70, B 2048, V 250880, 384 GPUs, 104.70 s) reports 149.77 TFLOP/s: eq. (3)."""
    kor = conv.korthikanti_model_flops(batch=4, seq_length=2048, num_layers=48, hidden_size=6144, vocab_size=51200)
    mfu = kor / (8 * 1.10 * 312e12)  # 0.4165; 1.10 s is rounded to +-0.005 s, i.e. MFU 0.4146 .. 0.4184
    assert 8 * 1.095 * 312e12 * 0.415 < kor < 8 * 1.105 * 312e12 * 0.415 and mfu == pytest.approx(0.4165, abs=1e-4)
    nar = conv.narayanan_hardware_flops(batch=512, seq_length=2048, num_layers=24, hidden_size=2304, vocab_size=51200)
    assert nar == pytest.approx(1.547e16, rel=1e-3)
    assert conv.step_s_from_tflops(nar, tflops_per_gpu=137, gpus=32) == pytest.approx(3.528, abs=5e-4)
    bloom = conv.narayanan_hardware_flops(batch=2048, seq_length=2048, num_layers=70, hidden_size=14336, vocab_size=250880)
    assert bloom / (104.70 * 384 * 1e12) == pytest.approx(149.77, abs=0.01)
    assert conv.korthikanti_model_flops(batch=4, seq_length=S, num_layers=L, hidden_size=H, vocab_size=10) == pytest.approx(
        3 * 4 * transformer_model(_spec()).flops_per_sample, rel=1e-12
    )


def test_mosaic_bloom_and_palm_conventions() -> None:
    """MPT-7B on 8 A100-40GB (llm-foundry table): 6,658,859,008 parameters, 29436 tokens/s at s 2048 -> MFU 50.92 %, HFU
    67.89 %. BLOOM's rule of thumb 8 N s B, by hand. Llama 3 405B (palm-mfu): 2.638e12 FLOPs per token, 12.565 s at
    430 TFLOP/s on 8192 GPUs for 16,777,216 tokens."""
    per_seq = dict(n_params=6658859008, num_layers=32, hidden_size=4096, seq_length=2048)
    seqs_per_s = 29436 / 2048
    assert conv.mosaic_flops_per_sequence(**per_seq) * seqs_per_s / (8 * 312e12) == pytest.approx(0.5092, abs=5e-5)
    assert conv.mosaic_flops_per_sequence(**per_seq, hfu=True) * seqs_per_s / (8 * 312e12) == pytest.approx(0.6789, abs=5e-5)
    assert conv.bloom_hardware_flops(n_params=2e9, seq_length=1000, batch=3) == 8 * 2e9 * 1000 * 3
    per_token = conv.palm_flops_per_token(n_params=405_853_388_800, num_layers=126, num_heads=128, head_dim=128, seq_length=8192)
    assert per_token == pytest.approx(2.638e12, rel=1e-3)
    assert conv.step_s_from_tflops(16_777_216 * per_token, tflops_per_gpu=430, gpus=8192) == pytest.approx(12.565, abs=5e-4)
    by_mfu = conv.step_s_from_mfu(16_777_216 * per_token, mfu=430 / 989, peak_tflops=989, gpus=8192)
    assert by_mfu == pytest.approx(12.565, abs=5e-4)
    with pytest.raises(FleetError, match="seq_length must be > 0"):
        conv.palm_flops_per_token(n_params=1, num_layers=1, num_heads=1, head_dim=1, seq_length=0)
