"""Profiling prices ``scaled_dot_product_attention`` as the fused kernel a GPU runs: what it keeps for backward grows
linearly in the sequence length (q, k, v, the output, an fp32 logsumexp per head and query), while attention written by
hand keeps its s x s probabilities; the user's module and ``torch.nn.functional`` are untouched afterwards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import seed_everything
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa

from lightning_fleet.planning import BlockSpec, FleetError, Precision, Role
from lightning_fleet.profiling import AttentionKernel, Method, profile
from tests.zoo import CASES, SEQ, Llama

pytestmark = pytest.mark.pure

SDPA = F.scaled_dot_product_attention
BATCH, WIDTH, HEADS = 2, 32, 4
HEAD_DIM = WIDTH // HEADS


class _Attention(nn.Module):
    """One residual attention layer: ``fused`` calls scaled_dot_product_attention, else it computes softmax(QK^T)V."""

    def __init__(self, kv_heads: int, causal: bool, fused: bool, masked: bool = False) -> None:
        super().__init__()
        self.kv_heads, self.causal, self.fused, self.masked = kv_heads, causal, fused, masked
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, kv_heads * HEAD_DIM, bias=False)
        self.v = nn.Linear(WIDTH, kv_heads * HEAD_DIM, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (lin(x).view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2) for lin in (self.k, self.v))
        if self.masked:  # a boolean mask, as 3-d (batch x heads, s, d) inputs
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(*(t.flatten(0, 1) for t in (q, k, v)), attn_mask=mask).unflatten(0, (b, HEADS))
        elif self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != HEADS)
        else:
            k, v = (t.repeat_interleave(HEADS // self.kv_heads, dim=1) for t in (k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
            if self.causal:
                scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        return x + self.o(y.transpose(1, 2).reshape(b, s, WIDTH))


class _Stack(nn.Module):
    def __init__(self, depth: int = 2, **layer: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(**layer) for _ in range(depth))  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).sum()


def _layer(module: nn.Module, batch: object, **kwargs: object) -> BlockSpec:
    """The (one, repeated) layer block of a meta profile."""
    result = profile(module, batch, global_batch_size=BATCH, **kwargs)  # type: ignore[arg-type]
    assert result.method is Method.META, result.fallback_reason
    (layer,) = [b for b in result.spec.blocks if b.role is Role.LAYER]
    return layer


def _layer_bytes(module: nn.Module, batch: object, **kwargs: object) -> float:
    """Saved bytes per sample of the layer block."""
    return _layer(module, batch, **kwargs).act_bytes


def _fused_layer_bytes(s: int, kv_heads: int, precision: Precision) -> float:
    """By hand, per sample: the layer input (kept by the q/k/v projections) and what the fused kernel keeps -- q, k, v,
    the output (the o projection's input is a view of it) and the fp32 logsumexp (torch/_meta_registrations.py:
    flash (batch, heads, s); memory-efficient (batch, heads, ceil(s/32)*32)) -- plus the kernel's RNG state per call
    (flash: a 2-element and a 0-d uint64, 24 bytes; memory-efficient: two 0-d int64, 16 bytes)."""
    e = precision.element_bytes
    flash = precision is not Precision.FP32
    lse_rows = s if flash else math.ceil(s / 32) * 32
    rng = 24 if flash else 16
    layer_input = e * s * WIDTH
    qkv_out = e * s * (WIDTH + 2 * kv_heads * HEAD_DIM + WIDTH)
    return layer_input + qkv_out + 4 * HEADS * lse_rows + rng / BATCH


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16_MIXED])
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_keeps_what_the_fused_kernel_keeps_linear_in_s(causal: bool, kv_heads: int, precision: Precision) -> None:
    """The layer input stays whole under tp; what the kernel keeps is per head (split)."""
    for s in (64, 128):
        layer = _layer(_Stack(kv_heads=kv_heads, causal=causal, fused=True), torch.zeros(BATCH, s, WIDTH), precision=precision)
        assert layer.act_bytes == pytest.approx(_fused_layer_bytes(s, kv_heads, precision))
        assert layer.act_replicated_bytes == precision.element_bytes * s * WIDTH


@pytest.mark.parametrize("s", [64, 40])
def test_a_mask_is_kept_as_the_memory_efficient_kernels_bias(s: int) -> None:
    """With a boolean mask a GPU runs memory-efficient attention, which keeps the mask as an additive bias in the
    query's dtype (shared by the batch: s*s*4 bytes a step), or, when s is not a multiple of 16 keys, a padded copy
    expanded over batch and heads (heads*s*48*4 bytes a sample at s = 40). The call takes 3-d (batch x heads, s, d)
    inputs, so the kernel's output, laid out (s, batch x heads, d), reaches the o projection as a copy (s*WIDTH*4)."""
    module = _Stack(kv_heads=HEADS, causal=False, fused=True, masked=True)
    bias = 4 * s * s / BATCH if s % 16 == 0 else 4 * HEADS * s * math.ceil(s / 16) * 16
    expected = _fused_layer_bytes(s, HEADS, Precision.FP32) + bias + 4 * s * WIDTH
    assert _layer_bytes(module, torch.zeros(BATCH, s, WIDTH)) == pytest.approx(expected)


@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_by_hand_keeps_its_probabilities(causal: bool, kv_heads: int) -> None:
    """softmax(QK^T)V written out keeps the s x s probabilities (4 bytes each in fp32) on top of what the fused kernel
    keeps, and its saved bytes grow faster than linearly (second difference over s = 64, 128, 256 positive); through
    scaled_dot_product_attention the same layer's grow linearly (second difference zero)."""
    by_hand, fused = {}, {}
    for s in (64, 128, 256):
        batch = torch.zeros(BATCH, s, WIDTH)
        by_hand[s] = _layer_bytes(_Stack(kv_heads=kv_heads, causal=causal, fused=False), batch)
        fused[s] = _layer_bytes(_Stack(kv_heads=kv_heads, causal=causal, fused=True), batch)
        assert by_hand[s] - fused[s] >= 4 * HEADS * s * s - 4 * HEADS * s - 16 / BATCH  # less the logsumexp and RNG state
    assert by_hand[256] - by_hand[128] > 2 * (by_hand[128] - by_hand[64])
    assert fused[256] - fused[128] == pytest.approx(2 * (fused[128] - fused[64]))


def test_the_math_path_on_request_keeps_the_probabilities_too() -> None:
    """attention_kernel='math' prices what the meta device runs: the probabilities of every head are kept."""
    s = 64
    batch = torch.zeros(BATCH, s, WIDTH)
    module = _Stack(kv_heads=HEADS, causal=True, fused=True)
    fused, math_path = (_layer_bytes(module, batch, attention_kernel=kernel) for kernel in ("flash", "math"))
    assert math_path - fused >= 4 * HEADS * s * s - 4 * HEADS * s - 16 / BATCH  # less the logsumexp and RNG state
    result = profile(module, batch, global_batch_size=BATCH, attention_kernel=AttentionKernel.MATH)
    assert any("2 scaled_dot_product_attention call(s) priced as the math path" in n for n in result.notes), result.notes
    with pytest.raises(FleetError, match="attention_kernel 'cudnn' is not one of 'math', 'flash'"):
        profile(module, batch, global_batch_size=BATCH, attention_kernel="cudnn")


def test_fused_attention_counts_the_flops_of_its_two_matmuls_and_no_elements() -> None:
    """FLOPs: QK^T and PV, 2*s*s*d each per head (torch.utils.flop_counter sdpa_flop, causal not halved), plus the four
    projections; the kernel's softmax is inside its time (priced at attention_efficiency), not memory-bound elements;
    and the report says how attention was priced."""
    s = 64
    module = _Stack(kv_heads=HEADS, causal=True, fused=True)
    result = profile(module, torch.zeros(BATCH, s, WIDTH), global_batch_size=BATCH, precision=Precision.BF16_MIXED)
    (layer,) = [b for b in result.spec.blocks if b.role is Role.LAYER]
    assert layer.flops == 4 * HEADS * s * s * HEAD_DIM + 4 * 2 * s * WIDTH * WIDTH
    assert layer.elementwise == s * WIDTH  # the residual add only: the kernel's softmax runs inside it
    (note,) = [n for n in result.notes if n.startswith("attention:")]
    assert "2 scaled_dot_product_attention call(s) priced as the fused kernel a GPU runs (flash x2)" in note


def test_module_and_functional_are_unchanged_after_profiling() -> None:
    seed_everything(0, verbose=False)
    module = _Stack(kv_heads=1, causal=True, fused=True)
    x = torch.randn(BATCH, 16, WIDTH)
    before, state = module(x), {k: v.clone() for k, v in module.state_dict().items()}
    profile(module, x, global_batch_size=BATCH)
    assert F.scaled_dot_product_attention is SDPA is torch._C._nn.scaled_dot_product_attention
    assert torch.nn.functional.__dict__["scaled_dot_product_attention"] is SDPA
    assert not torch.overrides._get_current_function_mode_stack()
    assert torch.equal(module(x), before)
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


class _Imported(nn.Module):
    """Two calls, through a name imported from torch.nn.functional and through torch._C._nn."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        q = batch.view(batch.shape[0], batch.shape[1], HEADS, HEAD_DIM).transpose(1, 2)
        return (imported_sdpa(q, q, q, is_causal=True) + torch._C._nn.scaled_dot_product_attention(q, q, q)).sum()


def test_sdpa_is_priced_fused_however_it_is_reached() -> None:
    result = profile(_Imported(), torch.zeros(BATCH, 64, WIDTH), global_batch_size=BATCH)
    assert result.method is Method.META, result.fallback_reason
    expected = "2 scaled_dot_product_attention call(s) priced as the fused kernel a GPU runs (efficient x2)"
    assert any(expected in n for n in result.notes), result.notes


class _ReadsData(_Stack):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.total = batch.sum().tolist()  # meta cannot: the real method runs
        return self(batch).sum()


@pytest.mark.parametrize("kv_heads", [HEADS, 1])
def test_real_method_on_cpu_counts_the_cpu_kernel_like_the_fused_one(kv_heads: int) -> None:
    """On CPU tensors without dropout PyTorch runs its fused CPU kernel (_scaled_dot_product_flash_attention_for_cpu),
    which keeps what the GPU's kernels keep but their RNG state; torch's flop counter has no formula for it, so its
    QK^T and PV FLOPs are counted with sdpa_flop_count: the real profile agrees with the meta one."""
    s = 64
    real = profile(_ReadsData(kv_heads=kv_heads, causal=True, fused=True), torch.zeros(BATCH, s, WIDTH), global_batch_size=BATCH)
    meta = profile(_Stack(kv_heads=kv_heads, causal=True, fused=True), torch.zeros(BATCH, s, WIDTH), global_batch_size=BATCH)
    assert real.method is Method.REAL and meta.method is Method.META
    (real_layer,) = [b for b in real.spec.blocks if b.role is Role.LAYER]
    (meta_layer,) = [b for b in meta.spec.blocks if b.role is Role.LAYER]
    assert real_layer.flops == meta_layer.flops
    assert real_layer.elementwise == meta_layer.elementwise == s * WIDTH
    assert real_layer.act_bytes == meta_layer.act_bytes - 16 / BATCH  # the memory-efficient kernel's RNG state
    assert any("2 scaled_dot_product_attention call(s) ran on cpu as that device runs them" in n for n in real.notes)


class _Encoder(nn.Module):
    """nn.TransformerEncoderLayer stack: its self-attention reaches SDPA inside torch's multi_head_attention_forward."""

    def __init__(self, mask_size: int | None = None) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=HEADS, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.mask_size = mask_size

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        mask = None if self.mask_size is None else torch.zeros(self.mask_size, self.mask_size, dtype=torch.bool)
        return self.encoder(batch, mask=mask).sum()


def test_transformer_encoder_layers_reach_the_fused_kernel() -> None:
    sizes = {}
    for s in (32, 64, 128):
        result = profile(_Encoder(), torch.zeros(BATCH, s, WIDTH), global_batch_size=BATCH)
        assert any("2 scaled_dot_product_attention call(s) priced as the fused kernel" in n for n in result.notes), result.notes
        (layer,) = [b for b in result.spec.blocks if b.role is Role.LAYER]
        sizes[s] = layer.act_replicated_bytes + layer.act_sharded_bytes
    assert sizes[128] - sizes[64] == pytest.approx(2 * (sizes[64] - sizes[32]))  # linear in s
    assert F.scaled_dot_product_attention is SDPA


def test_functional_is_restored_when_the_attention_call_fails() -> None:
    """A mask of the wrong shape fails inside multi_head_attention_forward, on meta and for real: the routed
    module global is restored all the same."""
    result = profile(_Encoder(mask_size=3), torch.zeros(BATCH, 8, WIDTH), global_batch_size=BATCH)
    assert result.method is Method.PARAMETERS
    assert "meta failed" in result.fallback_reason and "attn_mask" in result.fallback_reason, result.fallback_reason
    assert F.scaled_dot_product_attention is SDPA
    assert torch.nn.functional.__dict__["scaled_dot_product_attention"] is SDPA


def _llama_bytes(s: int, kernel: str) -> float:
    seed_everything(0, verbose=False)
    tokens = torch.zeros(BATCH, s, dtype=torch.long)
    return _layer_bytes(Llama(), (tokens, tokens), attention_kernel=kernel)


def test_zoo_llama_attention_bytes_are_linear_in_s() -> None:
    """The zoo's Llama (GQA through scaled_dot_product_attention, rotary, SwiGLU) at three sequence lengths: fused, the
    layer's saved bytes grow by equal steps; the math path's grow faster (its heads' s x s probabilities and the key/value
    heads it repeats), and at s = 8 exceed the fused kernel's (below that, memory-efficient attention's fp32 logsumexp,
    padded to 32 queries, outweighs a few scores)."""
    assert CASES["llama"].module is Llama and SEQ == 8  # its rotary tables are SEQ long
    fused = {s: _llama_bytes(s, "flash") for s in (2, 4, 8)}
    math_path = {s: _llama_bytes(s, "math") for s in (2, 4, 8)}
    assert fused[8] - fused[4] == pytest.approx(2 * (fused[4] - fused[2]))
    assert math_path[8] - math_path[4] > 2 * (math_path[4] - math_path[2])
    assert math_path[8] > fused[8]
