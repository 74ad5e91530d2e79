"""The FLOP counts published training runs report their throughput in, one small pure function per convention.

A paper's "TFLOP/s per GPU" or "MFU" is a FLOP count per iteration (or per token) divided by time, GPUs (and a peak);
each source counts differently (attention's s^2 term in full or not, recomputation or not, embeddings or not). These
functions give that count exactly as each source states it, so that a published figure turns back into a step time
(:func:`step_s_from_tflops`, :func:`step_s_from_mfu`). They price nothing of lightning_fleet's own cost model.

Symbols: B samples per iteration (global batch), s sequence length, L layers, h hidden size, a attention heads, g
key/value heads (query groups), f MLP inner size, V (padded) vocabulary, N parameters. FLOPs count 2 per multiply-add.

Pure (stdlib only); imported by benchmarks/published_runs.py and tests.
"""

from __future__ import annotations

from lightning_fleet.planning.errors import SpecError


def _positive(where: str, **values: float) -> None:
    """One SpecError naming the first value that is not a positive number."""
    for name, value in values.items():
        if not value > 0:
            raise SpecError(f"{where}: {name} must be > 0, got {value!r}")


# Megatron-LM megatron/training/training.py num_floating_point_operations (at f2e5db40, 2024; benchmarks/published_runs.yaml
# conventions.megatron-model-2024): 12 B s L h^2 ((1 + g/a + s/h) q/h + (f/h) (3/2 if swiglu) + V/(2 L h)).
def megatron_model_flops(
    *,
    batch: float,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    swiglu: bool = False,
) -> float:
    """FLOPs per iteration as Megatron-LM logs its model TFLOP/s: forward, weight- and input-gradient GEMMs (the factor 3
    in 12 = 3 x 2 x 2), no recomputation, attention's s^2 in full. q = head_dim x heads (h by default), f = 4h by default,
    g = num_kv_heads (a by default)."""
    h, a = hidden_size, num_heads
    f = 4 * h if ffn_hidden_size is None else ffn_hidden_size
    g = a if num_kv_heads is None else num_kv_heads
    q = (h // a if head_dim is None else head_dim) * a
    _positive("megatron_model_flops", batch=batch, seq_length=seq_length, num_layers=num_layers, hidden_size=h, num_heads=a,
              vocab_size=vocab_size, ffn_hidden_size=f, num_kv_heads=g, head_dim=q)
    s, n = seq_length, num_layers
    attention = (1 + g / a + s / h) * q / h
    mlp = f / h * (1.5 if swiglu else 1.0)
    logits = vocab_size / (2 * n * h)
    return 12.0 * batch * s * n * h * h * (attention + mlp + logits)


# Korthikanti et al. 2022 (arXiv 2205.05198), model FLOPs behind its MFU (benchmarks/published_runs.yaml
# conventions.korthikanti-mfu-hfu): 72 B s L h^2 (1 + s/6h + V/12hL).
def korthikanti_model_flops(*, batch: float, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int) -> float:
    """Model FLOPs per iteration of a GPT (4h GELU MLP, full multi-head attention), forward and backward, no recomputation."""
    _positive("korthikanti_model_flops", batch=batch, seq_length=seq_length, num_layers=num_layers, hidden_size=hidden_size,
              vocab_size=vocab_size)
    s, n, h = seq_length, num_layers, hidden_size
    return 72.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab_size / (12 * h * n))


# Narayanan et al. 2021 (arXiv 2104.04473) eq. (3), hardware FLOPs with full activation recomputation
# (conventions.narayanan-eq3; also the TFLOPs of Megatron-DeepSpeed's logs): 96 B s L h^2 (1 + s/6h + V/16Lh).
def narayanan_hardware_flops(*, batch: float, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int) -> float:
    """FLOPs per iteration with one recomputed forward (96 = 4 passes x 24): forward, recomputation, backward."""
    _positive("narayanan_hardware_flops", batch=batch, seq_length=seq_length, num_layers=num_layers, hidden_size=hidden_size,
              vocab_size=vocab_size)
    s, n, h = seq_length, num_layers, hidden_size
    return 96.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab_size / (16 * n * h))


# mosaicml/llm-foundry scripts/train/benchmarking/README.md (conventions.mosaic-mfu): "mfu = (3 * flops_per_seq + 3 *
# attn_flops_per_seq) * seq_per_sec / (gpu_num * GPU_AVAILABLE_FLOPS)", flops_per_seq = 2 * n_params * seq_len,
# attn_flops_per_seq = n_layers * 2 * 2 * (d_model * (seq_len**2)); HFU uses 4 instead of 3.
def mosaic_flops_per_sequence(*, n_params: float, num_layers: int, hidden_size: int, seq_length: int, hfu: bool = False) -> float:
    """FLOPs of one sequence as llm-foundry counts them: 3 passes (MFU) or 4 (HFU, one recomputed forward) over
    2 N s + 4 L h s^2."""
    _positive("mosaic_flops_per_sequence", n_params=n_params, num_layers=num_layers, hidden_size=hidden_size,
              seq_length=seq_length)
    passes = 4 if hfu else 3
    flops_per_seq = 2.0 * n_params * seq_length
    attn_flops_per_seq = num_layers * 2 * 2 * (hidden_size * seq_length**2)
    return passes * flops_per_seq + passes * float(attn_flops_per_seq)


# BLOOM tr11 README, Throughput (conventions.bloom-hardware-tflops): TFLOPs = model_size_in_B * 4 * 2 * seqlen *
# global_batch_size / (time_in_sec_per_interation * total_gpus * 1e3): the "4*2 co-efficient" counts one recomputed forward.
def bloom_hardware_flops(*, n_params: float, seq_length: int, batch: float) -> float:
    """Hardware FLOPs per iteration by BLOOM's rule of thumb: 8 N s B (2 per parameter and token, 4 passes)."""
    _positive("bloom_hardware_flops", n_params=n_params, seq_length=seq_length, batch=batch)
    return 8.0 * n_params * seq_length * batch


# PaLM (Chowdhery et al. 2022, Appendix B), the MFU Llama 3 (Sec. 3.3.2) reports (conventions.palm-mfu): model FLOPs per
# token 6N + 12 L H Q T (H heads, Q head dimension, T sequence length), no recomputation.
def palm_flops_per_token(*, n_params: float, num_layers: int, num_heads: int, head_dim: int, seq_length: int) -> float:
    """Model FLOPs per token: 6 per parameter (forward and backward) plus attention's 12 L H Q T."""
    _positive("palm_flops_per_token", n_params=n_params, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
              seq_length=seq_length)
    return 6.0 * n_params + 12.0 * num_layers * num_heads * head_dim * seq_length


def step_s_from_tflops(flops_per_step: float, *, tflops_per_gpu: float, gpus: int) -> float:
    """The step time a published per-GPU TFLOP/s implies: F / (GPUs x TFLOP/s x 1e12), F counted by that source's rule."""
    _positive("step_s_from_tflops", flops_per_step=flops_per_step, tflops_per_gpu=tflops_per_gpu, gpus=gpus)
    return flops_per_step / (gpus * tflops_per_gpu * 1e12)


def step_s_from_mfu(flops_per_step: float, *, mfu: float, peak_tflops: float, gpus: int) -> float:
    """The step time a published MFU (or HFU) implies: F / (GPUs x MFU x peak), with the peak the source divides by."""
    _positive("step_s_from_mfu", mfu=mfu, peak_tflops=peak_tflops)
    return step_s_from_tflops(flops_per_step, tflops_per_gpu=mfu * peak_tflops, gpus=gpus)


__all__ = [
    "bloom_hardware_flops",
    "korthikanti_model_flops",
    "megatron_model_flops",
    "mosaic_flops_per_sequence",
    "narayanan_hardware_flops",
    "palm_flops_per_token",
    "step_s_from_mfu",
    "step_s_from_tflops",
]
