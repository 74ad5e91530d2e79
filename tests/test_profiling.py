"""Profiling an nn.Module on the meta device: FLOPs and memory-bound elements per block, per sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt.model import GPT
from lightning_fleet.planning import Role
from lightning_fleet.planning.model import layer_elementwise, layer_flops
from lightning_fleet.profiling import profile_module


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # addmm (FLOPs), gelu (width elements), views (nothing), a residual add (width elements)
        return F.gelu(self.lin(x)).reshape(x.shape[0], -1).view_as(x) + x


class _Net(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).sum()


def test_elements_of_operators_without_matmul_are_counted_per_block_and_sample() -> None:
    """gelu and the add count their outputs; the Linear's matmul counts FLOPs; views count nothing."""
    spec = profile_module(_Net(), torch.zeros(5, 8), global_batch_size=5)
    (layer,) = [b for b in spec.blocks if b.role is Role.LAYER]
    assert layer.count == 3
    assert layer.flops == 2 * 8 * 8  # one [1 x 8] @ [8 x 8] per sample
    assert layer.elementwise == 8 + 8  # gelu + residual add
    post = spec.blocks[-1]
    assert post.role is Role.POST
    assert post.elementwise == pytest.approx(8 + 2 + 1 / 5)  # LayerNorm: output, mean, rstd per sample; the sum: one scalar for 5


def test_gpt_layer_matches_the_closed_forms() -> None:
    """The example GPT's profiled layer has the closed-form FLOPs exactly and the closed-form memory-bound elements plus
    what the meta device's math attention adds: the causal mask (s*s) and the LayerNorm statistics (4*s)."""
    s, h, a = 32, 64, 4
    module = GPT(num_layers=2, hidden_size=h, num_heads=a, seq_length=s)
    spec = profile_module(module, (torch.zeros(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long)), global_batch_size=1)
    (layer,) = [b for b in spec.blocks if b.role is Role.LAYER]
    assert layer.flops == pytest.approx(layer_flops(s, h, 4 * h))
    assert layer.elementwise == pytest.approx(layer_elementwise(s, h, 4 * h, a) + s * s + 4 * s)
