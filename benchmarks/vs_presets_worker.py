"""One rank of one run of the presets benchmark (``benchmarks/vs_presets.py`` launches it under torchrun), and the
Llama-style model it trains next to the example GPT.

``python -m torch.distributed.run --nproc-per-node 2 benchmarks/vs_presets_worker.py '<job JSON>'`` trains one model
at one size with one strategy, as a Lightning user writes it (``Trainer(accelerator="cpu", devices=2, strategy=NAME)``),
for a few steps, and writes ``rank<R>.json`` into the job's directory: the time between consecutive optimizer-step ends
after the warm-up, the process' resident-set high-water mark (``getrusage(RUSAGE_SELF).ru_maxrss``), the error a run
raised (its first line), and for ``fleet`` the plan it chose and its prediction.

Lightning refuses its ``fsdp`` and ``deepspeed_stage_*`` presets on a CPU accelerator; the driver records that refusal
(job ``variant`` "named") and then runs the same preset through :func:`cpu_preset` (the registry's own ``init_params``, so
Lightning's own FSDP/DeepSpeed configuration) with only the CPU seams opened (:data:`VARIANTS`). When the driver passes
memory cgroups (``cgroups`` in the job), each rank moves itself into its own one before importing torch, so everything
the rank allocates is charged there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _join_cgroup(job: dict) -> None:
    """Move this rank into its memory cgroup (one per local rank) before anything large is allocated."""
    groups = job.get("cgroups") or []
    if groups:
        Path(groups[int(os.environ["LOCAL_RANK"])], "cgroup.procs").write_text(str(os.getpid()))


if __name__ == "__main__":
    _join_cgroup(json.loads(sys.argv[1]))
    sys.path.insert(0, str(ROOT))

import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, Strategy, StrategyRegistry  # noqa: E402
from torch import nn  # noqa: E402

# --- the Llama-style model ----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias (Zhang & Sennrich 2019; Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_length: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary position embedding (Su et al. 2021), (seq, head_dim), halves repeated as Llama does."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the position tables (the rotate-half form)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GQAttention(nn.Module):
    """Causal grouped-query attention: ``kv_heads`` key/value heads shared by ``heads`` query heads; RoPE; no biases."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.heads // self.kv_heads  # each K/V head serves `group` query heads (repeat_kv, as Llama's reference code)
        k, v = (z.repeat_interleave(group, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """Gated feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020), three bias-free matrices."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: RMSNorm, GQA, RMSNorm, SwiGLU, residuals."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden)
        self.attn = GQAttention(hidden, heads, kv_heads)
        self.post_attention_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attention_norm(x))


class Llama(LightningModule):
    """A Llama-style byte-level language model: token embedding (no position table), RoPE, GQA, SwiGLU, RMSNorm, no
    biases, no dropout, an untied output head; AdamW. No lightning_fleet hooks: a module as its author writes it."""

    def __init__(self, num_layers: int = 4, hidden_size: int = 256, num_heads: int = 8, num_kv_heads: int = 2, ffn_size: int = 704,
                 seq_length: int = 128, vocab_size: int = 256, learning_rate: float = 3e-4) -> None:
        """
        Args:
            num_layers: decoder layers.
            hidden_size: width of the residual stream.
            num_heads: query heads.
            num_kv_heads: key/value heads (divides num_heads).
            ffn_size: width of the SwiGLU's gate and up projections.
            seq_length: tokens per sample (the RoPE tables' length).
            vocab_size: 256 for bytes.
            learning_rate: AdamW learning rate.
        """
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(hidden_size, num_heads, num_kv_heads, ffn_size) for _ in range(num_layers))
        self.norm = RMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        cos, sin = rope_tables(seq_length, hidden_size // num_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``idx`` (batch, time)."""
        t = idx.size(1)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=0.0)


def build_model(kind: str, shape: dict) -> LightningModule:
    """The benchmark's model: ``"gpt"`` (examples/gpt/model.py) or ``"llama"`` (:class:`Llama`) with ``shape``'s arguments."""
    if kind == "gpt":
        from examples.gpt.model import GPT

        return GPT(**shape)
    if kind == "llama":
        return Llama(**shape)
    raise ValueError(f"unknown model kind {kind!r}: 'gpt' or 'llama'")


# --- Lightning's DeepSpeed presets on CPU ----------------------------------------------------------------------


class CpuDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with its three CUDA-only seams opened for a CPU accelerator (gloo), nothing else:
    setup_environment takes the DDP path, setup_distributed skips the device-index check, and DeepSpeed is given the
    local rank as its device rank (``../shared/ENVIRONMENT.md``, "Lightning's DeepSpeedStrategy on CPU")."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # type: ignore[no-untyped-def]
        import argparse

        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


class CpuFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy with its CPU seams opened: the Trainer refuses ``strategy="fsdp"`` on a CPU accelerator by
    name and exact type (``type(strategy) is FSDPStrategy``), and torch's FSDP refuses ``device_id=None`` (Lightning's
    ``root_device.index`` on CPU: "FSDP needs a non-CPU accelerator device"); this subclass wraps the module with
    ``device_id=cpu`` and the preset's own arguments, then lets Lightning do the rest as it does for a wrapped module."""

    def _setup_model(self, model):  # type: ignore[no-untyped-def]
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                                           sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(wrapped)


def cpu_preset(name: str) -> Strategy:
    """Lightning's registered preset ``name`` (its own init_params) as :class:`CpuFSDPStrategy` or :class:`CpuDeepSpeedStrategy`."""
    entry = StrategyRegistry[name]
    cls = CpuFSDPStrategy if issubclass(entry["strategy"], FSDPStrategy) else CpuDeepSpeedStrategy
    return cls(**entry["init_params"])


# --- one run ---------------------------------------------------------------------------------------------------


class StepClock(Callback):
    """Wall time of each optimizer-step end (one Lightning batch is one optimizer step under every strategy here)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.ends.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        """Intervals between consecutive step ends, the first ``warmup`` steps left out."""
        return [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1 :])]


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


VARIANTS = ("named", "cpu", "cpu+client-optimizer")
"""How a job builds its strategy: ``named`` is ``Trainer(strategy=NAME)`` as a user writes it; ``cpu`` is Lightning's
registered preset NAME through :func:`cpu_preset`; ``cpu+client-optimizer`` is that with DeepSpeed's
``zero_force_ds_cpu_optimizer: false`` (the module's own torch optimizer steps the offloaded states, as lightning_fleet's
DeepSpeed config does) for an offload preset that refuses the module's AdamW."""


def build_strategy(job: dict):  # type: ignore[no-untyped-def]
    """The job's strategy argument for ``Trainer(strategy=...)``."""
    name, variant = job["strategy"], job.get("variant", "named")
    if name == "fleet":
        import lightning_fleet

        return lightning_fleet.FleetStrategy(cluster=job["cluster"])  # strategy="fleet" with this machine's calibration
    if variant == "named":
        return name
    strategy = cpu_preset(name)
    if variant == "cpu+client-optimizer":
        strategy.config["zero_force_ds_cpu_optimizer"] = False
    return strategy


def run(job: dict) -> dict:
    """Train the job's model with its strategy for warm-up + timed steps on this rank; the record it writes."""
    from examples.gpt.data import StdlibText

    record: dict = {"rank": int(os.environ.get("RANK", "0")), "strategy": job["strategy"], "variant": job.get("variant", "named"), "error": ""}
    seed_everything(0, verbose=False)
    model = build_model(job["model"], job["shape"])
    data = StdlibText(seq_length=job["shape"]["seq_length"], batch_size=job["global_batch"] // 2, limit_bytes=job["data_bytes"])
    clock = StepClock()
    trainer = None
    try:
        trainer = Trainer(accelerator="cpu", devices=2, strategy=build_strategy(job), max_steps=job["warmup"] + 1 + job["steps"],
                          logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock])
        trainer.fit(model, data)
    except Exception as err:  # a strategy that does not run is reported, not hidden
        traceback.print_exc()
        record["error"] = one_line(err)
    times = clock.step_times(job["warmup"])
    record["step_times_s"] = times
    record["median_step_s"] = statistics.median(times) if times and not record["error"] else math.nan
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    strategy = getattr(trainer, "strategy", None)
    if job["strategy"] == "fleet" and getattr(strategy, "plan", None) is not None:
        record["plan"] = str(strategy.plan)
        record["fleet_predicted_step_s"] = strategy.estimate.time.step_s
        record["fleet_profile"] = list(strategy.profile.report_lines()) if strategy.profile is not None else []
    return record


def main() -> None:
    job = json.loads(sys.argv[1])
    record = run(job)
    Path(job["out"], f"rank{record['rank']}.json").write_text(json.dumps(record))
    if record["error"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
